"""The embedded tool-use task (issue 34): 4-digit additions and multiplications that SmolLM2-135M-Instruct cannot do
in its head, with a prompt that teaches the calculator's protocol by one worked example.

Why this task: the embedded model gets one-digit additions mostly right, but not four-digit ones (nor any
multiplication of that size): with the calculator (rl/tools.py) each question is one copied expression away from its
answer, so a run with `--tools calculator` has a capability to learn that the model lacks alone.

Why this prompt (measured with scripts/benchmark/tool_call_probe.py, docs/tools.md "A CPU demo"): the protocol stated
in a system prompt, then one worked example as a previous chat turn (the user's question and the assistant's answer
holding a call, the calculator's output exactly as the engine wraps it, and the final sentence), then the question.
A few-shot turn is what a small instruct model copies best: stated in words alone, the model wrote a well-formed
call in only a few percent of its samples.

Rows follow the trainer's RLVR schema: `messages`, `ground_truth` (the exact integer), `dataset` ("arithmetic": the
last number of the response must equal it; a calculator output left as the last number counts). The train and test
splits never share a question.
"""

import random

from open_instruct.data.arithmetic_task import OPERATIONS, VERIFIER_NAME, operand_range, write_parquet_splits

DIGITS = 4
QUESTION_TEMPLATE = "What is {a} {op} {b}?"
SYSTEM_PROMPT = (
    "You can use a calculator. To compute something, write the expression between <calculator> and </calculator>; "
    "its result then appears between <output> and </output>. Finish with: The answer is <number>."
)
# The worked example's question is none of the task's: its operands have DIGITS digits but its output is written here.
EXAMPLE_QUESTION = QUESTION_TEMPLATE.format(a=4821, op="+", b=3907)
EXAMPLE_ANSWER = "<calculator>4821 + 3907</calculator><output>8728</output>\nThe answer is 8728."


def prompt_messages(question: str) -> list[dict]:
    """The protocol, the worked example as a previous turn, then `question`."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": EXAMPLE_QUESTION},
        {"role": "assistant", "content": EXAMPLE_ANSWER},
        {"role": "user", "content": question},
    ]


def question_to_row(a: int, op: str, b: int) -> dict:
    return {
        "messages": prompt_messages(QUESTION_TEMPLATE.format(a=a, op=op, b=b)),
        "ground_truth": str(OPERATIONS[op](a, b)),
        "dataset": VERIFIER_NAME,
    }


def make_tool_arithmetic_rows(
    seed: int = 0, operations: tuple[str, ...] = ("+", "*"), num_train: int = 1024, num_test: int = 64
) -> dict[str, list[dict]]:
    """`train` and `test` rows of distinct DIGITS-digit questions (none in both splits), deterministic for `seed`.
    There are 81 million questions per operation: they are drawn, not enumerated."""
    unknown = [op for op in operations if op not in OPERATIONS]
    if unknown or not operations:
        raise ValueError(f"operations={list(operations)} must be a non-empty subset of {list(OPERATIONS)}.")
    rng, operands = random.Random(seed), operand_range(DIGITS)
    questions: dict[tuple[int, str, int], None] = {}  # insertion-ordered set
    while len(questions) < num_train + num_test:
        questions[(rng.choice(operands), rng.choice(operations), rng.choice(operands))] = None
    drawn = list(questions)
    return {
        "train": [question_to_row(*q) for q in drawn[:num_train]],
        "test": [question_to_row(*q) for q in drawn[num_train:]],
    }


def write_tool_arithmetic_dataset(output_dir: str, seed: int = 0) -> dict[str, str]:
    """Write `{output_dir}/train.parquet` and `test.parquet` (each written to a temporary name, then renamed)."""
    return write_parquet_splits(output_dir, make_tool_arithmetic_rows(seed))
