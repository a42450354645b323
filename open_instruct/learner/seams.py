"""The learner's seams, declared once; tests/test_seams.py compares every implementation's methods with these,
parameter by parameter.

    Learner          what the trainer's loop calls. One process (ppo.PPOLearner, and grpo.GRPOLearner, which only
                     changes the advantages) and learner ranks on Ray (ray_group.LearnerGroup) offer it alike, so the
                     recipe in ppo_vllm_thread_ray_gtrl.py is the same for both.
    LearnerBackend   where a learner's models live and how its ranks talk: PPOLearner runs the same code on each
                     (single_process.SingleProcess; deepspeed_backend.DeepSpeedBackend, one rank of a DeepSpeed group).
    ModelTrainer     one trained model and its optimizer, as a backend builds it (`trainable`).
    EngineCheckpoints  a backend whose checkpoint is each trainer's own, written by every rank (DeepSpeed).

How the weights reach the engines is the generation side's seam (generation/seams.py): every learner hands out a copy
(`weights_for_engine`), and Ray learner ranks also broadcast them from rank 0 (`BroadcastsWeights`), which is how
the trainer feeds the engines with Ray learners.
"""

from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn

from open_instruct.data.batches import PromptBatch
from open_instruct.generation.seams import HandsOutWeights
from open_instruct.generation.vllm_engine import Completion
from open_instruct.learner.models import ModelSpec
from open_instruct.learner.saving import SavedModel
from open_instruct.learner.single_process import OptimizerSettings
from open_instruct.rewards.manager import Scorer


class Learner(HandsOutWeights, Protocol):
    """Make experience from a rollout, train on it, save the policy, checkpoint and restore itself, stop."""

    @property
    def lr(self) -> float:
        """The policy's learning rate at this step."""
        ...

    def make_experience(
        self, prompts: PromptBatch, completions: list[Completion], reward_manager: Scorer
    ) -> tuple[object, dict[str, float], dict]:
        """Score the rollout (`reward_manager`) and compute logprobs, rewards and advantages: (the experience for
        `train`, kept wherever the learner computes, the step's metrics, per-response scores and lengths)."""
        ...

    def train(self, experience: object) -> dict[str, float]:
        """The PPO epochs over `experience` (what `make_experience` returned); the step's training metrics."""
        ...

    def save(self, output_dir: str, extra_files: dict[str, dict] | None = None) -> SavedModel | None:
        """The policy as a Hugging Face folder in `output_dir`; what was written (None on ranks that do not write)."""
        ...

    def checkpoint_bytes(self) -> int:
        """About how many bytes `write_checkpoint` will write (the free-space check before it)."""
        ...

    def write_checkpoint(self, folder: str) -> int:
        """The learner's state into checkpoint `folder`; the bytes written, fsynced."""
        ...

    def read_checkpoint(self, folder: str) -> None:
        """Restore what `write_checkpoint` wrote."""
        ...

    def shutdown(self) -> None:
        """Stop now, after a failure (Ray learner ranks: kill them and free their placement; one process: nothing)."""
        ...


class ModelTrainer(Protocol):
    """A trained model and its optimizer: gradients accumulated over micro-batches, one step per minibatch."""

    model: nn.Module  # forward passes go through it (a DeepSpeed engine, or the module itself)

    @property
    def lr(self) -> float:
        ...

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """`loss`: one micro-batch's part of the minibatch's loss, its sum over the whole minibatch's count (padded or
        packed, rl.WholeBatch), so the parts' gradients add up; `last`: the minibatch's last micro-batch."""
        ...

    def step(self, apply: bool = True) -> bool:
        """The minibatch's update (clipped; never a non-finite one, nor one with `apply` False); whether it applied."""
        ...


class LearnerBackend(Protocol):
    """Where the learner's models live and how its ranks talk. Collectives (`gather_rows`, `all_sum`, the weights'
    iterators under ZeRO-3) must be called by every rank; in one process they are the identity."""

    rank: int
    world_size: int
    device: torch.device
    saves_engines: bool  # True: a checkpoint holds each trainer's own, every rank writing (EngineCheckpoints); False:
    # the learner's state_dict in one file (learner_state.py)

    def load_model(self, spec: ModelSpec) -> nn.Module:
        """The model `spec` names (at ZeRO-3: built partitioned, each rank holding its share)."""
        ...

    def trainable(self, model: nn.Module, settings: OptimizerSettings) -> ModelTrainer:
        ...

    def frozen(self, model: nn.Module) -> nn.Module:
        """A forward-only model (the reference policy, the reward model)."""
        ...

    def hf_model(self, model: nn.Module) -> nn.Module:
        """The Hugging Face model inside what `trainable`/`frozen` returned (its names are the checkpoint's)."""
        ...

    def local_rows(self, num_rows: int) -> slice:
        """The rows of an `num_rows`-row global batch this rank runs forward passes on (an equal share)."""
        ...

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' row shares concatenated back into the global batch, in order."""
        ...

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        ...

    def named_weights(
        self, model: nn.Module, dtype: torch.dtype, slot: int | None = None
    ) -> list[tuple[str, torch.Tensor]] | None:
        """The full weights in `dtype` with HF names on rank 0 (None elsewhere); `slot`: a reusable buffer where the
        backend keeps them (one process) or nothing (DeepSpeed: the copy travels by Ray)."""
        ...

    def iter_named_weights(
        self, model: nn.Module, dtype: torch.dtype, every_rank: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(name, copy in `dtype`) of each parameter as the engine computes with it; None on ranks other than 0
        unless `every_rank` (CUDA IPC: each rank shares its own copy)."""
        ...

    def weight_shapes(self, model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
        """Each parameter's full shape (ZeRO-3 holds a partition), in `iter_named_weights`' order."""
        ...

    def iter_master_weights(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The trained weights with the checkpoint's names (each shared tensor once), on rank 0 (None elsewhere); with
        LoRA adapters the merged fp32 weights under the base's names."""
        ...

    def trained_masters(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The trained parameters (LoRA: the adapters) by name, whole, in fp32, on rank 0 (None elsewhere)."""
        ...


class EngineCheckpoints(LearnerBackend, Protocol):
    """A backend with `saves_engines`: each trainer's own checkpoint, every rank writing its part in parallel."""

    def save_engine_checkpoint(self, trainer: ModelTrainer, folder: str, role: str) -> int:
        """`trainer`'s checkpoint in `folder` (a collective); the bytes this rank wrote, fsynced."""
        ...

    def load_engine_checkpoint(self, trainer: ModelTrainer, folder: str) -> None:
        ...

    def engine_checkpoint_bytes(self, trainers: list[ModelTrainer]) -> int:
        """About what this rank writes for `trainers` (the free-space check)."""
        ...
