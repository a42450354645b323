"""Tools and environments (environments/tools.py): the calculator never evaluates code, end strings are found once even when
they arrive in pieces, and every bad tool (raising, hanging, too long) is answered with text, never a crash."""

import time

import pytest
import torch

from open_instruct.environments import tools
from open_instruct.environments.tools import Calculator, Environment, ToolEnvironment, ToolError, run_steps, turn_end
from open_instruct.sandbox import isolation_problem


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
    # An observation ending in "</" and a model turn going on with "x>": the model did not write "</x>".
    observation_then_turn = "<output>1</" + "x> and on"
    assert turn_end(observation_then_turn, ("</x>",), len("<output>1</"), turn_start=len("<output>1</")) is None


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


class StartsBadly(Environment):
    end_strings = ("</s>",)

    def reset(self, row):
        if row["how"] == "raise":
            raise RuntimeError("no task for this row")
        if row["how"] == "exit":
            raise SystemExit(3)
        if row["how"] == "hang":
            time.sleep(30)
        self.row = row


class BuiltBadly(Environment):
    def __init__(self):
        raise ValueError("x" * 10**6)


def test_start_environments_answers_a_raising_or_hanging_start_with_text_and_starts_the_others():
    rows = [{"how": how} for how in ("fine", "raise", "hang", "exit", "fine")]
    start = time.monotonic()
    attempts = tools.start_environments(StartsBadly, rows, 0.5)
    assert time.monotonic() - start < 5  # the hanging reset did not hold the others for its 30 s
    assert [a.error is None for a in attempts] == [True, False, False, False, True]
    assert attempts[0].value.row is rows[0] and attempts[4].value.row is rows[4]
    assert attempts[1].error == "Error: the environment could not start: RuntimeError: no task for this row"
    assert attempts[2].timed_out and attempts[2].error == (
        "Error: the environment could not start: it took longer than 0.5 s and was stopped"
    )
    assert attempts[3].error == "Error: the environment could not start: SystemExit: 3"
    (built,) = tools.start_environments(BuiltBadly, [{}], 0.5)
    assert built.error.startswith("Error: the environment could not start: ValueError: xxx")  # cut by the engine


def test_an_observation_is_cut_to_its_token_budget_tokenising_only_its_head(tiny_model_dir):
    from open_instruct.data.tokenizer import load_tokenizer
    from open_instruct.generation.engine_batches import cut_to_tokens, observation_tokens

    tokenizer = load_tokenizer(tiny_model_dir)
    assert cut_to_tokens(tokenizer, "a short answer", 8) == ("a short answer", False)
    start = time.monotonic()
    cut, was_cut = cut_to_tokens(tokenizer, " word" * 2_000_000, 8)  # 10 MB: ~10 s to tokenise whole
    assert time.monotonic() - start < 1.0
    assert was_cut and cut == " word" * 8 and len(observation_tokens(tokenizer, cut)) == 8
    assert cut_to_tokens(tokenizer, "x" * 10**6, 8)[1]  # one long "word": cut too


class QuickPython(tools.PythonTool):
    LIMITS = tools.Limits(wall_time_s=0.5, max_output_bytes=1 << 10)


@pytest.mark.skipif(isolation_problem() is not None, reason=str(isolation_problem()))
def test_the_python_tool_answers_with_what_the_program_prints_or_its_error_run_in_the_sandbox(tmp_path):
    python = QuickPython()
    assert python("print(12345 * 6789)") == "83810205\n"
    with pytest.raises(ToolError, match="^ZeroDivisionError: "):
        python("print(1 // 0)")
    with pytest.raises(ToolError, match="past its 0.5 s limit"):
        python("while True:\n    pass")
    with pytest.raises(ToolError, match="printed more than 1024 bytes"):
        python("while True:\n    print('x' * 100)")
    # The model's program is not the trainer: it cannot write where the trainer can, nor reach the network.
    target = tmp_path / "written_by_the_model"
    with pytest.raises(ToolError):
        python(f"open({str(target)!r}, 'w').write('x')")
    assert not target.exists()
    with pytest.raises(ToolError, match="Network is unreachable|OSError"):
        python("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=0.3)")
    env = ToolEnvironment([python])
    env.reset({})
    observation, _, done = env.step("Let me compute. <python>print(2 ** 10)</python>")
    assert "1024" in observation and not done


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


# ---------------------------------------------------------------- tool tokens are not the policy's


def completion_with_calls(model_pieces: list[list[int]], tool_pieces: list[list[int]], finish_reason: str = "stop"):
    """A completion alternating the model's pieces and tools' outputs: model, tool, model, tool, ..."""
    from open_instruct.generation.vllm_engine import Completion

    token_ids, sampled = [], []
    for index, piece in enumerate(model_pieces):
        token_ids += piece
        sampled += [True] * len(piece)
        if index < len(tool_pieces):
            token_ids += tool_pieces[index]
            sampled += [False] * len(tool_pieces[index])
    logprobs = [-1.0 if s else None for s in sampled]
    return Completion(0, token_ids, "", finish_reason, logprobs, [0 if s else None for s in sampled], sampled)


