"""Learner ranks as Ray actors on DeepSpeed: a group with PPOLearner's methods, for the same trainer loop.

Each actor runs one rank of the run's learner class (`PPOLearner`, or `GRPOLearner` with --algorithm grpo) on
deepspeed_backend.DeepSpeedBackend. The driver sends every rank the
whole rollout (token ids, a few KB); the ranks split the forward passes and the minibatches between them
and keep their experience; metrics come back from rank 0 (every rank computes the same global ones).

Placement: one bundle per node entry of --num_learners_per_node, STRICT_SPREAD over nodes when several
are given, PACK for one. Rank 0 is created first and hosts the torch.distributed rendezvous.

Failures: every call waits on all ranks at once with a deadline, so a rank that dies (while the others
may sit in a collective waiting for it) ends the run at once with its name and cause, not a hang.

Imported only when Ray is used: the single-process trainer never loads ray or deepspeed.
"""

import atexit
import logging
import os

import ray
import torch
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from open_instruct.data.batches import PromptBatch
from open_instruct.generation.vllm_engine import Completion
from open_instruct.learner.algorithms import learner_class
from open_instruct.learner.experience import Experience
from open_instruct.learner.ppo import PPOLearner
from open_instruct.learner.saving import SavedModel
from open_instruct.rl.rewards import RewardManager
from open_instruct.run.args import Args, BatchSizes
from open_instruct.run.cluster import node_address_with_free_port, start_ray, wait_for_actors

log = logging.getLogger(__name__)


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
    ) -> str:
        """Join the learners' process group and build this rank's learner; returns where and in which dtype it
        computes (the driver says it: a rank's own output goes to the Ray logs)."""
        from open_instruct.data.tokenizer import load_tokenizer
        from open_instruct.learner import deepspeed_backend

        deepspeed_backend.init_process_group(self.rank, sizes.num_learners, *master, args.dist.learner_timeout_s)
        backend = deepspeed_backend.DeepSpeedBackend(
            args.dist.deepspeed_stage,
            args.ppo.per_device_train_batch_size,
            args.dist.gather_whole_model,
            deepspeed_backend.weights_dtype(args.dist.deepspeed_weights_dtype, args.model.learner_compute_dtype),
        )
        torch.manual_seed(args.run.seed)  # PPO's value head init, identical on every rank and in one process
        tokenizer = load_tokenizer(policy_path, args.model.model_revision)
        learner = learner_class(args.ppo.algorithm)  # the same class as a single-process run of these args
        self.learner = learner(args, sizes, tokenizer, policy_path, stop_token_ids, backend=backend)
        return f"{self.learner.device.type}: computing in {self.learner.compute_dtype_reason}"

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


class ExperienceOnRanks:
    """Stands for the experience the ranks keep: `make_experience` leaves it there for `train`."""


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
        try:
            for rank, bundle in enumerate(bundle_of_rank):
                in_bundle = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=bundle)
                self.ranks.append(actor_class.options(scheduling_strategy=in_bundle).remote(rank))
                if rank == 0:  # rank 0 first: it hosts the rendezvous the others connect to
                    master = self._call_rank(0, "rendezvous_address")
            for name, where in zip(self.names, self._call_all("where")):
                log.info(f"[ppo] {name}: pid {where['pid']} on node {where['node_id'][:12]}")
            computes = self._call_all("setup", args, sizes, policy_path, stop_token_ids, master)
        except BaseException:
            self.shutdown()  # a group that failed to start frees its actors and placement at once, not at exit
            raise
        log.info(f"[learner] rank 0 of {len(self.ranks)}, {computes[0]}")

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
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
            self.placement_group = None
