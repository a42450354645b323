"""The sizes of the run's models, from their configs alone: no weights are read (the memory plan's input).

Each model is built on the meta device (`torch.device("meta")`: shapes without storage) with the class the learner
loads it with, so its parameter count is exact (tied embeddings counted once, a value model's new score head
included); layers, widths and vocabulary come from its config.

Where a config comes from, in order:
1. a `config.json` file, or a local model folder (the embedded aliases included);
2. `configs/model_configs/<hub id>/config.json` in this checkout: the cluster recipes' architectures, shipped so
   that a recipe's plan can be checked offline (the hub cannot be reached on the development machines); the run
   itself still loads the hub model its flags name;
3. the hub (or its local cache).
"""

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from open_instruct.run.args import Args, ConfigError
from open_instruct.run.devices import MODEL_CONSTRUCTION

SHIPPED_CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "model_configs"


def keep_first_layers(config, num_layers: int) -> None:
    """Make `config` describe a model of its first `num_layers` decoder layers (--value_model_num_layers): transformers
    then loads those layers' weights and leaves the rest unread. 0, or at least the model's depth: all layers (a
    recipe's N then also runs a smaller model, e.g. the 2-layer test model)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if num_layers == 0 or num_layers >= text.num_hidden_layers:
        return
    text.num_hidden_layers = num_layers
    if isinstance(getattr(text, "layer_types", None), list):  # per-layer attention kinds (sliding / full)
        text.layer_types = text.layer_types[:num_layers]


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs to know of one model the learner holds."""

    role: str  # "policy", "value model", "reference policy", "reward model"
    trainable: bool
    num_params: int
    largest_module_params: int  # parameters of the largest single module (the embedding, or the LM head)
    largest_param: int  # elements of the largest single parameter
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal_lm: bool  # logits over the vocabulary (policy, reference); else a scalar score head
    source: str  # where its config was read
    checkpoint_bytes: int = 2  # per parameter in its files (the config's dtype; bf16 unless it says float32)
    trained_params: int | None = None  # with --lora_rank: the adapters' (and a score head's); None: all of them

    @property
    def attention_width(self) -> int:
        return self.num_heads * self.head_dim


def find_config(path_or_id: str, revision: str | None = None):
    """The transformers config of a model folder, a config.json file, a shipped recipe config or a hub id;
    returns (config, where it was read)."""
    from transformers import AutoConfig

    from open_instruct.data.embedded import resolve_model_path

    expanded = os.path.expanduser(path_or_id)
    if os.path.isfile(expanded):
        return AutoConfig.from_pretrained(expanded), expanded
    if not os.path.isdir(expanded):
        shipped = SHIPPED_CONFIGS / path_or_id / "config.json"
        if shipped.is_file():
            return AutoConfig.from_pretrained(str(shipped)), str(shipped.relative_to(SHIPPED_CONFIGS.parents[1]))
    folder = resolve_model_path(path_or_id)
    return AutoConfig.from_pretrained(folder, revision=revision), folder