EOS, PAD = 2, 0


@pytest.mark.parametrize(
    "model_pieces, tool_pieces, expected_mask",
    [
        ([[5, 6, EOS]], [], [1, 1, 1]),  # no call
        ([[5, 6], [7, EOS]], [[30, 31, 32]], [1, 1, 0, 0, 0, 1, 1]),  # one call
        ([[5], [6], [7], [8, EOS]], [[30], [31, 32], [33]], [1, 0, 1, 0, 0, 1, 0, 1, 1]),  # several calls
        ([[5], [6, EOS, 9]], [[30, EOS, 31]], [1, 0, 0, 0, 1, 1]),  # a stop token in a tool's output ends nothing; the sampled one does
        ([[5, 6]], [[30, 31]], [1, 1, 0, 0]),  # the response ends on a tool's output (--max_tool_calls, budget)
        # A native call's turn ends on the sampled stop token, and the response goes on after the tool's turn: every
        # turn is trained on (truncated at the stop token that ends the response, never at a turn's).
        ([[5, EOS], [6, EOS], [7, EOS]], [[30, 31], [32]], [1, 1, 0, 0, 1, 1, 0, 1, 1]),
    ],
)  # fmt: skip
def test_the_response_mask_holds_the_models_tokens_and_the_attention_mask_every_token(model_pieces, tool_pieces,
                                                                                    expected_mask):  # fmt: skip
    from open_instruct.data.batches import PromptBatch
    from open_instruct.learner.experience import layout_rollout

    completion = completion_with_calls(model_pieces, tool_pieces)
    other = completion_with_calls([[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]], [])  # a wider row: the first is padded
    prompts = PromptBatch([[1, 1, 1]], ["x"], ["arithmetic"], ["q"])
    rollout = layout_rollout(prompts, [completion, other], PAD, [EOS], "cpu")
    width = rollout.response_mask.shape[1]
    padded = expected_mask + [0] * (width - len(expected_mask))
    assert rollout.response_mask[0].int().tolist() == padded
    real = len(expected_mask)
    assert rollout.attention_mask[0, rollout.context_length :].tolist() == [1] * real + [0] * (width - real)
    assert int(rollout.response_length[0]) == real
    assert rollout.query_response[0, rollout.context_length : rollout.context_length + real].tolist() == (
        completion.token_ids[:real]
    )


