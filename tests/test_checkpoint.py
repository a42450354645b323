"""The pieces of checkpoint.py and the log repair, in process and fast (the real runs are in test_resume.py)."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from open_instruct.run import checkpoint, preemption, run_directory
from open_instruct.run.args import ConfigError, parse_args
from open_instruct.run.tracking import MetricsLogger, read_metrics, repair_jsonl


def make_args(output_dir, *flags: str):
    return parse_args(["--dataset_mixer_list", "data.jsonl", "1.0", "--output_dir", str(output_dir), *flags])


def learner_state(value: float = 1.0) -> dict:
    return {"policy": {"w": torch.full((2,), value)}, "value_model": {"w": torch.zeros(2)}}


# ---- saving ----------------------------------------------------------------------------------------------------------


def test_save_checkpoint_writes_a_complete_folder_and_keeps_the_newest(tmp_path):
    args = make_args(tmp_path)
    for step in (2, 4, 6):
        checkpoint.save_checkpoint(str(tmp_path), step, checkpoint.LearnerStateFile(learner_state(step)), {"step": step}, args, keep_last_n=2)
    found = checkpoint.complete_checkpoints(str(tmp_path))
    assert [os.path.basename(path) for path in found] == ["step_4", "step_6"]
    assert sorted(os.listdir(found[-1])) == ["COMPLETE", "args.json", "learner.pt", "topology.json", "trainer_state.json"]
    assert torch.load(os.path.join(found[-1], "learner.pt"))["policy"]["w"].tolist() == [6.0, 6.0]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_4", "step_6"]  # no staging folder left


def test_non_finite_weights_are_never_saved(tmp_path):
    with pytest.raises(checkpoint.NonFiniteError, match="the policy's weight w holds NaN or inf"):
        checkpoint.save_checkpoint(str(tmp_path), 1, checkpoint.LearnerStateFile(learner_state(float("nan"))), {},
                                   make_args(tmp_path), keep_last_n=1)  # fmt: skip
    assert os.listdir(tmp_path / "checkpoints") == []  # no checkpoint, no staging folder left


def test_resume_refuses_other_settings(tmp_path):
    args = make_args(tmp_path, "--learning_rate", "1e-4", "--resume")
    saved = make_args(tmp_path, "--learning_rate", "3e-6")
    checkpoint.save_checkpoint(str(tmp_path), 2, checkpoint.LearnerStateFile(learner_state()), {"step": 2}, saved, keep_last_n=1)
    with pytest.raises(ConfigError, match=r"--learning_rate 0.0001 \(checkpoint: 3e-06\)"):
        checkpoint.load_checkpoint(args)


@pytest.mark.parametrize(
    "resumed_with, refusal",
    [
        (["--num_learners_per_node", "1", "1", "--deepspeed_stage", "3"], None),  # the same 2 ranks, spread over two nodes: allowed
        (["--num_learners_per_node", "4", "--deepspeed_stage", "3"], "resume it with 2 learner ranks in all (--num_learners_per_node, over any "
                                           "nodes) and --deepspeed_stage 3, or start a new run without --resume."),
        (["--num_learners_per_node", "2", "--deepspeed_stage", "2"], "2 DeepSpeed learner rank(s) at ZeRO-3 and this "
                                                                     "run has 2 DeepSpeed learner rank(s) at ZeRO-2"),
        ([], "this run has the single-process learner: its learner state only loads into the same layout"),
        (["--num_learners_per_node", "2", "--deepspeed_stage", "3", "--vllm_num_engines", "2"], "resume with --vllm_num_engines 0."),
    ],
)
def test_resume_needs_the_learner_layout_that_wrote_the_checkpoint(tmp_path, resumed_with, refusal):
    """DeepSpeed partitions are per rank: another rank count or stage is refused in one line before any model loads
    (how the ranks spread over nodes may change, e.g. a requeued job on another allocation)."""
    written_by = make_args(tmp_path, "--num_learners_per_node", "2", "--deepspeed_stage", "3")
    checkpoint.save_checkpoint(str(tmp_path), 2, checkpoint.LearnerStateFile(learner_state()), {"step": 2}, written_by,
                               keep_last_n=1)  # fmt: skip
    topology = json.loads((tmp_path / "checkpoints" / "step_2" / "topology.json").read_text())
    assert topology == {"learner": "deepspeed", "learner_ranks": 2, "deepspeed_stage": 3, "vllm_num_engines": 0}
    args = make_args(tmp_path, *resumed_with, "--resume")
    if refusal is None:
        assert checkpoint.load_checkpoint(args).step == 2
    else:
        with pytest.raises(ConfigError) as refused:
            checkpoint.load_checkpoint(args)
        assert refusal in str(refused.value) and "\n" not in str(refused.value)


def test_resume_keeps_the_runs_name(tmp_path):
    saved = make_args(tmp_path, "--run_name", "first-run")
    checkpoint.save_checkpoint(str(tmp_path), 2, checkpoint.LearnerStateFile(learner_state()), {"step": 2}, saved, keep_last_n=1)
    args = make_args(tmp_path, "--resume")
    resumed = checkpoint.load_checkpoint(args)
    assert resumed.step == 2 and args.run.run_name == "first-run"


def test_resume_accepts_other_values_of_the_flags_declared_may_change_on_resume(tmp_path):
    """How often to save, how many to keep, logging and the engine check's bound may change on resume (a requeued job
    may need to save more often); the flags say so in their type (`MayChangeOnResume`), and docs/flags.md shows it."""
    saved = make_args(tmp_path, "--save_freq", "2", "--keep_last_n", "1", "--num_samples_to_log", "4")
    checkpoint.save_checkpoint(str(tmp_path), 2, checkpoint.LearnerStateFile(learner_state()), {"step": 2}, saved, keep_last_n=1)
    args = make_args(tmp_path, "--save_freq", "1", "--keep_last_n", "3", "--num_samples_to_log", "0", "--resume")
    assert checkpoint.load_checkpoint(args).step == 2


# ---- the output_dir --------------------------------------------------------------------------------------------------


def test_sweep_recovers_a_model_caught_between_two_renames_and_removes_leftovers(tmp_path):
    (tmp_path / ".model-old-abc" / "previous").mkdir(parents=True)
    (tmp_path / ".model-old-abc" / "previous" / "config.json").write_text("{}")
    (tmp_path / ".model-saving-def").mkdir()
    (tmp_path / ".summary.json.x.tmp").write_text("")
    for name in ("step_2", "step_4", ".step_6-saving-x"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_2" / checkpoint.COMPLETE_MARKER).write_text("{}")

    messages = run_directory.sweep_leftovers(str(tmp_path))

    assert (tmp_path / "model" / "config.json").exists()
    assert sorted(os.listdir(tmp_path)) == ["checkpoints", "model"]
    assert os.listdir(tmp_path / "checkpoints") == ["step_2"]
    assert any("recovered" in message for message in messages)


def write_earlier_run(folder) -> dict[str, bytes]:
    """An earlier run's files (and the user's own), returned with their bytes."""
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    (folder / "model").mkdir()
    (folder / "model" / "config.json").write_text('{"earlier": true}')
    (folder / "logs").mkdir()
    (folder / "logs" / "libraries.log").write_text("the earlier run's log\n")
    (folder / "notes.txt").write_text("mine")
    return tree_bytes(folder)


def tree_bytes(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and
            p.name != run_directory.LOCK_FILE}  # fmt: skip


def start_of_a_new_run(folder) -> None:
    (folder / "metrics.jsonl").write_text('{"step": 1, "new": true}\n')
    (folder / "samples.jsonl").write_text("{}\n")


def test_overwrite_output_dir_puts_the_earlier_run_back_when_the_new_one_saves_nothing(tmp_path):
    earlier = write_earlier_run(tmp_path)
    with pytest.raises(ConfigError):
        with run_directory.RunDirectory(make_args(tmp_path, "--overwrite_output_dir", "true")):
            assert sorted(os.listdir(tmp_path)) == [".earlier-run", ".run.lock", "notes.txt"]
            start_of_a_new_run(tmp_path)
            raise ConfigError("a typo in a data path")
    assert tree_bytes(tmp_path) == earlier
    assert not (tmp_path / run_directory.EARLIER_RUN).exists()


def test_overwrite_output_dir_deletes_the_earlier_run_once_the_new_one_has_a_checkpoint(tmp_path):
    write_earlier_run(tmp_path)
    args = make_args(tmp_path, "--overwrite_output_dir", "true")
    with run_directory.RunDirectory(args) as run_dir:
        start_of_a_new_run(tmp_path)
        run_dir.release_earlier_run()  # nothing saved yet: kept
        assert (tmp_path / run_directory.EARLIER_RUN / "model" / "config.json").exists()
        checkpoint.save_checkpoint(str(tmp_path), 1, checkpoint.LearnerStateFile(learner_state()), {"step": 1}, args, keep_last_n=1)
        run_dir.release_earlier_run()
        assert not (tmp_path / run_directory.EARLIER_RUN).exists()
    assert sorted(os.listdir(tmp_path)) == [".run.lock", "checkpoints", "metrics.jsonl", "notes.txt", "samples.jsonl"]
    assert "new" in (tmp_path / "metrics.jsonl").read_text()


def test_overwrite_output_dir_deletes_the_earlier_run_once_the_new_model_is_saved_elsewhere(tmp_path):
    """A full disk sent the final model to --fallback_save_dir: the new run's files replace the earlier run's."""
    write_earlier_run(tmp_path)
    with run_directory.RunDirectory(make_args(tmp_path, "--overwrite_output_dir", "true")) as run_dir:
        start_of_a_new_run(tmp_path)
        run_dir.release_earlier_run(saved_elsewhere="/elsewhere/model")
    assert sorted(os.listdir(tmp_path)) == [".run.lock", "metrics.jsonl", "notes.txt", "samples.jsonl"]
    assert "new" in (tmp_path / "metrics.jsonl").read_text()


@pytest.mark.parametrize("new_run_saved", [False, True])
def test_the_next_start_settles_an_overwrite_that_was_killed(tmp_path, new_run_saved):
    """kill -9 leaves the earlier run aside: put back if the new run saved nothing, else deleted."""
    earlier = write_earlier_run(tmp_path)
    with run_directory.RunDirectory(make_args(tmp_path, "--overwrite_output_dir", "true")) as run_dir:
        start_of_a_new_run(tmp_path)
        if new_run_saved:
            (tmp_path / "model").mkdir()
            (tmp_path / "model" / "config.json").write_text('{"new": true}')
        run_dir._lock_file.close()  # as the kernel does at kill -9; __exit__ then has nothing to settle
        run_dir._lock_file = None
    assert (tmp_path / run_directory.EARLIER_RUN).is_dir()
    messages = run_directory.sweep_leftovers(str(tmp_path))
    assert not (tmp_path / run_directory.EARLIER_RUN).exists()
    if new_run_saved:
        assert json.loads((tmp_path / "model" / "config.json").read_text()) == {"new": True}
        assert "deleted the earlier run" in messages[-1]
    else:
        assert tree_bytes(tmp_path) == earlier
        assert "put the earlier run back" in messages[-1]


# ---- logs ------------------------------------------------------------------------------------------------------------


def test_a_torn_last_line_does_not_break_the_next_run(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 1.0}\n{"step": 2, "x"')  # the process died mid-write
    logger = MetricsLogger(str(tmp_path))
    logger.log({"x": 3.0}, step=3)
    assert [row["step"] for row in read_metrics(str(path))] == [1, 3]


def test_repair_jsonl_drops_the_steps_after_a_checkpoint_and_leaves_a_clean_file_alone(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step}) + "\n" for step in (1, 2, 3, 4)))
    assert repair_jsonl(str(path)) == []
    warnings = repair_jsonl(str(path), keep_through_step=2)
    assert [row["step"] for row in read_metrics(str(path))] == [1, 2]
    assert warnings and "steps 3-4" in warnings[0]


# ---- signals ---------------------------------------------------------------------------------------------------------


def test_sigterm_sets_the_stop_flag_and_the_handler_is_restored(tmp_path):
    stop = preemption.StopRequest(str(tmp_path), timeout_s=60)
    previous = signal.getsignal(signal.SIGTERM)
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.name == "SIGTERM"
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) is previous


SIGNALS_SCRIPT = """
import os, signal, sys, time
from open_instruct.run import preemption

