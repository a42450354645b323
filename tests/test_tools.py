"""Tools and environments (rl/tools.py): the calculator never evaluates code, end strings are found once even when
they arrive in pieces, and every bad tool (raising, hanging, too long) is answered with text, never a crash."""

import time

import pytest

from open_instruct.rl import tools
from open_instruct.rl.tools import Calculator, Environment, ToolEnvironment, ToolError, run_steps, turn_end


@pytest.mark.parametrize(
    "expression, expected",
    [("2 + 3", "5"), ("(12 + 7) * 3", "57"), ("-4 * (2 - 9)", "28"), ("17 // 5", "3"), ("-7 // 2", "-4"),
     (" 12345 * 6789 ", "83810205"), ("((1))", "1")],
)  # fmt: skip
def test_calculator_computes_integer_arithmetic(expression, expected):
    assert Calculator()(expression) == expected


@pytest.mark.parametrize(
    "expression, complaint",
    [("__import__('os').system('true')", "not allowed"), ("2 ** 1000", "not allowed"), ("1.5 + 2", "not allowed"),
     ("True + 1", "not allowed"), ("x + 1", "not allowed"), ("1 / 2", "not allowed"), ("3 // 0", "division by zero"),
     ("2 +", "cannot parse"), ("9" * 60 + " * " + "9" * 60, "longer than 100 digits"), ("1+" * 150 + "1", "longer than 200")],
)  # fmt: skip
def test_calculator_refuses_anything_but_integer_arithmetic(expression, complaint):
    with pytest.raises(ToolError, match=complaint):
        Calculator()(expression)


def test_tool_environment_runs_the_last_call_and_wraps_its_output():
    env = ToolEnvironment([Calculator()], wrapper="<output>{output}</output>")
    observation, reward, done = env.step("First <calculator>1+1</calculator> then <calculator>20 * 3</calculator>")
    assert (observation, reward, done) == ("<output>60</output>", 0.0, False)
    assert env.errors == 0


def test_tool_errors_are_text_for_the_model_and_counted():
    class Broken(tools.Tool):
        name, start, end = "broken", "<b>", "</b>"

        def __call__(self, text):
            raise KeyError("boom")

    env = ToolEnvironment([Calculator(), Broken()], wrapper="[{output}]")
    assert env.step("<calculator>2 +</calculator>")[0].startswith("[Error: cannot parse")
    assert env.step("<b>x</b>")[0] == "[Error: KeyError: 'boom']"
    assert env.step("no opening tag </calculator>")[0] == "[Error: </calculator> without <calculator> before it]"
    assert env.errors == 3


def test_tool_output_is_cut_to_its_budget_before_wrapping():
    env = ToolEnvironment([Calculator()], wrapper="<o>{output}</o>", cut_output=lambda text: (text[:3], len(text) > 3))
    assert env.step("<calculator>99999 * 99999</calculator>")[0] == "<o>999</o>"
    assert env.outputs_cut == 1


@pytest.mark.parametrize("pieces", [["<calculator>1+1</calculator>"], ["<calculator>1+1</calc", "ulator> and on"],
                                    ["<calculator>1+1<", "/", "calculator", ">", " more"]])  # fmt: skip
def test_an_end_string_split_across_decode_steps_is_found_once_when_complete(pieces):
    text, searched, found = "", 0, []
    for piece in pieces:
        text += piece
        end = turn_end(text, ("</calculator>",), searched)
        if end is not None:
            found.append(end)
            searched = end  # the engine searches on from the end of the turn
        else:
            searched = len(text)
    assert found == [len("<calculator>1+1</calculator>")]


def test_turn_end_takes_the_earliest_end_string_and_never_one_already_searched():
    text = "a</x> b</y>"
    assert turn_end(text, ("</y>", "</x>"), 0) == len("a</x>")
    assert turn_end(text, ("</y>", "</x>"), len("a</x>")) == len(text)
    assert turn_end(text, ("</y>", "</x>"), len(text)) is None


class Hanging(Environment):
    end_strings = ("</h>",)

    def step(self, model_text):
        time.sleep(30)
        return "late", 0.0, False


class Raising(Environment):
    end_strings = ("</r>",)

    def step(self, model_text):
        raise RuntimeError("environment bug")


class Echo(Environment):
    end_strings = ("</e>",)

    def step(self, model_text):
        return model_text.upper(), 0.5, model_text.startswith("done")


def test_run_steps_cuts_a_hanging_step_answers_a_raising_one_and_keeps_the_order():
    start = time.monotonic()
    outcomes = run_steps([(Hanging(), "x</h>"), (Raising(), "y</r>"), (Echo(), "done</e>"), (Echo(), "go</e>")], 0.5)
    assert time.monotonic() - start < 5  # the hanging step did not hold the others for its 30 s
    assert outcomes[0].timed_out and "longer than 0.5 s" in outcomes[0].observation
    assert outcomes[1].error and outcomes[1].observation == "Error: RuntimeError: environment bug"
    assert (outcomes[2].observation, outcomes[2].reward, outcomes[2].done) == ("DONE</E>", 0.5, True)
    assert (outcomes[3].observation, outcomes[3].done) == ("GO</E>", False)
    assert not any(o.error or o.timed_out for o in outcomes[2:])


def test_tool_names_are_checked_before_anything_runs():
    assert tools.tool_names_problem(["calculator"]) is None
    assert "unknown" in tools.tool_names_problem(["calculator", "web_search"])
    assert "twice" in tools.tool_names_problem(["calculator", "calculator"])
    tools.ENVIRONMENTS["echo"] = Echo
    try:
        assert "runs alone" in tools.tool_names_problem(["echo", "calculator"])
        assert isinstance(tools.build_environment(["echo"]), Echo)
    finally:
        del tools.ENVIRONMENTS["echo"]
    assert isinstance(tools.build_environment(["calculator"]), ToolEnvironment)
