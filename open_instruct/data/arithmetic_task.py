"""The embedded verifiable task: integer arithmetic word prompts with exact answers.

Why this task: it needs no download, its answers are checked by code (RLVR), and the embedded
SmolLM2-135M-Instruct gets one-digit addition right about 40% of the time when sampling at
temperature 1.0 (about 90% greedy), so reinforcement learning has room to improve it.

Rows follow the trainer's RLVR schema: `messages` (the user turn), `ground_truth` (the exact
integer as a string) and `dataset` (the verifier name, "arithmetic").

The train and test splits never share a question: the set of distinct questions is partitioned
first, then each split is filled from its own part. One-digit addition has only 81 questions
(1..9 + 1..9), so a split is a partition of them, not a sample with repeats.

The tool-use task (the second half of this module, `make_tool_arithmetic_rows`): 4-digit additions and
multiplications that the model cannot do in its head, with a prompt that teaches the calculator's protocol by one
worked example.
"""

import itertools
import os
import random

OPERATIONS = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}
PROMPT_TEMPLATE = "What is {a} {op} {b}? Give the final answer as a number at the end."
VERIFIER_NAME = "arithmetic"


def operand_range(digits: int) -> range:
    """Operands with exactly `digits` digits (one digit: 1..9; zero is left out as too easy)."""
    if digits < 1:
        raise ValueError(f"digits={digits} is not a number of digits; use 1 or more.")
    return range(1 if digits == 1 else 10 ** (digits - 1), 10**digits)


def all_questions(digits: int, operations: tuple[str, ...]) -> list[tuple[int, str, int]]:
    """Every distinct (a, op, b) with `digits`-digit operands, in a fixed order."""
    unknown = [op for op in operations if op not in OPERATIONS]
    if unknown or not operations:
        raise ValueError(f"operations={list(operations)} must be a non-empty subset of {list(OPERATIONS)}.")
    operands = operand_range(digits)
    return [(a, op, b) for op in operations for a, b in itertools.product(operands, operands)]


def question_to_row(a: int, op: str, b: int) -> dict:
    return {
        "messages": [{"role": "user", "content": PROMPT_TEMPLATE.format(a=a, op=op, b=b)}],
        "ground_truth": str(OPERATIONS[op](a, b)),
        "dataset": VERIFIER_NAME,
    }


def make_arithmetic_rows(
    seed: int = 0,
    digits: int = 1,
    operations: tuple[str, ...] = ("+",),
    test_fraction: float = 0.25,
    max_test_rows: int = 256,
) -> dict[str, list[dict]]:
    """Partition the distinct questions into `train` and `test` rows, deterministically for `seed`.

    The test split holds `test_fraction` of the questions, capped at `max_test_rows` so that an
    eval stays cheap for two-digit tasks (8100 questions per operation).
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction={test_fraction} must lie strictly between 0 and 1.")
    questions = all_questions(digits, tuple(operations))
    random.Random(seed).shuffle(questions)
    num_test = max(1, min(max_test_rows, round(len(questions) * test_fraction)))
    test_questions, train_questions = questions[:num_test], questions[num_test:]
    return {
        "train": [question_to_row(*q) for q in train_questions],
        "test": [question_to_row(*q) for q in test_questions],
    }


def write_arithmetic_dataset(
    output_dir: str,
    seed: int = 0,
    digits: int = 1,
    operations: tuple[str, ...] = ("+",),
    test_fraction: float = 0.25,
) -> dict[str, str]:
    """Write `{output_dir}/train.parquet` and `test.parquet`; return split name -> path.

    Files are written to a temporary name and renamed, so a reader never sees half a file.
    """
    return write_parquet_splits(output_dir, make_arithmetic_rows(seed, digits, operations, test_fraction))


def write_parquet_splits(output_dir: str, rows_by_split: dict[str, list[dict]]) -> dict[str, str]:
    """`{output_dir}/{split}.parquet` for each split, each written to a temporary name and renamed (a reader never
    sees half a file); returns split name -> path. The embedded synthetic tasks' (this one, word_problems) writer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    os.makedirs(output_dir, exist_ok=True)
    paths = {}
    for split, rows in rows_by_split.items():
        path = os.path.join(output_dir, f"{split}.parquet")
        tmp_path = f"{path}.tmp-{os.getpid()}"
        pq.write_table(pa.Table.from_pylist(rows), tmp_path)
        os.replace(tmp_path, path)
        paths[split] = path
    return paths


