"""What the learner writes for people to keep: the policy as a Hugging Face folder (written under a temporary name,
then swapped in), a digest of its weights, and for a save in lower precision than training, how much of the
update the rounding removed.
"""

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass

import torch
from torch import nn

from open_instruct.run.devices import dtype_name


@dataclass
class SavedModel:
    """What `PPOLearner.save` wrote: where, in which dtype, a digest of the weights as stored, and for a save
    in lower precision than training, how much of the update the rounding removed (`rounding_report`)."""

    path: str
    dtype: str
    weights_sha256: str
    rounding: dict[str, float] | None = None


def state_dict_for_saving(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state dict on the CPU in `dtype`, each shared tensor once (a tied lm_head is not stored twice)."""
    state_dict, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        state_dict[name] = tensor.detach().to("cpu", dtype)
    return state_dict


def weights_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """A digest of names, dtypes, shapes and bytes: equal for the learner's weights and the saved file's."""
    digest = hashlib.sha256()
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def rounding_report(
    trained: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, float]:
    """How much of the training update survives storing the trained weights in `dtype`.

    An element counts as changed where the trained weight differs from the initial one, and as rounded away
    where it changed but both round to the same value in `dtype`. fp32 updates of about lr x steps (1e-5 to
    1e-4) are below half a bf16 step for most weights of magnitude 1e-2, so a bf16 save can silently return
    the initial model (measured on the CPU debug run: 97% of the weights bit-identical to the base model's).
    Names missing from `initial` are skipped.
    """
    changed = rounded_away = 0
    for name, weight in trained.items():
        if name not in initial:
            continue
        weight = weight.detach().float().cpu()
        start = initial[name].detach().float().cpu()
        moved = weight != start
        same_after_rounding = weight.to(dtype) == start.to(dtype)
        changed += int(moved.sum())
        rounded_away += int((moved & same_after_rounding).sum())
    return {
        "changed": float(changed),
        "rounded_away": float(rounded_away),
        "fraction_rounded_away": rounded_away / changed if changed else 0.0,
    }


def mark_config_dtype(config_path: str, dtype: str) -> None:
    """save_pretrained records the in-memory dtype; record the dtype the files hold instead."""
    with open(config_path) as f:
        config = json.load(f)
    config["dtype"] = dtype
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def save_hf_folder(
    model: nn.Module,
    tokenizer,
    output_dir: str,
    state_dict: dict[str, torch.Tensor],
    extra_files: dict[str, dict] | None = None,
) -> str:
    """Save `state_dict` as the model's weights, with its config, tokenizer, chat template and generation config.

    Written to a temporary folder beside `output_dir`, then swapped in with renames, so a crash
    mid-save leaves the previous checkpoint intact. The config's `dtype` is the weights' dtype.
    """
    output_dir = os.path.abspath(output_dir)
    parent = os.path.dirname(output_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}-saving-", dir=parent)
    try:
        model.save_pretrained(tmp_dir, state_dict=state_dict)
        saved_dtype = next(iter(state_dict.values())).dtype
        mark_config_dtype(os.path.join(tmp_dir, "config.json"), dtype_name(saved_dtype))
        tokenizer.save_pretrained(tmp_dir)
        for name, content in (extra_files or {}).items():
            with open(os.path.join(tmp_dir, name), "w") as f:
                json.dump(content, f, indent=2)
        old_dir = None
        if os.path.exists(output_dir):
            old_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}-old-", dir=parent)
            os.rename(output_dir, os.path.join(old_dir, "previous"))
        os.rename(tmp_dir, output_dir)
        if old_dir:
            shutil.rmtree(old_dir, ignore_errors=True)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return output_dir
