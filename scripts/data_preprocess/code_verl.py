"""PrimeIntellect/verifiable-coding-problems -> code rows in verl's schema: the problem as the user turn, its tests as
the ground truth in verl's form (`{"inputs": [...], "outputs": [...]}` for stdin/stdout problems, with `"fn_name"` for
function-call ones), `data_source` "primeintellect" (the `code` verifier, open_instruct/rewards/code_tests.py).

    python -m scripts.data_preprocess.code_verl --output_dir data/code [--input local_copy/] [--format open_instruct]

A hub row: `prompt` (the problem, already asking for a Python solution), `verification_info` (a JSON object, or its
text: `{"language", "test_cases": [{"type": "stdin_stdout" | "function_call", "input", "output", "fn_name"}]}`) and
`source` and `problem_id`, which are not kept. Skipped: rows for another language, without tests, or whose tests mix
the two types (the verifier runs one kind per row).
"""

import json

from scripts.data_preprocess.common import HubSource, PromptRow, cli, require_fields, run_converter

HUB_SOURCE = HubSource(name="PrimeIntellect/verifiable-coding-problems", config=None, splits=("train",))
VERIFIER_NAME = "primeintellect"
ANSWER_FORMAT = "\n\nGive your solution as one ```python code block."


def verl_tests(test_cases: list[dict]) -> dict | None:
    """The test cases in verl's form, or None when there are none or they mix stdin/stdout and function calls."""
    kinds = {case.get("type") for case in test_cases}
    if not test_cases or len(kinds) != 1:
        return None
    inputs = [case["input"] for case in test_cases]
    outputs = [case["output"] for case in test_cases]
    if kinds == {"stdin_stdout"}:
        return {"inputs": inputs, "outputs": outputs}
    fn_names = {case.get("fn_name") for case in test_cases}
    if kinds == {"function_call"} and len(fn_names) == 1 and None not in fn_names:
        return {"inputs": inputs, "outputs": outputs, "fn_name": fn_names.pop()}
    return None


def convert_row(row: dict) -> PromptRow | None:
    require_fields(row, ("prompt", "verification_info"), "verifiable-coding-problems")
    info = row["verification_info"]
    info = json.loads(info) if isinstance(info, str) else info
    if str(info.get("language", "python")).lower() not in ("python", "python3"):
        return None
    tests = verl_tests(info.get("test_cases") or [])
    if tests is None:
        return None
    messages = [{"role": "user", "content": row["prompt"].strip() + ANSWER_FORMAT}]
    return PromptRow(messages=messages, ground_truth=json.dumps(tests), dataset=VERIFIER_NAME)


def main(argv: list[str] | None = None) -> dict[str, str]:
    return run_converter(argv, __doc__.splitlines()[0], HUB_SOURCE, convert_row, default_format="verl")


if __name__ == "__main__":
    cli(main)
