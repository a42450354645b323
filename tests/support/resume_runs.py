"""Comparing a stopped-and-resumed run with an uninterrupted one: every logged step and the final weights."""

import math
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from open_instruct.run.flops import is_timing
from open_instruct.run.tracking import read_metrics
from tests.support.trainer_runs import RUN_TIMEOUT_S, last_lines


def log_of(process: subprocess.Popen) -> str:
    return process.log_path.read_text(errors="replace")


def logged_steps(output_dir: Path) -> set[int]:
    try:
        return {row["step"] for row in read_metrics(str(output_dir / "metrics.jsonl")) if "episode" in row}
    except (FileNotFoundError, ValueError):
        return set()


def wait_for_step(process: subprocess.Popen, output_dir: Path, step: int) -> None:
    deadline = time.time() + RUN_TIMEOUT_S
    while step not in logged_steps(output_dir):
        if process.poll() is not None:
            pytest.fail(f"the run ended (exit {process.returncode}) before step {step}:\n{last_lines(log_of(process))}")
        if time.time() > deadline:
            process.kill()
            pytest.fail(f"step {step} was not logged within {RUN_TIMEOUT_S}s")
        time.sleep(0.1)


def finish(process: subprocess.Popen) -> tuple[int, str]:
    try:
        process.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"the run did not end within {RUN_TIMEOUT_S}s")
    return process.returncode, log_of(process)


# What the in-process engine loaded while generating a step's rollouts: which rollout a sync lands in depends on when
# the engine admitted it, like the timings, and a resumed run's batches restored half generated carry none.
SCHEDULE_METRICS = {"run_id", "weight_sync/megabytes"}


def comparable(row: dict) -> dict:
    return {key: value for key, value in row.items() if not is_timing(key) and key not in SCHEDULE_METRICS}

# Runs compared without `exact` (Ray's DeepSpeed ranks, GRPO, LoRA) are held to float tolerance. The engine-vs-learner
# gaps are differences of logprobs of up to ~20 nats, whose float32 resolution is ~2e-6, and their extremes -- a max
# or min over thousands of tokens -- carry any rounding of the weights furthest, hence their wider bounds. The
# single-process resumes of tests/test_resume.py are compared bit for bit (docs/resume.md, "What resume reproduces").
LOGPROB_GAP_ABS_TOL = 1e-5
LOGPROB_GAP_EXTREME_ABS_TOL = 1e-4


def assert_same_run(output_dir: Path, reference: Path, exact: bool = False) -> None:
    """Every logged row (timings and run id aside), every logged response and the final model of a run equal the
    reference run's, to float tolerance, or bit for bit with `exact`."""
    expected = [comparable(row) for row in read_metrics(str(reference / "metrics.jsonl"))]
    resumed = [comparable(row) for row in read_metrics(str(output_dir / "metrics.jsonl"))]
    assert [row["step"] for row in resumed] == [row["step"] for row in expected]
    for got, want in zip(resumed, expected):
        assert got.keys() == want.keys(), f"step {want['step']}"
        for key, value in want.items():
            if isinstance(value, float) and not exact:
                abs_tol = 1e-6
                if key.startswith("debug/vllm_vs_learner_"):
                    extreme = key.endswith(("_max", "_min"))
                    abs_tol = LOGPROB_GAP_EXTREME_ABS_TOL if extreme else LOGPROB_GAP_ABS_TOL
                assert math.isclose(got[key], value, rel_tol=1e-5, abs_tol=abs_tol), f"step {want['step']} {key}: {got[key]!r} resumed vs {value!r}"
            else:
                assert got[key] == value, f"step {want['step']} {key}"

    assert_same_model(output_dir / "model", reference / "model", exact)
    assert sampled_tokens(output_dir) == sampled_tokens(reference), "the resumed run generated other tokens"


def sampled_tokens(output_dir: Path) -> list[tuple]:
    """(step, table, prompt, response, token ids) of every response the run logged to samples.jsonl: training samples
    (their text) and evals (text and token ids)."""
    rows = read_metrics(str(output_dir / "samples.jsonl"))
    return [(row["step"], row.get("table"), row["prompt"], row["response"], row.get("token_ids")) for row in rows]


def assert_same_model(model_dir: Path, reference_dir: Path, exact: bool = False) -> None:
    """Two saved HF folders hold the same weights (to float tolerance, or bit for bit with `exact`), and the first
    loads with transformers."""
    from transformers import AutoModelForCausalLM

    reference_weights = load_file(str(reference_dir / "model.safetensors"))
    weights = load_file(str(model_dir / "model.safetensors"))
    assert reference_weights.keys() == weights.keys()
    for name, tensor in reference_weights.items():
        if exact:
            differ = (weights[name] != tensor).sum().item()
            assert differ == 0, f"{name}: {differ} of {tensor.numel()} weights differ"
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    loaded = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    name, tensor = next(iter(reference_weights.items()))
    torch.testing.assert_close(loaded[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
