"""The embedded model cache: a damaged folder (a truncated, deleted or rewritten file) is found at its next use and
rebuilt with one line saying so, and building it leaves the caller's random generators as they were.

Each test works on copies of the real cache's folders in a temporary $OPEN_INSTRUCT_CACHE; the real one is only read.
"""

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from open_instruct.data import cache_folders
from open_instruct.data.embedded import EMBEDDED_MODEL_NAME, tiny_model_path
from open_instruct.run import console  # noqa: F401  (our log lines on the console, as in a run)

TINY = "tiny-llama-smollm2-tokenizer"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def smollm2_copy(smollm2_dir, tmp_path_factory) -> Path:
    """A copy of the embedded SmolLM2 folder (the tiny model's tokenizer comes from it), made once."""
    copy = tmp_path_factory.mktemp("smollm2") / EMBEDDED_MODEL_NAME
    shutil.copytree(smollm2_dir, copy)
    return copy


@pytest.fixture
def cache(smollm2_copy, tiny_model_dir, tmp_path, monkeypatch) -> Path:
    """A temporary $OPEN_INSTRUCT_CACHE holding the SmolLM2 copy and a copy of the real tiny model folder."""
    root = tmp_path / "cache"
    (root / "models").mkdir(parents=True)
    os.symlink(smollm2_copy, root / "models" / EMBEDDED_MODEL_NAME)
    shutil.copytree(tiny_model_dir, root / "models" / TINY)
    monkeypatch.setenv("OPEN_INSTRUCT_CACHE", str(root))
    return root


def cache_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[cache]")]


def assert_rebuilt_once(capsys, folder: Path, original_sha: str, problem: str) -> None:
    assert tiny_model_path() == str(folder)
    lines = cache_lines(capsys.readouterr().err)
    assert lines == [f"[cache] {folder} is damaged ({problem}); rebuilding it"], lines
    assert sha256(folder / "model.safetensors") == original_sha, "the rebuilt model is the model that was built"
    assert tiny_model_path() == str(folder)
    assert cache_lines(capsys.readouterr().err) == [], "rebuilt once, then used as it is"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(folder)  # loads


def test_a_truncated_weights_file_is_rebuilt_with_one_line(cache, capsys):
    folder = cache / "models" / TINY
    weights = folder / "model.safetensors"
    original_sha, size = sha256(weights), weights.stat().st_size
    tiny_model_path()  # (a folder built before manifests is checked by its structure, then given one)
    manifest = json.loads((folder / cache_folders.MANIFEST_NAME).read_text())["files"]
    assert manifest["model.safetensors"]["sha256"] == original_sha
    assert cache_lines(capsys.readouterr().err) == []

    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    assert_rebuilt_once(capsys, folder, original_sha, f"model.safetensors holds {size // 2} bytes, {size} when built")


def test_a_truncated_file_in_a_folder_without_manifest_is_found_by_its_header(cache, capsys):
    folder = cache / "models" / TINY
    weights = folder / "model.safetensors"
    original_sha, size = sha256(weights), weights.stat().st_size
    (folder / cache_folders.MANIFEST_NAME).unlink(missing_ok=True)  # as built before manifests existed
    with open(weights, "r+b") as f:
        f.truncate(size - 1000)
    assert_rebuilt_once(capsys, folder, original_sha, f"model.safetensors is cut off ({size - 1000} bytes of {size})")


def test_a_deleted_weights_file_is_rebuilt(cache, capsys):
    folder = cache / "models" / TINY
    original_sha = sha256(folder / "model.safetensors")
    tiny_model_path()
    (folder / "model.safetensors").unlink()
    assert_rebuilt_once(capsys, folder, original_sha, "model.safetensors is missing")


def test_a_file_rewritten_in_place_is_found_by_its_digest_and_a_copy_is_not(cache, capsys):
    folder = cache / "models" / TINY
    weights = folder / "model.safetensors"
    original_sha = sha256(weights)
    tiny_model_path()
    moved = folder.parent / "moved"  # copied elsewhere and back: new times, same bytes
    shutil.copytree(folder, moved, copy_function=shutil.copy)
    shutil.rmtree(folder)
    moved.rename(folder)
    tiny_model_path()
    assert cache_lines(capsys.readouterr().err) == [], "same bytes: nothing to rebuild"

    data = bytearray(weights.read_bytes())
    data[-100:] = bytes(100)  # the same size, other weights
    weights.write_bytes(bytes(data))
    assert_rebuilt_once(capsys, folder, original_sha, "model.safetensors differs from what was built (sha256)")


def test_building_the_cache_leaves_the_global_generators_as_they_were(smollm2_copy, tmp_path, monkeypatch):
    """The first run after install builds the tiny model inside the trainer, after seeding: it must go on as a run
    on a built cache does (the value head's init draws from torch's generator next)."""
    root = tmp_path / "cache"
    (root / "models").mkdir(parents=True)
    os.symlink(smollm2_copy, root / "models" / EMBEDDED_MODEL_NAME)
    monkeypatch.setenv("OPEN_INSTRUCT_CACHE", str(root))
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    expected = (torch.rand(4), random.random(), np.random.rand())
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    tiny_model_path()  # builds it
    assert (root / "models" / TINY / "model.safetensors").exists()
    after = (torch.rand(4), random.random(), np.random.rand())
    assert torch.equal(after[0], expected[0]) and after[1:] == expected[1:]


def test_a_same_size_rewrite_that_keeps_the_time_is_found_in_a_file_cheap_to_hash(cache, capsys):
    """Size and modification time kept (as `cp -p` or a restore puts them back): a file up to CHEAP_TO_HASH_BYTES, here
    the tiny model's weights and its tokenizer, is hashed at every use all the same."""
    folder = cache / "models" / TINY
    original_sha = sha256(folder / "model.safetensors")
    tiny_model_path()
    for name in ("model.safetensors", "tokenizer.json"):
        path = folder / name
        assert path.stat().st_size <= cache_folders.CHEAP_TO_HASH_BYTES
        stat = path.stat()
        data = bytearray(path.read_bytes())
        data[-100:] = bytes(100) if name.endswith(".safetensors") else b" " * 100  # the same size, other bytes
        path.write_bytes(bytes(data))
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the time put back
        assert_rebuilt_once(capsys, folder, original_sha, f"{name} differs from what was built (sha256)")
