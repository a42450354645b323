"""Experiment tracking: a JSONL metrics log that is always written, and wandb on top when asked (plots: `plots`).

The JSONL files in `output_dir` are the record of a run: they are written whether or not wandb is on, one
line per call and flushed at once, so a crash keeps everything logged before it. wandb mirrors them.

Files written by `MetricsLogger` in `output_dir`:
- `metrics.jsonl`: one line per `log()` call, `{"step": step, **metrics}`.
- `samples.jsonl`: one line per sample row, `{"step": step, "table": name, **row}`.
- `lengths.jsonl`: one line per histogram, `{"step": step, "name": name, "values": [...]}` (`log_histograms`:
  prompt and response lengths in tokens; `plot_length_histograms` draws them).
- `summary.json`: the final values set with `set_summary()`/`update_summary()`, rewritten atomically after each call.

Non-finite numbers (NaN, +inf, -inf) are written as JSON `null`: Python's `json.dumps` would write the bare
tokens `NaN`/`Infinity`, which strict JSON readers (jq, JavaScript's JSON.parse) reject. `read_metrics`
therefore returns `None` for them, and the plots leave a gap there. wandb still receives the original value, so
its charts show the NaN.
"""

import json
import math
import os
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

from open_instruct.run.console import say

# Short labels for the one-line progress summary; a key not listed here shows its last path component.
SHORT_NAMES = {
    "training_step": "step",
    "episode": "ep",
    "objective/verifiable_correct_rate": "correct",
    "objective/scores": "score",
    "objective/rlhf_reward": "reward",
    "objective/kl": "kl",
    "objective/entropy": "ent",
    "objective/non_score_reward": "kl_pen",
    "eval/correct_rate": "eval",
    "loss/policy_avg": "pg",
    "loss/value_avg": "vf",
    "val/sequence_lengths": "len",
    "val/ratio": "ratio",
    "policy/clipfrac_avg": "clip",
}


