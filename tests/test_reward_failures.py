"""One response never stops or stalls the step: a verifier or --reward_function that raises, returns something that is
not a number in [0, 1], or hangs scores that response 0 and is counted (reward/errors/<verifier>,
reward/timeouts/<verifier>); N failures in a row stop the run with one line (rewards/failures.py). The verifiers run
once per response, where the batch is collected, and every learner rank combines the same verdicts
(rl.VerifiedScores): here through the real BatchCollector and a manager pickled as a Ray rank receives it.

Everything goes through RewardManager.score (the learner's call) or BatchCollector.collect (the trainer's), with the
real reward worker process, the real code sandbox and the real IFEval checks.
"""

import json
import logging
import pickle
import sys
import textwrap
import time

import pytest

from open_instruct.generation.step_batch import BatchCollector
from open_instruct.rewards import ifeval_checks
from open_instruct.rewards.failures import RewardFailures
from open_instruct.rewards.manager import RewardConfig, RewardManager, VerifiedScores
from open_instruct.sandbox import isolation_problem
from tests.support.scripted_engine import ScriptedEngine, start_requests
from tests.support.trainer_runs import run_command

SANDBOX_PROBLEM = isolation_problem()
needs_sandbox = pytest.mark.skipif(SANDBOX_PROBLEM is not None, reason=f"isolation impossible here: {SANDBOX_PROBLEM}")


def reward_file(folder, body: str, name: str = "my_reward.py") -> str:
    """A --reward_function file whose `judge(response, ground_truth)` runs `body` (response "ok" scores 1 unless the
    body returns first); the spec."""
    path = folder / name
    path.write_text("import time\n\ndef judge(response, ground_truth):\n" + textwrap.indent(body, "    ")
                    + "\n    return 1.0\n")  # fmt: skip
    return f"{path}:judge"


def score(manager: RewardManager, responses: list[str], ground_truths=None, names=None):
    count = len(responses)
    return manager.score(responses, ground_truths or ["x"] * count, names or [None] * count, [True] * count)


# ---- a --reward_function that fails on one response -------------------------------------------------------------------


@pytest.mark.parametrize("bad, cause", [
    ("raise ZeroDivisionError('division by zero')", "ZeroDivisionError: division by zero"),
    ("return float('nan')", "returned nan, not a number in [0, 1]"),
    ("return 5.0", "returned 5.0, not a number in [0, 1]"),
    ("return 'yes'", "returned 'yes', not a number"),
    ("return None", "returned None, not a number"),
    ("import sys; sys.exit(3)", "SystemExit: 3"),
    ("import os; os._exit(1)", "its process died (exit code 1)"),
])  # fmt: skip
def test_a_reward_function_failing_on_one_response_scores_it_0_counts_it_and_warns_once(tmp_path, caplog, bad, cause):
    spec = reward_file(tmp_path, f"if response == 'bad':\n    {bad}")
    manager = RewardManager(RewardConfig(reward_function=spec))
    with caplog.at_level(logging.WARNING, logger="open_instruct"):
        for _ in range(2):  # the second batch: the same failure is counted again, said no more
            scores, metrics = score(manager, ["ok", "bad", "ok"])
            assert scores.tolist() == [1.0, 0.0, 1.0]
            assert metrics["reward/errors/judge"] == 1.0 and metrics["reward/timeouts/judge"] == 0.0
            assert metrics["objective/judge_correct_rate"] == pytest.approx(2 / 3)
    warnings = [record.getMessage() for record in caplog.records]
    assert len(warnings) == 1, warnings
    assert f"--reward_function {spec} failed on a response ({cause})" in warnings[0], warnings[0]
    assert "it scores 0, counted in reward/errors/judge" in warnings[0] and "\n" not in warnings[0]


def test_a_hanging_reward_function_is_cut_at_the_timeout_and_the_batch_goes_on(tmp_path):
    spec = reward_file(tmp_path, "if response == 'hang':\n    time.sleep(3600)")
    manager = RewardManager(RewardConfig(reward_function=spec, reward_timeout_s=1.0))
    score(manager, ["ok"])  # the worker started and the function loaded: not the time measured below
    started = time.monotonic()
    scores, metrics = score(manager, ["ok", "hang", "ok", "hang", "ok"])
    seconds = time.monotonic() - started
    assert scores.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert metrics["reward/timeouts/judge"] == 2.0 and metrics["reward/errors/judge"] == 0.0
    # Two cuts at 1 s, each followed by a new worker process that loads the function again (~0.5 s on 2 cores).
    assert 2.0 <= seconds < 8.0, seconds
    assert score(manager, ["ok"])[0].tolist() == [1.0]  # the next batch: a fresh worker


