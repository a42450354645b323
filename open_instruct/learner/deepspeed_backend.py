"""The learner backend of one DeepSpeed rank (learner/seams.LearnerBackend says what PPOLearner uses of it).

Policy and value model are DeepSpeed training engines at ZeRO stage 0, 2 or 3, with torch AdamW as the
client optimizer (DeepSpeed's own Adam kernels JIT-compile for minutes on CPUs); the reference and reward
models are ZeRO-3 inference engines at stage 3 (sharded like the policy) and plain replicated models
otherwise. fp32 with gloo on CPUs, bf16 (fp32 master weights) with NCCL on GPUs, chosen at run time.
The JSON configs live in configs/ds_configs/; batch sizes, clipping and precision are filled in here.

Imported only by the Ray learner actors: the single-process trainer never loads deepspeed.
"""

import importlib
import json
import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import deepspeed
import torch
import torch._dynamo  # noqa: F401  before any ZeRO-3 partitioning, else torch._dynamo fails with "Signature mismatch"
import torch.distributed as dist
from deepspeed.utils import safe_get_full_fp32_param
from torch import nn

from open_instruct.learner import lora, models, saving
from open_instruct.learner.single_process import OptimizerSettings, adamw, lr_scheduler
from open_instruct.run import devices
from open_instruct.run.checkpoint import NonFiniteError, fsync_files

# The tag (subfolder) of the DeepSpeed checkpoint each trained model writes inside a checkpoints/step_N/<role>/ folder.
ENGINE_TAG = "engine"

DS_CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "ds_configs"


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float,
                       local_rank: int | None = None) -> None:  # fmt: skip
    """Join the learner group: gloo on CPUs, NCCL on GPUs. Rank 0 listens on master_addr:master_port.
    `local_rank`: this rank's CUDA device index in its process (run.devices.local_gpu_index; None: no GPU)."""
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank or 0),  # DeepSpeed reads it to pick this rank's device
    )
    if master_addr.startswith("127."):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # DeepSpeed JIT-compiles a shared-memory all-reduce for CPU inference at init (minutes on 2 cores);
    # training never uses it.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if torch.cuda.is_available():
        # NCCL without `device_id`: DeepSpeed would bind the communicator to the device eagerly at init, the pattern
        # open-instruct avoids because it hangs next to a vLLM weight-transfer group; this way the communicator is
        # created at the first collective, on the device set here. DeepSpeed then adopts the initialised group.
        torch.cuda.set_device(local_rank or 0)
        dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s), rank=rank, world_size=world_size)
    deepspeed.init_distributed(
        dist_backend="nccl" if torch.cuda.is_available() else "gloo",
        auto_mpi_discovery=False,
        timeout=timedelta(seconds=timeout_s),
        rank=rank,
        world_size=world_size,
    )


def real_partition(param: nn.Parameter) -> torch.Tensor:
    """The elements of `param` this rank holds: at ZeRO-3 its partition (`ds_tensor`) without the padding. DeepSpeed
    cuts a parameter into equal partitions of ceil(numel / ranks) elements and allocates them with `torch.empty`, so
    the tail of the last ones is padding that is never written (partition_parameters.py `_partition_param`): it may
    hold NaN from whatever the memory held, and says nothing about the weights."""
    local = getattr(param, "ds_tensor", None)
    if local is None:
        return param
    start = local.ds_numel * dist.get_rank(group=param.ds_process_group)
    return local.narrow(0, 0, max(0, min(local.ds_numel, param.ds_numel - start)))


def load_ds_config(name: str) -> dict:
    path = DS_CONFIG_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config {path} is missing; run from a checkout that has configs/ds_configs/.")
    with open(path) as f:
        return json.load(f)


class DeepSpeedTrainer:
    """A DeepSpeed training engine: it sums the micro-batches' parts of the loss over ranks (see `backward`) and clips
    by the global norm."""

    def __init__(self, model: nn.Module, settings: OptimizerSettings, config: dict):
        self.engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=adamw(model, settings),
            lr_scheduler=lambda optimizer: lr_scheduler(optimizer, settings),
            config=config,
        )
        self.model = self.engine

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """`loss` is one micro-batch's part of the minibatch's loss (its sum over the minibatch's count, see
        rl.WholeBatch): the parts' gradients add up over micro-batches and ranks. The engine divides by its
        gradient_accumulation_steps and averages over ranks, which the scale undoes; the minibatch's end is marked by
        hand (packed micro-batches: every rank runs the same number, which may differ from minibatch to minibatch).
        Its step() must follow every backward: it updates only at that end. The engine would apply a NaN update (fp32
        has no loss scaler to skip it), so a non-finite loss stops this rank first; the learner group then ends the
        run naming it."""
        if not torch.isfinite(loss):
            raise NonFiniteError(f"a non-finite loss ({loss.item()}) on this learner rank; lower the learning rate")
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss * self.engine.gradient_accumulation_steps() * dist.get_world_size())
        self.engine.step()

    def step(self, apply: bool = True) -> bool:
        if not self.engine.was_step_applied():
            raise RuntimeError(
                "DeepSpeed did not apply an optimizer step at the end of a minibatch; its gradient_accumulation_steps "
                "must equal the micro-batches per minibatch on each rank."
            )
        return True  # a non-finite loss already stopped the rank in backward

    @property
    def lr(self) -> float:
        return self.engine.get_lr()[0]