def _json_safe(value: Any, where: str) -> Any:
    """Turn `value` into plain JSON data: non-finite floats become None, tensor/numpy scalars become numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, Mapping):
        return {str(key): _json_safe(item, f"{where}.{key}") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # a 0-d torch tensor or numpy scalar
        return _json_safe(value.item(), where)
    raise TypeError(
        f"{where} has a value of type {type(value).__name__} that cannot be written as JSON; pass a number, "
        "string, bool, None, or a list/dict of those (call .item() or .tolist() on tensors first)."
    )


def _append_json_lines(path: str, records: list[dict]) -> None:
    # Open, write, close on every call: the lines are on disk when this returns, even if the process dies next.
    text = "".join(json.dumps(record, allow_nan=False) + "\n" for record in records)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()


def repair_jsonl(path: str, keep_through_step: int | None = None) -> list[str]:
    """Make a JSONL log safe to append to; return warnings saying what was dropped.

    A cut-off last line (the process died mid-write) is dropped: appending after it would leave an invalid line
    in the middle of the file. With `keep_through_step`, rows of later steps are dropped too: a run resumed from
    the checkpoint of that step logs them again. Rewritten atomically; untouched when nothing changes.
    """
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    lines = text.split("\n")
    tail = lines.pop()  # "" when the file ends with a newline
    warnings = []
    if tail:
        warnings.append(f"{path}: dropped a cut-off last line ({len(tail)} characters) left by an interrupted write")
    kept, dropped_steps = [], set()
    for line in lines:
        step = _step_of(line)
        if keep_through_step is not None and step is not None and step > keep_through_step:
            dropped_steps.add(step)
        else:
            kept.append(line)
    if dropped_steps:
        warnings.append(
            f"{path}: dropped the rows of steps {min(dropped_steps)}-{max(dropped_steps)}, logged after the checkpoint "
            f"of step {keep_through_step}; the resumed run logs them again"
        )
    if warnings:

        def write(tmp_path: str) -> None:
            with open(tmp_path, "w", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in kept))
                f.flush()
                os.fsync(f.fileno())

        _replace_atomically(path, write)
    return warnings


def _step_of(line: str) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (json.JSONDecodeError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def _replace_atomically(path: str, write) -> None:
    """Call write(tmp_path), then rename over `path`: a reader sees the old file or the new one, never half."""
    directory, name = os.path.split(os.path.abspath(path))
    fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp_path)
        os.replace(tmp_path, path)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)


class MetricsLogger:
    """Log training metrics to `{output_dir}/metrics.jsonl` and, with `with_tracking`, to a wandb run.

    The JSONL files are appended to, never truncated: a resumed run in the same `output_dir` continues them (a
    cut-off last line is dropped first, see `repair_jsonl`), and with `wandb_run_id` the same wandb run. With
    `run_id`, every metrics row carries it. wandb is configured through its own environment variables
    (`WANDB_MODE=offline`, `WANDB_DIR`, ...).
    """

    def __init__(
        self,
        output_dir: str,
        *,
        with_tracking: bool = False,
        wandb_project: str = "open_instruct",
        wandb_entity: str | None = None,
        run_name: str = "run",
        config: dict | None = None,
        run_id: str | None = None,
        wandb_run_id: str | None = None,
    ):
        os.makedirs(output_dir, exist_ok=True)
        self.output_dir = output_dir
        self.metrics_path = os.path.join(output_dir, "metrics.jsonl")
        self.samples_path = os.path.join(output_dir, "samples.jsonl")
        self.lengths_path = os.path.join(output_dir, "lengths.jsonl")
        self.summary_path = os.path.join(output_dir, "summary.json")
        self.run_id = run_id
        for path in (self.metrics_path, self.samples_path, self.lengths_path):
            for warning in repair_jsonl(path):
                say(f"[tracking] warning: {warning}")
        self._summary: dict[str, Any] = {}
        self._lock = threading.Lock()  # generation/eval threads may log while the learner logs
        self._run = None
        self._wandb_url: str | None = None
        if with_tracking:
            import wandb  # imported here: it takes a second and is not needed without tracking

            self._run = wandb.init(
                project=wandb_project, entity=wandb_entity, name=run_name, config=config, id=wandb_run_id,
                resume="allow" if wandb_run_id else None,
            )
            self._wandb_url = self._run.url  # kept so the model card can link the run after finish()

    @property
    def wandb_run_id(self) -> str | None:
        """The wandb run's id (kept in checkpoints, so that a resumed run logs to the same wandb run)."""
        return self._run.id if self._run is not None else None

    @property
    def wandb_url(self) -> str | None:
        """The wandb run page, or None without tracking or in offline mode (an offline run has no page yet)."""
        return self._wandb_url

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Append `{"step": step, **metrics}` to metrics.jsonl and send the metrics to wandb at that step."""
        metrics = dict(metrics)
        metrics_step = metrics.pop("step", step)
        if metrics_step != step:
            raise ValueError(
                f"metrics passed to MetricsLogger.log hold 'step' = {metrics_step!r} but the step argument is {step}; "
                "drop the 'step' key (the logger writes it from the argument) or rename that metric."
            )
        run_id = {"run_id": self.run_id} if self.run_id is not None else {}
        record = _json_safe({"step": step, **run_id, **metrics}, "metrics")
        with self._lock:
            _append_json_lines(self.metrics_path, [record])
            if self._run is not None:
                self._run.log(metrics, step=step)

    def log_samples(self, rows: list[dict], step: int, name: str = "sample_completions") -> None:
        """Record sample rows (e.g. prompt, response, score) in samples.jsonl and, when tracking, a wandb.Table."""
        if not rows:
            return
        records = [_json_safe({"step": step, "table": name, **row}, f"{name}[{i}]") for i, row in enumerate(rows)]
        with self._lock:
            _append_json_lines(self.samples_path, records)
            if self._run is not None:
                import wandb

                columns = list(dict.fromkeys(key for row in rows for key in row))  # union of keys, first-seen order
                table = wandb.Table(columns=columns, data=[[row.get(column) for column in columns] for row in rows])
                self._run.log({name: table}, step=step)

    def log_histograms(self, histograms: dict[str, list[float]], step: int) -> None:
        """Record each list of values (e.g. the response lengths of a step) in lengths.jsonl and, when tracking, as a
        wandb.Histogram at `step`."""
        records = [_json_safe({"step": step, "name": name, "values": list(values)}, name) for name, values in
                   histograms.items()]  # fmt: skip
        with self._lock:
            _append_json_lines(self.lengths_path, records)
            if self._run is not None:
                import wandb

                self._run.log({name: wandb.Histogram(values) for name, values in histograms.items()}, step=step)

    def set_summary(self, key: str, value: Any) -> None:
        """Set a final value (best eval score, total time, ...) in the wandb summary and in summary.json."""
        self.update_summary({key: value})

    def update_summary(self, values: dict[str, Any]) -> None:
        """Set several final values at once: summary.json is rewritten once, so a reader sees all of them or none."""
        safe_values = {key: _json_safe(value, f"summary[{key!r}]") for key, value in values.items()}
        with self._lock:
            self._summary.update(safe_values)
            text = json.dumps(self._summary, indent=2, allow_nan=False) + "\n"

            def write(tmp_path: str) -> None:
                with open(tmp_path, "w", encoding="utf-8") as f:
                    f.write(text)

            _replace_atomically(self.summary_path, write)
            if self._run is not None:
                self._run.summary.update(values)

    def finish(self) -> None:
        """Close the wandb run (uploads or syncs it), with everything logged on disk when this returns; safe to call
        twice."""
        with self._lock:
            if self._run is not None:
                import wandb

                self._run.finish()
                self._run = None
                # run.finish() returns once wandb's service has answered the exit record, but the service writes and
                # closes the run's .wandb file only later, on a message nobody waits for: measured under load, 2 of
                # 12 offline runs held only the file's header when finish() returned (complete 5-9 ms later).
                # teardown() waits for the service process to exit, so the run is on disk (a later wandb.init starts
                # a new service, ~1 s).
                wandb.teardown()


def _format_value(key: str, value: Any) -> str:
    if value is None:
        return "nan"
    if isinstance(value, int):  # bools too
        return str(int(value))
    if key.startswith("time/"):
        return f"{value:.1f}s"
    return f"{value:.3g}"


def format_progress(metrics: dict, keys: list[str]) -> str:
    """One compact line for a progress bar, e.g. `step 3 | correct 0.41 | reward 0.12 | kl 0.003 | total 12.4s`.

    Keys missing from `metrics` are left out; a key shows as its SHORT_NAMES label or its last path component.
    Integers print as they are, `time/*` values as seconds with one decimal, other numbers with 3 significant digits.
    """
    parts = []
    for key in keys:
        if key in metrics:
            label = SHORT_NAMES.get(key, key.rsplit("/", 1)[-1])
            parts.append(f"{label} {_format_value(key, metrics[key])}")
    return " | ".join(parts)


def read_metrics(metrics_jsonl: str) -> list[dict]:
    """Read a metrics.jsonl file; a cut-off last line (the process died mid-write) is skipped."""
    if not os.path.isfile(metrics_jsonl):
        raise FileNotFoundError(
            f"metrics file {metrics_jsonl!r} does not exist; pass the metrics.jsonl written by MetricsLogger in the "
            "run's output_dir."
        )
    with open(metrics_jsonl, encoding="utf-8") as f:
        lines = f.read().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if number == len(lines):
                break
            raise ValueError(
                f"line {number} of {metrics_jsonl!r} is not valid JSON ({e.msg}); fix or delete that line."
            ) from e
    return records
