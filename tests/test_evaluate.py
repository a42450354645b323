"""`python -m open_instruct.evaluate`: a fresh engine per saved folder, greedy and sampled correct rates, a table."""

import json
import sys

import pytest

from tests.support.trainer_runs import run_command


@pytest.mark.e2e
def test_evaluate_reports_greedy_and_sampled_rates_per_split_for_each_model(tiny_model_dir, tmp_path):
    """Graded by the --reward_function a run trained with: here one that accepts every response, while the rows'
    arithmetic verifier accepts few of the tiny model's random-weight answers, so every rate being 1 shows the
    function graded them."""
    output = tmp_path / "eval.json"
    (tmp_path / "accept.py").write_text("def every_response(response, ground_truth):\n    return 1.0\n")
    command = [
        sys.executable, "-m", "open_instruct.evaluate", tiny_model_dir, "tiny",
        "--samples", "2", "--response_length", "8", "--output_json", str(output),
        "--reward_function", "accept.py:every_response",
    ]  # fmt: skip
    process, _ = run_command(command, tmp_path, timeout_s=600)
    assert process.returncode == 0, process.stderr[-3000:]
    results = json.loads(output.read_text())["results"]
    assert [r["model"] for r in results] == [tiny_model_dir, "tiny"]
    for result in results:
        # The embedded task: 61 train and 20 test questions, all 81 one-digit additions together.
        assert (result["greedy_train_responses"], result["greedy_test_responses"], result["greedy_all_responses"]) == (61, 20, 81)
        assert result["sampled_all_responses"] == 2 * 81
        assert all(result[f"{mode}_{split}"] == 1.0 for mode in ("greedy", "sampled") for split in ("train", "test", "all"))
    assert "| model | greedy_train |" in process.stdout


ANSWER_AT_EVERY_LETTER = '''
import string

from open_instruct.environments import tools

from tests.support.trainer_runs import run_command


class AnswerAtEveryLetter(tools.Environment):
    """The tiny model never writes a real call: a turn ends at every printable character, answered with a marker."""

    end_strings = tuple(string.printable)

    def step(self, text):
        return " [tool said 7] ", 0.0, False
'''


@pytest.mark.e2e
def test_evaluate_with_tools_answers_the_calls_and_grades_the_text_with_their_outputs(tiny_model_dir, tmp_path):
    """`--tools`: the fresh engine answers each call as training does, the grader reads the outputs (a reward function
    that accepts only a response holding the tool's marker gives 1) and the tool-call rate is reported."""
    output = tmp_path / "eval.json"
    (tmp_path / "answer.py").write_text(ANSWER_AT_EVERY_LETTER)
    (tmp_path / "marked.py").write_text("def has_output(response, ground_truth):\n"
                                        "    return float('[tool said 7]' in response)\n")  # fmt: skip
    command = [
        sys.executable, "-m", "open_instruct.evaluate", tiny_model_dir, "--samples", "2", "--response_length", "12",
        "--tools", "answer.py:AnswerAtEveryLetter", "--max_tool_calls", "2", "--output_json", str(output),
        "--reward_function", "marked.py:has_output",
    ]  # fmt: skip
    process, _ = run_command(command, tmp_path, timeout_s=600)
    assert process.returncode == 0, process.stderr[-3000:]
    result = json.loads(output.read_text())["results"][0]
    assert (result["greedy_test_responses"], result["sampled_test_responses"]) == (20, 40)
    for mode in ("greedy", "sampled"):
        for split in ("train", "test"):  # only a response that called the tool holds its marker (unless the response
            # budget cut the marker short)
            assert result[f"{mode}_{split}"] <= result[f"{mode}_{split}_tool_calls"]
    # Sampled at temperature 1, the random model writes text at once: nearly every response calls and is graded right.
    assert result["sampled_test"] > 0.5 and result["sampled_train"] > 0.5
    assert "greedy_test_tool_calls" in process.stdout


