"""--reward_function path/to/file.py:fn: the user's own verifier, from their file, scores every row.

The batch is scored by RewardManager.score, the call the learner makes in make_experience (the trainer verifies each
batch where it collects it); the function runs in the reward worker, a process that loads it again from its absolute
path, also where a manager was unpickled in another working directory (here a fresh process). A function that raises,
returns something not in [0, 1] or hangs: tests/test_reward_failures.py. Refusals at start-up go through the CLI in
tests/test_bad_inputs.py; here the loader's own messages.
"""

import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from open_instruct.rewards.manager import RewardConfig, RewardManager
from open_instruct.rewards.reward_function import load_reward_function
from open_instruct.run.args import ConfigError, parse_args
from open_instruct.run.validation import row_checker
from tests.support.trainer_runs import run_command

SHOUTED = textwrap.dedent('''
    def shouts_the_answer(response, ground_truth):
        """1 for the ground truth in capitals and nothing else."""
        return float(response.strip() == ground_truth.upper())
''')
# A fixed batch: the rows name the string_match verifier, which scores every response 1 (case is normalised away).
RESPONSES = ["FIVE", "five", "SEVEN", "The answer is six"]
GROUND_TRUTHS = ["five", "five", "seven", "six"]
STOPPED = [True] * 4


def reward_file(folder, source: str = SHOUTED, name: str = "my_reward.py") -> str:
    path = folder / name
    path.write_text(source)
    return str(path)


def test_the_rows_verifier_scores_the_batch_without_the_flag():
    score, metrics = RewardManager(RewardConfig()).score(RESPONSES, GROUND_TRUTHS, ["string_match"] * 4, STOPPED)
    assert score.tolist() == [1.0, 1.0, 1.0, 1.0] and metrics["objective/string_match_correct_rate"] == 1.0


def test_a_reward_function_replaces_every_rows_verifier_and_logs_its_correct_rate(tmp_path):
    spec = f"{reward_file(tmp_path)}:shouts_the_answer"
    manager = RewardManager(RewardConfig(reward_function=spec, verification_reward=2.0))
    # Verifier names the registry does not know, or none at all: the function scores every row with a ground truth.
    score, metrics = manager.score(RESPONSES, GROUND_TRUTHS, ["string_match", "my_task", None, "my_task"], STOPPED)
    assert score.tolist() == [2.0, 0.0, 2.0, 0.0]
    assert metrics["objective/shouts_the_answer_correct_rate"] == 0.5
    assert metrics["objective/verifiable_correct_rate"] == 0.5
    assert "objective/string_match_correct_rate" not in metrics
    manager.validate(["my_task", None])  # names are not resolved: the function replaces them


def test_the_other_reward_terms_still_apply(tmp_path):
    spec = f"{reward_file(tmp_path)}:shouts_the_answer"
    config = RewardConfig(reward_function=spec, add_r1_style_format_reward=True, non_stop_penalty=True)
    score, _ = RewardManager(config).score(["FIVE", "FIVE"], ["five", "five"], [None, None], [True, False])
    assert score.tolist() == [1.0, -1.0]  # the format reward is 0 for both; the second never stopped


