"""The embedded mixed-length workload (data/word_problems.py): deterministic, GSM8K-schema rows the loader reads, worked
answers whose every step is right and that the verifier accepts, and a wide spread of lengths."""

import re
import statistics

import pyarrow.parquet as pq

from open_instruct.data.sources import normalise_row, read_raw_rows
from open_instruct.data.word_problems import MAX_STEPS, make_word_problem_rows, write_word_problem_dataset
from open_instruct.rewards.verifiers import VERIFIERS, resolve_verifier_name
from open_instruct.run.args import parse_args

STEP_PATTERN = re.compile(r"(\d+) ([-+*/]) (\d+) = (\d+)\.$")
OPERATIONS = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__, "/": int.__floordiv__}


def test_same_seed_same_rows_other_seed_other_rows_and_no_question_twice():
    rows = make_word_problem_rows(seed=5, num_train=300, num_test=40)
    assert rows == make_word_problem_rows(seed=5, num_train=300, num_test=40)
    assert rows["train"][:20] != make_word_problem_rows(seed=6, num_train=20, num_test=1)["train"]
    questions = [row["messages"][0]["content"] for split in ("train", "test") for row in rows[split]]
    assert len(questions) == 340 and len(set(questions)) == 340, "a question appears twice (or in both splits)"


def test_every_worked_step_is_right_and_the_verifier_accepts_the_worked_answer():
    for row in make_word_problem_rows(seed=0)["train"]:
        user, assistant = row["messages"]
        assert (user["role"], assistant["role"], row["dataset"]) == ("user", "assistant", "gsm8k")
        lines = assistant["content"].split("\n")
        count = int(re.search(r"starts with (\d+)", lines[0]).group(1))
        for line in lines[1:-1]:  # each step starts from the count the previous one ended with
            a, op, b, result = STEP_PATTERN.search(line).groups()
            assert int(a) == count and OPERATIONS[op](int(a), int(b)) == int(result) >= 0, line
            assert op != "/" or int(a) % int(b) == 0, line  # equal shares only of what divides
            count = int(result)
        assert lines[-1] == f"The final answer is {count}." and row["ground_truth"] == str(count)
        verifier = VERIFIERS[resolve_verifier_name(row["dataset"])]
        assert verifier(assistant["content"], row["ground_truth"]) == 1.0
        assert verifier(assistant["content"].replace(lines[-1], "The final answer is 0."), row["ground_truth"]) == 0.0


def test_worked_answers_spread_from_a_sentence_to_hundreds_of_tokens():
    rows = make_word_problem_rows(seed=0)["train"]
    steps = [len(row["messages"][1]["content"].split("\n")) - 2 for row in rows]
    assert min(steps) == 1 and max(steps) == MAX_STEPS
    # Most problems are short, a few long (log-uniform steps), as GSM8K/MATH answers are.
    assert statistics.median(steps) <= 6 and sum(s >= 15 for s in steps) >= 50
    words = [len(row["messages"][1]["content"].split()) for row in rows]
    assert min(words) < 25 and max(words) > 150  # SmolLM2's tokenizer: 31 to ~480 tokens (docs/data.md)


def test_the_trainer_reads_it_by_name_as_prompts_without_the_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("OPEN_INSTRUCT_CACHE", str(tmp_path))
    args = parse_args(["--dataset_mixer_list", "embedded_word_problems", "1.0",
                       "--dataset_mixer_eval_list", "embedded_word_problems", "16"])  # fmt: skip
    folder = args.data.dataset_mixer_list[0]
    assert folder.startswith(str(tmp_path)) and args.data.dataset_mixer_eval_list == [folder, "16"]
    assert pq.read_table(f"{folder}/test.parquet").to_pylist() == make_word_problem_rows()["test"]
    row = normalise_row(read_raw_rows(folder, "train", max_rows=1)[0], "row 0", folder)
    assert [m["role"] for m in row["messages"]] == ["user"] and row["dataset"] == "gsm8k"


def test_parquet_round_trip(tmp_path):
    paths = write_word_problem_dataset(str(tmp_path), seed=2)
    rows = make_word_problem_rows(seed=2)
    for split, path in paths.items():
        assert pq.read_table(path).to_pylist() == rows[split]
