import pyarrow.parquet as pq
import pytest

from open_instruct.data.arithmetic_task import all_questions, make_arithmetic_rows, write_arithmetic_dataset


def question_of(row: dict) -> str:
    return row["messages"][0]["content"]


def test_one_digit_addition_partitions_all_81_questions():
    rows = make_arithmetic_rows(seed=0, digits=1, operations=("+",))
    train, test = {question_of(r) for r in rows["train"]}, {question_of(r) for r in rows["test"]}
    assert len(rows["train"]) + len(rows["test"]) == 81
    assert len(train | test) == 81, "a question appears twice"
    assert not train & test, "train and test share a question"


@pytest.mark.parametrize("digits,operations", [(1, ("+", "-", "*")), (2, ("+",))])
def test_splits_are_disjoint_and_answers_exact(digits, operations):
    rows = make_arithmetic_rows(seed=3, digits=digits, operations=operations)
    assert not {question_of(r) for r in rows["train"]} & {question_of(r) for r in rows["test"]}
    for row in rows["train"][:200] + rows["test"]:
        a, op, b = question_of(row).removeprefix("What is ").split("?")[0].split(" ")
        assert int(row["ground_truth"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert row["dataset"] == "arithmetic"
        assert len(str(a)) == digits and len(str(b)) == digits


def test_same_seed_same_rows_other_seed_other_split():
    assert make_arithmetic_rows(seed=1) == make_arithmetic_rows(seed=1)
    assert make_arithmetic_rows(seed=1)["test"] != make_arithmetic_rows(seed=2)["test"]


def test_parquet_round_trip(tmp_path):
    paths = write_arithmetic_dataset(str(tmp_path), seed=0)
    rows = make_arithmetic_rows(seed=0)
    for split, path in paths.items():
        assert pq.read_table(path).to_pylist() == rows[split]


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="subset of"):
        all_questions(1, ("/",))
    with pytest.raises(ValueError, match="test_fraction"):
        make_arithmetic_rows(test_fraction=1.5)


def test_tool_task_splits_are_disjoint_four_digit_and_its_worked_example_is_what_the_engine_appends():
    """The tool-use demo's task (data/arithmetic_task.py): 4-digit questions the verifier grades exactly, no question in
    both splits, and a worked example whose call, output and wrapper are byte for byte what the calculator and the
    default --tool_output_wrapper give: a prompt that taught another format would teach the model a wrong protocol."""
    from open_instruct.data import arithmetic_task
    from open_instruct.environments.tools import DEFAULT_OUTPUT_WRAPPER, Calculator, ToolEnvironment
    from open_instruct.rewards.verifiers import arithmetic

    rows = arithmetic_task.make_tool_arithmetic_rows(seed=0)
    assert (len(rows["train"]), len(rows["test"])) == (1024, 64)
    questions = {split: {r["messages"][-1]["content"] for r in rows[split]} for split in rows}
    assert len(questions["train"]) == 1024 and not questions["train"] & questions["test"]
    for row in rows["train"][:100] + rows["test"]:
        a, op, b = row["messages"][-1]["content"].removeprefix("What is ").removesuffix("?").split()
        assert len(a) == len(b) == 4 and op in "+*"
        assert arithmetic(f"The answer is {int(a) + int(b) if op == '+' else int(a) * int(b)}.", row["ground_truth"])
    assert rows["test"][0]["messages"][:3] == arithmetic_task.tool_prompt_messages("")[:3]
    assert {op for row in rows["test"] for op in row["messages"][-1]["content"].split()} >= {"+", "*"}
    call, after = arithmetic_task.TOOL_EXAMPLE_ANSWER.split("</calculator>")
    observation, _, _ = ToolEnvironment([Calculator()], DEFAULT_OUTPUT_WRAPPER).step(call + "</calculator>")
    assert after.startswith(observation)
    assert arithmetic(arithmetic_task.TOOL_EXAMPLE_ANSWER, observation.removeprefix("<output>").split("<")[0])
    assert arithmetic_task.make_tool_arithmetic_rows(seed=0) == rows
