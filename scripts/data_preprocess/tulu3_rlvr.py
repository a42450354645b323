"""Tulu 3's RLVR mix (GSM8K, MATH and instruction-following rows) -> RLVR prompts, the hub rows as they are.

    python -m scripts.data_preprocess.tulu3_rlvr --output_dir data/tulu3_rlvr [--input local_copy/] [--format verl]

allenai/RLVR-GSM-MATH-IF-Mixed-Constraints already holds `messages`, `ground_truth` and `dataset` ("gsm8k", "MATH" or
"ifeval", each the name of a verifier here); `constraint_type` and `constraint` only describe the IF rows' prompts
and are dropped. Every row's ground truth is checked by its verifier's GROUND_TRUTH_CHECKS entry: a row the trainer
would refuse fails the conversion now, naming its ground truth, instead of at the start of a run.
"""

from open_instruct.rewards.verifiers import GROUND_TRUTH_CHECKS, resolve_verifier_name
from scripts.data_preprocess.common import HubSource, PromptRow, cli, require_fields, run_converter

HUB_SOURCE = HubSource(name="allenai/RLVR-GSM-MATH-IF-Mixed-Constraints", config=None, splits=("train",))


def convert_row(row: dict) -> PromptRow:
    require_fields(row, ("messages", "ground_truth", "dataset"), "Tulu 3 RLVR")
    check_ground_truth = GROUND_TRUTH_CHECKS.get(resolve_verifier_name(row["dataset"]))
    if check_ground_truth is not None:
        check_ground_truth(row["ground_truth"])
    return PromptRow(messages=row["messages"], ground_truth=row["ground_truth"], dataset=row["dataset"])


def main(argv: list[str] | None = None) -> dict[str, str]:
    return run_converter(argv, __doc__.splitlines()[0], HUB_SOURCE, convert_row)


if __name__ == "__main__":
    cli(main)
