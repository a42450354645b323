"""The embedded mixed-length task: multi-step word problems in the GSM8K row schema, generated (the hub cannot be
reached here), whose worked answers run from a sentence to several hundred tokens.

Why it exists: on the arithmetic task every prompt has about the same length and every answer is a few
tokens, so padding costs the learner nothing. Real RLVR data (GSM8K, MATH) is not like that: answers run from a few
dozen tokens to the length limit, and a batch padded to its longest row wastes most of its slots. This task gives
the learner that length distribution, offline and deterministically.

A problem follows one person's count of one kind of item through 1 to MAX_STEPS (20) operations (buy, find, give away,
lose, multiply, share equally); the number of steps is drawn log-uniformly, so most problems are short and a few are
long, as in real data. Rows: `messages` (the user's question, then the worked answer as an assistant turn, which
the prompt loader drops: it is the answer), `ground_truth` (the final count) and `dataset` ("gsm8k": the last
number of a response must equal it). Every worked answer ends with its ground truth, so the verifier accepts it.
The train and test splits never share a question.
"""

import math
import random

VERIFIER_NAME = "gsm8k"
MAX_STEPS = 20
MAX_COUNT = 5000  # counts stay below this: numbers a small model can still add
NAMES = ("Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kemi", "Liam", "Mei",
         "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara")  # fmt: skip
ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils", "stamps", "shells", "cards", "beads")
SHORT_INSTRUCTION = "Give the final answer as a number at the end."
STEP_BY_STEP_INSTRUCTION = "Solve it step by step, then give the final answer as a number at the end."


def next_operation(rng: random.Random, name: str, item: str, count: int) -> tuple[str, str, int]:
    """One step on `count`: (the sentence of the question, the line of the worked answer, the new count)."""
    choices = ["buy", "find"]
    if count > 1:
        choices += ["give", "lose"]
    if count * 2 < MAX_COUNT:
        choices.append("times")
    divisors = [k for k in (2, 3, 4, 5) if count % k == 0 and count > k]
    if divisors:
        choices.append("share")
    kind = rng.choice(choices)
    if kind in ("buy", "find"):
        n = rng.randint(1, min(60, MAX_COUNT - count - 1) if count < MAX_COUNT - 2 else 1)
        new = count + n
        if kind == "buy":
            return f"{name} buys {n} more {item}.", f"{name} buys {n} more: {count} + {n} = {new}.", new
        return (f"Then {name} finds {n} {item} in a drawer.",
                f"Finding {n} in the drawer: {count} + {n} = {new}.", new)  # fmt: skip
    if kind in ("give", "lose"):
        n = rng.randint(1, min(40, count - 1))
        new = count - n
        if kind == "give":
            return (f"{name} gives {n} {item} to a neighbour.",
                    f"After giving {n} to the neighbour: {count} - {n} = {new}.", new)  # fmt: skip
        return f"On the way home {name} loses {n} {item}.", f"Losing {n}: {count} - {n} = {new}.", new
    if kind == "times":
        k = rng.choice([k for k in (2, 3, 4) if count * k < MAX_COUNT])
        new = count * k
        return (f"By the end of the week {name} has {k} times as many {item} as before.",
                f"{k} times as many as before: {count} * {k} = {new}.", new)  # fmt: skip
    k = rng.choice(divisors)
    new = count // k
    return (f"{name} shares the {item} equally among {k} friends, {name} included, and keeps one share.",
            f"One of {k} equal shares: {count} / {k} = {new}.", new)  # fmt: skip


def make_problem(rng: random.Random) -> dict:
    """One word problem as a row: `messages` (question, worked answer), `ground_truth`, `dataset`."""
    num_steps = min(MAX_STEPS, int(math.exp(rng.uniform(0.0, math.log(MAX_STEPS + 1)))))  # log-uniform in 1..MAX_STEPS
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    count = rng.randint(2, 40)
    question = [f"{name} has {count} {item}."]
    worked = [f"{name} starts with {count} {item}."]
    for _ in range(num_steps):
        sentence, line, count = next_operation(rng, name, item, count)
        question.append(sentence)
        worked.append(line)
    instruction = SHORT_INSTRUCTION if num_steps <= 2 else STEP_BY_STEP_INSTRUCTION
    question.append(f"How many {item} does {name} have now? {instruction}")
    worked.append(f"The final answer is {count}.")
    return {
        "messages": [
            {"role": "user", "content": " ".join(question)},
            {"role": "assistant", "content": "\n".join(worked)},
        ],
        "ground_truth": str(count),
        "dataset": VERIFIER_NAME,
    }


def make_word_problem_rows(seed: int = 0, num_train: int = 1024, num_test: int = 64) -> dict[str, list[dict]]:
    """`train` and `test` rows, deterministic for `seed`; no question appears twice (so none is in both splits)."""
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < num_train + num_test:
        row = make_problem(rng)
        question = row["messages"][0]["content"]
        if question not in seen:
            seen.add(question)
            rows.append(row)
    return {"train": rows[:num_train], "test": rows[num_train:]}


def write_word_problem_dataset(output_dir: str, seed: int = 0) -> dict[str, str]:
    """Write `{output_dir}/train.parquet` and `test.parquet` (each written to a temporary name, then renamed)."""
    from open_instruct.data.arithmetic_task import write_parquet_splits

    return write_parquet_splits(output_dir, make_word_problem_rows(seed))
