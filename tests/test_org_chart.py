"""The native tool-call demo's parts (docs/tools.md "A native tool-call demo"): the org-chart task, its environment, and
the supervised warm-up (`python -m open_instruct.sft_warmup`) that teaches the call format before GRPO."""

import json
import sys

import pytest

from open_instruct.data.org_chart_task import QUESTIONS, make_org_chart_rows
from open_instruct.environments.tool_parsers import ToolCall
from open_instruct.environments.tools import OrgChart
from open_instruct.rewards.verifiers import VERIFIERS
from tests.support.trainer_runs import run_command

IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def rows():
    return make_org_chart_rows(seed=0, num_train=64, num_test=32, num_warmup=32)


def chain_answer(managers: dict, person: str, hops: int) -> str:
    for _ in range(hops):
        person = managers[person]
    return person


def test_each_row_asks_about_its_own_chart_and_the_held_out_questions_need_two_calls(rows):
    assert make_org_chart_rows(seed=0, num_train=64, num_test=32, num_warmup=32) == rows  # deterministic for a seed
    for split in ("train", "test", "warmup"):
        for row in rows[split]:
            managers = json.loads(row["managers"])
            person = next(p for p in managers if row["messages"][-1]["content"] == QUESTIONS[row["hops"]].format(person=p))
            assert row["ground_truth"] == chain_answer(managers, person, row["hops"])
            demonstration = json.loads(row["demonstration"])
            assert demonstration[: len(row["messages"])] == row["messages"]
            assert demonstration[-1] == {"role": "assistant", "content": f"The answer is {row['ground_truth']}."}
            assert sum(bool(m.get("tool_calls")) for m in demonstration) == row["hops"]
    assert [{row["hops"] for row in rows[split]} for split in ("train", "test", "warmup")] == [{2}, {2}, {1, 2}]
    seen = {(row["managers"], row["messages"][-1]["content"]) for row in rows["train"] + rows["warmup"]}
    assert not seen & {(row["managers"], row["messages"][-1]["content"]) for row in rows["test"]}
    assert len({row["managers"] for split in rows.values() for row in split}) == 128  # no chart twice


def test_the_environment_answers_from_the_rows_chart_and_errors_are_counted(rows):
    row = rows["test"][0]
    managers = json.loads(row["managers"])
    first, top = next(iter(managers)), list(managers.values())[-1]
    chart = OrgChart()
    chart.reset(row)
    results, reward, done = chart.step_calls(
        [ToolCall("manager_of", {"person": first}), ToolCall("manager_of", {"person": top}),
         ToolCall("manager_of", {"person": "Nobody"}), ToolCall(None, None, error="the JSON does not parse")], "")  # fmt: skip
    assert results == [managers[first], f"{top} has no manager.", "Error: no one named 'Nobody' is in the org chart.",
                       "Error: the JSON does not parse"]  # fmt: skip
    assert (reward, done, chart.errors) == (0.0, False, 1)


def test_the_grader_takes_the_models_final_answer_not_a_tools_result(rows):
    """string_match on the final-answer phrase: the manager of the manager scores 1; the first call's result copied as
    the answer, or the right name seen only in a tool result, scores 0."""
    row = rows["test"][0]
    demonstration = json.loads(row["demonstration"])
    first_result = demonstration[3]["content"]
    grade = VERIFIERS["string_match"]
    assert grade(f"<tool_response>\n{first_result}\n</tool_response>\nThe answer is {row['ground_truth']}.", row["ground_truth"]) == 1.0
    assert grade(f"The answer is {first_result}.", row["ground_truth"]) == 0.0
    assert grade(f"<tool_response>\n{row['ground_truth']}\n</tool_response>\nI do not know.", row["ground_truth"]) == 0.0


@pytest.fixture(scope="module")
def tokenizer():
    from open_instruct.data.embedded import smollm2_path
    from open_instruct.data.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path())


