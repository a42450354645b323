"""The pieces of checkpoint.py and the log repair, in process and fast (the real runs are in test_resume.py)."""

import json
import os
import signal

import pytest
import torch

from open_instruct.run import checkpoint
from open_instruct.run import preemption
from open_instruct.run import run_directory
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
        checkpoint.save_checkpoint(str(tmp_path), step, learner_state(step), {"step": step}, args, keep_last_n=2)
    found = checkpoint.complete_checkpoints(str(tmp_path))
    assert [os.path.basename(path) for path in found] == ["step_4", "step_6"]
    assert sorted(os.listdir(found[-1])) == ["COMPLETE", "args.json", "learner.pt", "trainer_state.json"]
    assert torch.load(os.path.join(found[-1], "learner.pt"))["policy"]["w"].tolist() == [6.0, 6.0]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_4", "step_6"]  # no staging folder left


def test_non_finite_weights_are_never_saved(tmp_path):
    with pytest.raises(checkpoint.NonFiniteError, match="the policy's weight w holds NaN or inf"):
        checkpoint.save_checkpoint(str(tmp_path), 1, learner_state(float("nan")), {}, make_args(tmp_path), keep_last_n=1)
    assert not (tmp_path / "checkpoints").exists()


def test_resume_refuses_other_settings(tmp_path):
    args = make_args(tmp_path, "--learning_rate", "1e-4", "--resume")
    saved = make_args(tmp_path, "--learning_rate", "3e-6")
    checkpoint.save_checkpoint(str(tmp_path), 2, learner_state(), {"step": 2}, saved, keep_last_n=1)
    with pytest.raises(ConfigError, match=r"--learning_rate 0.0001 \(checkpoint: 3e-06\)"):
        checkpoint.load_checkpoint(args)


def test_resume_keeps_the_runs_name(tmp_path):
    saved = make_args(tmp_path, "--run_name", "first-run")
    checkpoint.save_checkpoint(str(tmp_path), 2, learner_state(), {"step": 2}, saved, keep_last_n=1)
    args = make_args(tmp_path, "--resume")
    resumed = checkpoint.load_checkpoint(args)
    assert resumed.step == 2 and args.run.run_name == "first-run"


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


def test_overwrite_output_dir_deletes_only_the_earlier_runs_files(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    (tmp_path / "model").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    with run_directory.RunDirectory(make_args(tmp_path, "--overwrite_output_dir", "true")):
        pass
    assert sorted(os.listdir(tmp_path)) == [".run.lock", "notes.txt"]


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