def test_failures_in_a_row_stop_the_run_with_one_line_naming_the_function(tmp_path):
    spec = reward_file(tmp_path, "if response != 'ok':\n    raise KeyError(response)")
    manager = RewardManager(RewardConfig(reward_function=spec, reward_max_consecutive_failures=3))
    # Two in a row, a success, two more: never three in a row (across batches too).
    assert score(manager, ["a", "b", "ok", "c"])[0].tolist() == [0.0, 0.0, 1.0, 0.0]
    with pytest.raises(RewardFailures) as stopped:
        score(manager, ["d", "e", "ok"])
    message = str(stopped.value)
    assert message == (f"--reward_function {spec} failed on 3 responses in a row, the last: KeyError: 'e'; fix it, "
                       "or raise --reward_max_consecutive_failures (0: never stop)")  # fmt: skip
    never = RewardManager(RewardConfig(reward_function=spec, reward_max_consecutive_failures=0))
    assert score(never, ["a"] * 60)[1]["reward/errors/judge"] == 60.0


# ---- the built-in verifiers ----------------------------------------------------------------------------------------

IFEVAL_JSON = json.dumps({"instruction_id_list": ["detectable_format:json_format"], "kwargs": [{}]})


def test_an_ifeval_check_that_raises_scores_its_response_0_and_the_others_are_graded():
    """A JSON array nested 100,000 deep is JSON, but json.loads recurses once per level: RecursionError."""
    deep = "[" * 100_000 + "]" * 100_000
    scores, metrics = RewardManager(RewardConfig()).score(
        ['{"a": 1}', deep, "not json"], [IFEVAL_JSON] * 3, ["ifeval"] * 3, [True] * 3
    )
    assert scores.tolist() == [1.0, 0.0, 0.0]
    assert metrics["reward/errors/ifeval"] == 1.0 and metrics["objective/ifeval_correct_rate"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("check, text", [
    (ifeval_checks.split_sentences, "." * 20_000 + "x"),  # was 23 s (quadratic in the run of dots)
    (ifeval_checks.split_sentences, "x" * 20_000 + " . A"),  # the word before a period, searched from the start
    (ifeval_checks.is_json, "```" + " " * 3_000 + "x"),  # a fence and spaces: was minutes
])  # fmt: skip
def test_ifeval_checks_take_linear_time_on_degenerate_responses(check, text):
    started = time.perf_counter()
    check(text)
    assert time.perf_counter() - started < 1.0


@needs_sandbox
@pytest.mark.parametrize("value", ["nested", "huge"])
def test_a_code_answer_that_cannot_be_decoded_scores_0_and_never_raises(value):
    """A call row's return value nested deeper than json.loads recurses, or an integer beyond int()'s digit limit (the
    program lifts its own process's limits to make them): the program's value is no answer (0), and the honest program
    beside it in the batch still scores 1."""
    returns = {"nested": "import sys\n    sys.setrecursionlimit(100_000)\n    v = []\n    for _ in range(3_000):\n"
                         "        v = [v]\n    return v",
               "huge": "import sys\n    sys.set_int_max_str_digits(0)\n    return 10 ** 5_000"}[value]  # fmt: skip
    tests = json.dumps({"inputs": [[1, 2]], "outputs": [3], "fn_name": "add"})
    responses = [f"```python\ndef add(a, b):\n    {returns}\n```", "```python\ndef add(a, b):\n    return a + b\n```"]
    manager = RewardManager(RewardConfig(code_timeout_s=10.0, code_memory_mb=1024))
    scores, metrics = manager.score(responses, [tests] * 2, ["code"] * 2, [True] * 2)
    assert scores.tolist() == [0.0, 1.0]
    assert metrics["objective/code_correct_rate"] == 0.5


@needs_sandbox
def test_a_code_verifier_that_raises_on_one_row_does_not_stop_the_others():
    """The guard around the code verifier itself: tests that cannot be read (rows are checked at load; scored
    directly, they raise inside CodeVerifier.score on the sandbox pool's thread)."""
    tests = json.dumps({"inputs": [[1, 2]], "outputs": [3], "fn_name": "add"})
    program = "```python\ndef add(a, b):\n    return a + b\n```"
    scores, metrics = RewardManager(RewardConfig(code_workers=2)).score(
        [program, program, program], [tests, "not json", tests], ["code"] * 3, [True] * 3
    )
    assert scores.tolist() == [1.0, 0.0, 1.0] and metrics["reward/errors/code"] == 1.0


# ---- each response verified once, every rank the same verdicts ---------------------------------------------------


def test_the_collector_verifies_each_response_once_and_every_rank_gets_the_same_scores(tmp_path):
    """The real BatchCollector (the scripted engine of tests/test_async_schedule.py behind the real generation thread)
    verifies the batch it hands the learner: the function runs once per response, and the scorer each rank unpickles
    (as Ray hands it over) gives the same scores without running it again, with the file gone and a reward model's
    term added on the rank."""
    calls = tmp_path / "calls.txt"
    spec = reward_file(tmp_path, f"open({str(calls)!r}, 'a').write('call\\n')\nreturn 0.25")
    manager = RewardManager(RewardConfig(reward_function=spec, reward_model_multiplier=2.0))
    thread, requests = start_requests(ScriptedEngine(dict.fromkeys(range(10), 3)), async_steps=0)
    try:
        collector = BatchCollector(requests, manager, 0, 1, False, max_extra_batches=0, stop_token_ids=[])
        batch = collector.collect(learner_version=0, steps_left=2)
    finally:
        thread.shutdown()
    assert isinstance(batch.scorer, VerifiedScores)
    assert calls.read_text() == "call\n"  # one prompt, one response
    (tmp_path / "my_reward.py").unlink()  # a rank could not load it: it must not need to
    import torch

    texts = [c.text for c in batch.rollout.completions]
    ranks = [pickle.loads(pickle.dumps(batch.scorer)) for _ in range(2)]
    results = [rank.score(texts, ["0"], ["arithmetic"], [True], torch.tensor([0.5]), [3]) for rank in ranks]
    for scores, metrics in results:
        assert scores.tolist() == [0.25 + 2.0 * 0.5] and metrics["objective/judge_correct_rate"] == 0.25
    assert calls.read_text() == "call\n"


# ---- end to end --------------------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_a_run_whose_reward_function_raises_finishes_and_one_that_always_fails_stops_in_one_line(tiny_model_dir,
                                                                                                  tmp_path):  # fmt: skip
    """The tiny model, one GRPO step of 8 responses: a function that raises on every odd-length response finishes,
    counting its failures; one that raises on all of them stops at that step with one line and exit code 1."""
    rows = [{"prompt": f"What is {a} + {a}?", "ground_truth": str(2 * a), "dataset": "my_task"} for a in range(8)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    half = reward_file(tmp_path, "if len(response) % 2:\n    raise ValueError('odd')", "half.py")
    always = reward_file(tmp_path, "raise ValueError('never works')", "always.py")

    def run(spec: str, name: str, limit: int):
        command = [
            sys.executable, "-m", "open_instruct.grpo_vllm_thread_ray_gtrl", "--model_name_or_path", tiny_model_dir,
            "--dataset_mixer_list", str(data), "1.0", "--reward_function", spec, "--reward_max_consecutive_failures",
            str(limit), "--local_rollout_batch_size", "4", "--number_samples_per_prompt", "2",
            "--per_device_train_batch_size", "4", "--response_length", "16", "--total_episodes", "8",
            "--num_evals", "0", "--output_dir", str(tmp_path / name),
        ]  # fmt: skip
        return run_command(command, tmp_path)[0]

    done = run(half, "half", 50)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "half" / "metrics.jsonl").read_text().splitlines()]
    steps = [step for step in steps if "policy_version/learner" in step]
    assert len(steps) == 1 and steps[0]["reward/errors/judge"] > 0  # tiny's answers: some of odd length
    stopped = run(always, "always", 6)
    assert stopped.returncode == 1, stopped.stderr[-3000:]
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: stopped: --reward_function {always} failed on 6 responses in a row, the last: "
                           "ValueError: never works; fix it"), last  # fmt: skip
    assert "Traceback" not in stopped.stderr
