"""Learner ranks as Ray actors on DeepSpeed: a group with PPOLearner's methods, for the same trainer loop.

Each actor runs one rank of the run's learner class (`PPOLearner`, or `GRPOLearner` with --algorithm grpo) on
deepspeed_utils.DeepSpeedBackend. The driver sends every rank the
whole rollout (token ids, a few KB); the ranks split the forward passes and the minibatches between them
and keep their experience; metrics come back from rank 0 (every rank computes the same global ones).

Placement: one bundle per node entry of --num_learners_per_node, STRICT_SPREAD over nodes when several
are given, PACK for one. Rank 0 is created first and hosts the torch.distributed rendezvous.

Failures: every call waits on all ranks at once with a deadline, so a rank that dies (while the others
may sit in a collective waiting for it) ends the run at once with its name and cause, not a hang.

Imported only when Ray is used: the single-process trainer never loads ray or deepspeed.
"""

import atexit
import os
import socket
import time

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from open_instruct.ground_truth_utils import RewardManager
from open_instruct.ppo_args import Args, BatchSizes
from open_instruct.ppo_learner import Experience, PPOLearner, PromptBatch, SavedModel, learner_class
from open_instruct.vllm_utils import Completion


class LearnerFailed(RuntimeError):
    """A learner rank died or raised; the message names the actor and the cause."""