# ---------------------------------------------------------------- the tool-use task
# 4-digit additions and multiplications that SmolLM2-135M-Instruct cannot do in its head, with a prompt that teaches
# the calculator's protocol by one worked example. A dataset mixer names it `embedded_tool_arithmetic`.
#
# Why this task: the embedded model gets one-digit additions mostly right, but not four-digit ones (nor any
# multiplication of that size): with the calculator (environments/tools.py) each question is one copied expression away from its
# answer, so a run with `--tools calculator` has a capability to learn that the model lacks alone.
#
# Why this prompt (measured with scripts/benchmark/tool_call_probe.py, docs/tools.md "A CPU demo"): the protocol stated
# in a system prompt, then one worked example as a previous chat turn (the user's question and the assistant's answer
# holding a call, the calculator's output exactly as the engine wraps it, and the final sentence), then the question.
# A few-shot turn is what a small instruct model copies best: stated in words alone (with or without the example inline),
# the model wrote no well-formed call in 128 samples; with the example as a previous turn, in about a third.
#
# Rows follow the trainer's RLVR schema: `messages`, `ground_truth` (the exact integer), `dataset` ("arithmetic": the
# last number of the response must equal it; a calculator output left as the last number counts). The train and test
# splits never share a question.

TOOL_DIGITS = 4
TOOL_QUESTION_TEMPLATE = "What is {a} {op} {b}?"
TOOL_SYSTEM_PROMPT = (
    "You can use a calculator. To compute something, write the expression between <calculator> and </calculator>; "
    "its result then appears between <output> and </output>. Finish with: The answer is <number>."
)
# The worked example: its output is written as the calculator and the default --tool_output_wrapper give it.
TOOL_EXAMPLE_QUESTION = TOOL_QUESTION_TEMPLATE.format(a=4821, op="+", b=3907)
TOOL_EXAMPLE_ANSWER = "<calculator>4821 + 3907</calculator><output>8728</output>\nThe answer is 8728."


def tool_prompt_messages(question: str) -> list[dict]:
    """The protocol, the worked example as a previous turn, then `question`."""
    return [
        {"role": "system", "content": TOOL_SYSTEM_PROMPT},
        {"role": "user", "content": TOOL_EXAMPLE_QUESTION},
        {"role": "assistant", "content": TOOL_EXAMPLE_ANSWER},
        {"role": "user", "content": question},
    ]


def tool_question_to_row(a: int, op: str, b: int) -> dict:
    return {
        "messages": tool_prompt_messages(TOOL_QUESTION_TEMPLATE.format(a=a, op=op, b=b)),
        "ground_truth": str(OPERATIONS[op](a, b)),
        "dataset": VERIFIER_NAME,
    }


def make_tool_arithmetic_rows(
    seed: int = 0, operations: tuple[str, ...] = ("+", "*"), num_train: int = 1024, num_test: int = 64
) -> dict[str, list[dict]]:
    """`train` and `test` rows of distinct TOOL_DIGITS-digit questions (none in both splits), deterministic for `seed`.
    There are 81 million questions per operation: they are drawn, not enumerated."""
    unknown = [op for op in operations if op not in OPERATIONS]
    if unknown or not operations:
        raise ValueError(f"operations={list(operations)} must be a non-empty subset of {list(OPERATIONS)}.")
    rng, operands = random.Random(seed), operand_range(TOOL_DIGITS)
    questions: dict[tuple[int, str, int], None] = {}  # insertion-ordered set
    while len(questions) < num_train + num_test:
        questions[(rng.choice(operands), rng.choice(operations), rng.choice(operands))] = None
    drawn = list(questions)
    return {
        "train": [tool_question_to_row(*q) for q in drawn[:num_train]],
        "test": [tool_question_to_row(*q) for q in drawn[num_train:]],
    }


def write_tool_arithmetic_dataset(output_dir: str, seed: int = 0) -> dict[str, str]:
    """Write `{output_dir}/train.parquet` and `test.parquet` (each written to a temporary name, then renamed)."""
    return write_parquet_splits(output_dir, make_tool_arithmetic_rows(seed))
