"""Tests for scripts/data_preprocess: local copies with the hub datasets' real column layout, converted and
read back through the trainer's loader."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from open_instruct.data.prompt_dataset import load_prompt_dataset
from scripts.data_preprocess import arithmetic, full_hh_rlhf, gsm8k, hellaswag, tulu3_rlvr
from scripts.data_preprocess import math as math_converter
from scripts.data_preprocess.common import last_boxed_content

REPO_ROOT = Path(__file__).resolve().parents[1]


def write_parquet(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def load_split(output_dir: Path, split: str) -> list[dict]:
    """A converted split as the trainer reads it: shuffled, so equal files give equal lists."""
    path = output_dir / f"{split}.parquet"
    return load_prompt_dataset([str(path), "1.0"], [split], seed=0).remove_columns("source").to_list()


def by_prompt(rows: list[dict]) -> dict[str, dict]:
    return {row["messages"][-1]["content"]: row for row in rows}


GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 friends in April, and half as many in May. How many in all?",
        "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72.\n#### 72",
    },
    {"question": "A farm has 1,000 hens and 72 ducks. How many birds?", "answer": "1000+72=1072\n#### 1,072"},
    {"question": "A row with no final answer.", "answer": "It is unclear."},
]


def test_gsm8k_from_a_folder_with_split_files(tmp_path):
    write_parquet(tmp_path / "gsm8k" / "main" / "train-00000-of-00001.parquet", GSM8K_ROWS)
    write_jsonl(tmp_path / "gsm8k" / "main" / "test-00000-of-00001.jsonl", GSM8K_ROWS[:1])
    written = gsm8k.main(["--input", str(tmp_path / "gsm8k"), "--output_dir", str(tmp_path / "out")])
    assert sorted(written) == ["test", "train"]
    train = by_prompt(load_split(tmp_path / "out", "train"))
    assert len(train) == 2  # the row without "####" is skipped
    assert train[GSM8K_ROWS[0]["question"]] == {
        "messages": [{"role": "user", "content": GSM8K_ROWS[0]["question"]}],
        "ground_truth": "72",
        "dataset": "gsm8k",
    }
    assert train[GSM8K_ROWS[1]["question"]]["ground_truth"] == "1072"
    assert len(load_split(tmp_path / "out", "test")) == 1


def test_verl_format_reads_back_as_the_same_rows(tmp_path):
    write_parquet(tmp_path / "train.parquet", GSM8K_ROWS)
    common_args = ["--input", str(tmp_path / "train.parquet"), "--splits", "train"]
    gsm8k.main([*common_args, "--output_dir", str(tmp_path / "rlvr")])
    gsm8k.main([*common_args, "--output_dir", str(tmp_path / "verl"), "--format", "verl"])
    verl_file = pq.read_table(tmp_path / "verl" / "train.parquet")
    assert verl_file.column_names == ["prompt", "data_source", "reward_model", "extra_info"]
    assert verl_file.to_pylist()[0]["reward_model"] == {"ground_truth": "72", "style": "rule"}
    assert load_split(tmp_path / "verl", "train") == load_split(tmp_path / "rlvr", "train")


def test_single_file_input_needs_one_split_and_max_rows_limits(tmp_path):
    write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    with pytest.raises(ValueError, match=r"is a single file, so it holds one split, but --splits asks for"):
        gsm8k.main(["--input", str(tmp_path / "gsm8k.jsonl"), "--output_dir", str(tmp_path / "out")])
    one_split = ["--input", str(tmp_path / "gsm8k.jsonl"), "--splits", "train", "--output_dir", str(tmp_path)]
    gsm8k.main([*one_split, "--max_rows", "1"])
    assert len(load_split(tmp_path, "train")) == 1


def test_wrong_column_layout_names_the_missing_fields(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"problem": "1+1", "solution": "2"}])
    with pytest.raises(ValueError, match=r"gsm8k row lacks the field\(s\) \['question', 'answer'\]"):
        gsm8k.main(["--input", str(tmp_path / "train.jsonl"), "--splits", "train", "--output_dir", str(tmp_path)])


# Rows in the layout of allenai/RLVR-GSM-MATH-IF-Mixed-Constraints (written here; the hub is offline in the tests).
TULU3_RLVR_ROWS = [
    {"messages": [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many?"}], "ground_truth": "7",
     "dataset": "gsm8k", "constraint_type": None, "constraint": None},
    {"messages": [{"role": "user", "content": "Simplify $2x + 3x$."}], "ground_truth": "5x", "dataset": "MATH",
     "constraint_type": None, "constraint": None},
    {"messages": [{"role": "user", "content": "Name a river. Do not use commas."}],
     "ground_truth": json.dumps({"func_name": "validate_no_commas", "N": None, "keyword_list": None}),
     "dataset": "ifeval", "constraint_type": "No Commas", "constraint": "Do not use commas."},
]  # fmt: skip


def test_tulu3_rlvr_keeps_the_hub_rows_as_they_are(tmp_path):
    write_parquet(tmp_path / "train.parquet", TULU3_RLVR_ROWS)
    tulu3_rlvr.main(["--input", str(tmp_path / "train.parquet"), "--output_dir", str(tmp_path / "out")])
    rows = by_prompt(load_split(tmp_path / "out", "train"))
    assert rows == {
        raw["messages"][0]["content"]: {key: raw[key] for key in ("messages", "ground_truth", "dataset")}
        for raw in TULU3_RLVR_ROWS
    }


def test_tulu3_rlvr_refuses_an_if_row_the_verifier_cannot_grade(tmp_path):
    bad_row = {**TULU3_RLVR_ROWS[2], "ground_truth": json.dumps({"func_name": "validate_word_constraint", "N": 5})}
    write_jsonl(tmp_path / "train.jsonl", [*TULU3_RLVR_ROWS, bad_row])
    with pytest.raises(ValueError, match="'validate_word_constraint' needs argument 'quantifier'"):
        tulu3_rlvr.main(["--input", str(tmp_path / "train.jsonl"), "--output_dir", str(tmp_path / "out")])


def test_math_takes_the_last_boxed_answer(tmp_path):
    rows = [
        {
            "problem": "Compute $\\frac{1}{2} + \\frac{1}{2}$.",
            "solution": "First $\\boxed{0}$ is wrong; the sum is $\\boxed{1}$.",
            "level": "Level 1",
            "type": "Prealgebra",
        },
        {
            "problem": "Simplify $\\frac{2}{4}$.",
            "solution": "Divide: $\\boxed{\\frac{1}{2}}$.",
            "level": "Level 2",
            "type": "Algebra",
        },
        {"problem": "No answer here.", "solution": "We stop.", "level": "Level 3", "type": "Geometry"},
    ]
    write_parquet(tmp_path / "math" / "data" / "train-00000-of-00001.parquet", rows)
    write_parquet(tmp_path / "math" / "data" / "test-00000-of-00001.parquet", rows[:1])
    math_converter.main(["--input", str(tmp_path / "math"), "--output_dir", str(tmp_path / "out")])
    train = by_prompt(load_split(tmp_path / "out", "train"))
    assert {prompt: row["ground_truth"] for prompt, row in train.items()} == {
        rows[0]["problem"]: "1",
        rows[1]["problem"]: "\\frac{1}{2}",
    }
    assert {row["dataset"] for row in train.values()} == {"math"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so $\\boxed{\\frac{a}{b^{2}}}$.", "\\frac{a}{b^{2}}"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\fbox{7}", "7"),
        ("is $\\boxed 5$.", "5"),
        ("no box", None),
        ("\\boxed{unbalanced", None),
    ],
)
def test_last_boxed_content(text, expected):
    assert last_boxed_content(text) == expected


HELLASWAG_ROW = {
    "ind": 4,
    "activity_label": "Removing ice from car",
    "ctx_a": "Then, the man writes over the snow covering the window of a car, and a woman wearing winter "
    "clothes smiles.",
    "ctx_b": "then",
    "ctx": "Then, the man writes over the snow covering the window of a car, and a woman wearing winter clothes "
    "smiles. then",
    "endings": [
        ", the man adds wax to the windshield and cuts it.",
        ", a person board a ski lift, while two men supporting the head of the person wearing winter clothes snow "
        "as the we girls sled.",
        ", the man puts on a christmas coat, knitted with netting.",
        ", the man continues removing the snow on his car.",
    ],
    "source_id": "activitynet~v_-1IBHYS3L-Y",
    "split": "train",
    "split_type": "indomain",
    "label": "3",
}


def test_hellaswag_lettered_choices(tmp_path):
    unlabelled = HELLASWAG_ROW | {"label": ""}
    write_jsonl(tmp_path / "hellaswag" / "validation.jsonl", [HELLASWAG_ROW, unlabelled])
    hellaswag.main(
        ["--input", str(tmp_path / "hellaswag"), "--splits", "validation", "--output_dir", str(tmp_path / "out")]
    )
    (row,) = load_split(tmp_path / "out", "validation")
    prompt = row["messages"][0]["content"]
    assert HELLASWAG_ROW["ctx"] in prompt
    assert "A. , the man adds wax" in prompt and "D. , the man continues removing the snow" in prompt
    assert row["ground_truth"] == "D" and row["dataset"] == "string_match"


def test_full_hh_rlhf_prompt_only(tmp_path):
    rows = [
        {
            "chosen": "\n\nHuman: What are some cuss words in english?\n\nAssistant: I'd rather not list those."
            "\n\nHuman: What's your favorite one?\n\nAssistant: I haven't even thought about it.",
            "rejected": "\n\nHuman: What are some cuss words in english?\n\nAssistant: I'd rather not list those."
            "\n\nHuman: What's your favorite one?\n\nAssistant: Ass.",
        },
        {"chosen": "no dialogue markers at all", "rejected": "none here either"},
    ]
    write_parquet(tmp_path / "hh" / "train.parquet", rows)
    write_parquet(tmp_path / "hh" / "test.parquet", rows[:1])
    full_hh_rlhf.main(["--input", str(tmp_path / "hh"), "--output_dir", str(tmp_path / "out")])
    (row,) = load_split(tmp_path / "out", "train")  # the malformed row is skipped
    assert row == {
        "messages": [
            {"role": "user", "content": "What are some cuss words in english?"},
            {"role": "assistant", "content": "I'd rather not list those."},
            {"role": "user", "content": "What's your favorite one?"},
        ],
        "ground_truth": None,
        "dataset": None,
    }


def test_arithmetic_in_both_formats(tmp_path):
    written = arithmetic.main(["--output_dir", str(tmp_path / "rlvr"), "--seed", "1"])
    assert sorted(written) == ["test", "train"]
    arithmetic.main(["--output_dir", str(tmp_path / "verl"), "--seed", "1", "--format", "verl"])
    train = load_split(tmp_path / "rlvr", "train")
    assert len(train) + len(load_split(tmp_path / "rlvr", "test")) == 81  # all one-digit additions
    assert {row["dataset"] for row in train} == {"arithmetic"}
    assert load_split(tmp_path / "verl", "train") == train


def test_converter_runs_as_a_module(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS[:1])
    command = [sys.executable, "-m", "scripts.data_preprocess.gsm8k", "--input", str(tmp_path / "train.jsonl")]
    command += ["--splits", "train", "--output_dir", str(tmp_path / "out")]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert "train: wrote 1 rows" in result.stdout
    assert load_split(tmp_path / "out", "train")[0]["ground_truth"] == "72"


@pytest.mark.parametrize("flags, complaint", [
    (["--input", "{tmp}/none.jsonl", "--splits", "train"], "error: Dataset path {tmp}/none.jsonl does not exist; check "
     f"the path (relative to {REPO_ROOT})."),
    (["--input", "{tmp}/other_layout.jsonl", "--splits", "train"], "error: A gsm8k row lacks the field(s) ['question', "
     "'answer'] (it has ['q']); --input must have the column layout of the hub dataset."),
    ([], "error: reading the hub dataset openai/gsm8k (split train) failed, HF_HUB_OFFLINE is set (ConnectionError: "
     "Couldn't reach 'openai/gsm8k' on the Hub (OfflineModeIsEnabled)); pass --input with a local copy (`hf download "
     "openai/gsm8k --repo-type dataset --local-dir DIR` where the Hub is reachable), or unset HF_HUB_OFFLINE."),
])  # fmt: skip
def test_a_converter_answers_bad_input_in_one_line(flags, complaint, tmp_path):
    """Run as a user runs it: a missing --input, rows of another layout, the hub dataset offline: one line on stderr
    and exit code 2, as the trainers answer (no traceback)."""
    write_jsonl(tmp_path / "other_layout.jsonl", [{"q": 1}])
    command = [sys.executable, "-m", "scripts.data_preprocess.gsm8k", "--output_dir", str(tmp_path / "out")]
    command += [flag.format(tmp=tmp_path) for flag in flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == complaint.format(tmp=tmp_path)


def test_without_input_the_hub_dataset_is_read(tmp_path, monkeypatch):
    import datasets

    from scripts.data_preprocess import common

    calls = []

    def fake_load_dataset(name, config, split):
        calls.append((name, config, split))
        return datasets.Dataset.from_list(GSM8K_ROWS)

    monkeypatch.setattr(common.datasets, "load_dataset", fake_load_dataset)
    gsm8k.main(["--output_dir", str(tmp_path), "--max_rows", "2"])
    assert calls == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
    assert len(load_split(tmp_path, "test")) == 2


CODE_ROWS = [
    {"prompt": "Solve the following coding problem using the programming language python:\nPrint a + b.",
     "verification_info": json.dumps({"language": "python", "test_cases": [
         {"type": "stdin_stdout", "input": "1 2\n", "output": "3\n", "fn_name": None},
         {"type": "stdin_stdout", "input": "5 5\n", "output": "10\n", "fn_name": None}]}),
     "source": "codeforces", "problem_id": "p1"},
    {"prompt": "Write max_score(points, k).",
     "verification_info": {"language": "python", "test_cases": [
         {"type": "function_call", "fn_name": "max_score", "input": [[1, 2, 3], 2], "output": [5]}]},
     "source": "leetcode", "problem_id": "p2"},
    {"prompt": "In C++: print a + b.", "verification_info": json.dumps({"language": "cpp", "test_cases": [
        {"type": "stdin_stdout", "input": "1 2\n", "output": "3\n"}]}), "source": "x", "problem_id": "p3"},
    {"prompt": "Mixed tests.", "verification_info": json.dumps({"language": "python", "test_cases": [
        {"type": "stdin_stdout", "input": "1\n", "output": "1\n"},
        {"type": "function_call", "fn_name": "f", "input": [1], "output": [1]}]}), "source": "x", "problem_id": "p4"},
    {"prompt": "No tests.", "verification_info": json.dumps({"language": "python", "test_cases": []}),
     "source": "x", "problem_id": "p5"},
]  # fmt: skip


def test_code_problems_to_verl_schema_and_back_through_the_loader(tmp_path):
    from open_instruct.rewards.code_tests import parse_tests
    from open_instruct.rewards.verifiers import resolve_verifier_name
    from scripts.data_preprocess import code_verl

    write_jsonl(tmp_path / "code.jsonl", CODE_ROWS)
    written = code_verl.main(["--input", str(tmp_path / "code.jsonl"), "--output_dir", str(tmp_path / "out")])
    assert pq.read_table(written["train"]).column_names == ["prompt", "data_source", "reward_model", "extra_info"]
    rows = by_prompt(load_split(tmp_path / "out", "train"))
    assert len(rows) == 2  # the C++ row, the mixed one and the one without tests are skipped
    stdio = rows[CODE_ROWS[0]["prompt"] + code_verl.ANSWER_FORMAT]
    assert json.loads(stdio["ground_truth"]) == {"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]}
    call = parse_tests(rows[CODE_ROWS[1]["prompt"] + code_verl.ANSWER_FORMAT]["ground_truth"])
    assert call.kind == "call" and [(test.fn_name, test.args, test.expected) for test in call.inputs] == [
        ("max_score", ([1, 2, 3], 2), [5])
    ]
    assert resolve_verifier_name(stdio["dataset"]) == "code"