class LearnerRank:
    """One learner rank in its own Ray actor process."""

    def __init__(self, rank: int):
        self.rank = rank
        self.learner: PPOLearner | None = None
        self.experience: Experience | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host a process group on."""
        return node_address_with_free_port()

    def where(self) -> dict:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def setup(
        self, args: Args, sizes: BatchSizes, policy_path: str, stop_token_ids: list[int], master: tuple[str, int]
    ) -> None:
        from open_instruct import deepspeed_utils
        from open_instruct.model_utils import load_tokenizer

        deepspeed_utils.init_process_group(self.rank, sizes.num_learners, *master, args.dist.learner_timeout_s)
        backend = deepspeed_utils.DeepSpeedBackend(
            args.dist.deepspeed_stage,
            args.ppo.per_device_train_batch_size,
            args.dist.gather_whole_model,
            args.model.learner_compute_dtype,
        )
        torch.manual_seed(args.run.seed)  # PPO's value head init, identical on every rank and in one process
        tokenizer = load_tokenizer(policy_path, args.model.model_revision)
        learner = learner_class(args.ppo.algorithm)  # the same class as a single-process run of these args
        self.learner = learner(args, sizes, tokenizer, policy_path, stop_token_ids, backend=backend)

    def make_experience(
        self, prompts: PromptBatch, completions: list[Completion], reward_manager: RewardManager
    ) -> tuple[dict, dict]:
        self.experience, metrics, samples = self.learner.make_experience(prompts, completions, reward_manager)
        return metrics, samples

    def train(self) -> dict[str, float]:
        metrics = self.learner.train(self.experience)
        self.experience = None
        return metrics

    def weights_for_engine(self):
        return self.learner.weights_for_engine()  # no slot: the copy travels back through Ray

    def lr(self) -> float:
        return self.learner.lr

    def weight_bucket_plan(self, bucket_bytes: int):
        return self.learner.weight_bucket_plan(bucket_bytes)

    def join_weight_group(self, *group_args) -> None:
        self.learner.join_weight_group(*group_args)

    def broadcast_weights(self) -> dict | None:
        return self.learner.broadcast_weights()

    def save(self, output_dir: str, extra_files: dict[str, dict] | None = None) -> SavedModel | None:
        return self.learner.save(output_dir, extra_files)


def node_address_with_free_port() -> tuple[str, int]:
    address = ray.util.get_node_ip_address()
    with socket.socket() as sock:
        sock.bind((address, 0))
        return address, sock.getsockname()[1]


class ExperienceOnRanks:
    """Stands for the experience the ranks keep: `make_experience` leaves it there for `train`."""


def start_ray(ray_address: str | None, num_actors: int) -> None:
    if ray.is_initialized():
        return
    started = time.time()
    if ray_address is not None:
        ray.init(address=ray_address, log_to_driver=True)
    else:  # a local instance with a logical CPU for each actor (learner, engine), even on a machine with fewer cores
        ray.init(num_cpus=max(os.cpu_count() or 1, num_actors), include_dashboard=False)
    print(f"[ppo] Ray {'joined at ' + ray_address if ray_address else 'started locally'} in {time.time() - started:.1f}s")


def reserve_learner_placement(dist) -> tuple:
    """The learner ranks' placement group (one bundle per node entry of --num_learners_per_node) and GPUs per rank.

    Reserved before the engine actors are placed, so that engines landing first cannot take the CPUs or GPUs of a
    node that the learners' STRICT_SPREAD needs.
    """
    start_ray(dist.ray_address, dist.num_learners + dist.vllm_num_engines * dist.vllm_tensor_parallel_size)
    use_gpu = ray.cluster_resources().get("GPU", 0) > 0
    gpu_per_rank = (0.5 if dist.single_gpu_mode else 1) if use_gpu else 0  # single GPU mode: an engine takes the rest
    bundles = [{"CPU": n, **({"GPU": n * gpu_per_rank} if use_gpu else {})} for n in dist.num_learners_per_node]
    strategy = "STRICT_SPREAD" if len(bundles) > 1 else "PACK"
    group = placement_group(bundles, strategy=strategy)
    try:
        ray.get(group.ready(), timeout=dist.learner_timeout_s)
    except GetTimeoutError:
        remove_placement_group(group)
        raise LearnerFailed(
            f"Ray could not place learners {bundles} ({strategy}) within {dist.learner_timeout_s:.0f}s on a cluster "
            f"with {ray.cluster_resources()}; lower --num_learners_per_node or add nodes."
        ) from None
    return group, gpu_per_rank


class LearnerGroup:
    """PPOLearner's methods (make_experience, train, weights_for_engine, save, lr) over Ray learner ranks."""

    def __init__(self, args: Args, sizes: BatchSizes, policy_path: str, stop_token_ids: list[int], placement=None):
        """`placement`: from `reserve_learner_placement`, when it had to come before the engine actors' placement."""
        dist = args.dist
        self.timeout_s = dist.learner_timeout_s
        self.placement_group, gpu_per_rank = placement or reserve_learner_placement(dist)
        atexit.register(self.shutdown)
        actor_class = ray.remote(num_cpus=1, num_gpus=gpu_per_rank)(LearnerRank)
        bundle_of_rank = [node for node, count in enumerate(dist.num_learners_per_node) for _ in range(count)]
        self.names = [f"learner rank {rank}" for rank in range(len(bundle_of_rank))]
        self.ranks = []
        for rank, bundle in enumerate(bundle_of_rank):
            in_bundle = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=bundle)
            self.ranks.append(actor_class.options(scheduling_strategy=in_bundle).remote(rank))
            if rank == 0:  # rank 0 first: it hosts the rendezvous the others connect to
                master = self._call_rank(0, "rendezvous_address")
        for name, where in zip(self.names, self._call_all("where")):
            print(f"[ppo] {name}: pid {where['pid']} on node {where['node_id'][:12]}")
        self._call_all("setup", args, sizes, policy_path, stop_token_ids, master)

    def _call_rank(self, rank: int, method: str, *method_args):
        return self._wait([getattr(self.ranks[rank], method).remote(*method_args)], [self.names[rank]], method)[0]

    def _call_all(self, method: str, *method_args) -> list:
        method_args = [ray.put(a) for a in method_args]  # stored once, read by every rank
        refs = [getattr(rank, method).remote(*method_args) for rank in self.ranks]
        return self._wait(refs, self.names, method)

    def _wait(self, refs: list, names: list[str], method: str) -> list:
        advice = "raise --learner_timeout_s if the work is that slow, else look for a stuck rank in the Ray logs"
        return wait_for_actors(refs, names, method, self.timeout_s, LearnerFailed, advice)

    def make_experience(
        self, prompts: PromptBatch, completions: list[Completion], reward_manager: RewardManager
    ) -> tuple[ExperienceOnRanks, dict, dict]:
        metrics, samples = self._call_all("make_experience", prompts, completions, reward_manager)[0]
        return ExperienceOnRanks(), metrics, samples

    def train(self, experience: ExperienceOnRanks) -> dict[str, float]:
        return self._call_all("train")[0]

    def weights_for_engine(self, slot: int | None = None) -> list[tuple[str, torch.Tensor]]:
        return self._call_all("weights_for_engine")[0]  # `slot` unused: Ray hands over a copy in fresh memory

    @property
    def lr(self) -> float:
        return self._call_rank(0, "lr")

    def weight_group_address(self) -> tuple[str, int]:
        return self._call_rank(0, "rendezvous_address")

    def weight_bucket_plan(self, bucket_bytes: int):
        return self._call_rank(0, "weight_bucket_plan", bucket_bytes)

    def join_weight_group(self, host: str, port: int, world_size: int, backend: str, timeout_s: float) -> None:
        self._call_all("join_weight_group", host, port, world_size, backend, timeout_s)

    def broadcast_weights(self) -> dict:
        """Every rank gathers (ZeRO-3), rank 0 sends; rank 0's report: checksum of what was sent, timings."""
        return self._call_all("broadcast_weights")[0]

    def save(self, output_dir: str, extra_files: dict[str, dict] | None = None) -> SavedModel:
        """Rank 0 writes the gathered policy; its SavedModel says where, in which dtype, and the weights' digest."""
        return self._call_all("save", output_dir, extra_files)[0]

    def state_dict(self) -> dict:
        """Asked for by a checkpoint (only on SIGTERM/SIGINT: validation refuses --save_freq in Ray mode)."""
        raise NotImplementedError(
            "checkpoints of Ray learner ranks are not supported yet (their DeepSpeed optimizer states are not saved); "
            "the run stops without one"
        )

    def shutdown(self) -> None:
        """Kill the ranks (some may hang in a collective with a dead peer) and release their placement."""
        if not ray.is_initialized():
            return
        for rank in self.ranks:
            ray.kill(rank, no_restart=True)
        self.ranks = []
        remove_placement_group(self.placement_group)


