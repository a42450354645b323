"""Learner ranks as Ray actors on DeepSpeed: a group with PPOLearner's methods, for the same trainer loop.

Each actor runs one rank of the run's learner class (`PPOLearner`, or `GRPOLearner` with --algorithm grpo) on
deepspeed_backend.DeepSpeedBackend. The driver sends every rank the
whole rollout (token ids, a few KB); the ranks split the forward passes and the minibatches between them
and keep their experience; metrics come back from rank 0 (every rank computes the same global ones).

Placement: run/placement.py (one bundle per node entry of --num_learners_per_node, STRICT_SPREAD over nodes when
several are given, PACK for one; with --single_gpu_mode one bundle per rank, shared with its engine). Rank 0 is
created first and hosts the torch.distributed rendezvous. Each rank computes on the GPU Ray gave it (its index in
this process from Ray's GPU ids, run.devices.local_gpu_index) and reports its device to the driver before it loads a
model: the driver decides from those reports (memory, the weight transfer), never from its own view.

Failures: every call waits on all ranks at once with a deadline, so a rank that dies (while the others
may sit in a collective waiting for it) ends the run at once with its name and cause, not a hang.

Imported only when Ray is used: the single-process trainer never loads ray or deepspeed.
"""

import atexit
import dataclasses
import logging
import os
from collections.abc import Callable

import ray
import torch

from open_instruct.data.batches import PromptBatch
from open_instruct.generation.step_batch import verdicts
from open_instruct.generation.vllm_engine import Completion
from open_instruct.generation.weight_transfer import WeightTransfer
from open_instruct.learner.algorithms import learner_class
from open_instruct.learner.experience import Experience
from open_instruct.learner.ppo import PPOLearner
from open_instruct.learner.saving import SavedModel
from open_instruct.learner.weight_sender import WeightSender
from open_instruct.rewards.manager import RewardManager, Scorer, VerifiedScores
from open_instruct.run import devices
from open_instruct.run.args import Args, BatchSizes, ConfigError
from open_instruct.run.cluster import (
    folder_problem,
    niceness_warning,
    node_address_with_free_port,
    wait_for_actors,
    write_folder_token,
)
from open_instruct.run.placement import Placement, reserve_placement

log = logging.getLogger(__name__)


class LearnerFailed(RuntimeError):
    """A learner rank died or raised; the message names the actor and the cause."""


