"""LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on the learner's models, with peft.

Each adapted linear layer computes `W x + s B A x` (s = --lora_alpha / --lora_rank), with W frozen and only A and B
trained; B starts at 0, so the adapted model starts as the base. What this module adds around peft:

- **The reference is the base**: the policy with its adapters disabled computes `W x` alone, bit for bit the base
  model's function (`adapters_disabled`), so no reference model is loaded.
- **Merged weights for the engine**: the engine runs plain HF weights. At each sync every adapted layer's
  `W + s B A` is computed out of place in fp32 from the frozen W (`merged_weight`). peft's own `merge_adapter` /
  `unmerge_adapter` add and subtract `s B A` in place in the weights' dtype: in bf16 the round trip does not give W
  back, and the drift compounds over syncs (TRL issue 6688). Here W is never written, so each sync is exact in fp32;
  a bf16 engine then holds the merge rounded to bf16, which loses most of a small update (docs/lora.md has the
  numbers; `--lora_weight_sync adapter` sends the adapters instead).
- **What trains, and what a checkpoint holds**: the adapters (and a value model's score head, trained in full).
- **What users keep**: the merged fp32 weights as a plain HF folder, and the adapters in peft's format beside them.
"""

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn

from open_instruct.run.devices import MODEL_CONSTRUCTION
from open_instruct.run.model_shapes import lora_targets

ADAPTER = "default"  # peft's name of the one adapter a model gets
ADAPTER_FOLDER = "adapter"  # inside a saved model folder: PeftModel.from_pretrained(base, "<model>/adapter")


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    target_modules: tuple[str, ...] = ()  # empty: every linear layer of the decoder

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def of(cls, model_args) -> "LoraSettings | None":
        """The run's LoRA settings (args.model), or None without --lora_rank."""
        if model_args.lora_rank == 0:
            return None
        return cls(model_args.lora_rank, model_args.lora_alpha, tuple(model_args.lora_target_modules))


