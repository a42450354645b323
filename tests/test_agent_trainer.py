"""Training with an agent program as the rollout (`--rollout_agent`), as a user runs it, on the tiny model: every
rollout is three calls of the real `openai` client to the trainer's endpoint, each call's prompt extending the last
(tests/support/agents.py three_calls). In sync mode the learner's logprobs of every sampled token, those after the
agent's turns included, are the engine's to 1e-3 nats: the samples are what the engine sampled, token for token. The
saved model is not the initial one. A run stopped by SIGTERM and resumed is bit for bit the uninterrupted one (with
--agent_concurrency 1: one call in the engine at a time, so no float depends on which calls shared a step)."""

import signal

import pytest
import torch
from safetensors.torch import load_file

from open_instruct.run.tracking import read_metrics
from tests.support.forked_runs import start_run
from tests.support.resume_runs import assert_same_run, finish, wait_for_step
from tests.support.trainer_runs import (
    FP32_LEARNER,
    SMALL_RUN,
    SYNC_MAX_LOGPROB_DIFF,
    TESTS_DIR,
    TRAINER,
    last_lines,
    run_command,
    run_to_completion,
)

pytestmark = [pytest.mark.e2e]
AGENT = ["--rollout_agent", f"{TESTS_DIR / 'support' / 'agents.py'}:three_calls"]
GRPO = [TRAINER[0], "-m", "open_instruct.grpo_vllm_thread_ray_gtrl"]


def test_a_grpo_run_trains_on_the_agents_calls_token_for_token(tiny_model_dir, tmp_path):
    output = tmp_path / "output"
    command = [
        *GRPO, "--model_name_or_path", tiny_model_dir, "--output_dir", str(output), *SMALL_RUN, "--response_length", "64",
        "--async_mode", "false", "--total_episodes", "16", "--num_evals", "1", *AGENT, "--learning_rate", "1e-3",
        "--max_vllm_logprob_diff", str(SYNC_MAX_LOGPROB_DIFF), *FP32_LEARNER,
    ]  # fmt: skip
    run_to_completion(command, cwd=tmp_path)
    rows = read_metrics(str(output / "metrics.jsonl"))
    steps = [row for row in rows if "agent/calls_per_rollout" in row]
    assert len(steps) == 2
    for step in steps:
        assert step["agent/calls_per_rollout"] == 3 and step["agent/splits"] == 0 and step["agent/bridged_frac"] == 1
        assert step["agent/errors"] == 0 and step["agent/dropped"] == 0
        assert step["debug/vllm_vs_learner_logprob_diff_mean"] < SYNC_MAX_LOGPROB_DIFF
        assert step["objective/scores"] == pytest.approx(step["agent/reward"])
        assert 0 < step["agent/answer_tokens"] <= 18
    evals = [row for row in rows if "eval/agent/calls_per_rollout" in row]
    assert evals and all(row["eval/agent/calls_per_rollout"] == 3 for row in evals)
    # What the user keeps: the saved model moved off the initial weights.
    saved, initial = load_file(str(output / "model" / "model.safetensors")), load_file(f"{tiny_model_dir}/model.safetensors")
    assert any(not torch.equal(saved[name], initial[name]) for name in initial if name in saved)


@pytest.mark.slow
def test_a_resumed_agent_run_is_the_uninterrupted_one_bit_for_bit(tmp_path):
    """Slow (~3 min on 2 cores): two runs of 4 steps side by side, one stopped by SIGTERM after step 2 and resumed: the
    exactness of a resume is only seen on whole runs."""
    flags = ["--model_name_or_path", "tiny", *SMALL_RUN, "--response_length", "64", "--async_mode", "false",
             "--total_episodes", "32", "--num_evals", "2", "--save_freq", "2", *AGENT, "--agent_concurrency", "1",
             *FP32_LEARNER]  # fmt: skip
    reference, interrupted = tmp_path / "reference" / "output", tmp_path / "interrupted" / "output"
    for output in (reference, interrupted):
        output.mkdir(parents=True)
    runs = [start_run(TRAINER + flags + ["--output_dir", str(output)], output.parent, output.parent / "run.log")
            for output in (reference, interrupted)]  # fmt: skip
    for run, output in zip(runs, (reference, interrupted)):
        run.log_path = output.parent / "run.log"
    wait_for_step(runs[1], interrupted, 2)
    runs[1].send_signal(signal.SIGTERM)
    code, log = finish(runs[1])
    assert code == 128 + signal.SIGTERM, last_lines(log)
    resumed, _ = run_command(TRAINER + flags + ["--output_dir", str(interrupted), "--resume"], cwd=interrupted.parent)
    assert resumed.returncode == 0, last_lines(resumed.stderr)
    code, log = finish(runs[0])
    assert code == 0, last_lines(log)
    assert_same_run(interrupted, reference, exact=True)