class LearnerRank:
    """One learner rank in its own Ray actor process."""

    def __init__(self, rank: int):
        self.rank = rank
        self.learner: PPOLearner | None = None
        self.experience: Experience | None = None
        self.sender: WeightSender | None = None
        self.local_gpu: int | None = None
        self.gpu_bound = False

    def bind_gpu(self) -> int | None:
        """The GPU Ray gave this rank, as torch numbers it in this process (None: none), made the current CUDA device
        at the first call: not a hard-coded 0, which is wrong when Ray leaves CUDA_VISIBLE_DEVICES alone
        (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES)."""
        if not self.gpu_bound and ray.is_initialized():  # outside a Ray actor (tests): no GPU of Ray's
            self.local_gpu = devices.local_gpu_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
            if self.local_gpu is not None and torch.cuda.is_available():
                torch.cuda.set_device(self.local_gpu)
            self.gpu_bound = True
        return self.local_gpu

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host a process group on."""
        return node_address_with_free_port()

    def weight_group_address(self) -> tuple[str, int]:
        """Where rank 0 hosts the weight group. vLLM's group helper is imported first (rank 0 uses it to join), so that
        the join spends its deadline in the rendezvous and not in this import (~1.6 s alone, past 4 s beside other
        work) while the engines, which join at the same time, already wait under it."""
        import vllm.distributed.utils  # noqa: F401

        return self.rendezvous_address()

    def where(self) -> dict:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(), "gpu_ids": ray.get_gpu_ids(),
                "local_gpu": self.bind_gpu(), "niceness": os.getpriority(os.PRIO_PROCESS, 0)}  # fmt: skip

    def device_report(self) -> dict:
        """This rank's device as it sees it (before any model loads: free memory is what the learner will have)."""
        self.bind_gpu()
        return {**devices.device_report(), "node_id": ray.get_runtime_context().get_node_id()}

    def output_dir_problem(self, output_dir: str, token: str) -> str | None:
        """Why this rank cannot write the run's output_dir as the driver sees it, or None."""
        return folder_problem(output_dir, token)

    def setup(
        self, args: Args, sizes: BatchSizes, policy_path: str, stop_token_ids: list[int], master: tuple[str, int]
    ) -> str:
        """Join the learners' process group and build this rank's learner; returns where and in which dtype it
        computes (the driver says it: a rank's own output goes to the Ray logs)."""
        from open_instruct.data.tokenizer import load_tokenizer
        from open_instruct.learner import deepspeed_backend
        from open_instruct.run.hub_models import folder_on_this_node, models_on_this_node

        # The driver resolved hub ids to snapshot folders in its HF cache; a node that does not share it fetches the
        # same commit now, before any rank joins the group or loads (hub_models.py).
        args = dataclasses.replace(args, model=models_on_this_node(args.model))
        policy_path = folder_on_this_node(policy_path)

        deepspeed_backend.init_process_group(self.rank, sizes.num_learners, *master, args.dist.learner_timeout_s,
                                             local_rank=self.bind_gpu())  # fmt: skip
        backend = deepspeed_backend.DeepSpeedBackend(
            args.dist.deepspeed_stage,
            args.ppo.per_device_train_batch_size,
            args.dist.gather_whole_model,
            deepspeed_backend.weights_dtype(args.dist.deepspeed_weights_dtype, args.model.learner_compute_dtype),
        )
        torch.manual_seed(args.run.seed)  # PPO's value head init, identical on every rank and in one process
        tokenizer = load_tokenizer(policy_path)
        learner = learner_class(args.ppo.algorithm)  # the same class as a single-process run of these args
        self.learner = learner(args, sizes, tokenizer, policy_path, stop_token_ids, backend=backend)
        said = f"{self.learner.device.type}: computing in {self.learner.compute_dtype_reason}"
        if args.ppo.old_logprobs_from == "auto":
            said += f"; old logprobs (--old_logprobs_from auto): {self.learner.old_logprobs_choice[2]}"
        return said + (f"\n{self.learner.dtype_warning}" if self.learner.dtype_warning else "")

    def make_experience(
        self, prompts: PromptBatch, completions: list[Completion], reward_manager: Scorer
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

    def weight_bucket_plan(self, bucket_bytes: int, dtype_name: str):
        self.sender = WeightSender(self.learner)
        return self.sender.plan(bucket_bytes, dtype_name)

    def join_weight_group(self, transfer: WeightTransfer, client) -> None:
        self.sender.join(transfer, client)

    def broadcast_weights(self) -> dict | None:
        return self.sender.send()

    def save(self, output_dir: str, extra_files: dict[str, dict] | None = None) -> SavedModel | None:
        return self.learner.save(output_dir, extra_files)

    def checkpoint_bytes(self) -> int:
        return self.learner.checkpoint_bytes()

    def write_checkpoint(self, folder: str) -> int:
        return self.learner.write_checkpoint(folder)

    def read_checkpoint(self, folder: str) -> None:
        self.learner.read_checkpoint(folder)


class ExperienceOnRanks:
    """Stands for the experience the ranks keep: `make_experience` leaves it there for `train`."""


class LearnerGroup:
    """PPOLearner's methods (seams.Learner: make_experience, train, save, lr, the checkpoint's) and the weight
    transfer's (generation/seams.BroadcastsWeights) over Ray learner ranks."""

    def __init__(self, args: Args, sizes: BatchSizes, policy_path: str, stop_token_ids: list[int],
                 placement: Placement | None = None, check_devices: Callable[[list[dict]], None] | None = None):  # fmt: skip
        """`placement`: from `run.placement.reserve_placement`, when it had to come before the engine actors'.
        `check_devices(reports)`: checks of the ranks' own device reports, run before any rank loads a model."""
        dist = args.dist
        self.timeout_s = dist.learner_timeout_s
        self.placement = placement or reserve_placement(dist)
        atexit.register(self.shutdown)
        self.names = [f"learner rank {rank}" for rank in range(dist.num_learners)]
        self.ranks = []
        try:
            for rank in range(dist.num_learners):
                self.ranks.append(ray.remote(LearnerRank).options(**self.placement.learner_options(rank)).remote(rank))
                if rank == 0:  # rank 0 first: it hosts the rendezvous the others connect to
                    master = self._call_rank(0, "rendezvous_address")
            for name, where in zip(self.names, self._call_all("where")):
                gpus = f", GPU {','.join(map(str, where['gpu_ids']))}" if where["gpu_ids"] else ""
                log.info(f"[ppo] {name}: pid {where['pid']} on node {where['node_id'][:12]}{gpus}")
                if warning := niceness_warning(name, where["niceness"]):
                    log.warning(warning)
            self.check_output_dir(args.run.output_dir)
            self.reports = self._call_all("device_report")
            if check_devices is not None:
                check_devices(self.reports)
            computes = self._call_all("setup", args, sizes, policy_path, stop_token_ids, master)
        except BaseException:
            self.shutdown()  # a group that failed to start frees its actors and placement at once, not at exit
            raise
        log.info(f"[learner] rank 0 of {len(self.ranks)}, {computes[0]}")

    def check_output_dir(self, output_dir: str) -> None:
        """Learner rank 0 writes the model and checkpoints on its node: `output_dir` (absolute, as the driver resolved
        it) must be the driver's folder there, on a file system both see."""
        os.makedirs(output_dir, exist_ok=True)  # the trainer's RunDirectory made it already; tests may not have
        token_path, token = write_folder_token(output_dir)
        try:
            problem = self._call_rank(0, "output_dir_problem", output_dir, token)
        finally:
            os.remove(token_path)
        if problem is not None:
            raise ConfigError(
                f"--output_dir {output_dir} is not the same folder on learner rank 0's node ({problem}); give a path on "
                "a file system every node shares (e.g. a network file system mounted at the same path)."
            )

    def device_reports(self) -> list[dict]:
        """Each rank's own report of its device (rank 0 first), taken before the models loaded."""
        return self.reports

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
        self, prompts: PromptBatch, completions: list[Completion], reward_manager: Scorer
    ) -> tuple[ExperienceOnRanks, dict, dict]:
        if isinstance(reward_manager, RewardManager):
            # The verifiers run here, once per response, and every rank combines the same verdicts: ranks verifying
            # the rollout each could cut different responses at --reward_timeout_s and train on different advantages.
            reward_manager = VerifiedScores(reward_manager, verdicts(reward_manager, prompts, completions))
        metrics, samples = self._call_all("make_experience", prompts, completions, reward_manager)[0]
        return ExperienceOnRanks(), metrics, samples

    def train(self, experience: ExperienceOnRanks) -> dict[str, float]:
        return self._call_all("train")[0]

    def weights_for_engine(self, slot: int | None = None) -> list[tuple[str, torch.Tensor]]:
        """The whole policy through Ray's object store: for tests and benchmarks only. The trainer never calls it:
        Ray learners send their weights to every engine, the in-process one included, by a transfer from rank 0."""
        return self._call_all("weights_for_engine")[0]  # `slot` unused: Ray hands over a copy in fresh memory

    @property
    def lr(self) -> float:
        return self._call_rank(0, "lr")

    def weight_group_address(self) -> tuple[str, int]:
        return self._call_rank(0, "weight_group_address")

    def weight_bucket_plan(self, bucket_bytes: int, dtype_name: str):
        """The policy's tensors in sending order in the engines' dtype (the same on every rank)."""
        return self._call_all("weight_bucket_plan", bucket_bytes, dtype_name)[0]

    def join_weight_group(self, transfer: WeightTransfer, client=None) -> None:
        """Rank 0 joins the engines' group (gloo, nccl); with ipc every rank builds vLLM's trainer side."""
        self._call_all("join_weight_group", transfer, client)

    def broadcast_weights(self) -> dict:
        """Every rank gathers (ZeRO-3) or shares its copy (IPC), rank 0 sends; rank 0's report: checksum, timings."""
        return self._call_all("broadcast_weights")[0]

    def save(self, output_dir: str, extra_files: dict[str, dict] | None = None) -> SavedModel:
        """Rank 0 writes the gathered policy; its SavedModel says where, in which dtype, and the weights' digest."""
        return self._call_all("save", output_dir, extra_files)[0]

    def checkpoint_bytes(self) -> int:
        """About what all ranks together write into a checkpoint (the driver's free-space check)."""
        return sum(self._call_all("checkpoint_bytes"))

    def write_checkpoint(self, folder: str) -> int:
        """Every rank writes its part of the checkpoint into `folder` (the driver's temporary folder, on a file system
        every node shares) in parallel; returns the bytes they wrote. A rank that dies or raises meanwhile ends the
        run (LearnerFailed naming it): the group is stopped first, so no rank goes on writing into a folder the
        checkpoint then deletes."""
        try:
            return sum(self._call_all("write_checkpoint", folder))
        except LearnerFailed:
            self.shutdown()
            raise

    def read_checkpoint(self, folder: str) -> None:
        """Every rank restores its part (DeepSpeed loads each rank's own partitions)."""
        self._call_all("read_checkpoint", folder)

    def shutdown(self) -> None:
        """Kill the ranks (some may hang in a collective with a dead peer) and release their placement."""
        if not ray.is_initialized():
            return
        for rank in self.ranks:
            ray.kill(rank, no_restart=True)
        self.ranks = []
        if self.placement is not None:
            self.placement.remove()
            self.placement = None
