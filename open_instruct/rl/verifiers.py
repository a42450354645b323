"""Verifiable rewards (RLVR): answer checkers for each dataset.

A verifier is `fn(response, ground_truth) -> float` in [0, 1]. Dataset rows name their verifier in
`dataset` (open-instruct) or `data_source` (verl); `VERIFIER_ALIASES` maps those names to the verifiers here.
Only `code` runs model-written code, in the sandbox (`code_tests`).
"""

import functools
import logging
import re
import threading
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

from open_instruct.rl import code_tests

logger = logging.getLogger(__name__)
# A number as models write it: optional minus, digits with optional thousands separators, optional decimals.
# The look-behind keeps "3-5" from reading as -5 and "x2" or "1.2.3" tails from reading as numbers.
NUMBER_PATTERN = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3}(?!\d))+|\d+)(?:\.\d+)?")
# "The answer is ...", "The final answer is ...", "Final answer: ...", "Answer: ...".
FINAL_ANSWER_PATTERN = re.compile(r"\b(?:final\s+)?answer\s*(?:is\b|:)\s*:?", re.IGNORECASE)
SENTENCE_END_PATTERN = re.compile(r"\.(?:\s|$)")
BOXED_PREFIX = "\\boxed"
R1_FORMAT_PATTERN = re.compile(
    r"\s*<think>(?:(?!</?think>|</?answer>).)*</think>\s*<answer>(?:(?!</?think>|</?answer>).)*</answer>\s*",
    re.DOTALL,
)
# Longer "answers" are almost surely not answers, and sympy can take minutes on them.
MAX_MATH_ANSWER_CHARS = 1000
# math-verify's timeouts use signal.alarm, which only works in the main thread; elsewhere they are off.
MATH_VERIFY_TIMEOUT_SECONDS = 5


# ---------------------------------------------------------------- answer extraction


def normalize_number_text(text: str) -> str:
    """Unicode minus to ASCII, so "−3" reads as -3."""
    return text.replace("\u2212", "-")


def last_number(text: str) -> Decimal | None:
    """The last number written in `text` ("1,234" -> 1234, "-3.50" -> -3.5), or None when there is none."""
    matches = NUMBER_PATTERN.findall(normalize_number_text(text))
    if not matches:
        return None
    try:
        return Decimal(matches[-1].replace(",", ""))
    except InvalidOperation:
        return None


