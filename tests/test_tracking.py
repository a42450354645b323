"""Tests for open_instruct.run.tracking and run.plots: the JSONL record, summary, progress line, plots, and wandb in offline mode."""

import glob
import json
import math
import os
import re
import struct

import pytest

from open_instruct.run import plots, tracking


def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]  # json.loads is lenient; the raw text is checked separately


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR"
    return struct.unpack(">II", header[16:24])


# ---------------------------------------------------------------- MetricsLogger without wandb


def test_log_writes_one_strict_json_line_per_call(tmp_path):
    logger = tracking.MetricsLogger(str(tmp_path / "run"))
    logger.log({"objective/kl": 0.5, "episode": 64}, step=1)
    logger.log({"objective/kl": float("nan"), "loss/policy_avg": float("inf"), "episode": 128}, step=2)
    logger.log({"objective/kl": 0.25, "episode": 192, "step": 3}, step=3)  # a 'step' equal to the argument is fine
    # Each line is on disk as soon as log() returns, before finish().
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl") == [
        {"step": 1, "objective/kl": 0.5, "episode": 64},
        {"step": 2, "objective/kl": None, "loss/policy_avg": None, "episode": 128},
        {"step": 3, "objective/kl": 0.25, "episode": 192},
    ]
    assert tracking.read_metrics(str(tmp_path / "run" / "metrics.jsonl"))[1]["objective/kl"] is None
    assert logger.wandb_url is None
    logger.finish()
    logger.finish()


def test_log_accepts_tensor_and_numpy_scalars(tmp_path):
    import numpy as np
    import torch

    logger = tracking.MetricsLogger(str(tmp_path))
    logger.log({"a": torch.tensor(0.5), "b": np.float32(0.25), "c": np.int64(7), "d": torch.tensor(float("nan"))}, 0)
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 0, "a": 0.5, "b": 0.25, "c": 7, "d": None}]


def test_log_rejects_bad_values_and_conflicting_step(tmp_path):
    logger = tracking.MetricsLogger(str(tmp_path))
    with pytest.raises(ValueError, match="'step' = 5 but the step argument is 4"):
        logger.log({"step": 5}, step=4)
    with pytest.raises(TypeError, match=r"metrics\.x.*\.item\(\)"):
        logger.log({"x": object()}, step=4)
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing half-written


def test_log_appends_across_loggers(tmp_path):
    tracking.MetricsLogger(str(tmp_path)).log({"x": 1.0}, step=0)
    tracking.MetricsLogger(str(tmp_path)).log({"x": 2.0}, step=1)  # a resumed run continues the file
    assert [row["x"] for row in tracking.read_metrics(str(tmp_path / "metrics.jsonl"))] == [1.0, 2.0]


def test_log_samples_and_summary(tmp_path):
    logger = tracking.MetricsLogger(str(tmp_path))
    rows = [
        {"prompt": "What is 2 + 3?", "response": "5", "score": 1.0},
        {"prompt": "What is 4 + 4?", "response": "9", "score": 0.0, "note": "wrong"},
    ]
    logger.log_samples(rows, step=2)
    logger.log_samples([], step=3)
    logger.log_samples(rows[:1], step=4, name="eval_completions")
    assert read_jsonl(tmp_path / "samples.jsonl") == [
        {"step": 2, "table": "sample_completions", **rows[0]},
        {"step": 2, "table": "sample_completions", **rows[1]},
        {"step": 4, "table": "eval_completions", **rows[0]},
    ]

    logger.set_summary("best_eval_correct_rate", 0.75)
    logger.set_summary("final_kl", float("nan"))
    logger.set_summary("best_eval_correct_rate", 0.8)
    assert json.loads((tmp_path / "summary.json").read_text()) == {"best_eval_correct_rate": 0.8, "final_kl": None}
    assert sorted(os.listdir(tmp_path)) == ["samples.jsonl", "summary.json"]  # no temporary file left behind


