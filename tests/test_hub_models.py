"""Models named by a hub id become local snapshot folders before anything loads (open_instruct/run/hub_models.py),
against the real huggingface_hub client downloading from a local fake Hub (tests/support/fake_hub.py) on 127.0.0.1.

The learner ranks' side (a 2-rank ZeRO-3 run whose policy is a hub id) is in tests/test_ray_learners.py. A resumed
run loads the commits its checkpoint recorded, not what the branches point to by then: in process, and with the
trainer (two starts of the tiny model).
"""

import json
import os
import shutil
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save

from open_instruct.ppo_vllm_thread_ray_gtrl import cli
from open_instruct.run.args import ConfigError, parse_args
from open_instruct.run.hub_models import HUB_MODEL_FILES, folder_on_this_node, resolved_commits, with_local_models
from tests.support.fake_hub import FakeHub, download_env, folder_files, serve_downloads
from tests.support.resume_runs import assert_same_run
from tests.support.trainer_runs import FP32_LEARNER, SMALL_RUN, TRAINER, last_lines, run_command

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


# ---- a resumed run loads the commits its run started from ------------------------------------------------------------


def moved_on(tiny_model_dir: str) -> dict[str, bytes]:
    """The tiny model's files with other weights (each moved by noise) and another generation config: what a branch
    holds after someone pushed to it."""
    weights = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    moved = {name: tensor + 0.05 * torch.randn(tensor.shape, generator=generator) for name, tensor in weights.items()}
    return {**folder_files(tiny_model_dir), "model.safetensors": save(moved),
            "generation_config.json": b'{"do_sample": false}'}  # fmt: skip


def test_a_resumed_run_loads_the_commits_its_checkpoint_recorded_not_the_branches_newest(hub, tiny_model_dir):
    """Every model flag named by a hub id (policy, whose folder also gives the reference policy and the tokenizer;
    reward; value at --value_model_revision) is loaded on resume at the commit recorded at the run's start, after
    every branch moved on."""
    hub.add_repo("org/reward", folder_files(tiny_model_dir), branch="v2")
    args = parse_args(["--model_name_or_path", "org/policy", "--reward_model_path", "org/reward",
                       "--value_model_path", "org/reward", "--value_model_revision", "v2"])  # fmt: skip
    first = with_local_models(args).model
    pins = json.loads(json.dumps(resolved_commits(args, with_local_models(args))))  # as trainer_state.json holds them
    assert {flag: (pin["repo"], pin["revision"]) for flag, pin in pins.items()} == {
        "--model_name_or_path": ("org/policy", "main"), "--reward_model_path": ("org/reward", "main"),
        "--value_model_path": ("org/reward", "v2")}  # fmt: skip
    assert pins["--model_name_or_path"]["commit"] == os.path.basename(first.model_name_or_path)
    started_with = {flag: folder_files(getattr(first, flag)) for flag in ("model_name_or_path", "reward_model_path",
                                                                          "value_model_path")}  # fmt: skip
    moved = moved_on(tiny_model_dir)
    for repo, branch in (("org/policy", "main"), ("org/reward", "main"), ("org/reward", "v2")):
        hub.add_repo(repo, moved, branch=branch)
    assert folder_files(with_local_models(args).model.model_name_or_path)["model.safetensors"] == moved[
        "model.safetensors"]  # a new run gets the branch's newest  # fmt: skip

    resumed = with_local_models(args, pins).model

    for flag, files in started_with.items():
        assert getattr(resumed, flag) == getattr(first, flag)
        assert folder_files(getattr(resumed, flag)) == files, flag
    loaded = load_file(os.path.join(resumed.model_name_or_path, "model.safetensors"))  # what the learner loads
    original = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert all(torch.equal(loaded[name], tensor) for name, tensor in original.items())


@pytest.mark.e2e
@pytest.mark.slow
def test_a_resume_after_the_branch_moved_continues_the_run_it_started(tmp_path, tiny_model_dir):
    """The trainer, as a user runs it: a 2-step run of `org/policy` (main) with a checkpoint at step 1; main then
    gets other weights; resumed from step 1, the run's step 2 (its KL to the reference policy, the reference loaded
    again at resume) and final model equal the uninterrupted run's. Loading main's new weights as the reference
    gave step 2 another `objective/kl`. Slow: each start is a new interpreter (the Hub's variables differ from the
    forked runs'), two starts of the tiny model (~45 s each)."""
    workdir, output_dir = tmp_path, tmp_path / "output"
    flags = ["--model_name_or_path", "org/policy", "--total_episodes", "16", "--num_evals", "0", "--save_freq", "1",
             "--async_mode", "false", "--output_dir", str(output_dir), *FP32_LEARNER, *SMALL_RUN]  # fmt: skip
    with FakeHub() as hub:
        first_commit = hub.add_repo("org/policy", folder_files(tiny_model_dir))
        env = download_env(hub, workdir / "hf_cache")
        first, _ = run_command(TRAINER + flags, cwd=workdir, env=env)
        assert first.returncode == 0, last_lines(first.stderr)
        shutil.copytree(output_dir, workdir / "uninterrupted")
        assert hub.add_repo("org/policy", moved_on(tiny_model_dir)) != first_commit
        resumed, _ = run_command(TRAINER + flags + ["--resume", str(output_dir / "checkpoints" / "step_1")],
                                 cwd=workdir, env=env)  # fmt: skip
    assert resumed.returncode == 0, last_lines(resumed.stderr)
    assert_same_run(output_dir, workdir / "uninterrupted", exact=True)  # sync mode: bit for bit
    pinned = f"--model_name_or_path org/policy at commit {first_commit[:12]} (its revision main then)"
    assert pinned in resumed.stdout + resumed.stderr
    assert f"snapshots/{first_commit}" in (resumed.stdout + resumed.stderr)  # the policy folder the run names