def decoder_linear_layers(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The linear layers of a model's decoder by module name (`model.layers.0.self_attn.q_proj`, ...): those under its
    backbone, so neither a causal LM's head nor a value model's score head."""
    prefix = model.base_model_prefix
    backbone = getattr(model, prefix)
    return {f"{prefix}.{name}": module for name, module in backbone.named_modules()
            if isinstance(module, torch.nn.Linear)}  # fmt: skip


def lora_targets(model: torch.nn.Module, requested: list[str]) -> list[str]:
    """The decoder's linear layer names (their last part, `q_proj`) that get adapters: `requested` (--lora_target_modules)
    after checking each names one, else all of them."""
    available = sorted({name.rsplit(".", 1)[-1] for name in decoder_linear_layers(model)})
    unknown = [name for name in requested if name not in available]
    if unknown:
        raise ConfigError(
            f"--lora_target_modules {' '.join(unknown)}: no linear layer of the {type(model).__name__} decoder has that "
            f"name; expected some of {' '.join(available)} (or nothing: all of them)."
        )
    return sorted(set(requested)) if requested else available


def lora_params(model: torch.nn.Module, rank: int, targets: list[str]) -> int:
    """Parameters of rank-`rank` adapters on the decoder layers named `targets`: A [rank, in] and B [out, rank] each."""
    return sum(rank * (layer.in_features + layer.out_features)
               for name, layer in decoder_linear_layers(model).items() if name.rsplit(".", 1)[-1] in targets)  # fmt: skip


def attention_sizes(text) -> tuple[int, int, int]:
    """(heads, KV heads, head_dim) of a text model's config: without `num_key_value_heads` every head has its own keys
    and values; without `head_dim` the heads split the hidden size."""
    num_heads = text.num_attention_heads
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    return num_heads, num_kv_heads, getattr(text, "head_dim", None) or text.hidden_size // num_heads


def model_shape(
    role: str, path_or_id: str, trainable: bool, scalar_head: bool, revision: str | None = None,
    lora_rank: int = 0, lora_target_modules: list[str] | None = None, num_layers: int = 0,
) -> ModelShape:  # fmt: skip
    """`role`'s sizes, built on the meta device from its config (see the module docstring for where it is read).
    With `lora_rank` > 0 a trainable model trains only its adapters (and a scalar head)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        config, source = find_config(path_or_id, revision)
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"the memory plan needs the {role}'s config and {path_or_id!r} gave none "
            f"({' '.join(str(error).split())[:160]}); "
            f"give a model folder, a config.json, or ship one as configs/model_configs/{path_or_id}/config.json."
        ) from error
    if scalar_head:
        config.num_labels = 1
    keep_first_layers(config, num_layers)
    auto_class = AutoModelForSequenceClassification if scalar_head else AutoModelForCausalLM
    with MODEL_CONSTRUCTION, torch.device("meta"):  # (from_config sets torch's default dtype to the config's)
        model = auto_class.from_config(config)
    params = list(model.parameters())  # a tied embedding is one parameter: counted once
    module_sizes = [sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules()]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    trained_params = None
    if trainable and lora_rank > 0:
        head = sum(p.numel() for p in model.score.parameters()) if scalar_head else 0
        trained_params = lora_params(model, lora_rank, lora_targets(model, lora_target_modules or [])) + head
    num_heads, num_kv_heads, head_dim = attention_sizes(text)
    return ModelShape(
        role=role,
        trainable=trainable,
        num_params=sum(p.numel() for p in params),
        largest_module_params=max(module_sizes),
        largest_param=max(p.numel() for p in params),
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        num_layers=text.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        causal_lm=not scalar_head,
        source=source,
        checkpoint_bytes=4 if str(getattr(config, "dtype", None) or "").endswith("float32") else 2,
        trained_params=trained_params,
    )


def run_model_shapes(args: Args) -> list[ModelShape]:
    """The models a learner rank of this run holds, in the order it loads them: the policy, the reference (with a
    non-zero --beta and no --lora_rank), the reward model (with a non-zero --reward_model_multiplier) and PPO's value model."""
    model = args.model
    policy = model.model_name_or_path
    lora = {"lora_rank": model.lora_rank, "lora_target_modules": model.lora_target_modules}
    shapes = [model_shape("policy", policy, trainable=True, scalar_head=False, revision=model.model_revision, **lora)]
    if args.ppo.beta != 0 and model.lora_rank == 0:  # with LoRA the reference is the policy, its adapters disabled
        shapes.append(model_shape("reference policy", policy, False, False, model.model_revision))
    if args.reward.reward_model_multiplier != 0 and model.reward_model_path is not None:
        shapes.append(model_shape("reward model", model.reward_model_path, False, True, model.reward_model_revision))
    if args.ppo.algorithm == "ppo":
        if model.value_model_path is not None:
            value_path, value_revision = model.value_model_path, model.value_model_revision
        elif model.reward_model_path is not None:
            value_path, value_revision = model.reward_model_path, model.reward_model_revision
        else:
            value_path, value_revision = policy, model.model_revision
        shapes.append(model_shape("value model", value_path, True, True, value_revision,
                                  num_layers=model.value_model_num_layers, **lora))  # fmt: skip
    return shapes


def describe_count(num_params: int) -> str:
    """8030261248 -> '8.03B', 134515008 -> '134.5M'."""
    if num_params >= 1e9:
        return f"{num_params / 1e9:.2f}B"
    return f"{num_params / 1e6:.{1 if num_params >= 1e6 else 3}f}M"
