"""Loading a model under DeepSpeed ZeRO-3 so that each rank only ever holds its share of it.

transformers' own ZeRO-3 path (`HfDeepSpeedConfig` around `from_pretrained`) reads every checkpoint file whole on
every rank before rank 0 scatters the weights: measured at 2 ranks on a 168M-parameter model, a peak of +0.9-1.3 GB
per rank, more than a plain replicated load. Here instead:

1. the model is built from its config inside `deepspeed.zero.Init`, without random init: each submodule's parameters
   are partitioned as soon as it is built, so a rank holds its 1/N of every tensor (and, transiently, the module
   being built);
2. each rank copies its own flat range of every tensor straight from the safetensors files into its partition
   (`param.ds_tensor`), one tensor at a time, through a memory map: no communication, no whole tensor on any rank;
3. a new score head (a value model built from a causal-LM checkpoint) is gathered, initialised on rank 0 with PPO's
   std 1/sqrt(hidden+1) and the run's seed (the single process's values exactly), and scattered back.

The model's dtype is the DeepSpeed config's (bf16 when it enables bf16, else fp32): `zero.Init(dtype=...)` is not
passed, because in DeepSpeed 0.19 an explicit dtype becomes bf16 on the CPU accelerator whatever it is.
Only safetensors folders load this way (every hub model of the recipes has them); other formats fail with one line.
"""

import json
import math
import os

import deepspeed
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from transformers.initialization import no_init_weights

from open_instruct.learner.models import (
    ModelSpec,
    finish_loading,
    restate_missing_weights,
    score_head_generator,
    score_head_std,
)

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


def checkpoint_files(folder: str, role: str) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it, for a local model folder (one file or shards)."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            return {name: os.path.join(folder, file) for name, file in json.load(f)["weight_map"].items()}
    single = os.path.join(folder, SINGLE_FILE)
    if os.path.isfile(single):
        with safe_open(single, "pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise ValueError(
        f"the {role} {folder!r} has no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}), which ZeRO-3 loads "
        f"partitioned; convert the checkpoint to safetensors, or run with --deepspeed_stage 2."
    )


def copy_partition(param: nn.Parameter, tensor_slice, rank: int) -> None:
    """Copy this rank's flat range [rank*part, (rank+1)*part) of the full tensor into `param.ds_tensor` (the last
    rank's partition is zero-padded), reading only the rows of the file that cover it."""
    part = param.ds_tensor.ds_numel
    start, end = rank * part, min((rank + 1) * part, param.ds_numel)
    if end <= start:
        return
    shape = tensor_slice.get_shape()
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    first_row, last_row = start // row, -(-end // row)
    rows = tensor_slice[first_row:last_row].reshape(-1)
    param.ds_tensor.data[: end - start].copy_(rows[start - first_row * row : end - first_row * row])


def load_partitioned(spec: ModelSpec, ds_config: dict, dtype: torch.dtype) -> nn.Module:
    """`spec`'s model built partitioned under `ds_config` (the config its engine will be initialised with) and filled
    from its safetensors files, each rank reading only its share."""
    config = spec.config()
    files = checkpoint_files(spec.path, spec.role)
    with deepspeed.zero.Init(config_dict_or_path=ds_config), no_init_weights():
        model = spec.auto_class.from_config(config, dtype=dtype)
    # Built this way the output embedding is not yet tied to the input one (measured with transformers 5.19): tie
    # them now, or a tied LM head would stay at the uninitialised memory no checkpoint tensor fills.
    model.tie_weights()
    rank, prefix = dist.get_rank(), model.base_model_prefix
    head_is_new, missing = spec.head_is_new(config), []
    for name, param in model.named_parameters():
        key = name if name in files else name.removeprefix(prefix + ".")  # a checkpoint of the bare backbone
        if key not in files:
            missing.append(name)
            continue
        with safe_open(files[key], "pt") as f:  # one handle per tensor: pages read stay mapped while it is open
            tensor_slice = f.get_slice(key)
            if tuple(tensor_slice.get_shape()) != tuple(param.ds_shape):
                raise ValueError(f"the {spec.role} checkpoint {spec.path!r} holds {key} of shape "
                                 f"{tuple(tensor_slice.get_shape())}, the model needs {tuple(param.ds_shape)}")  # fmt: skip
            with torch.no_grad():
                copy_partition(param, tensor_slice, rank)
    for name, buffer in model.named_buffers():  # persistent buffers are not partitioned: each rank loads them whole
        if name in files:
            with safe_open(files[name], "pt") as f, torch.no_grad():
                buffer.copy_(f.get_tensor(name))
    new_head = [name for name in missing if head_is_new and name.startswith("score.")]
    restate_missing_weights(spec.role, spec.path, [name for name in missing if name not in new_head])
    if new_head:
        init_partitioned_score_head(model)
    return finish_loading(model, spec)


def init_partitioned_score_head(model: nn.Module) -> None:
    """PPO's score-head init on a partitioned head: gathered, written by rank 0 from the run's seeded generator (the
    values the single process draws), scattered back to every rank."""
    head = model.score
    with deepspeed.zero.GatheredParameters(list(head.parameters()), modifier_rank=0):
        if dist.get_rank() == 0:
            nn.init.normal_(head.weight, std=score_head_std(model.config), generator=score_head_generator())
            if head.bias is not None:
                nn.init.zeros_(head.bias)