if sys.argv[2] != "default":
    preemption.SAME_REQUEST_WINDOW_S = float(sys.argv[2])
stop = preemption.StopRequest(sys.argv[1], timeout_s=60)
stop.install()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(float(sys.argv[3]))
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("still running, stop requested:", stop.requested)
"""


@pytest.mark.parametrize("gap_s, window_s, stops_at_once", [(0.05, "default", False), (0.3, "0.1", True)])
def test_two_signals_within_the_window_are_one_request(tmp_path, gap_s, window_s, stops_at_once):
    """GNU timeout and SLURM signal the process and its group: two SIGTERMs at once are one preemption (a checkpoint
    is written); a second one after the window still stops at once. The first case runs with the trainer's own
    window."""
    script = tmp_path / "signals.py"
    script.write_text(SIGNALS_SCRIPT)
    process = subprocess.run([sys.executable, str(script), str(tmp_path), str(window_s), str(gap_s)],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    if stops_at_once:
        assert process.returncode == 128 + signal.SIGTERM, process.stderr
        assert "error: a second SIGTERM came 0s after the first: stopped without a new checkpoint" in process.stderr
    else:
        assert process.returncode == 0, process.stderr
        assert "still running, stop requested: True" in process.stdout


# ---- a full disk -----------------------------------------------------------------------------------------------------

DISK_SCRIPT = """
import json, os, sys
import torch
from open_instruct.run import checkpoint, disk_space
from open_instruct.run.args import parse_args