def test_gae_across_tool_outputs_is_the_gae_of_the_policys_tokens_end_to_end():
    from open_instruct import rl

    generator = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1, 0], [1, 0, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    reward, value = torch.randn(2, 9, generator=generator), torch.randn(2, 9, generator=generator)
    absurd = torch.full_like(value, 1e6)
    advantage, return_ = rl.compute_gae(reward, torch.where(mask, value, absurd), mask, 0.9, 0.8)
    for row in range(2):
        kept = mask[row]
        length = int(kept.sum())
        compact_adv, compact_ret = rl.compute_gae(
            reward[row, kept][None], value[row, kept][None], torch.ones(1, length, dtype=torch.bool), 0.9, 0.8
        )
        torch.testing.assert_close(advantage[row, kept], compact_adv[0])
        torch.testing.assert_close(return_[row, kept], compact_ret[0])
        assert (advantage[row, ~kept] == 0).all() and (return_[row, ~kept] == 0).all()


def test_the_score_goes_on_the_last_token_the_policy_sampled_even_before_a_tool_output():
    from open_instruct import rl

    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    kl = torch.where(mask, 0.5, 1e6)  # absurd KL on tool tokens and padding: never read
    reward, _ = rl.per_token_rewards(torch.tensor([1.0, 2.0, 3.0]), kl, mask, beta=0.1)
    torch.testing.assert_close(reward, torch.tensor([[-0.05, 0.95, 0, 0], [-0.05, 0, 1.95, 0], [-0.05, -0.05, -0.05, 2.95]]))


def test_tools_from_the_users_file_and_their_mistakes(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(
        "from open_instruct.environments import tools\n"
        "class Reverse(tools.Tool):\n"
        "    name, start, end = 'reverse', '<reverse>', '</reverse>'\n"
        "    def __call__(self, text):\n"
        "        return text[::-1]\n"
        "class Silent(tools.Tool):\n"
        "    name, start, end = 'silent', '<s>', ''\n"
        "def not_a_class():\n"
        "    pass\n"
        "NOT_A_TOOL = 3\n"
    )
    assert tools.tool_names_problem([f"{path}:Reverse", "calculator"]) is None
    env = tools.build_environment([f"{path}:Reverse"], wrapper="[{output}]")
    assert env.step("<reverse>abc</reverse>") == ("[cba]", 0.0, False)
    assert "defines no Tool or Environment subclass or function 'NOT_A_TOOL'" in tools.tool_names_problem(
        [f"{path}:NOT_A_TOOL"])
    assert "is not a file" in tools.tool_names_problem([f"{tmp_path}/none.py:Reverse"])
    assert "non-empty end strings" in tools.tool_names_problem([f"{path}:Silent"])
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no')\n")
    assert "importing" in tools.tool_names_problem([f"{broken}:Reverse"])
    assert tools.absolute_names(["calculator", "my_tools.py:Reverse"])[1] == f"{tools.os.path.abspath('my_tools.py')}:Reverse"


def test_the_eval_reports_the_share_of_responses_that_called_a_tool_only_in_a_run_with_tools():
    from open_instruct.data.batches import PromptBatch
    from open_instruct.generation.eval_metrics import eval_metrics
    from open_instruct.generation.generation_thread import Rollout
    from open_instruct.generation.vllm_engine import Completion
    from open_instruct.rewards.manager import RewardConfig, RewardManager

    prompts = PromptBatch([[1, 2]], ["12"], ["arithmetic"], ["What is 3 * 4?"])
    called = dict.fromkeys(("calls", "errors", "timeouts", "outputs_cut", "seconds", "reward"), 0) | {"calls": 1}
    no_call = dict(called, calls=0)
    greedy = [Completion(0, [5, 6, 7], "<c>3 * 4</c><o>12</o>", "stop", sampled=[True, False, True], tool_stats=called),
              Completion(0, [5], "13", "stop", sampled=None, tool_stats=no_call)]  # fmt: skip
    sampled = [Completion(0, [5], "12", "stop", sampled=None, tool_stats=no_call)] * 3 + greedy[:1]
    metrics, _ = eval_metrics(Rollout(0, greedy, sampled_completions=sampled), prompts, RewardManager(RewardConfig()))
    assert (metrics["eval/tool_call_rate"], metrics["eval/sampled_tool_call_rate"]) == (0.5, 0.25)
    assert metrics["eval/correct_rate"] == 0.5 and metrics["eval/sequence_lengths"] == 1.5  # 2 + 1 model tokens
    plain = [Completion(0, [5], "12", "stop")]
    metrics, _ = eval_metrics(Rollout(0, plain, sampled_completions=plain), prompts, RewardManager(RewardConfig()))
    assert "eval/tool_call_rate" not in metrics and "eval/sampled_tool_call_rate" not in metrics


def test_cut_tool_outputs_are_counted_in_the_eval_and_named_once_on_the_console(capsys):
    """A tool answering far more than --tool_output_max_tokens costs time on every call: the eval counts its cut
    outputs (greedy and sampled, eval/tool_outputs_cut, as tools/outputs_cut counts a batch's), and the first cut the
    trainer sees, in an eval or a batch, is one console line naming the flag; later ones are only counted."""
    from open_instruct.data.batches import PromptBatch
    from open_instruct.generation.eval_metrics import eval_metrics
    from open_instruct.generation.generation_thread import Rollout
    from open_instruct.generation.step_batch import BatchCollector
    from open_instruct.generation.vllm_engine import Completion
    from open_instruct.rewards.manager import RewardConfig, RewardManager
    from open_instruct.run import console  # noqa: F401 - puts our modules' log lines on the console, as in a run

    prompts = PromptBatch([[1, 2]], ["12"], ["arithmetic"], ["What is 3 * 4?"])
    stats = dict.fromkeys(("calls", "errors", "timeouts", "outputs_cut", "seconds", "reward"), 0) | {"calls": 2}
    greedy = [Completion(0, [5, 6], "12", "stop", sampled=[True, False], tool_stats=stats | {"outputs_cut": 2})]
    sampled = [Completion(0, [5, 6], "12", "stop", sampled=[True, False], tool_stats=stats | {"outputs_cut": 1})] * 2
    metrics, _ = eval_metrics(Rollout(0, greedy, sampled_completions=sampled), prompts, RewardManager(RewardConfig()))
    assert metrics["eval/tool_outputs_cut"] == 4
    collector = BatchCollector(None, RewardManager(RewardConfig()), 1, 1, False, 0, [], with_tools=True)
    capsys.readouterr()
    collector.note_cut_outputs(0.0, "the eval")  # nothing cut: nothing said
    collector.note_cut_outputs(metrics["eval/tool_outputs_cut"], "the eval")
    collector.note_cut_outputs(7.0, "the batch of policy version 1")
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[tools] warning: 4 tool output(s) in the eval were longer than "
                                                   "--tool_output_max_tokens and were cut"), lines  # fmt: skip
