"""A tool-calling environment for runs of the tiny model, which never writes a real call: its turn ends at every letter
or digit it writes, so its responses call as often as --max_tool_calls lets them. Passed by path:
`--tools tests/support/tool_environments.py:EveryLetter`. `LockedBox` and its variants take native tool calls
(`step_calls`), for runs with --tool_call_parser hermes."""

import itertools
import random
import string
import threading
import time

from open_instruct.environments import tools

# Each step of EveryLetter takes a random time, drawn from a generator of its own (the trainer's RNGs untouched), so
# that the runs using it (tests/test_resume.py's tool mode) prove a run does not depend on when its calls return.
CALL_TIMES = random.Random()


class EveryLetter(tools.Environment):
    end_strings = tuple(string.ascii_letters + string.digits)
    output_suffix = ""

    def reset(self, row):
        self.turns = 0

    def step(self, text):
        time.sleep(CALL_TIMES.uniform(0.0, 0.01))
        self.turns += 1
        return f" [{self.turns}]{self.output_suffix}", 0.0, False


class EveryLetterWithStopToken(EveryLetter):
    """Its outputs hold the tiny model's stop token as text, which must not end the response."""

    output_suffix = " <|im_end|>"


class StartsBadly(EveryLetter):
    """An environment whose start fails for two prompts of every four: the reset of the second raises, the third's
    hangs far past --tool_timeout_s. Every other sample answers each turn with a megabyte, which the engine must cut
    to --tool_output_max_tokens (and tokenise no more of than that needs)."""

    def reset(self, row):
        if row["prompt_index"] % 4 == 1:
            raise RuntimeError("no environment for this prompt")
        if row["prompt_index"] % 4 == 2:
            time.sleep(120)
        super().reset(row)

    def step(self, text):
        self.turns += 1
        return f" [{self.turns}]" + " word" * 200_000, 0.0, False


class BuiltBadly(EveryLetter):
    """Every other one built raises in its constructor (their order is the threads', so not which sample's)."""

    built = itertools.count()

    def __init__(self):
        if next(self.built) % 2:
            raise ValueError("cannot build this environment")


class TaskFromRow(tools.Environment):
    """An environment whose task is its dataset row, as a user's would be: `reset(row)` gets every column of the row
    (here `label`, `turn_reward` and `max_turns`, besides the prompt's `messages`). Each turn is answered with the
    row's label and rewarded with its `turn_reward` (recorded on the turn's last sampled token); the sample ends after
    `max_turns` turns. Every letter or digit ends a turn, as in EveryLetter. Routed by a column:
    `--tools tests/support/tool_environments.py:TaskFromRow calculator --environment_column env`."""

    end_strings = tuple(string.ascii_letters + string.digits)

    def reset(self, row):
        self.label, self.turn_reward, self.max_turns = row["label"], row["turn_reward"], row["max_turns"]
        self.question = row["messages"][-1]["content"]
        self.turns = 0

    def step(self, text):
        self.turns += 1
        return f" <{self.label}>", self.turn_reward, self.turns >= self.max_turns


class QuietTask(TaskFromRow):
    """Another environment for the same rows (a run mixing two): it answers with the turn count and gives no reward."""

    def step(self, text):
        self.turns += 1
        return f" [{self.turns}]", 0.0, self.turns >= self.max_turns


class SleepsRandomly(EveryLetter):
    """Every turn's answer takes 0-0.5 s, a different time on each run: the tokens must not care."""

    def step(self, text):
        time.sleep(random.uniform(0.0, 0.5))
        return super().step(text)


class SlowForSomePrompts(tools.Environment):
    """Only the samples of prompts below `slow_prompts` call (the others' environment ends no turn), and each call takes
    `seconds`: some samples wait on a slow tool while the others decode."""

    slow_prompts, seconds = 4, 2.0
    ends_at_answer = False  # True: the answer ends the sample's response (done)

    def reset(self, row):
        self.end_strings = tuple(string.ascii_letters + string.digits) if row["prompt_index"] < self.slow_prompts else ()

    def step(self, text):
        time.sleep(self.seconds)
        self.end_strings = ()  # one call a sample
        return " [slow]", 0.0, self.ends_at_answer


class Sleep(tools.Tool):
    """`<sleep>0.3</sleep>` sleeps that long and answers "slept 0.3": a tool a worker process builds from its file."""

    name, start, end = "sleep", "<sleep>", "</sleep>"

    def __call__(self, text):
        time.sleep(float(text))
        return f"slept {text}"


class SeveralSleeps(tools.ToolEnvironment):
    """A turn holding several calls: every <sleep>...</sleep> of it (as a native tool-call turn may hold several)."""

    def __init__(self):
        super().__init__([Sleep()])

    def calls(self, model_text):
        return [(0, call.split("</sleep>")[0]) for call in model_text.split("<sleep>")[1:]]


class LockedBox(tools.Environment):
    """A native-format environment (--tool_call_parser hermes): the model opens a box whose code is its row's `code`
    column by calling `try_code`. `step_calls` gets the turn's calls as the parser read them and answers each on its
    own (a tool turn per call); the right code earns 1 and ends the sample. The threads its steps ran on are noted in
    `step_threads` (a pool thread's, never the engine's)."""

    schemas = [{"type": "function", "function": {
        "name": "try_code", "description": "Try a code on the locked box.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}]  # fmt: skip
    step_threads: set = set()

    def reset(self, row):
        self.code, self.tries = str(row["code"]), 0

    def step_calls(self, calls, model_text):
        self.step_threads.add(threading.get_ident())
        results = []
        for call in calls:
            if call.error is not None:  # bad JSON, an unknown function, arguments that do not fit: the model reads why
                results.append(f"Error: {call.error}")
                continue
            self.tries += 1
            results.append("open" if call.arguments["code"] == self.code else "wrong")
        opened = "open" in results
        return results, float(opened), opened


class LockedBoxOneAnswer(LockedBox):
    """The same box answering the whole turn with one text (one tool turn), however many calls it made."""

    def step_calls(self, calls, model_text):
        results, reward, done = super().step_calls(calls, model_text)
        return f"{results.count('wrong')} wrong, {self.tries} tries so far", reward, done


class LockedBoxMiscounts(LockedBox):
    """Answers one result too many: the model reads an error, counted."""

    def step_calls(self, calls, model_text):
        results, reward, done = super().step_calls(calls, model_text)
        return results + ["extra"], reward, done


class LockedBoxHangs(LockedBox):
    """Its step hangs past any --tool_timeout_s a test gives."""

    def step_calls(self, calls, model_text):
        time.sleep(3)
        return super().step_calls(calls, model_text)