def test_the_warm_up_trains_on_the_tokens_the_engine_would_hold_and_only_on_the_models_own(rows, tokenizer):
    """A demonstration's ids are the prompt as the trainer renders it, each assistant turn's text and the stop token,
    and each tool turn exactly as the engine appends it: together, the tokenisation of the whole conversation rendered
    by the template. The trained tokens are the assistant turns' and nothing else."""
    from open_instruct.data.chat_templates import CHATML_TOOLS_TEMPLATE
    from open_instruct.environments.chat_turns import ToolTurns
    from open_instruct.sft_warmup import demonstration_example

    turns = ToolTurns(tokenizer, CHATML_TOOLS_TEMPLATE, list(OrgChart.schemas))
    for row in (rows["warmup"][0], rows["test"][0]):  # one call and two
        messages = json.loads(row["demonstration"])
        example = demonstration_example(messages, tokenizer, turns, tokenizer.eos_token_id)
        whole = turns.render(messages, add_generation_prompt=False)
        assert example.token_ids == tokenizer.encode(whole.removesuffix("\n"), add_special_tokens=False)
        trained = tokenizer.decode([t for t, keep in zip(example.token_ids, example.trained) if keep])
        calls = [f'\n<tool_call>\n{{"name": "manager_of", "arguments": {{"person": "{m["tool_calls"][0]["function"]["arguments"]["person"]}"}}}}\n</tool_call>{IM_END}'
                 for m in messages if m.get("tool_calls")]  # fmt: skip
        assert trained == "".join(calls) + f"The answer is {row['ground_truth']}.{IM_END}"


@pytest.mark.parametrize("flags, complaint", [
    (["--demonstration_column", "answers"], "--demonstration_column answers: "),
    (["--examples", "0"], "--examples 0: give a positive number"),
    (["--examples", "5000"], "--examples 5000: give 1 to 1024"),
    (["--dataset", "/no/such/folder"], "/no/such/folder"),
    (["--split", "validation"], "--split validation: "),
    (["--exampels", "4"], "unrecognized arguments: --exampels 4; run with --help"),
    (["--tools", "calculator"], "demonstration 0 calls 'manager_of', which --tools calculator does not offer"),
    (["--chat_template_name", "nope"], "chat_template_name='nope' is not a known template"),
])  # fmt: skip
def test_the_warm_up_refuses_bad_input_in_one_line_before_the_model_loads(flags, complaint, tmp_path, capsys):
    from open_instruct.sft_warmup import main

    with pytest.raises(SystemExit) as exit_info:
        main([*flags, "--model_name_or_path", "tiny", "--output_dir", str(tmp_path / "warmup")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") and complaint in err[0], err
    assert not (tmp_path / "warmup").exists()


@pytest.mark.e2e
def test_the_warm_up_saves_a_model_that_predicts_the_demonstrations_better(tiny_model_dir, tmp_path, tokenizer):
    """On what the user keeps: the saved folder loads, carries the template it was taught with and a record of the
    run, and its loss on the demonstrations is below the base model's (the tiny random model, 3 steps)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from open_instruct.data.chat_templates import CHATML_TOOLS_TEMPLATE
    from open_instruct.environments.chat_turns import ToolTurns
    from open_instruct.sft_warmup import WarmupArgs, batch_loss, demonstration_example, load_demonstrations

    output = tmp_path / "warmup"
    command = [sys.executable, "-m", "open_instruct.sft_warmup", "--model_name_or_path", tiny_model_dir,
               "--examples", "6", "--batch_size", "2", "--learning_rate", "1e-3", "--output_dir", str(output)]  # fmt: skip
    process, _ = run_command(command, tmp_path, timeout_s=600)
    assert process.returncode == 0, process.stderr[-3000:]
    assert "[sft_warmup] saved" in process.stdout + process.stderr
    record = json.loads((output / "sft_warmup.json").read_text())
    assert len(record["losses"]) == 3 and record["chat_template_name"] == "chatml_tools"
    assert AutoTokenizer.from_pretrained(output).chat_template == CHATML_TOOLS_TEMPLATE
    turns = ToolTurns(tokenizer, CHATML_TOOLS_TEMPLATE, list(OrgChart.schemas))
    examples = [demonstration_example(c, tokenizer, turns, tokenizer.eos_token_id)
                for c in load_demonstrations(WarmupArgs(examples=6))]  # fmt: skip
    with torch.no_grad():
        losses = [batch_loss(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), examples,
                             tokenizer.pad_token_id).item() for path in (tiny_model_dir, output)]  # fmt: skip
    assert losses[1] < losses[0] - 1.0, losses
    assert not list(tmp_path.glob("warmup.tmp-*"))
