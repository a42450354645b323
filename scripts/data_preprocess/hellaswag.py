"""HellaSwag -> multiple-choice prompts: the context and four lettered endings; the answer is the letter.

    python -m scripts.data_preprocess.hellaswag --output_dir data/hellaswag [--input local_copy/] [--format verl]

The hub's test split has no labels (label ""), so it is not converted by default; unlabelled rows are skipped.
"""

from scripts.data_preprocess.common import HubSource, PromptRow, cli, require_fields, run_converter

HUB_SOURCE = HubSource(name="Rowan/hellaswag", config=None, splits=("train", "validation"))
VERIFIER_NAME = "string_match"
LETTERS = "ABCD"


def multiple_choice_prompt(context: str, endings: list[str]) -> str:
    options = "\n".join(f"{letter}. {ending}" for letter, ending in zip(LETTERS, endings))
    return (
        f"Which ending continues the text best?\n\n{context}\n\n{options}\n\n"
        f"Answer with the letter of the ending ({', '.join(LETTERS[: len(endings)])})."
    )


def convert_row(row: dict) -> PromptRow | None:
    require_fields(row, ("ctx", "endings", "label"), "hellaswag")
    if len(row["endings"]) != len(LETTERS):
        raise ValueError(
            f"A hellaswag row has {len(row['endings'])} endings ({row['endings']}), expected {len(LETTERS)}; "
            f"check that --input is a copy of {HUB_SOURCE.name}."
        )
    if row["label"] in (None, ""):
        return None
    prompt = multiple_choice_prompt(row["ctx"], row["endings"])
    return PromptRow(
        messages=[{"role": "user", "content": prompt}], ground_truth=LETTERS[int(row["label"])], dataset=VERIFIER_NAME
    )


def main(argv: list[str] | None = None) -> dict[str, str]:
    return run_converter(argv, __doc__.splitlines()[0], HUB_SOURCE, convert_row)


if __name__ == "__main__":
    cli(main)