def test_a_manager_sent_to_another_process_loads_the_function_again_from_its_path(tmp_path, monkeypatch):
    """As a Ray learner rank receives it: pickled without the function, unpickled in a process that never imported the
    file and runs in another folder (the spec was relative to the driver's)."""
    reward_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    manager = RewardManager(RewardConfig(reward_function="my_reward.py:shouts_the_answer"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = ("import pickle, sys; manager = pickle.load(sys.stdin.buffer); "
              f"score, metrics = manager.score({RESPONSES!r}, {GROUND_TRUTHS!r}, [None] * 4, [True] * 4); "
              "print(score.tolist(), metrics['objective/shouts_the_answer_correct_rate'])")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    done = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(manager), capture_output=True,
                          cwd=elsewhere, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().strip() == "[1.0, 0.0, 1.0, 0.0] 0.5"


@pytest.mark.parametrize(
    "source, spec_tail, expected",
    [
        (SHOUTED, "", "is not a file and a function's name; give path/to/file.py:function"),
        (SHOUTED, ":no_such_function", "defines no function 'no_such_function' (its functions: shouts_the_answer)"),
        ("def one(response):\n    return 1.0\n", ":one", "one(response) cannot be called as one(response, ground_truth)"),
        ("def three(response, ground_truth, row):\n    return 1.0\n", ":three",
         "three(response, ground_truth, row) cannot be called as three(response, ground_truth)"),
        ("import no_such_module_anywhere\n", ":f", "failed: ModuleNotFoundError: No module named 'no_such_module_anywhere'"),
        ("def f(response, ground_truth):\n    return 1.0\n", ":f:g", "my_reward.py:f is not a file"),
        ("SCORE = 1.0\n", ":SCORE", "defines no function 'SCORE' (its functions: none)"),
    ],
)  # fmt: skip
def test_a_reward_function_that_cannot_work_is_refused_in_one_line(tmp_path, source, spec_tail, expected):
    spec = reward_file(tmp_path, source) + spec_tail
    with pytest.raises(ValueError) as error:
        load_reward_function(spec)
    message = str(error.value)
    assert message.startswith(f"--reward_function {spec!r}") and expected in message and "\n" not in message, message


def test_a_function_with_extra_optional_parameters_is_accepted(tmp_path):
    path = reward_file(tmp_path, "def f(response, ground_truth, *, partial=0.5):\n    return partial\n")
    assert load_reward_function(f"{path}:f")("a", "b") == 0.5


def test_rows_need_no_known_verifier_name_with_a_reward_function(tmp_path):
    spec = f"{reward_file(tmp_path)}:shouts_the_answer"
    row = {"ground_truth": "five", "dataset": "my_task"}
    row_checker(parse_args(["--reward_function", spec]), "train")(row, "row 0")
    with pytest.raises(ConfigError, match="row 0: Unknown verifier 'my_task'"):
        row_checker(parse_args([]), "train")(row, "row 0")


@pytest.mark.e2e
def test_a_grpo_run_scores_its_responses_with_the_function(tiny_model_dir, tmp_path):
    """End to end, the tiny model for 2 steps: every logged sample's score is what the function gives its response,
    and each step logs the function's correct rate (the rows name a verifier the registry does not know)."""
    path = reward_file(tmp_path, "def even_length(response, ground_truth):\n    return float(len(response) % 2 == 0)\n")
    rows = [{"prompt": f"What is {a} + {a}?", "ground_truth": str(2 * a), "dataset": "my_task"} for a in range(8)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    output_dir = tmp_path / "output"
    command = [
        sys.executable, "-m", "open_instruct.grpo_vllm_thread_ray_gtrl",
        "--model_name_or_path", tiny_model_dir,
        "--dataset_mixer_list", str(data), "1.0",
        "--reward_function", f"{path}:even_length",
        "--local_rollout_batch_size", "4", "--number_samples_per_prompt", "2", "--per_device_train_batch_size", "4",
        "--response_length", "16", "--total_episodes", "16", "--num_samples_to_log", "8",
        "--output_dir", str(output_dir),
    ]  # fmt: skip
    done, _ = run_command(command, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in steps if "policy_version/learner" in line]
    samples = [json.loads(line) for line in (output_dir / "samples.jsonl").read_text().splitlines()]
    samples = [row for row in samples if "score" in row]
    assert len(steps) == 2 and len(samples) == 16
    for row in samples:
        assert row["score"] == float(len(row["response"]) % 2 == 0), row
    for step in steps:
        step_samples = [row["score"] for row in samples if row["step"] == step["step"]]
        assert step["objective/even_length_correct_rate"] == pytest.approx(sum(step_samples) / len(step_samples))
        assert step["objective/verifiable_correct_rate"] == step["objective/even_length_correct_rate"]
