"""The embedded native tool-use task (docs/tools.md "A native tool-call demo"): who manages a person's manager, in an
org chart the model can only read through a tool. A dataset mixer names it `embedded_org_chart`.

Each row holds its own random org chart: six people drawn from NAMES, each managed by the next one in a random order
(the last one manages the others and has no manager), written to the row's `managers` column as JSON. The question
names one person and asks for the manager of their manager: the answer is two `manager_of` calls away (the second
call's argument is the first call's result), and no two rows share a chart, so nothing about a chart can be learned
by heart. The `org_chart` environment (environments/tools.py `OrgChart`) answers the calls from the row's chart.

The grader is `string_match` on the model's own final answer ("The answer is <name>."): a tool's result never holds
that phrase, so copying a result without answering scores 0, and answering the first call's result (the manager, not
the manager's manager) scores 0 too.

Splits: `train` (1024 questions two levels up, for RL), `test` (64 held-out questions two levels up) and `warmup`
(256 questions, one or two levels up in turn). Every row carries `demonstration`: the whole right conversation (one
call per level, the results, the answer) as JSON chat messages; `python -m open_instruct.sft_warmup --split warmup`
trains on the warmup split's to teach the call format first (SmolLM2-135M-Instruct makes no native call at all before
it). Each split is drawn from its own generator; a chart of six of 32 names in one of 6! orders is practically never
drawn twice, and the test split is checked to share no (chart, question) with the other two.
"""

import json
import random

from open_instruct.data.arithmetic_task import write_parquet_splits

# 32 common first names.
NAMES = ("Anna", "Ben", "Carl", "Dana", "Emma", "Frank", "Grace", "Henry", "Ivan", "Jack", "Kate", "Leo", "Mark",
         "Nina", "Oscar", "Paul", "Rose", "Sam", "Tom", "Vera", "Will", "Zoe", "Adam", "Bob", "Chris", "David", "Eric",
         "Fred", "George", "Jane", "Lisa", "Mary")  # fmt: skip
PEOPLE_PER_CHART = 6
FUNCTION_NAME = "manager_of"
VERIFIER_NAME = "string_match"
SYSTEM_PROMPT = "Look people up with the tool. Finish with: The answer is <name>."
QUESTIONS = {1: "Who is {person}'s manager?", 2: "Who is the manager of {person}'s manager?"}  # by the calls needed


def manager_answer(managers: dict[str, str], person: str) -> str:
    """What `manager_of(person)` answers in this chart: the `org_chart` environment's tool result, and the
    demonstrations' (the task defines the answer; environments/tools.py `OrgChart` serves it)."""
    if person in managers:
        return managers[person]
    if person in managers.values():
        return f"{person} has no manager."
    return f"Error: no one named {person!r} is in the org chart."


def draw_chart(rng: random.Random) -> dict[str, str]:
    """person -> manager for six people in a random order, each managed by the next; the last has no entry."""
    people = rng.sample(NAMES, PEOPLE_PER_CHART)
    return {person: manager for person, manager in zip(people, people[1:])}


def prompt_messages(person: str, hops: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": QUESTIONS[hops].format(person=person)}]  # fmt: skip


def call_message(person: str) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": FUNCTION_NAME, "arguments": {"person": person}}}]}  # fmt: skip


def demonstration(managers: dict[str, str], person: str, hops: int) -> list[dict]:
    """The right conversation for a question: the prompt, one call per level and its result, the answer."""
    messages, asked = prompt_messages(person, hops), person
    for _ in range(hops):
        messages += [call_message(asked),
                     {"role": "tool", "name": FUNCTION_NAME, "content": manager_answer(managers, asked)}]  # fmt: skip
        asked = managers[asked]
    return [*messages, {"role": "assistant", "content": f"The answer is {asked}."}]


def question_row(rng: random.Random, hops: int) -> dict:
    """A new chart and a question about it `hops` levels up (the person asked about has that many managers above)."""
    managers = draw_chart(rng)
    people = list(managers)[: len(managers) + 1 - hops]  # the chain's order: each is managed by the next
    person = rng.choice(people)
    answer = person
    for _ in range(hops):
        answer = managers[answer]
    return {
        "messages": prompt_messages(person, hops),
        "ground_truth": answer,
        "dataset": VERIFIER_NAME,
        "managers": json.dumps(managers),
        "demonstration": json.dumps(demonstration(managers, person, hops)),
        "hops": hops,
    }


def make_org_chart_rows(seed: int = 0, num_train: int = 1024, num_test: int = 64,
                        num_warmup: int = 256) -> dict[str, list[dict]]:  # fmt: skip
    """`train` and `test` rows (questions two levels up) and `warmup` rows (one or two levels up, alternating: the
    warm-up's demonstrations), deterministic for `seed`; each split from its own generator, and no test row shares
    its (chart, question) with a train or warmup row."""
    train = [question_row(random.Random(f"org-chart-train-{seed}-{i}"), hops=2) for i in range(num_train)]
    warmup = [question_row(random.Random(f"org-chart-warmup-{seed}-{i}"), hops=1 + i % 2) for i in range(num_warmup)]
    seen = {(row["managers"], row["messages"][-1]["content"]) for row in train + warmup}
    test, i = [], 0
    while len(test) < num_test:
        row = question_row(random.Random(f"org-chart-test-{seed}-{i}"), hops=2)
        i += 1
        if (row["managers"], row["messages"][-1]["content"]) not in seen:
            test.append(row)
    return {"train": train, "test": test, "warmup": warmup}


def write_org_chart_dataset(output_dir: str, seed: int = 0) -> dict[str, str]:
    """Write `{output_dir}/train.parquet` and `test.parquet` (each written to a temporary name, then renamed)."""
    return write_parquet_splits(output_dir, make_org_chart_rows(seed))