def test_read_metrics_skips_a_cut_off_last_line_but_not_a_bad_middle_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "x": 1.0}\n{"step": 1, "x": 2.0}\n{"step": 2, "x"')
    assert tracking.read_metrics(str(path)) == [{"step": 0, "x": 1.0}, {"step": 1, "x": 2.0}]
    path.write_text('{"step": 0, "x": 1.0}\n{"step": 1,\n{"step": 2, "x": 3.0}\n')
    with pytest.raises(ValueError, match="line 2"):
        tracking.read_metrics(str(path))
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        tracking.read_metrics(str(tmp_path / "nope.jsonl"))


# ---------------------------------------------------------------- format_progress


def test_format_progress():
    metrics = {
        "training_step": 3,
        "objective/verifiable_correct_rate": 0.4123,
        "objective/rlhf_reward": 0.12,
        "objective/kl": 0.003,
        "time/total": 12.43,
        "custom/thing": 1234.5,
        "loss/value_avg": None,
    }
    keys = [
        "training_step",
        "objective/verifiable_correct_rate",
        "objective/rlhf_reward",
        "objective/kl",
        "not/logged",
        "loss/value_avg",
        "custom/thing",
        "time/total",
    ]
    assert (
        tracking.format_progress(metrics, keys)
        == "step 3 | correct 0.412 | reward 0.12 | kl 0.003 | vf nan | thing 1.23e+03 | total 12.4s"
    )
    assert tracking.format_progress({}, keys) == ""


# ---------------------------------------------------------------- plot_training_curves


def write_metrics(path, rows) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def test_plot_default_keys_skips_unlogged_ones(tmp_path):
    rows = [
        {
            "step": step,
            "episode": 64 * step,
            "objective/verifiable_correct_rate": 0.3 + 0.05 * step,
            "objective/kl": None if step == 2 else 0.001 * step,
            "loss/policy_avg": -0.01 * step,
        }
        for step in range(1, 6)
    ]
    rows.insert(3, {"step": 3, "eval/correct_rate": 0.5})  # eval logged on its own, without episode
    write_metrics(tmp_path / "metrics.jsonl", rows)
    png = plots.plot_training_curves(str(tmp_path / "metrics.jsonl"), str(tmp_path / "curves.png"))
    assert png == str(tmp_path / "curves.png")
    # 4 of the 8 default keys were logged: a 2 x 2 grid of 5 x 3 inch panels at 100 dpi.
    assert png_size(png) == (1000, 600)
    assert os.path.getsize(png) > 10_000  # lines, labels and titles drawn, not a blank image
    assert sorted(os.listdir(tmp_path)) == ["curves.png", "metrics.jsonl"]  # written atomically, no temp file


def test_training_curves_points():
    rows = [
        {"step": 1, "episode": 64, "objective/kl": 0.1, "loss/policy_avg": 0.5},
        {"step": 2, "episode": 128, "objective/kl": None},
        {"step": 2, "eval/correct_rate": 0.75},
        {"step": 3, "episode": 192, "objective/kl": 0.3},
    ]
    x_key, curves = plots.training_curves(rows, ["objective/kl", "eval/correct_rate", "objective/kl", "never"])
    assert x_key == "episode"
    assert list(curves) == ["objective/kl", "eval/correct_rate"]
    xs, ys = curves["objective/kl"]
    assert xs == [64, 128, 192] and ys[0] == 0.1 and math.isnan(ys[1]) and ys[2] == 0.3
    assert curves["eval/correct_rate"] == ([128], [0.75])  # the episode logged at step 2
    assert plots.training_curves([{"step": 0, "a": 1.0}, {"step": 5, "a": 2.0}], ["a"]) == (
        "step",
        {"a": ([0, 5], [1.0, 2.0])},
    )


def test_correct_rate_against_wall_clock_seconds_takes_an_eval_rows_time_from_its_step():
    rows = [
        {"step": 1, "episode": 64, "time/from_scratch": 30.5, "objective/verifiable_correct_rate": 0.25},
        {"step": 2, "episode": 128, "time/from_scratch": 61.0, "objective/verifiable_correct_rate": 0.5},
        {"step": 2, "eval/correct_rate": 0.75},  # the final eval, logged on its own
    ]
    x_key, curves = plots.training_curves(rows, list(plots.CORRECT_RATE_KEYS), x_key="time/from_scratch")
    assert x_key == "time/from_scratch"
    assert curves == {
        "objective/verifiable_correct_rate": ([30.5, 61.0], [0.25, 0.5]),
        "eval/correct_rate": ([61.0], [0.75]),
    }


def test_plot_chosen_keys_and_errors(tmp_path):
    write_metrics(tmp_path / "metrics.jsonl", [{"step": s, "a": s * 0.1, "b": math.sin(s)} for s in range(10)])
    one = plots.plot_training_curves(str(tmp_path / "metrics.jsonl"), str(tmp_path / "one.png"), keys=["a"])
    assert png_size(one) == (500, 300)
    two = plots.plot_training_curves(
        str(tmp_path / "metrics.jsonl"), str(tmp_path / "two.png"), keys=["a", "b", "a", "zzz"]
    )
    assert png_size(two) == (1000, 300)  # a and b side by side; the repeated a and the unlogged zzz skipped
    with pytest.raises(ValueError, match="zzz"):
        plots.plot_training_curves(str(tmp_path / "metrics.jsonl"), str(tmp_path / "none.png"), keys=["zzz"])
    assert not (tmp_path / "none.png").exists()


# ---------------------------------------------------------------- wandb, offline


def test_wandb_offline_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    output_dir = tmp_path / "output"
    logger = tracking.MetricsLogger(
        str(output_dir), with_tracking=True, wandb_project="test", run_name="offline-test", config={"lr": 1e-6}
    )
    for step in range(3):
        logger.log({"objective/kl": 0.01 * step, "objective/scores": float("nan") if step == 1 else 1.0}, step=step)
    logger.log_samples([{"prompt": "1 + 1", "response": "2", "score": 1.0}], step=2)
    logger.log_histograms({"lengths/response_tokens": [3, 5, 5, 9]}, step=2)
    logger.set_summary("best", 1.0)
    assert logger.wandb_url is None  # an offline run has no page
    logger.finish()

    [run_dir] = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert glob.glob(os.path.join(run_dir, "*.wandb"))
    # wandb writes each logged table as JSON: the samples reached it.
    [table_file] = glob.glob(os.path.join(run_dir, "files", "media", "table", "sample_completions_*.table.json"))
    table = json.load(open(table_file))
    assert table["columns"] == ["prompt", "response", "score"] and table["data"] == [["1 + 1", "2", 1.0]]
    # The lengths reached wandb as a histogram of all 4 values: wandb-core stores each history item's JSON in the
    # .wandb protobuf as plain bytes (the Python reader for it is gone from wandb 0.2x).
    [wandb_file] = glob.glob(os.path.join(run_dir, "*.wandb"))
    data = open(wandb_file, "rb").read()
    assert b'lengths/response_tokens\x12\x05_type\x82\x01\x0b"histogram"' in data
    counts = re.search(rb"lengths/response_tokens\x12\x06values[^\[]*(\[[0-9,]+\])", data)
    assert counts is not None and sum(json.loads(counts.group(1))) == 4
    # There is no reader for the .wandb file: what was logged is checked through the logger's own record.
    assert tracking.read_metrics(str(output_dir / "metrics.jsonl")) == [
        {"step": 0, "objective/kl": 0.0, "objective/scores": 1.0},
        {"step": 1, "objective/kl": 0.01, "objective/scores": None},
        {"step": 2, "objective/kl": 0.02, "objective/scores": 1.0},
    ]
    assert json.loads((output_dir / "summary.json").read_text()) == {"best": 1.0}


def test_length_histograms_are_logged_and_plotted_first_and_last_step(tmp_path):
    logger = tracking.MetricsLogger(str(tmp_path))
    logger.log_histograms({"lengths/prompt_tokens": [30, 31, 31, 33]}, step=0)
    for step, lengths in [(1, [10, 32, 32]), (2, [8, 9, 32]), (3, [6, 7, 7])]:
        logger.log_histograms({"lengths/response_tokens": lengths}, step=step)
    histograms = plots.read_histograms(str(tmp_path / "lengths.jsonl"))
    assert histograms == {
        "lengths/prompt_tokens": [(0, [30, 31, 31, 33])],
        "lengths/response_tokens": [(1, [10, 32, 32]), (2, [8, 9, 32]), (3, [6, 7, 7])],
    }
    png = plots.plot_length_histograms(str(tmp_path / "lengths.jsonl"), str(tmp_path / "lengths.png"))
    assert os.path.getsize(png) > 10_000
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no histogram"):
        plots.plot_length_histograms(str(tmp_path / "empty.jsonl"), str(tmp_path / "x.png"))


def test_summary_reports_a_start_eval_only_when_one_was_taken_before_training(tmp_path):
    """--num_evals 0 evaluates the final policy only: summary.json gives its rate as the end, never as a "start" it
    did not measure."""
    from open_instruct.run.summary import summarize

    logger = tracking.MetricsLogger(str(tmp_path))
    logger.log({"objective/verifiable_correct_rate": 0.25}, step=1)
    logger.log({"eval/correct_rate": 0.5, "eval/sampled_correct_rate": 0.4, "eval/policy_version": 3}, step=3)
    only_final = summarize(str(tmp_path / "metrics.jsonl"))
    assert only_final["eval_correct_rate_end"] == 0.5 and "eval_correct_rate_start" not in only_final
    assert "eval_sampled_correct_rate_start" not in only_final

    path = tmp_path / "both"
    logger = tracking.MetricsLogger(str(path))
    logger.log({"eval/correct_rate": 0.1, "eval/sampled_correct_rate": 0.2, "eval/policy_version": 0}, step=0)
    logger.log({"eval/correct_rate": 0.5, "eval/sampled_correct_rate": 0.4, "eval/policy_version": 3}, step=3)
    both = summarize(str(path / "metrics.jsonl"))
    assert (both["eval_correct_rate_start"], both["eval_correct_rate_end"]) == (0.1, 0.5)
    assert (both["eval_sampled_correct_rate_start"], both["eval_sampled_correct_rate_end"]) == (0.2, 0.4)
