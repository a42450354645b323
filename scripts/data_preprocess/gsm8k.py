"""GSM8K -> RLVR prompts: the question as the user turn, the number after "####" as the ground truth.

    python -m scripts.data_preprocess.gsm8k --output_dir data/gsm8k [--input local_copy/] [--format verl]
"""

from scripts.data_preprocess.common import HubSource, PromptRow, cli, require_fields, run_converter

HUB_SOURCE = HubSource(name="openai/gsm8k", config="main", splits=("train", "test"))
VERIFIER_NAME = "gsm8k"
ANSWER_MARKER = "####"


def final_answer(answer_text: str) -> str | None:
    """The text after the last "####" with thousands separators removed ("1,200" -> "1200")."""
    if ANSWER_MARKER not in answer_text:
        return None
    return answer_text.rsplit(ANSWER_MARKER, 1)[1].strip().replace(",", "")


def convert_row(row: dict) -> PromptRow | None:
    require_fields(row, ("question", "answer"), "gsm8k")
    answer = final_answer(row["answer"])
    if not answer:
        return None
    messages = [{"role": "user", "content": row["question"]}]
    return PromptRow(messages=messages, ground_truth=answer, dataset=VERIFIER_NAME)


def main(argv: list[str] | None = None) -> dict[str, str]:
    return run_converter(argv, __doc__.splitlines()[0], HUB_SOURCE, convert_row)


if __name__ == "__main__":
    cli(main)
