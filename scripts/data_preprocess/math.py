"""MATH (lighteval copy) -> RLVR prompts: the problem as the user turn, the solution's last \\boxed{} as answer.

    python -m scripts.data_preprocess.math --output_dir data/math [--input local_copy/] [--format verl]
"""

import sys

if __name__ == "math":  # this file was imported as Python's `math`: a script here was run by its path
    sys.exit(
        "scripts/data_preprocess/math.py shadows Python's math module because a converter was run by file path; "
        "run it as a module from the repository root: python -m scripts.data_preprocess.<name> ..."
    )

from scripts.data_preprocess.common import HubSource, PromptRow, cli, last_boxed_content, require_fields, run_converter

HUB_SOURCE = HubSource(name="DigitalLearningGmbH/MATH-lighteval", config=None, splits=("train", "test"))
VERIFIER_NAME = "math"


def convert_row(row: dict) -> PromptRow | None:
    require_fields(row, ("problem", "solution"), "MATH")
    answer = last_boxed_content(row["solution"])
    if not answer:
        return None
    messages = [{"role": "user", "content": row["problem"]}]
    return PromptRow(messages=messages, ground_truth=answer, dataset=VERIFIER_NAME)


def main(argv: list[str] | None = None) -> dict[str, str]:
    return run_converter(argv, __doc__.splitlines()[0], HUB_SOURCE, convert_row)


if __name__ == "__main__":
    cli(main)
