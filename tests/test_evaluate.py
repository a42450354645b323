"""`python -m open_instruct.evaluate`: a fresh engine per saved folder, greedy and sampled correct rates, a table."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e]


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
    process = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert process.returncode == 0, process.stderr[-3000:]
    results = json.loads(output.read_text())["results"]
    assert [r["model"] for r in results] == [tiny_model_dir, "tiny"]
    for result in results:
        # The embedded task: 61 train and 20 test questions, all 81 one-digit additions together.
        assert (result["greedy_train_responses"], result["greedy_test_responses"], result["greedy_all_responses"]) == (61, 20, 81)
        assert result["sampled_all_responses"] == 2 * 81
        assert all(result[f"{mode}_{split}"] == 1.0 for mode in ("greedy", "sampled") for split in ("train", "test", "all"))
    assert "| model | greedy_train |" in process.stdout
