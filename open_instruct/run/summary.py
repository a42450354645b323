"""What a run leaves for people to read at its end: summary.json's entries (start vs end correct rates, the save's
rounding report, how every run ended: `status` and `reason`, where a failed or preempted one stopped) and the plots
of its metrics."""

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
        evals = [(r.get("eval/policy_version"), r[key]) for r in records if r.get(key) is not None]
        name = key.removeprefix("eval/")
        if evals and evals[0][0] in (0, None):  # "start": an eval of the weights before training (--num_evals 0 has none)
            summary[f"eval_{name}_start"] = evals[0][1]
        if evals and evals[-1][0] != 0:
            summary[f"eval_{name}_end"] = evals[-1][1]
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


def ending_of(error: BaseException) -> tuple[str, str]:
    """How a run that raised `error` ended: its status in summary.json and the reason, in one line."""
    if isinstance(error, Preempted):
        return "preempted", one_line(error)
    if isinstance(error, KeyboardInterrupt):
        return "interrupted", "interrupted by the keyboard (KeyboardInterrupt)"
    if isinstance(error, SystemExit):  # e.g. Ray's own SIGTERM handler, before the trainer's is installed again
        return "interrupted", f"stopped by sys.exit({error.code!r}) (SystemExit)"
    return "failed", f"{type(error).__name__}: {one_line(error)}"


def record_ending(output_dir: str, logger: MetricsLogger, status: str, reason: str, last_step: int, **extra) -> None:
    """summary.json says how the run ended (`status`: completed, preempted, failed or interrupted; `reason`: one line),
    its last step, and the newest complete checkpoint to resume from; in one write."""
    checkpoints = complete_checkpoints(output_dir)
    logger.update_summary({"status": status, "reason": reason, **extra, "last_step": last_step,
                           "last_checkpoint": checkpoints[-1] if checkpoints else None})  # fmt: skip


def record_failure(output_dir: str, logger: MetricsLogger, error: BaseException, last_step: int) -> None:
    """summary.json and the plot describe this run even when it stops early: how, where, what to resume from."""
    status, reason = ending_of(error)
    last_step = error.step if isinstance(error, Preempted) else last_step
    record_ending(output_dir, logger, status, reason, last_step, error=one_line(error))
    try:
        plot_training_curves(os.path.join(output_dir, "metrics.jsonl"), os.path.join(output_dir, "training_curves.png"))
    except (FileNotFoundError, ValueError):
        pass  # nothing logged yet: no plot
    logger.finish()


def record_exit_without_checkpoint(output_dir: str, logger: MetricsLogger, line: str, last_step: int) -> None:
    """The last words of a preempted run that exits at once, without a new checkpoint (preemption.StopRequest: its
    deadline passed, or a second signal came): summary.json must not go on saying `running`."""
    try:
        record_ending(output_dir, logger, "preempted", line, last_step)
    except OSError as failure:  # a full disk: the exit's own line says the same
        say(f"[ppo] warning: could not record the exit in summary.json: {one_line(failure)}", error=True)