out = sys.argv[1]
args = parse_args(["--dataset_mixer_list", "data.jsonl", "1.0", "--output_dir", out])
MB = 2**20
state = lambda value: {"policy": {"w": torch.full((MB // 4,), float(value))}, "value_model": {}}  # 1 MiB of weights
report = {}

def save(step, learner_state, keep_last_n=2):
    try:
        checkpoint.save_checkpoint(out, step, checkpoint.LearnerStateFile(learner_state), {"step": step}, args, keep_last_n=keep_last_n)
        return "saved"
    except disk_space.DiskFullError as error:
        return str(error)

report["step_1"] = save(1, state(1))
report["step_2"] = save(2, state(2))
# Room for two: step_3 fits once step_1, which it would delete anyway, is gone first.
report["step_3"] = save(3, state(3))
# Too big for the disk: refused before anything is written.
report["too_big"] = save(4, {"policy": {"w": torch.zeros(32 * MB // 4)}, "value_model": {}})
# Its size hidden from the estimate (not a tensor): the write itself runs out of space.
report["hidden_size"] = save(5, {"policy": {"w": torch.zeros(1)}, "value_model": {}, "blob": os.urandom(8 * MB)})
report["left"] = sorted(os.listdir(os.path.join(out, "checkpoints")))
newest = checkpoint.complete_checkpoints(out)[-1]
report["newest_w"] = torch.load(os.path.join(newest, "learner.pt"))["policy"]["w"][0].item()
print(json.dumps(report))
"""


def test_a_checkpoint_on_a_full_disk_says_so_and_keeps_the_newest_complete_one(tmp_path):
    from tests.support.small_disk import on_small_disk, small_disk_unavailable

    if reason := small_disk_unavailable():
        pytest.skip(reason)
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "script.py"
    script.write_text(DISK_SCRIPT)
    # 3.5 MiB: the estimate of a 1 MiB checkpoint is ~2 MiB (with headroom): two fit, a third once one is gone.
    command = on_small_disk(str(disk), 3.5, [sys.executable, str(script), str(disk / "out")])
    process = subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ})
    assert process.returncode == 0, process.stderr[-3000:]
    report = json.loads(process.stdout.strip().splitlines()[-1])
    assert report["step_1"] == report["step_2"] == report["step_3"] == "saved"
    root = f"{disk}/out/checkpoints"
    assert re.fullmatch(rf"checkpoint step_4 not written: no space left on {root} \(needs ~0\.0\d+ GB, 0\.00\d+ GB free\)",
                        report["too_big"]), report["too_big"]  # fmt: skip
    assert report["hidden_size"].startswith(f"checkpoint step_5 not written: no space left on {root} ("), report
    assert report["left"] == ["step_2", "step_3"], "no staging folder left, the newest two complete ones kept"
    assert report["newest_w"] == 3.0


# ---- the divergence guard --------------------------------------------------------------------------------------------

WORKING_STEP = {"policy/weight_norm_vs_start": 1.02, "objective/kl": 3.0, "val/sequence_lengths": 30.0,
                "policy/approxkl_avg": 0.02}  # fmt: skip


@pytest.mark.parametrize(
    "changes, cause",
    [
        ({}, None),
        ({"objective/kl": None, "policy/weight_norm_vs_start": None}, None),  # --beta 0, ZeRO-3: not measured
        ({"policy/weight_norm_vs_start": 8.9}, "the policy's weight norm is 8.9x the initial policy's (bound 4x)"),
        ({"policy/weight_norm_vs_start": 0.1}, "the policy's weight norm is 0.1x"),
        ({"policy/weight_norm_vs_start": float("nan")}, "the policy's weights hold NaN or inf"),
        ({"objective/kl": 900.0}, "the KL to the reference is 30 nats per token (bound 20)"),
        ({"objective/kl": -900.0}, "the KL to the reference is -30 nats per token"),
        ({"policy/approxkl_avg": 12.0}, "PPO's approximate KL is 12 per token (bound 10)"),
    ],
)
def test_the_divergence_guard_names_what_is_out_of_bounds(changes, cause):
    from open_instruct.run.divergence import DivergedError, check_divergence

    metrics = {key: value for key, value in {**WORKING_STEP, **changes}.items() if value is not None}
    if cause is None:
        check_divergence(metrics, step=3, learning_rate=1e-6)
        return
    with pytest.raises(DivergedError) as error:
        check_divergence(metrics, step=3, learning_rate=10.0)
    assert str(error.value).startswith("the policy diverged at step 3: ") and cause in str(error.value)
    assert str(error.value).endswith("Lower --learning_rate (now 10)")
