"""Folders built once and kept in the cache (`embedded`): built under a file lock in a temporary folder and renamed
into place, with a manifest of what was built, checked at every use, so that a damaged folder is rebuilt instead of
failing every later run.

A folder's manifest (`MANIFEST_NAME`) records each file's size, sha256 and modification time at build time. A use
checks that every file is there with its size (a truncated or deleted file), and the sha256 of every file that is cheap
to hash (up to `CHEAP_TO_HASH_BYTES`: configs, tokenizers, the tiny model's weights, the datasets) or whose
modification time changed (a file rewritten in place); the files' own structure is checked too (a safetensors header
that promises more bytes than the file holds, a parquet file without its footer). So the only change not caught is
one to a large file (the embedded model's weights) that keeps its size and modification time: bit rot, or a rewrite
that puts the time back on purpose; hashing those at every use would cost seconds per start. Folders built before
manifests existed are checked by structure alone and then given a manifest.

A build leaves the caller's random number generators as it found them: the first run after installing builds the
cache inside the trainer's process, after the run seeded them, and must go on as every later run does.
"""

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

MANIFEST_NAME = ".open_instruct_manifest.json"
# Files up to this size are hashed at every use (sha256 reads ~0.5-1 GB/s: at most ~0.1 s a file); larger ones only
# when their modification time changed.
CHEAP_TO_HASH_BYTES = 64 * 2**20


@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


@contextlib.contextmanager
def global_rng_untouched() -> Iterator[None]:
    """Python's, numpy's and torch's global generators are as they were when the block ends (a model built inside
    draws its random weights from torch's: the value head a run initialises next would differ)."""
    import random

    import numpy as np
    import torch

    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):  # the CPU generator; cache builds run on the CPU
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def build_once(final_dir: str, build: Callable[[str], None], marker: str = "config.json") -> str:
    """`final_dir`, built by `build(tmp_dir)` unless it is there and intact (see `folder_problem`); a damaged one is
    rebuilt, with one line saying why."""
    if folder_problem(final_dir, marker) is None:
        return final_dir
    parent = os.path.dirname(final_dir)
    with file_lock(os.path.join(parent, f".{os.path.basename(final_dir)}.lock")):
        problem = folder_problem(final_dir, marker)  # another process may have built it meanwhile
        if problem is None:
            return final_dir
        if os.path.exists(final_dir):
            log.warning(f"[cache] {final_dir} is damaged ({problem}); rebuilding it")
        tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(final_dir)}-", dir=parent)
        try:
            with global_rng_untouched():
                build(tmp_dir)
            write_manifest(tmp_dir)
            shutil.rmtree(final_dir, ignore_errors=True)
            os.rename(tmp_dir, final_dir)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
    return final_dir


def folder_problem(folder: str, marker: str) -> str | None:
    """What is wrong with a built folder (a phrase), or None when it is complete and as built."""
    if not os.path.isfile(os.path.join(folder, marker)):
        return f"no {marker}" if os.path.isdir(folder) else "not built yet"
    manifest = read_manifest(folder)
    if manifest is None:  # built before manifests: its files' structure, then a manifest of what is there
        problem = structure_problem(folder, marker)
        if problem is None:
            with contextlib.suppress(OSError):  # a read-only cache is used as it is
                write_manifest(folder)
        return problem
    changed = False
    for name, built in manifest.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        stat = os.stat(path)
        if stat.st_size != built["bytes"]:
            return f"{name} holds {stat.st_size} bytes, {built['bytes']} when built"
        if stat.st_mtime_ns != built["mtime_ns"] or stat.st_size <= CHEAP_TO_HASH_BYTES:
            if file_sha256(path) != built["sha256"]:
                return f"{name} differs from what was built (sha256)"
            if stat.st_mtime_ns != built["mtime_ns"]:
                built["mtime_ns"], changed = stat.st_mtime_ns, True  # copied or touched, same bytes
    if changed:
        with contextlib.suppress(OSError):
            _write_json_atomically(os.path.join(folder, MANIFEST_NAME), manifest)
    return structure_problem(folder, marker)


def structure_problem(folder: str, marker: str) -> str | None:
    """Cheap checks of the files' own structure: every safetensors file holds the bytes its header promises, every
    parquet file ends with its footer, and a model folder (marked by config.json) has weights."""
    names = sorted(os.listdir(folder))
    if marker == "config.json" and not any(name.endswith((".safetensors", ".bin")) for name in names):
        return "no weights file"
    for name in names:
        path = os.path.join(folder, name)
        if name.endswith(".safetensors"):
            problem = safetensors_problem(path)
        elif name.endswith(".parquet"):
            problem = parquet_problem(path)
        else:
            continue
        if problem is not None:
            return f"{name} {problem}"
    return None


def safetensors_header(path: str) -> tuple[int, dict]:
    """A safetensors file is an 8-byte header length, a JSON header with each tensor's dtype, shape and byte range,
    then the bytes. Returns (header length, header); ValueError when the file has no readable header."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path} is too short for a safetensors header")
        (header_length,) = struct.unpack("<Q", prefix)
        if header_length > os.path.getsize(path):
            raise ValueError(f"{path} is cut off inside its header")
        return header_length, json.loads(f.read(header_length))


def safetensors_problem(path: str) -> str | None:
    size = os.path.getsize(path)
    try:
        header_length, header = safetensors_header(path)
    except ValueError:
        return f"has no readable header ({size} bytes)"
    data_end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    expected = 8 + header_length + data_end
    if size < expected:
        return f"is cut off ({size} bytes of {expected})"
    return None


def parquet_problem(path: str) -> str | None:
    with open(path, "rb") as f:
        head = f.read(4)
        f.seek(max(0, os.path.getsize(path) - 4))
        tail = f.read(4)
    return None if head == tail == b"PAR1" else "is cut off (no parquet footer)"


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, MANIFEST_NAME), encoding="utf-8") as f:
            return json.load(f)["files"]
    except (OSError, ValueError, KeyError):
        return None


def write_manifest(folder: str) -> None:
    """Each file's size, sha256 and modification time, as built."""
    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name != MANIFEST_NAME and os.path.isfile(path):
            stat = os.stat(path)
            files[name] = {"bytes": stat.st_size, "sha256": file_sha256(path), "mtime_ns": stat.st_mtime_ns}
    _write_json_atomically(os.path.join(folder, MANIFEST_NAME), files)


def _write_json_atomically(path: str, files: dict) -> None:
    fd, tmp_path = tempfile.mkstemp(prefix=".manifest-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"files": files}, f, indent=1)
        os.replace(tmp_path, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp_path)
        raise
