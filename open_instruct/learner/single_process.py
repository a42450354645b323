"""How the learner's models are placed and stepped, and how its ranks talk: the single-process backend.

PPOLearner runs the same code in one process and on every rank of a DeepSpeed group; what differs sits behind a
backend, the seam learner/seams.LearnerBackend (each member is described there; `deepspeed_backend.DeepSpeedBackend`
is the other one), and the trainers it builds (seams.ModelTrainer: `AdamWTrainer` here). In one process every model
is on this process's device and the collectives are the identity.

This module imports neither torch.distributed nor deepspeed: the single-process path never needs them.
"""

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import (
    get_scheduler,
)

from open_instruct.learner import lora, models, saving
from open_instruct.run import devices


@dataclass
class OptimizerSettings:
    """One model's AdamW and LR schedule, and how its gradients are accumulated and clipped."""

    learning_rate: float
    weight_decay: float
    lr_scheduler_type: str
    warmup_steps: int
    optimizer_steps: int
    max_grad_norm: float
    gradient_accumulation_steps: int  # micro-batches per optimizer step on this rank
    micro_batch_size: int


def adamw(model: nn.Module, settings: OptimizerSettings) -> torch.optim.AdamW:
    """AdamW over the parameters that train (with LoRA the adapters' alone: the frozen base gets no state)."""
    trained = [param for param in model.parameters() if param.requires_grad]
    return torch.optim.AdamW(trained, lr=settings.learning_rate, weight_decay=settings.weight_decay, eps=1e-5)


def lr_scheduler(optimizer, settings: OptimizerSettings):
    return get_scheduler(
        settings.lr_scheduler_type,
        optimizer,
        num_warmup_steps=settings.warmup_steps,
        num_training_steps=settings.optimizer_steps,
    )


class AdamWTrainer:
    """A plain torch model with AdamW: gradients accumulated over micro-batches, clipped, one step per minibatch."""

    def __init__(self, model: nn.Module, settings: OptimizerSettings):
        self.model, self.settings = model, settings
        self.optimizer = adamw(model, settings)
        self.scheduler = lr_scheduler(self.optimizer, settings)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """`loss` is one micro-batch's part of the minibatch's loss (its sum over the minibatch's count, see
        rl.WholeBatch): the parts' gradients add up to the minibatch's. `last`: the minibatch's last micro-batch
        (DeepSpeed needs to know)."""
        loss.backward()

    def step(self, apply: bool = True) -> bool:
        """Clip and apply the minibatch's update, unless `apply` is False or the gradient norm is not finite (a NaN
        update is never applied). Returns whether it was applied; a skipped update keeps its place in the schedule."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.settings.max_grad_norm)
        applied = apply and bool(torch.isfinite(grad_norm))
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return applied

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]


class SingleProcess:
    """Today's learner: every model on this process's device, collectives are the identity."""

    rank, world_size = 0, 1
    saves_engines = False  # a checkpoint holds the learner's state_dict in one file (PPOLearner.write_checkpoint)

    SNAPSHOT_SLOTS = 3  # at most two requests with weights are in flight (async), plus the one being written

    def __init__(self):
        self.device = devices.learner_device()
        self.snapshots = WeightSnapshots(self.SNAPSHOT_SLOTS)

    def load_model(self, spec: models.ModelSpec) -> nn.Module:
        return models.load_model(spec, self.device)

    def trainable(self, model: nn.Module, settings: OptimizerSettings) -> AdamWTrainer:
        return AdamWTrainer(model, settings)

    def frozen(self, model: nn.Module) -> nn.Module:
        return model

    def hf_model(self, model: nn.Module) -> nn.Module:
        """The Hugging Face model inside what `trainable`/`frozen` returned (its names are the checkpoint's)."""
        return models.hf_model_of(model)

    def local_rows(self, num_rows: int) -> slice:
        return slice(0, num_rows)

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def named_weights(
        self, model: nn.Module, dtype: torch.dtype, slot: int | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        """A copy for the engine; on CPUs into reused buffer `slot` when given (WeightSnapshots says why; GPUs
        reuse memory through the CUDA caching allocator already). With LoRA adapters: the merged weights, computed
        afresh out of place, and the frozen ones by reference (lora.py)."""
        hf_model = self.hf_model(model)
        if lora.is_adapted(hf_model):
            return list(lora.merged_weights(hf_model, dtype))
        if slot is None or self.device.type != "cpu" or slot >= self.SNAPSHOT_SLOTS:
            return named_weights_for_engine(hf_model, dtype)
        return self.snapshots.take(hf_model, dtype, slot)

    def iter_named_weights(
        self, model: nn.Module, dtype: torch.dtype, every_rank: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, whatever `every_rank` says: this process is rank 0 and the only one (merged with LoRA)."""
        for weight in lora.engine_weights(self.hf_model(model)):
            yield weight.name, weight.value(dtype)  # copied into a broadcast bucket at once

    def weight_shapes(self, model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
        return [(weight.name, weight.shape) for weight in lora.engine_weights(self.hf_model(model))]

    def iter_master_weights(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The trained weights with the checkpoint's names (each shared tensor once), one at a time: here the model's
        own fp32 parameters; with LoRA adapters the merged fp32 weights under the base's names."""
        hf_model = self.hf_model(model)
        if lora.is_adapted(hf_model):
            yield from lora.merged_weights(hf_model, torch.float32)
            return
        for name, tensor in saving.unique_state_items(hf_model):
            yield name, tensor.detach()

    def trained_masters(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The trained parameters (LoRA: the adapters) by name."""
        return {name: param.detach() for name, param in lora.trained_parameters(self.hf_model(model)).items()}


def named_weights_for_engine(model: nn.Module, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """A snapshot of the policy's weights with HF names, detached and copied, for the vLLM engine.

    A copy, because the learner keeps updating its parameters in place while the generation
    thread loads (and generates with) this version.
    """
    return [(name, param.detach().to(dtype=dtype, copy=True)) for name, param in model.named_parameters()]


class WeightSnapshots:
    """Copies of a model's weights for the engine, written into `slots` flat buffers that are reused.

    An async run copies the policy at every step, because the learner trains on while the engine has yet to load
    the copy. Fresh memory for each copy costs page faults: for SmolLM2-135M in fp32 (540 MB) the copy measured
    0.19 s into new memory against 0.046 s into memory already touched. The caller says which slot to write
    (`take(model, dtype, slot)`) and must not reuse a slot whose copy the engine has not loaded yet
    (rollout_requests.RolloutRequests picks a slot no request in flight holds). Views into the slot come back
    with HF names, as `named_weights_for_engine` returns them.
    """

    def __init__(self, slots: int):
        self.buffers: list[torch.Tensor | None] = [None] * slots

    def take(self, model: nn.Module, dtype: torch.dtype, slot: int) -> list[tuple[str, torch.Tensor]]:
        params = list(model.named_parameters())
        numel = sum(param.numel() for _, param in params)
        buffer = self.buffers[slot]
        if buffer is None or buffer.numel() != numel or buffer.dtype != dtype or buffer.device != params[0][1].device:
            buffer = self.buffers[slot] = torch.empty(numel, dtype=dtype, device=params[0][1].device)
        named, offset = [], 0
        with torch.no_grad():
            for name, param in params:
                view = buffer[offset : offset + param.numel()].view(param.shape)
                view.copy_(param.detach())
                named.append((name, view))
                offset += param.numel()
        return named
