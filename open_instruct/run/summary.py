"""What a run leaves for people to read at its end: summary.json's entries (start vs end correct rates, the save's
rounding report, how and where a failed or preempted run stopped) and the plots of its metrics."""

import os

from open_instruct.run.checkpoint import complete_checkpoints
from open_instruct.run.console import say
from open_instruct.run.plots import CORRECT_RATE_KEYS, plot_length_histograms, plot_training_curves
from open_instruct.run.preemption import Preempted
from open_instruct.run.tracking import MetricsLogger, read_metrics
from open_instruct.run.validation import one_line


def summarize(metrics_path: str) -> dict:
    """Start vs end: eval correct rates (greedy, sampled), and the training batches' sampled correct rate
    (mean of the first / last 3 steps)."""
    records = read_metrics(metrics_path)
    sampled = [r["objective/verifiable_correct_rate"] for r in records if r.get("objective/verifiable_correct_rate") is not None]
    summary = {}
    for key in ("eval/correct_rate", "eval/sampled_correct_rate"):
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            name = key.removeprefix("eval/")
            summary[f"eval_{name}_start"], summary[f"eval_{name}_end"] = values[0], values[-1]
    if sampled:
        window = min(3, len(sampled))
        summary["sampled_correct_rate_start"] = sum(sampled[:window]) / window
        summary["sampled_correct_rate_end"] = sum(sampled[-window:]) / window
    return summary


def report_save_rounding(saved) -> dict:
    """Summary entries for a save in lower precision than training (`saved`: the learner's SavedModel), with a warning
    when it lost most updates."""
    if saved.rounding is None:
        return {}
    fraction = saved.rounding["fraction_rounded_away"]
    if fraction > 0.5:
        say(
            f"[ppo] WARNING: saving in {saved.dtype} rounded {fraction:.0%} of the changed weights back to their "
            f"initial value: {saved.path} holds little of the training. Save with --save_dtype float32.",
            error=True,
        )
    return {"save/fraction_of_changed_weights_rounded_away": fraction}


def write_plots(output_dir: str) -> str:
    """training_curves.png, correct_rate_vs_time.png (when the run has correct rates) and length_histograms.png;
    returns the first one's path."""
    metrics_path = os.path.join(output_dir, "metrics.jsonl")
    plot_path = plot_training_curves(metrics_path, os.path.join(output_dir, "training_curves.png"))
    try:  # correct rates against wall-clock seconds; a run without verifiable rewards has none
        plot_training_curves(metrics_path, os.path.join(output_dir, "correct_rate_vs_time.png"),
                             keys=list(CORRECT_RATE_KEYS), x_key="time/from_scratch")  # fmt: skip
    except ValueError:
        pass
    plot_length_histograms(os.path.join(output_dir, "lengths.jsonl"), os.path.join(output_dir, "length_histograms.png"))
    return plot_path


def record_failure(output_dir: str, logger: MetricsLogger, error: BaseException, last_step: int) -> None:
    """summary.json and the plot describe this run even when it stops early: how, where, what to resume from."""
    preempted = isinstance(error, Preempted)
    checkpoints = complete_checkpoints(output_dir)
    logger.set_summary("status", "preempted" if preempted else "failed")
    logger.set_summary("error", one_line(error))
    logger.set_summary("last_step", error.step if preempted else last_step)
    logger.set_summary("last_checkpoint", checkpoints[-1] if checkpoints else None)
    try:
        plot_training_curves(os.path.join(output_dir, "metrics.jsonl"), os.path.join(output_dir, "training_curves.png"))
    except (FileNotFoundError, ValueError):
        pass  # nothing logged yet: no plot
    logger.finish()