@pytest.mark.e2e
def test_evaluate_resets_each_environment_with_its_row_routed_by_its_column(tiny_model_dir, tmp_path):
    """--environment_column: the test rows name TaskFromRow, which answers a turn with its row's own `label` column
    (here the row's ground truth, each row's different) and ends the sample; the train rows name none and get the
    calculator, which the tiny model never calls. A reward function accepting a response that holds `<ground_truth>`
    passes only responses whose environment read their own row."""
    from tests.support.trainer_runs import TESTS_DIR

    task = f"{TESTS_DIR / 'support' / 'tool_environments.py'}:TaskFromRow"

    def rows(split: str, env: str | None) -> str:
        path = tmp_path / f"{split}.jsonl"
        path.write_text("".join(json.dumps({
            "messages": [{"role": "user", "content": f"Say something {i}."}], "ground_truth": f"{split}{i}",
            "dataset": "arithmetic", "label": f"{split}{i}", "turn_reward": 0.0, "max_turns": 1,
            **({"env": env} if env else {})}) + "\n" for i in range(6)))  # fmt: skip
        return str(path)

    output = tmp_path / "eval.json"
    (tmp_path / "labelled.py").write_text("def own_label(response, ground_truth):\n"
                                          "    return float(f'<{ground_truth}>' in response)\n")  # fmt: skip
    command = [
        sys.executable, "-m", "open_instruct.evaluate", tiny_model_dir, "--samples", "2", "--response_length", "12",
        "--dataset_mixer_list", rows("train", None), "1.0", "--dataset_mixer_eval_list", rows("test", task), "1.0",
        "--tools", task, "calculator", "--environment_column", "env", "--max_tool_calls", "2",
        "--reward_function", "labelled.py:own_label", "--output_json", str(output),
    ]  # fmt: skip
    process, _ = run_command(command, tmp_path, timeout_s=600)
    assert process.returncode == 0, process.stderr[-3000:]
    result = json.loads(output.read_text())["results"][0]
    assert (result["greedy_test_responses"], result["sampled_test_responses"]) == (6, 12)
    assert result["greedy_train"] == result["sampled_train"] == 0.0
    assert result["sampled_test"] > 0.5 and result["sampled_test"] <= result["sampled_test_tool_calls"]


@pytest.mark.parametrize("flags, complaint", [
    (["/no/such/model", "--tools", "calculater"], "--tools calculater: unknown"),
    (["/no/such/model", "--tools", "calculator", "--max_tool_calls", "0"], "--max_tool_calls 0 is not valid"),
    (["output/no_such_run/model"], "MODEL output/no_such_run/model is not a folder; give a saved model folder (a run's "
     "OUTPUT_DIR/model), a hub id"),
    (["tiny", "no_such_model"], "MODEL no_such_model is not a folder"),  # every model, before the first one's engine
    (["tiny", "--environment_column", "env"], "--environment_column 'env' shapes tool calls, and --tools is not set"),
    (["no-such-owner/no-such-model"], "MODEL no-such-owner/no-such-model (revision main) is no local folder, nor in the "
     "HF cache, and HF_HUB_OFFLINE is set; run `hf download no-such-owner/no-such-model"),
    (["tiny", "--dataset_mixer_list", "no_such_file.jsonl", "1.0"], "Dataset path no_such_file.jsonl does not exist"),
])  # fmt: skip
def test_evaluate_refuses_bad_input_in_one_line_before_any_model_loads(flags, complaint, capsys):
    """As the trainers: a bad flag, a model that is not there (a folder, a hub id offline) or missing data is one line
    `error: ...` and exit code 2, before any engine starts (no traceback: it ends a 20-line one)."""
    from open_instruct.evaluate import main

    with pytest.raises(SystemExit) as exit_:
        main(flags)
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and complaint in error and "\n" not in error


def test_evaluate_refuses_a_row_naming_no_tools_entry_before_any_model_loads(tmp_path, capsys):
    from open_instruct.evaluate import main

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "What is 1 + 1?"}], "ground_truth": "2",
                                "dataset": "arithmetic", "env": "maze"}) + "\n")  # fmt: skip
    with pytest.raises(SystemExit) as exit_:
        main(["tiny", "--tools", "calculator", "--environment_column", "env", "--dataset_mixer_list", str(data), "1.0",
              "--dataset_cache_dir", str(tmp_path / "cache")])  # fmt: skip
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and "\n" not in error
    assert "row 0: column `env` (--environment_column) names 'maze', which is not one of --tools calculator" in error
