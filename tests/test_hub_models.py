"""Models named by a hub id become local snapshot folders before anything loads (open_instruct/run/hub_models.py),
against the real huggingface_hub client downloading from a local fake Hub (tests/fake_hub.py) on 127.0.0.1.

The learner ranks' side (a 2-rank ZeRO-3 run whose policy is a hub id) is in tests/test_ray_learners.py.
"""

import os
import shutil
import sys
import time

import pytest

from open_instruct.ppo_vllm_thread_ray_gtrl import cli
from open_instruct.run.args import ConfigError, parse_args
from open_instruct.run.hub_models import HUB_MODEL_FILES, folder_on_this_node, with_local_models
from tests.fake_hub import FakeHub, folder_files, serve_downloads

# Files a hub repo may hold that a run does not need: never downloaded.
NOT_NEEDED = {"README.md": b"# a model\n", "pytorch_model.bin": b"pickled weights", "onnx/model.onnx": b"graph"}


@pytest.fixture
def hub(monkeypatch, tmp_path, tiny_model_dir):
    """A fake Hub serving the tiny model as `org/policy` (main, and a branch `v2` whose generation config differs)
    and `org/reward`; this process downloads from it into tmp_path/hf_cache."""
    with FakeHub() as fake:
        serve_downloads(monkeypatch, fake, tmp_path / "hf_cache")
        tiny = folder_files(tiny_model_dir)
        fake.add_repo("org/policy", {**tiny, **NOT_NEEDED})
        fake.add_repo("org/policy", {**tiny, "generation_config.json": b'{"do_sample": false}'}, branch="v2")
        fake.add_repo("org/reward", tiny)
        yield fake


def add_repo_without_safetensors(hub: FakeHub, tiny_model_dir: str) -> None:
    """`org/pickles`: the tiny model's config and tokenizer, its weights only as a pickle."""
    files = {path: data for path, data in folder_files(tiny_model_dir).items() if not path.endswith(".safetensors")}
    hub.add_repo("org/pickles", {**files, "pytorch_model.bin": b"pickled weights"})


def needed(files: dict[str, bytes]) -> dict[str, bytes]:
    return {path: data for path, data in files.items() if path not in NOT_NEEDED and path != ".gitattributes"}


def test_hub_ids_become_snapshots_of_their_revisions_and_folders_stay(hub, tiny_model_dir, tmp_path):
    args = parse_args(["--model_name_or_path", "org/policy", "--model_revision", "v2",
                       "--reward_model_path", "org/reward", "--value_model_path", tiny_model_dir])  # fmt: skip

    local = with_local_models(args).model

    policy, reward = local.model_name_or_path, local.reward_model_path
    assert policy.startswith(str(tmp_path / "hf_cache")) and reward.startswith(str(tmp_path / "hf_cache"))
    assert folder_files(policy) == needed(hub.repos["org/policy"]["v2"])  # v2's files, not main's
    assert folder_files(policy)["generation_config.json"] == b'{"do_sample": false}'
    assert folder_files(reward) == needed(hub.repos["org/reward"]["main"])
    assert not any(path in NOT_NEEDED for path in folder_files(policy))
    assert local.value_model_path == tiny_model_dir  # a local folder stays as it is
    assert (local.model_revision, local.reward_model_revision) == (None, None)  # the folder is the revision
    # The run's own args keep what the user gave (the logged config and the model card name the hub id).
    assert (args.model.model_name_or_path, args.model.model_revision) == ("org/policy", "v2")


def test_a_cached_snapshot_is_used_offline_without_asking_the_hub(hub, monkeypatch):
    import huggingface_hub.constants

    args = parse_args(["--model_name_or_path", "org/policy"])
    online = with_local_models(args).model.model_name_or_path
    asked = len(hub.requests)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    assert with_local_models(args).model.model_name_or_path == online
    assert len(hub.requests) == asked


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--model_name_or_path", "org/missing"],
         "--model_name_or_path org/missing (revision main): no such local folder, and no such model repo on http://127"),
        (["--model_name_or_path", "org/policy", "--model_revision", "v9"],
         "--model_name_or_path org/policy (revision v9): the repo has no revision 'v9'; give a branch, tag or commit"),
        (["--model_name_or_path", "org/policy", "--reward_model_path", "org/reward", "--reward_model_revision", "v2"],
         "--reward_model_path org/reward (revision v2): the repo has no revision 'v2'"),
        (["--model_name_or_path", "org/policy", "--value_model_path", "org/pickles"],
         "--value_model_path org/pickles (revision main) holds no safetensors weights (model.safetensors or "
         "model.safetensors.index.json), the only format the learner loads"),
        (["--model_name_or_path", "tiny", "--model_revision", "v2"],
         "is a local folder and has no revisions, yet one was given ('v2')"),
    ],
    ids=["no such repo", "no such revision", "no such reward model revision", "no safetensors", "folder with revision"],
)  # fmt: skip
def test_a_model_that_cannot_load_is_one_line(hub, flags, expected, tiny_model_dir):
    add_repo_without_safetensors(hub, tiny_model_dir)
    with pytest.raises(ConfigError) as error:
        with_local_models(parse_args(flags))
    message = str(error.value)
    assert expected in message and "\n" not in message, message


