"""What the learner writes for people to keep: the policy as a Hugging Face folder, a digest of its weights, and for a
save in lower precision than training, how much of the update the rounding removed.

The weights stream in one tensor at a time (the backends' `iter_master_weights`: the trained fp32 masters, gathered
parameter by parameter under ZeRO-3) and go out in safetensors shards of at most `MAX_SHARD_BYTES` with the
Hugging Face index beside them, so the largest host buffer is one shard, never the whole model. The folder is
written under a temporary name and swapped in with renames: a crash mid-save leaves the previous one intact.
"""

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from open_instruct.run.checkpoint import NonFiniteError
from open_instruct.run.devices import dtype_name

MAX_SHARD_BYTES = 5 * 2**30  # Hugging Face's default shard size: a shard is the largest buffer a save holds
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class SavedModel:
    """What `PPOLearner.save` wrote: where, in which dtype, a digest of the weights as stored, and for a save
    in lower precision than training, how much of the update the rounding removed (`RoundingReport`)."""

    path: str
    dtype: str
    weights_sha256: str
    rounding: dict[str, float] | None = None


def unique_state_items(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The state dict's (name, tensor) pairs in order, each shared tensor once (a tied lm_head is not stored twice:
    the first name, the embedding's, is kept, as `save_pretrained` does)."""
    seen = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor


class WeightsDigest:
    """A sha256 of named weights: each tensor's own sha256 (of its name, dtype, shape and bytes), combined in name
    order. It can be computed while the tensors stream past in any order, and is equal for the learner's weights and
    the files written from them."""

    def __init__(self):
        self.per_tensor: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().cpu().contiguous()
        digest = hashlib.sha256(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
        self.per_tensor[name] = digest.hexdigest()

    def hexdigest(self) -> str:
        combined = hashlib.sha256()
        for name in sorted(self.per_tensor):
            combined.update(f"{name}={self.per_tensor[name]};".encode())
        return combined.hexdigest()


def weights_sha256(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """The `WeightsDigest` of a state dict (or (name, tensor) pairs): the learner's weights and the saved files'."""
    digest = WeightsDigest()
    for name, tensor in named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors:
        digest.add(name, tensor)
    return digest.hexdigest()


class RoundingReport:
    """How much of the training update survives storing the trained weights in `dtype`, tensor by tensor.

    An element counts as changed where the trained weight differs from the initial one, and as rounded away
    where it changed but both round to the same value in `dtype`. fp32 updates of about lr x steps (1e-5 to
    1e-4) are below half a bf16 step for most weights of magnitude 1e-2, so a bf16 save can silently return
    the initial model (measured on the CPU debug run: 97% of the weights bit-identical to the base model's).
    Names without an initial weight are skipped.
    """

    def __init__(self, dtype: torch.dtype):
        self.dtype, self.changed, self.rounded_away = dtype, 0, 0

    def add(self, trained: torch.Tensor, initial: torch.Tensor | None) -> None:
        if initial is None:
            return
        trained, initial = trained.detach().float().cpu(), initial.detach().float().cpu()
        moved = trained != initial
        self.changed += int(moved.sum())
        self.rounded_away += int((moved & (trained.to(self.dtype) == initial.to(self.dtype))).sum())

    def as_dict(self) -> dict[str, float]:
        return {
            "changed": float(self.changed),
            "rounded_away": float(self.rounded_away),
            "fraction_rounded_away": self.rounded_away / self.changed if self.changed else 0.0,
        }


def rounding_report(
    trained: dict[str, torch.Tensor], initial: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, float]:
    """`RoundingReport` of whole state dicts."""
    report = RoundingReport(dtype)
    for name, weight in trained.items():
        report.add(weight, initial.get(name))
    return report.as_dict()


class CheckpointReader:
    """The tensors of a safetensors model folder, read one at a time by name (None for a name it lacks): the initial
    weights for the rounding report without a second model in memory."""

    def __init__(self, folder: str):
        index = os.path.join(folder, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                self.file_of = {name: os.path.join(folder, file) for name, file in json.load(f)["weight_map"].items()}
        else:
            with safe_open(os.path.join(folder, SINGLE_FILE), "pt") as f:
                self.file_of = {name: os.path.join(folder, SINGLE_FILE) for name in f.keys()}  # noqa: SIM118

    @classmethod
    def of(cls, folder: str) -> "CheckpointReader | None":
        """A reader when `folder` is a local safetensors model folder, else None."""
        if os.path.isfile(os.path.join(folder, INDEX_FILE)) or os.path.isfile(os.path.join(folder, SINGLE_FILE)):
            return cls(folder)
        return None

    def get(self, name: str) -> torch.Tensor | None:
        if name not in self.file_of:
            return None
        with safe_open(self.file_of[name], "pt") as f:  # one handle per tensor: no page of the file stays mapped
            return f.get_tensor(name)


def mark_config_dtype(config_path: str, dtype: str) -> None:
    """save_pretrained records the in-memory dtype; record the dtype the files hold instead."""
    with open(config_path) as f:
        config = json.load(f)
    config["dtype"] = dtype
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


class ShardWriter:
    """Writes tensors into safetensors shards of at most `max_bytes` as they come, then names them as Hugging Face
    does (`model.safetensors`, or `model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`)."""

    def __init__(self, folder: str, max_bytes: int = MAX_SHARD_BYTES):
        self.folder, self.max_bytes = folder, max_bytes
        self.shard: dict[str, torch.Tensor] = {}
        self.shard_bytes = self.total_bytes = 0
        self.files: list[list[str]] = []  # the names in each written shard

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.shard and self.shard_bytes + nbytes > self.max_bytes:
            self.flush()
        self.shard[name] = tensor.contiguous()
        self.shard_bytes += nbytes
        self.total_bytes += nbytes

    def flush(self) -> None:
        if self.shard:
            save_file(self.shard, os.path.join(self.folder, f"shard-{len(self.files)}.tmp"), metadata={"format": "pt"})
            self.files.append(list(self.shard))
            self.shard, self.shard_bytes = {}, 0

    def finish(self) -> list[str]:
        """Write the last shard, rename all, write the index; returns the file names."""
        self.flush()
        count = len(self.files)
        names = [SINGLE_FILE] if count == 1 else [f"model-{k + 1:05d}-of-{count:05d}.safetensors" for k in range(count)]
        for k, final in enumerate(names):
            os.rename(os.path.join(self.folder, f"shard-{k}.tmp"), os.path.join(self.folder, final))
        if count > 1:
            weight_map = {name: file for file, shard in zip(names, self.files) for name in shard}
            with open(os.path.join(self.folder, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}, f, indent=2)
        return names


def save_hf_folder(
    model: nn.Module,
    tokenizer,
    output_dir: str,
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    extra_files: dict[str, dict] | None = None,
    initial: CheckpointReader | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    write_more: Callable[[str], None] | None = None,
) -> SavedModel:
    """Save `weights` (name, tensor) in `dtype` as `model`'s weights, with its config (architectures and dtype of the
    files), generation config, tokenizer and chat template, and `extra_files` as JSON. `model` gives the config and
    class only: its own parameters may be partitioned. With `initial` (a save in lower precision), the rounding report.
    `write_more(folder)` adds files before the folder is swapped in (LoRA: the adapters). Non-finite weights are never
    written.
    """
    output_dir = os.path.abspath(output_dir)
    parent = os.path.dirname(output_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}-saving-", dir=parent)
    try:
        writer, digest, rounding = ShardWriter(tmp_dir, max_shard_bytes), WeightsDigest(), RoundingReport(dtype)
        for name, tensor in weights:
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise NonFiniteError(f"the policy's weight {name} holds NaN or inf; refusing to save it")
            stored = tensor.detach().to("cpu", dtype)
            digest.add(name, stored)
            if initial is not None:
                rounding.add(tensor, initial.get(name))
            writer.add(name, stored)
        writer.finish()
        config = model.config
        config.architectures = [type(model).__name__]
        config.save_pretrained(tmp_dir)
        mark_config_dtype(os.path.join(tmp_dir, "config.json"), dtype_name(dtype))
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        for name, content in (extra_files or {}).items():
            with open(os.path.join(tmp_dir, name), "w") as f:
                json.dump(content, f, indent=2)
        if write_more is not None:
            write_more(tmp_dir)
        old_dir = None
        if os.path.exists(output_dir):
            old_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(output_dir)}-old-", dir=parent)
            os.rename(output_dir, os.path.join(old_dir, "previous"))
        os.rename(tmp_dir, output_dir)
        if old_dir:
            shutil.rmtree(old_dir, ignore_errors=True)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return SavedModel(output_dir, dtype_name(dtype), digest.hexdigest(), rounding.as_dict() if initial else None)


def read_saved_weights(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a saved folder (one file or shards): what a user reading the folder gets."""
    reader = CheckpointReader(folder)
    return {name: reader.get(name) for name in reader.file_of}