def weights_dtype(requested: str, learner_compute_dtype: str) -> str:
    """--deepspeed_weights_dtype, decided on the rank's own device: auto is bf16 on a GPU computing in bf16."""
    if requested != "auto":
        return requested
    on_gpu_in_bf16 = torch.cuda.is_available() and learner_compute_dtype != "float32"
    return "bfloat16" if on_gpu_in_bf16 else "float32"


class DeepSpeedBackend:
    """One rank's models on DeepSpeed: the seams.LearnerBackend (and EngineCheckpoints) PPOLearner runs on.

    `weights_dtype`: the dtype of the module weights the engines compute with at ZeRO-2/3. bfloat16 is DeepSpeed's
    bf16 mode: bf16 weights on the device, fp32 master weights (and, set here, fp32 gradient accumulation) in the
    optimizer; the saved model is always the fp32 masters. float32: the weights are the masters. At stage 0 the
    weights stay fp32 (DeepSpeed cannot accumulate a bf16 engine's gradients in fp32 there; autocast still computes
    in bf16 where the learner chose it).
    """

    saves_engines = True  # a checkpoint holds each engine's own DeepSpeed checkpoint, every rank writing its part

    def __init__(self, stage: int, micro_batch_size: int, gather_whole_model: bool, weights_dtype: str = "float32"):
        self.stage, self.micro_batch_size, self.gather_whole_model = stage, micro_batch_size, gather_whole_model
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = devices.learner_device()
        self.bf16 = weights_dtype == "bfloat16" and stage in (2, 3)

    def config(self, name: str, micro_batch_size: int, gradient_accumulation_steps: int, max_grad_norm: float) -> dict:
        config = {
            **load_ds_config(name),
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "train_batch_size": micro_batch_size * gradient_accumulation_steps * self.world_size,
            "gradient_clipping": max_grad_norm,
            "bf16": {"enabled": self.bf16},
        }
        if self.bf16 and name.endswith("_train.json"):
            # Summing 14 micro-batches of bf16 gradients loses their low bits (DeepSpeed warns of it): accumulate in fp32.
            config["data_types"] = {"grad_accum_dtype": "fp32"}
        return config

    def train_config(self, settings: OptimizerSettings) -> dict:
        return self.config(f"zero{self.stage}_train.json", settings.micro_batch_size,
                           settings.gradient_accumulation_steps, settings.max_grad_norm)  # fmt: skip

    def inference_config(self) -> dict:
        return self.config("zero3_inference.json", self.micro_batch_size, 1, 0.0)

    def load_model(self, spec: models.ModelSpec) -> nn.Module:
        """The whole model on this rank (stages 0 and 2), or, at stage 3, built partitioned and filled rank by rank
        from its files (zero3_loading): the config is the one its engine is initialised with below."""
        if self.stage != 3:
            return models.load_model(spec, self.device)
        from open_instruct.learner.zero3_loading import load_partitioned

        if spec.trainable:
            dtype = torch.bfloat16 if self.bf16 else torch.float32
            # The batch sizes of the train config do not change how a model is partitioned.
            config = self.config("zero3_train.json", self.micro_batch_size, 1, 1.0)
        else:
            dtype, config = devices.inference_dtype(self.device), self.inference_config()
        return load_partitioned(spec, config, dtype)

    def trainable(self, model: nn.Module, settings: OptimizerSettings) -> DeepSpeedTrainer:
        return DeepSpeedTrainer(model, settings, self.train_config(settings))

    def frozen(self, model: nn.Module) -> nn.Module:
        if self.stage != 3:
            return model
        engine, *_ = deepspeed.initialize(model=model, config=self.inference_config())
        engine.eval()  # DeepSpeedEngine.eval returns None, not the engine
        return engine

    # ---- checkpoints: DeepSpeed's own, every rank writing its partition in parallel ----

    def save_engine_checkpoint(self, trainer: DeepSpeedTrainer, folder: str, role: str) -> int:
        """`trainer`'s DeepSpeed checkpoint in folder/engine/ (a collective: every rank calls it): the module weights,
        this rank's partition of the fp32 masters and AdamW moments, the LR scheduler. Returns the bytes this rank
        wrote, fsynced (DeepSpeed does not fsync). Refuses to write non-finite weights."""
        self.check_finite(trainer.engine, role)
        os.makedirs(folder, exist_ok=True)
        # With LoRA the frozen base is left out (a resumed run reloads it from --model_name_or_path): the checkpoint
        # holds the adapters (and a value model's score head) and their optimizer state alone. DeepSpeed's
        # exclude_frozen_parameters drops each frozen parameter under one name only: a tied LM head's second name
        # (the whole embedding) would stay, so the module's state drops every name of a frozen parameter.
        module = trainer.engine.module
        frozen = {name for name, param in module.named_parameters(remove_duplicate=False) if not param.requires_grad}

        def drop_frozen(_, state: dict, prefix: str, __) -> None:
            for name in frozen:
                state.pop(prefix + name, None)

        hook = module.register_state_dict_post_hook(drop_frozen)
        try:
            trainer.engine.save_checkpoint(folder, tag=ENGINE_TAG, save_latest=False,
                                           exclude_frozen_parameters=bool(frozen))  # fmt: skip
        finally:
            hook.remove()
        written = os.path.join(folder, ENGINE_TAG)
        # Each rank's files name it (zero_pp_rank_<r>_...); the others (the replicated states of ZeRO-0/2, DeepSpeed's
        # own notes) come from rank 0.
        own = [name for name in os.listdir(written)
               if f"zero_pp_rank_{self.rank}_" in name or (self.rank == 0 and "zero_pp_rank_" not in name)]  # fmt: skip
        return fsync_files(written, own)

    def check_finite(self, model: nn.Module, role: str) -> None:
        """NonFiniteError naming the first weight of `model` with NaN or inf among the elements this rank holds (at
        ZeRO-3 its partitions without their padding: `real_partition`). No collective: each rank checks its own."""
        for name, param in unwrap(model).named_parameters():
            local = real_partition(param)
            if local.is_floating_point() and not torch.isfinite(local).all():
                raise NonFiniteError(f"the {role}'s weight {name} holds NaN or inf on rank {self.rank}; refusing to save it")

    def load_engine_checkpoint(self, trainer: DeepSpeedTrainer, folder: str) -> None:
        """Restore what `save_engine_checkpoint` wrote into this run's engine (same rank count and stage)."""
        path, _ = trainer.engine.load_checkpoint(
            folder, tag=ENGINE_TAG, load_optimizer_states=True, load_lr_scheduler_states=True,
            load_module_strict=not has_frozen(trainer.engine),  # a LoRA checkpoint holds no frozen weights
        )  # fmt: skip
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint in {os.path.join(folder, ENGINE_TAG)}")

    def engine_checkpoint_bytes(self, trainers: list[DeepSpeedTrainer]) -> int:
        """About what this rank writes: its share of the fp32 masters and two AdamW moments (12 bytes a weight), and,
        at ZeRO-0/2, on rank 0, the module weights in their dtype (at ZeRO-3 they are the masters' partitions: measured,
        the tiny model's 6.59M weights at 2 ranks wrote 39.5 MB of optimizer state per rank and 13 KB of module state).
        The trained weights only: a LoRA checkpoint leaves the frozen base out."""
        total = 0
        for trainer in trainers:
            trained = [p for p in unwrap(trainer.engine).parameters() if p.requires_grad]
            numel = sum(getattr(p, "ds_numel", p.numel()) for p in trained)
            weight_bytes = 2 if self.bf16 else 4
            if self.stage == 0:
                total += numel * (weight_bytes + 8) if self.rank == 0 else 0
            elif self.stage == 2:
                total += numel * 12 // self.world_size + (numel * weight_bytes if self.rank == 0 else 0)
            else:
                total += numel * 12 // self.world_size
        return total

    def hf_model(self, model: nn.Module) -> nn.Module:
        """The Hugging Face model inside an engine's wrapper (its parameter names are the checkpoint's)."""
        return unwrap(model)

    def local_rows(self, num_rows: int) -> slice:
        share = num_rows // self.world_size  # compute_batch_sizes makes the rollout a multiple of the ranks
        return slice(self.rank * share, (self.rank + 1) * share)

    def gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        on_device = tensor.to(self.device)
        dist.all_reduce(on_device)
        return on_device.to(tensor.device)

    def named_weights(
        self, model: nn.Module, dtype: torch.dtype, slot: int | None = None
    ) -> list[tuple[str, torch.Tensor]] | None:
        """Rank 0 gets the full weights. Under ZeRO-3 every rank takes part in gathering them: the whole model
        at once with --gather_whole_model, else one parameter at a time (peak memory: the largest one)."""
        weights = list(self.iter_named_weights(model, dtype))
        return weights if self.rank == 0 else None

    def iter_named_weights(
        self, model: nn.Module, dtype: torch.dtype, every_rank: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(name, copy in `dtype`) of each weight as the engine computes with it, in order (with LoRA adapters the
        merged `W + s B A` under the base's names, lora.engine_weights); the tensor is None on ranks other than 0
        unless `every_rank` (a CUDA IPC transfer: each rank shares its own copy). Under ZeRO-3 every rank must run the
        iterator to the end: each step gathers a weight's parameters (an adapted layer's base and adapters together,
        so at most one layer is whole at a time), or, with --gather_whole_model, the first step gathers all of them."""
        module = unwrap(model)
        keep = every_rank or self.rank == 0
        weights = lora.engine_weights(module)
        whole = self.stage == 3 and self.gather_whole_model
        with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=whole):
            for weight in weights:
                with deepspeed.zero.GatheredParameters(weight.params, enabled=self.stage == 3 and not whole):
                    yield weight.name, weight.value(dtype, copy=True) if keep else None

    def weight_shapes(self, model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
        """The weights' full shapes (ZeRO-3 keeps a partition), in `iter_named_weights`' order and names."""
        return [(weight.name, weight.shape) for weight in lora.engine_weights(unwrap(model))]

    def full_master(self, param: nn.Parameter) -> torch.Tensor:
        """A trained parameter's whole fp32 master at ZeRO-2/3 (a collective at ZeRO-3), else the parameter."""
        if self.stage in (2, 3) and param.requires_grad:
            return safe_get_full_fp32_param(param)
        return param

    def iter_master_weights(self, model: nn.Module) -> Iterator[tuple[str, torch.Tensor | None]]:
        """The trained weights with the checkpoint's names (each shared tensor once), one at a time, on the CPU of rank
        0 (None elsewhere): at ZeRO-2/3 the optimizer's fp32 masters, gathered (a collective per tensor: every rank
        runs the iterator to the end), so a bf16 engine's save holds what it trained, not its bf16 copies. With LoRA
        adapters: the merged weights under the base's names, from the frozen base and the adapters' masters, in fp32."""
        module = unwrap(model)
        if lora.is_adapted(module):
            named = lora.merged_weights(module, torch.float32, gathered=self.gathered, read=self.full_master, copy=True)
        else:
            named = self.iter_state_masters(module)
        for name, full in named:
            yield name, (full.to("cpu", copy=True) if self.rank == 0 else None)

    def iter_state_masters(self, module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in saving.unique_state_items(module):
            if isinstance(tensor, nn.Parameter) and tensor.requires_grad:
                full = self.full_master(tensor)
            elif self.stage == 3 and hasattr(tensor, "ds_id"):  # a frozen partitioned parameter
                with deepspeed.zero.GatheredParameters([tensor]):
                    full = tensor.detach().clone()
            else:
                full = tensor.detach()
            yield name, full

    def trained_masters(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The trained parameters (LoRA: the adapters) by name, whole, fp32, on the CPU of rank 0 (None elsewhere; a
        collective per parameter at ZeRO-3)."""
        trained = {}
        for name, param in unwrap(model).named_parameters():
            if param.requires_grad:
                full = self.full_master(param)
                trained[name] = full.detach().to("cpu", copy=True)
        return trained if self.rank == 0 else None

    def gathered(self, params: list[nn.Parameter]):
        """A context in which `params` are whole on every rank (ZeRO-3 gathers them; elsewhere they are)."""
        return deepspeed.zero.GatheredParameters(params, enabled=self.stage == 3)


def has_frozen(model: nn.Module) -> bool:
    """Whether some of `model`'s weights do not train (LoRA's frozen base)."""
    return any(not param.requires_grad for param in model.parameters())


def unwrap(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a DeepSpeed engine and our wrapper (its parameter names carry no prefix)."""
    module = model.module if isinstance(model, deepspeed.DeepSpeedEngine) else model
    return models.hf_model_of(module)