@torch.no_grad()  # a weight for the engine or a file: no autograd graph through the adapters
def merged_weight(base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> torch.Tensor:
    """`W + s B A` in fp32, out of place: `base` W [out, in], `lora_a` A [rank, in], `lora_b` B [out, rank]. One
    addmm, which writes only its result: `W + s * (B @ A)` makes three [out, in] temporaries and measured 12x slower
    (29 ms vs 2.5 ms for a 576 x 1536 layer at rank 16, on 2 busy cores)."""
    return torch.addmm(base.float(), lora_b.float(), lora_a.float(), alpha=scaling)


def add_adapters(hf_model: nn.Module, settings: LoraSettings, seed: int, train_head: bool = False) -> PeftModel:
    """Rank-r adapters on `hf_model`'s decoder linear layers, everything else frozen (but the score head of a value
    model with `train_head`). peft modifies `hf_model` in place: the returned PeftModel wraps it, and `hf_model` keeps
    its class, config and forward (models.TokenLogprobs and TokenScores go on wrapping it).

    A starts from peft's init (Kaiming-uniform) drawn from a generator of the run's seed, B from 0: the adapted model
    starts as the base, and two runs with one seed start alike (the engine may draw from torch's global generator
    in another thread meanwhile, as models.score_head_generator says).
    """
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        target_modules=lora_targets(hf_model, list(settings.target_modules)),
        lora_dropout=0.0,  # --lora_dropout's check (run/flags.py) refuses anything else: the engine samples without dropout
        bias="none",
    )
    with MODEL_CONSTRUCTION:  # peft builds the adapter layers under torch's default dtype (devices says why)
        peft_model = get_peft_model(hf_model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(hf_model):
            lora_a = layer.lora_A[ADAPTER].weight
            lora_a.copy_(nn.init.kaiming_uniform_(torch.empty_like(lora_a), a=math.sqrt(5), generator=generator))
            layer.lora_B[ADAPTER].weight.zero_()
    if train_head:
        hf_model.score.requires_grad_(True)
    return peft_model


def save_adapter(peft_model: PeftModel, trained: dict[str, torch.Tensor], model_folder: str) -> None:
    """The adapters in peft's format in `model_folder`/adapter (adapter_config.json naming the base, and
    adapter_model.safetensors): `PeftModel.from_pretrained(base, "<model>/adapter")` loads them. `trained`: the
    trained weights by the HF model's names, whole (DeepSpeed: the gathered fp32 masters; the module's own may be
    partitions or bf16 copies)."""
    prefix = "base_model.model."  # peft's names of the wrapped HF model's parameters
    state = {prefix + name: tensor for name, tensor in trained.items() if "lora_" in name}
    peft_model.save_pretrained(os.path.join(model_folder, ADAPTER_FOLDER), state_dict=state)


@torch.no_grad()
def adapter_weights(model: nn.Module, dtype: torch.dtype) -> list[tuple[str, torch.Tensor]]:
    """The adapters alone, copied in `dtype`, under peft's names in a saved adapter (`base_model.model.<module>.lora_A
    .weight`): what an engine serving them loads (--lora_weight_sync adapter). A copy: the learner trains on."""
    prefix, own = "base_model.model.", f".{ADAPTER}."
    return [(prefix + name.replace(own, "."), param.detach().to(dtype=dtype, copy=True))
            for name, param in model.named_parameters() if "lora_" in name]  # fmt: skip


def lora_layers(model: nn.Module) -> list[LoraLayer]:
    return [module for module in model.modules() if isinstance(module, LoraLayer)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """`model` computes as its base inside: each adapted layer returns its frozen base layer's output alone."""
    layers = lora_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def trained_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters that train, by name: with adapters, theirs (and a score head's)."""
    return {name: param for name, param in model.named_parameters() if param.requires_grad}


@dataclass
class EngineWeight:
    """One tensor of the weights the engine and a saved folder get, under the base model's HF name: an adapted layer's
    weight is merged from its frozen base W and its adapters (`params` = [W, A, B], `layer` the adapted layer); any
    other is `params[0]` as it is. Under ZeRO-3 `params` are what must be gathered together to compute it."""

    name: str
    params: list[nn.Parameter]
    layer: LoraLayer | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self.params[0], "ds_shape", self.params[0].shape))  # ZeRO-3 holds a partition

    def value(self, dtype: torch.dtype, read=lambda param: param, copy: bool = False) -> torch.Tensor:
        """The tensor in `dtype`: merged afresh (`merged_weight`), or the frozen tensor itself unless `copy` or `dtype`
        differs. `read(param)` gives a parameter's values (DeepSpeed: a trained one's fp32 master for a save)."""
        if self.layer is None:
            return read(self.params[0]).detach().to(dtype=dtype, copy=copy)
        base, lora_a, lora_b = (read(param) for param in self.params)
        return merged_weight(base, lora_a, lora_b, self.layer.scaling[ADAPTER]).to(dtype)


def engine_weights(model: nn.Module) -> list[EngineWeight]:
    """The adapted model's weights under the base model's HF names (what the engine and a saved folder expect), in the
    model's parameter order, each shared tensor once."""
    seen: set[int] = set()
    adapted: list[str] = []  # the adapted layers' names: their own submodules (base_layer, lora_A, ...) are not weights
    weights = []
    for module_name, module in model.named_modules():
        if any(module_name.startswith(f"{name}.") for name in adapted):
            continue
        if isinstance(module, LoraLayer):
            adapted.append(module_name)
            base = module.get_base_layer()
            seen.update({id(base.weight), id(base.bias)})
            pair = [module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight]
            weights.append(EngineWeight(f"{module_name}.weight", [base.weight, *pair], module))
            if base.bias is not None:
                weights.append(EngineWeight(f"{module_name}.bias", [base.bias]))
            continue
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                weights.append(EngineWeight(f"{module_name}.{name}" if module_name else name, [param]))
    return weights


def merged_named_weights(
    model: nn.Module, dtype: torch.dtype, gathered=None, read=lambda param: param, copy: bool = False
) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor in `dtype`, whether it is merged) of each of `engine_weights`, computed one at a time: an adapted
    layer's weight is `merged_weight` of its frozen base (a fresh tensor); any other weight is the frozen tensor itself,
    not a copy (it never changes), unless `copy` or `dtype` differs. `gathered(params)`: a context in which the
    params are whole (DeepSpeed ZeRO-3 gathers each weight's params, so at most one layer is whole at a time; then
    `copy`, as the gathered memory is given back when the context ends)."""
    for weight in engine_weights(model):
        with gathered(weight.params) if gathered is not None else contextlib.nullcontext():
            yield weight.name, weight.value(dtype, read, copy), weight.layer is not None


def merged_weights(model: nn.Module, dtype: torch.dtype, **how) -> Iterator[tuple[str, torch.Tensor]]:
    """`merged_named_weights` as (name, tensor) pairs: what the engine loads, and what a saved folder holds."""
    for name, tensor, _ in merged_named_weights(model, dtype, **how):
        yield name, tensor


def is_adapted(model: nn.Module) -> bool:
    return any(isinstance(module, LoraLayer) for module in model.modules())


class AdaptersDisabled:
    """The reference policy of a LoRA run: `policy` (a models.TokenLogprobs with adapters) called with its adapters
    disabled, which is the base model's function; it holds no weights of its own."""

    def __init__(self, policy: nn.Module):
        self.policy = policy

    @property
    def hf_model(self) -> nn.Module:
        return self.policy.hf_model

    def __call__(self, *args, **kwargs):
        with adapters_disabled(self.policy):
            return self.policy(*args, **kwargs)