def test_offline_and_not_cached_says_what_to_download(hub, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError) as error:
        with_local_models(parse_args(["--model_name_or_path", "org/policy", "--model_revision", "v2"]))
    patterns = " ".join(repr(pattern) for pattern in HUB_MODEL_FILES)
    assert str(error.value) == (
        "--model_name_or_path org/policy (revision v2) is no local folder, nor in the HF cache, and HF_HUB_OFFLINE is "
        f"set; run `hf download org/policy --revision v2 --include {patterns}` (with this run's HF_HOME) on every node, "
        "or unset HF_HUB_OFFLINE."
    )
    assert hub.requests == []


def test_a_node_without_the_drivers_snapshot_fetches_the_same_commit(hub, monkeypatch, tmp_path):
    """A learner rank or engine on another node gets the driver's snapshot folder; where that node's HF cache lacks
    it, the node downloads that commit (not the branch's newest) into its own cache."""
    import huggingface_hub.constants

    driver_folder = with_local_models(parse_args(["--model_name_or_path", "org/policy"])).model.model_name_or_path
    commit, resolved_files = os.path.basename(driver_folder), dict(hub.repos["org/policy"]["main"])
    hub.add_repo("org/policy", {"config.json": b'{"moved": "on"}'})  # main moves on after the driver resolved it
    shutil.rmtree(tmp_path / "hf_cache")  # the other node: its own, empty, HF cache
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "node_cache"))
    asked = len(hub.requests)

    node_folder = folder_on_this_node(driver_folder)

    assert node_folder == str(tmp_path / "node_cache" / "models--org--policy" / "snapshots" / commit)
    assert folder_files(node_folder) == needed(resolved_files)
    assert not any(request.path.endswith("/revision/main") for request in hub.requests[asked:])
    assert folder_on_this_node(node_folder) == node_folder  # present: nothing asked
    with pytest.raises(ConfigError, match=f"the model folder {tmp_path}/gone does not exist on the node"):
        folder_on_this_node(str(tmp_path / "gone"))


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--value_model_path", "org/pickles"], "--value_model_path org/pickles (revision main) holds no safetensors"),
        (["--model_revision", "v9"], "--model_name_or_path org/policy (revision v9): the repo has no revision 'v9'"),
    ],
    ids=["value model without safetensors", "missing policy revision"],
)
def test_the_trainer_exits_2_before_ray_for_a_hub_model_that_cannot_load(
    hub, flags, expected, tmp_path, capsys, tiny_model_dir
):
    """The 8B recipe's layout (learner ranks on Ray at ZeRO-3, the value model from a hub id): the trainer stops at
    start with one line, before Ray starts or any model loads (the old code got past every check and failed in
    the ZeRO-3 ranks, after Ray, placement and the engines)."""
    add_repo_without_safetensors(hub, tiny_model_dir)
    argv = ["--model_name_or_path", "org/policy", "--num_learners_per_node", "2", "--deepspeed_stage", "3",
            "--local_rollout_batch_size", "4", "--number_samples_per_prompt", "2", "--per_device_train_batch_size", "2",
            "--response_length", "16", "--total_episodes", "8", "--output_dir", str(tmp_path / "out"), *flags]  # fmt: skip
    start = time.time()
    with pytest.raises(SystemExit) as exit_info:
        cli(argv)
    seconds = time.time() - start
    captured = capsys.readouterr()
    error_lines = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert exit_info.value.code == 2, captured.err[-2000:]
    assert len(error_lines) == 1 and expected in error_lines[0], captured.err[-2000:]
    assert "Traceback" not in captured.err and "[vllm] engine" not in captured.out + captured.err
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    assert seconds < 30