def last_boxed_content(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text`, nested braces included; None if absent or unbalanced."""
    start = text.rfind(BOXED_PREFIX)
    if start == -1:
        return None
    position = start + len(BOXED_PREFIX)
    while position < len(text) and text[position].isspace():
        position += 1
    if position == len(text) or text[position] != "{":
        return None
    depth = 0
    for end in range(position, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                return text[position + 1 : end]
    return None


def clean_answer_text(text: str) -> str:
    """Strip whitespace, math dollars, markdown bold and a trailing period around an answer."""
    return text.strip().strip("$*").strip().rstrip(".").strip()


def final_answer_phrase_text(text: str) -> str | None:
    """The answer after the last final-answer phrase, up to the end of its line or sentence; None if absent."""
    matches = list(FINAL_ANSWER_PATTERN.finditer(text))
    if not matches:
        return None
    tail = text[matches[-1].end() :].split("\n", 1)[0]
    sentence_end = SENTENCE_END_PATTERN.search(tail)
    if sentence_end:
        tail = tail[: sentence_end.start()]
    return clean_answer_text(tail)


def extract_final_answer(response: str) -> str | None:
    """The model's final answer: the last `\\boxed{}` if any, else the text after a final-answer phrase."""
    boxed = last_boxed_content(response)
    if boxed is not None:
        return boxed.strip()
    return final_answer_phrase_text(response)


# ---------------------------------------------------------------- verifiers


def numbers_match(response_number: Decimal | None, ground_truth_number: Decimal) -> float:
    """1.0 when the numbers are equal as decimals ("3.50" == "3.5", "12.0" == "12"), else 0.0."""
    return float(response_number is not None and response_number == ground_truth_number)


def required_number(ground_truth: str, verifier_name: str) -> Decimal:
    number = last_number(ground_truth)
    if number is None:
        raise ValueError(
            f"Ground truth {ground_truth!r} holds no number but the {verifier_name!r} verifier compares numbers; "
            f"fix the dataset row or give it a verifier that fits its answers."
        )
    return number


def gsm8k(response: str, ground_truth: str) -> float:
    """GSM8K: the last number in the response, compared numerically with the ground truth."""
    return numbers_match(last_number(response), required_number(ground_truth, "gsm8k"))


def arithmetic(response: str, ground_truth: str) -> float:
    """The embedded arithmetic task: the last number in the reply must equal the integer ground truth."""
    expected = required_number(ground_truth, "arithmetic")
    if expected != expected.to_integral_value():
        raise ValueError(
            f"Ground truth {ground_truth!r} is not an integer but the 'arithmetic' verifier grades integer "
            f"answers; fix the dataset row or use the 'gsm8k' verifier for decimal answers."
        )
    return numbers_match(last_number(response), expected)


def normalize_text(text: str) -> str:
    """Lowercase, collapse whitespace, drop surrounding whitespace and a trailing period."""
    return " ".join(text.lower().split()).rstrip(".").strip()


def string_match(response: str, ground_truth: str) -> float:
    """Exact match after normalisation of the final answer (or the whole response when none is marked)."""
    answer = extract_final_answer(response)
    answer = response if answer is None else answer
    return float(normalize_text(answer) == normalize_text(ground_truth))


def math_verify_timeout() -> int | None:
    """math-verify's signal-based timeout in the main thread; None (off) in other threads, where it would raise."""
    return MATH_VERIFY_TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None


def as_latex_math(answer: str) -> str:
    """Wrap a bare answer in `$...$` so math-verify's LaTeX extractor sees it as one expression."""
    answer = answer.strip()
    if BOXED_PREFIX in answer:
        return answer
    return f"${answer.strip('$')}$"


@functools.lru_cache(maxsize=4096)
def parse_ground_truth(ground_truth: str, timeout_seconds: int | None) -> tuple:
    """Parse a ground-truth answer once: each prompt is sampled several times with the same ground truth."""
    from math_verify import parse

    return tuple(parse(as_latex_math(ground_truth), parsing_timeout=timeout_seconds))


def math(response: str, ground_truth: str) -> float:
    """MATH: the last `\\boxed{}` (or final-answer phrase) is equivalent to the ground truth per math-verify.

    A response with no marked answer scores 0: the prompt asks for one, and guessing at the last expression
    would reward rambling. Any math-verify error or timeout scores 0.
    """
    from math_verify import parse, verify

    answer = extract_final_answer(response)
    if not answer or len(answer) > MAX_MATH_ANSWER_CHARS:
        return 0.0
    timeout_seconds = math_verify_timeout()
    try:
        gold = parse_ground_truth(ground_truth, timeout_seconds)
        predicted = parse(as_latex_math(answer), parsing_timeout=timeout_seconds)
        if not gold or not predicted:
            return 0.0
        return float(verify(list(gold), predicted, timeout_seconds=timeout_seconds))
    except BaseException as error:  # math-verify's TimeoutException derives from BaseException
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        logger.debug("math-verify failed on answer %r: %r", answer[:200], error)
        return 0.0


def r1_format(response: str, ground_truth: str | None = None) -> float:
    """R1-style format reward: 1.0 for `<think>...</think>` then `<answer>...</answer>` and nothing else.

    Not a ground-truth verifier: `ground_truth` is ignored.
    """
    return float(R1_FORMAT_PATTERN.fullmatch(response) is not None)


def check_numeric_ground_truth(verifier: Callable[[str, str], float]) -> Callable[[str], None]:
    """A ground-truth check for a verifier that compares numbers: grading an empty response raises for a ground truth
    it cannot compare (no number; not an integer, for `arithmetic`)."""

    def check(ground_truth: str) -> None:
        verifier("", ground_truth)

    return check


VERIFIERS: dict[str, Callable[[str, str], float]] = {
    "gsm8k": gsm8k,
    "math": math,
    "arithmetic": arithmetic,
    "string_match": string_match,
    "code": code_tests.code,
}
# Dataset names used by open-instruct (`dataset`) and verl (`data_source`), lowercased -> verifier name.
VERIFIER_ALIASES: dict[str, str] = {
    "gsm8k": "gsm8k",
    "openai/gsm8k": "gsm8k",
    "math": "math",
    "lighteval/math": "math",
    "digitallearninggmbh/math-lighteval": "math",
    "huggingfaceh4/math-500": "math",
    "arithmetic": "arithmetic",
    "string_match": "string_match",
    # Code with tests: open-instruct's `code`, verl's and PRIME's data sources, the hub sets they come from.
    "code": "code",
    "code_stdio": "code",
    "codecontests": "code",
    "deepmind/code_contests": "code",
    "apps": "code",
    "codeparrot/apps": "code",
    "taco": "code",
    "baai/taco": "code",
    "codeforces": "code",
    "primeintellect": "code",
    "primeintellect/verifiable-coding-problems": "code",
}
# Verifier name -> a check that raises ValueError (one line: the problem and the fix) for a ground truth that
# verifier cannot grade. The trainer runs it on every row before any model loads; a verifier that can grade any
# text needs none.
GROUND_TRUTH_CHECKS: dict[str, Callable[[str], None]] = {
    "gsm8k": check_numeric_ground_truth(gsm8k),
    "arithmetic": check_numeric_ground_truth(arithmetic),
    "code": code_tests.check_ground_truth,
}


def resolve_verifier_name(name: str) -> str:
    """Canonical verifier name for a dataset's `dataset`/`data_source` value (case-insensitive)."""
    canonical = VERIFIER_ALIASES.get(str(name).strip().lower())
    if canonical is None:
        raise ValueError(
            f"Unknown verifier {name!r}: known names are {', '.join(sorted(VERIFIER_ALIASES))}; set the row's "
            f"`dataset`/`data_source` to one of them or pass `--apply_verifiable_reward false`."
        )
    return canonical
