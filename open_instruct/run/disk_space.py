"""Long writes on a disk that may be full: the free space is checked against an estimate of the write's size first,
and a write that runs out of space anyway fails with the same sentence, `no space left on <where> (needs ~N GB,
F GB free)`, instead of the writer's own message (torch.save's is "unexpected pos 704 vs 598"). A write that fails
never removes what was there before (checkpoints and the final model are written beside it, then renamed).
"""

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from open_instruct.data.cache_folders import safetensors_header

# What a write needs besides its estimate: file system blocks, the small JSON files beside the weights.
HEADROOM_FRACTION = 0.05
HEADROOM_BYTES = 2**20
OUT_OF_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(RuntimeError):
    """A write that does not fit on its disk; the message says what, where, how much it needs and how much is free.
    `rescued_to`: where what did not fit was written instead, if anywhere."""

    def __init__(self, message: str, rescued_to: str | None = None):
        super().__init__(message)
        self.rescued_to = rescued_to


def free_bytes(path: str) -> int | None:
    """Free bytes for an unprivileged writer on the file system that holds `path` (or the nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def gigabytes(num_bytes: float) -> str:
    value = num_bytes / 1e9
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def no_space(where: str, needed: int | None) -> str:
    free = free_bytes(where)
    amounts = [f"needs ~{gigabytes(needed)} GB"] if needed else []
    amounts += [f"{gigabytes(free)} GB free"] if free is not None else []
    return f"no space left on {where} ({', '.join(amounts)})"


def with_headroom(num_bytes: int) -> int:
    return int(num_bytes * (1 + HEADROOM_FRACTION)) + HEADROOM_BYTES


def require_space(where: str, needed: int, what: str) -> None:
    """Raise DiskFullError(`what`: no space left on ...) when `where`'s disk has less than `needed` bytes free."""
    free = free_bytes(where)
    if free is not None and needed > free:
        raise DiskFullError(f"{what}: {no_space(where, needed)}")


def is_out_of_space(error: BaseException) -> bool:
    """Whether `error` (or an error it was raised from) is a write that ran out of space: an OSError with ENOSPC or
    EDQUOT, or a writer's own error that carries one (torch.save through a file object raises a RuntimeError whose
    context is the OSError; safetensors' message quotes "os error 28")."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in OUT_OF_SPACE_ERRNOS:
            return True
        if any(text in str(error) for text in ("No space left on device", "Disk quota exceeded", "os error 28")):
            return True
        error = error.__cause__ or error.__context__
    return False


@contextmanager
def out_of_space_as_error(where: str, needed: int | None, what: str) -> Iterator[None]:
    """A write in the block that runs out of space raises DiskFullError(`what`: no space left on `where` ...)."""
    try:
        yield
    except Exception as error:
        if isinstance(error, DiskFullError) or not is_out_of_space(error):
            raise
        raise DiskFullError(f"{what}: {no_space(where, needed)}") from error


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def tensor_bytes(state) -> int:
    """Bytes of every tensor in a nested state (dicts, lists, tuples): what torch.save writes, less its small index."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(value) for value in state)
    return 0


def weights_numel(model_dir: str) -> int | None:
    """The parameters of the HF folder `model_dir`, counted in its safetensors headers (no weights read); None when it
    is not a local folder of safetensors files (a hub id, or .bin weights)."""
    if not os.path.isdir(model_dir):
        return None
    weight_files = [name for name in os.listdir(model_dir) if name.endswith(".safetensors")]
    if not weight_files:
        return None
    numel = 0
    for name in weight_files:
        _, header = safetensors_header(os.path.join(model_dir, name))
        numel += sum(torch.Size(entry["shape"]).numel() for key, entry in header.items() if key != "__metadata__")
    return numel


def model_folder_bytes(model_dir: str, dtype: torch.dtype) -> int | None:
    """What an HF folder of this model takes with its weights stored in `dtype`: the weights' element count (read from
    the safetensors headers of `model_dir`) times the dtype's size, plus the folder's other files (tokenizer, config).
    None when `model_dir` is not a local folder of safetensors files (a hub id, or .bin weights)."""
    numel = weights_numel(model_dir)
    if numel is None:
        return None
    other_files = sum(os.path.getsize(os.path.join(model_dir, name)) for name in os.listdir(model_dir)
                      if not name.endswith(".safetensors") and os.path.isfile(os.path.join(model_dir, name)))  # fmt: skip
    itemsize = torch.empty((), dtype=dtype).element_size()
    return numel * itemsize + other_files
