"""Anthropic HH-RLHF -> prompts for reward-model scoring: the dialogue before the last assistant reply.

    python -m scripts.data_preprocess.full_hh_rlhf --output_dir data/hh [--input local_copy/] [--format verl]

Rows carry no ground truth and no verifier (`ground_truth` and `dataset` are None): only a reward model
can score the answers. The prompt comes from the `chosen` dialogue; `rejected` shares the same prompt.
"""

import re

from scripts.data_preprocess.common import HubSource, PromptRow, cli, require_fields, run_converter

HUB_SOURCE = HubSource(name="Anthropic/hh-rlhf", config=None, splits=("train", "test"))
SPEAKER_ROLES = {"Human": "user", "Assistant": "assistant"}
# The dialogues are "\n\nHuman: ...\n\nAssistant: ..."; the capture keeps the speaker for each turn.
TURN_HEADER = re.compile(r"\n\n(Human|Assistant): ?")


def dialogue_turns(dialogue: str) -> list[dict]:
    """Split an HH dialogue into chat turns; text before the first header (normally none) is dropped."""
    pieces = TURN_HEADER.split(dialogue)
    return [
        {"role": SPEAKER_ROLES[speaker], "content": text.strip()} for speaker, text in zip(pieces[1::2], pieces[2::2])
    ]


def convert_row(row: dict) -> PromptRow | None:
    require_fields(row, ("chosen", "rejected"), "hh-rlhf")
    turns = dialogue_turns(row["chosen"])
    if turns and turns[-1]["role"] == "assistant":
        turns = turns[:-1]  # the reply being compared, not part of the prompt
    if not turns or turns[-1]["role"] != "user":
        return None  # malformed dialogue: no user turn to answer
    return PromptRow(messages=turns, ground_truth=None, dataset=None)


def main(argv: list[str] | None = None) -> dict[str, str]:
    return run_converter(argv, __doc__.splitlines()[0], HUB_SOURCE, convert_row)


if __name__ == "__main__":
    cli(main)