def wait_for_actors(refs: list, names: list[str], method: str, timeout_s: float, failure: type[RuntimeError],
                    timeout_advice: str) -> list:  # fmt: skip
    """All results, in order; the first actor to die or raise ends the wait (as `failure`, naming it), whatever the
    others are doing, and so does the deadline."""
    name_of = dict(zip(refs, names))
    results, pending = {}, list(refs)
    deadline = time.time() + timeout_s
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.time()))
        if not done:
            waiting = ", ".join(name_of[ref] for ref in pending)
            raise failure(f"{waiting} did not finish {method} within {timeout_s:.0f}s; {timeout_advice}.")
        ref = done[0]
        try:
            results[ref] = ray.get(ref)
        except RayActorError as error:
            raise failure(f"{name_of[ref]} died during {method}: {death_cause(error)}") from None
        except RayTaskError as error:
            cause = error.cause if error.cause is not None else error
            failed = f"{name_of[ref]} failed in {method}: {type(cause).__name__}: {first_line(cause)}"
            death = first_death(pending, name_of, method, PEER_DEATH_GRACE_S)
            if death is not None:  # it failed because a peer of its collective died: the death goes first
                raise failure(f"{death} (then {failed})") from error
            raise failure(failed) from error
        except RayError as error:  # e.g. OutOfMemoryError: Ray's memory monitor killed the actor's worker
            raise failure(f"{name_of[ref]} was lost during {method}: {type(error).__name__}: {first_line(error)}") from None
    return [results[ref] for ref in refs]


# A collective (weight broadcast, ZeRO gather) fails on every peer of a process that dies, often before Ray has
# noticed the death itself (it does within about a second): a failure waits this long for a death among the others.
PEER_DEATH_GRACE_S = 5.0


def first_death(refs: list, name_of: dict, method: str, grace_s: float) -> str | None:
    """'<actor> died during <method>: <cause>' for the first of `refs` whose actor dies within `grace_s`, else None
    (their other results and errors are dropped: the caller is already failing)."""
    deadline = time.time() + grace_s
    while refs and time.time() < deadline:
        done, refs = ray.wait(refs, num_returns=1, timeout=max(0.0, deadline - time.time()))
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError as error:
                return f"{name_of[ref]} died during {method}: {death_cause(error)}"
            except RayError:
                continue
    return None


def death_cause(error: RayActorError) -> str:
    """Ray's several-line report of a dead actor, cut to the line that says why it died."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    because = [line for line in lines if "because" in line]
    return (because or lines or [type(error).__name__])[0]


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
