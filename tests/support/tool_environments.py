"""A tool-calling environment for runs of the tiny model, which never writes a real call: its turn ends at every letter
or digit it writes, so its responses call as often as --max_tool_calls lets them. Passed by path:
`--tools tests/support/tool_environments.py:EveryLetter`."""

import itertools
import string
import time

from open_instruct.rl import tools


class EveryLetter(tools.Environment):
    end_strings = tuple(string.ascii_letters + string.digits)
    output_suffix = ""

    def reset(self, row):
        self.turns = 0

    def step(self, text):
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
