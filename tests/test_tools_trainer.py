"""A training run with a tool-calling environment, as a user runs it (`--tools path/to/file.py:Class`), on the tiny
model: its tool outputs reach the learner token for token as the engine appended them (in sync mode the learner's
logprobs of every sampled token, those after a tool's output included, are the engine's to 1e-3 nats), they are never
trained on, and the tools/* metrics are logged. The tiny model never writes a real tool call, so the environment ends
a turn at every letter or digit: a model that calls its tool as often as --max_tool_calls lets it. An environment that
cannot start for half the prompts (its reset raises or hangs) and answers a megabyte a call ends those samples and
cuts the answers, and the run goes on to its end."""

import math

import pytest

from open_instruct.run.tracking import read_metrics
from tests.support.trainer_runs import (
    FP32_LEARNER,
    SMALL_RUN,
    SYNC_MAX_LOGPROB_DIFF,
    TESTS_DIR,
    TRAINER,
    run_to_completion,
)

pytestmark = [pytest.mark.e2e]


def test_a_run_with_tool_calls_trains_on_the_models_tokens_alone(tiny_model_dir, tmp_path):
    command = [
        *TRAINER, "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "output"), *SMALL_RUN,
        "--async_mode", "false", "--total_episodes", "16", "--num_evals", "0", "--response_length", "24",
        "--tools", f"{TESTS_DIR / 'support' / 'tool_environments.py'}:EveryLetterWithStopToken", "--max_tool_calls", "3",
        "--max_vllm_logprob_diff", str(SYNC_MAX_LOGPROB_DIFF), *FP32_LEARNER,
    ]  # fmt: skip
    run_to_completion(command, cwd=tmp_path)
    steps = [line for line in read_metrics(str(tmp_path / "output" / "metrics.jsonl")) if "tools/calls_per_sample" in line]
    assert len(steps) == 2
    for step in steps:
        assert 1 <= step["tools/calls_per_sample"] <= 3
        assert 0 < step["tools/token_fraction"] < 1
        assert step["tools/errors"] == 0 and step["tools/timeouts"] == 0
        assert step["debug/vllm_vs_learner_logprob_diff_mean"] < SYNC_MAX_LOGPROB_DIFF
        # The model's tokens alone: the 24-token budget is shared with the outputs (each several tokens long).
        assert step["val/sequence_lengths"] <= 24 - 2 * step["tools/calls_per_sample"]
        assert all(math.isfinite(step[key]) for key in ("loss/policy_avg", "loss/value_avg", "objective/kl"))


def test_a_run_whose_environment_cannot_start_for_some_prompts_ends_those_samples_and_goes_on(tiny_model_dir, tmp_path):
    """`StartsBadly`: of every 4 prompts the second's reset raises and the third's hangs (cut at --tool_timeout_s), and
    every call is answered with a megabyte. The run ends completed, each step counting its 4 samples (2 prompts x 2)
    that could not start, and the answers cut to --tool_output_max_tokens."""
    command = [
        *TRAINER, "--model_name_or_path", tiny_model_dir, "--output_dir", str(tmp_path / "output"), *SMALL_RUN,
        "--async_mode", "false", "--total_episodes", "16", "--num_evals", "0", "--response_length", "24",
        "--tools", f"{TESTS_DIR / 'support' / 'tool_environments.py'}:StartsBadly", "--max_tool_calls", "2",
        "--tool_timeout_s", "1", "--tool_output_max_tokens", "4",
    ]  # fmt: skip
    run_to_completion(command, cwd=tmp_path)
    steps = [line for line in read_metrics(str(tmp_path / "output" / "metrics.jsonl")) if "tools/start_errors" in line]
    assert len(steps) == 2
    for step in steps:
        assert step["tools/start_errors"] == 4
        assert step["tools/outputs_cut"] == step["tools/calls_per_sample"] * 8 > 0
        assert all(math.isfinite(step[key]) for key in ("loss/policy_avg", "loss/value_avg", "objective/kl"))
