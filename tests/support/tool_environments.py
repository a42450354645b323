"""A tool-calling environment for runs of the tiny model, which never writes a real call: its turn ends at every letter
or digit it writes, so its responses call as often as --max_tool_calls lets them. Passed by path:
`--tools tests/support/tool_environments.py:EveryLetter`."""

import string

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
