"""Plots of a run's metrics.jsonl and lengths.jsonl: training curves against episodes, correct rates against wall-clock
seconds, and the prompt and response length histograms (PNG, written atomically).
"""

import math
import os

from open_instruct.run.tracking import _replace_atomically, read_metrics

# Correct rates against wall-clock seconds (correct_rate_vs_time.png): what a run buys per hour of hardware.
CORRECT_RATE_KEYS = ("objective/verifiable_correct_rate", "eval/correct_rate", "eval/sampled_correct_rate")
DEFAULT_PLOT_KEYS = (
    "objective/verifiable_correct_rate",
    "objective/scores",
    "objective/rlhf_reward",
    "objective/kl",
    "eval/correct_rate",
    "eval/sampled_correct_rate",
    "loss/policy_avg",
    "loss/value_avg",
    "val/sequence_lengths",
    "debug/vllm_vs_learner_logprob_diff_mean",
    "debug/vllm_vs_learner_logprob_diff_max",
    "debug/vllm_vs_learner_ratio_mean",
    "grpo/zero_std_groups_frac",
)


def training_curves(
    records: list[dict], keys: list[str], x_key: str | None = None
) -> tuple[str, dict[str, tuple[list, list]]]:
    """The (x, y) points of each key in `keys` that has a logged value, and the name of the x axis.

    x is `x_key` when given (e.g. `time/from_scratch`: wall-clock seconds), else `episode` when any row logged it,
    else `step`. A row without the x key (e.g. eval metrics logged on their own) takes the x logged at its step.
    Non-finite values (null in the JSONL) become NaN: a gap in the line.
    """
    if x_key is None:
        x_key = "episode" if any(r.get("episode") is not None for r in records) else "step"
    x_at_step = {r.get("step"): r[x_key] for r in records if r.get(x_key) is not None}
    curves = {}
    for key in keys:
        if key in curves or not any(record.get(key) is not None for record in records):
            continue
        xs, ys = [], []
        for record in records:
            step = record.get("step")
            x = step if x_key == "step" else record.get(x_key, x_at_step.get(step))
            if key in record and x is not None:
                xs.append(x)
                ys.append(math.nan if record[key] is None else record[key])
        curves[key] = (xs, ys)
    return x_key, curves


def plot_training_curves(
    metrics_jsonl: str, png_path: str, keys: list[str] | None = None, x_key: str | None = None
) -> str:
    """Plot one subplot per logged metric of `keys` (default DEFAULT_PLOT_KEYS) to a PNG; return png_path.

    Keys that were never logged are skipped; see `training_curves` for the x axis (`x_key`) and the gaps.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    wanted = list(DEFAULT_PLOT_KEYS if keys is None else keys)
    x_key, curves = training_curves(read_metrics(metrics_jsonl), wanted, x_key)
    if not curves:
        raise ValueError(
            f"{metrics_jsonl!r} has no logged value for any of {wanted}; pass keys= with metric names that appear in "
            "that file."
        )
    ncols = 1 if len(curves) == 1 else 2
    nrows = math.ceil(len(curves) / ncols)
    # A Figure with its own Agg canvas (no pyplot): no global state, safe to call from any thread.
    figure = Figure(figsize=(5 * ncols, 3 * nrows), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    for index, (key, (xs, ys)) in enumerate(curves.items()):
        axes = figure.add_subplot(nrows, ncols, index + 1)
        axes.plot(xs, ys, marker="." if len(xs) < 50 else None, linewidth=1.2)
        axes.set_title(key, fontsize=10)
        axes.set_xlabel(x_key)
        axes.grid(alpha=0.3)
    run_name = os.path.basename(os.path.dirname(os.path.abspath(metrics_jsonl)))
    figure.suptitle(f"Training curves: {run_name}")

    def write(tmp_path: str) -> None:
        figure.savefig(tmp_path, format="png")

    _replace_atomically(png_path, write)
    return png_path


def read_histograms(lengths_jsonl: str) -> dict[str, list[tuple[int, list[float]]]]:
    """lengths.jsonl as {name: [(step, values), ...]} in the order logged."""
    histograms: dict[str, list[tuple[int, list[float]]]] = {}
    for record in read_metrics(lengths_jsonl):
        histograms.setdefault(record["name"], []).append((record["step"], record["values"]))
    return histograms


def plot_length_histograms(lengths_jsonl: str, png_path: str) -> str:
    """One subplot per histogram name in lengths.jsonl: its first and last logged step overlaid (e.g. the response
    lengths at the first and the last training step; a name logged once, like the dataset's prompt lengths, shows
    one), with each one's mean in the legend. Returns png_path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    histograms = read_histograms(lengths_jsonl)
    if not histograms:
        raise ValueError(f"{lengths_jsonl!r} holds no histogram; MetricsLogger.log_histograms writes them.")
    figure = Figure(figsize=(5 * len(histograms), 3.2), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    for index, (name, logged) in enumerate(histograms.items()):
        axes = figure.add_subplot(1, len(histograms), index + 1)
        shown = [logged[0], logged[-1]] if len(logged) > 1 else logged[:1]
        low = min(min(values, default=0) for _, values in shown)
        high = max(max(values, default=0) for _, values in shown)
        bins = min(40, int(high - low) + 1)
        for step, values in shown:
            mean = sum(values) / max(len(values), 1)
            axes.hist(values, bins=bins, range=(low, high + 1), alpha=0.55, label=f"step {step} (mean {mean:.1f})")
        axes.set_title(name, fontsize=10)
        axes.set_xlabel("tokens")
        axes.set_ylabel("count")
        axes.legend(fontsize=8)
    run_name = os.path.basename(os.path.dirname(os.path.abspath(lengths_jsonl)))
    figure.suptitle(f"Lengths: {run_name}")

    def write(tmp_path: str) -> None:
        figure.savefig(tmp_path, format="png")

    _replace_atomically(png_path, write)
    return png_path
