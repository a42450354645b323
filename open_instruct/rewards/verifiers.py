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
from decimal import Decimal

from open_instruct.rewards import code_tests
from open_instruct.rewards import ifeval as ifeval_rows
from open_instruct.rewards.answer_extraction import (  # noqa: F401 (the extraction API is also reached from here)
    NUMBER_PATTERN,
    extract_final_answer,
    extract_math_answer,
    last_boxed_content,
    last_number,
)

logger = logging.getLogger(__name__)
BOXED_PREFIX = "\\boxed"
R1_FORMAT_PATTERN = re.compile(
    r"\s*<think>(?:(?!</?think>|</?answer>).)*</think>\s*<answer>(?:(?!</?think>|</?answer>).)*</answer>\s*",
    re.DOTALL,
)
# Longer "answers" are almost surely not answers, and sympy can take minutes on them.
MAX_MATH_ANSWER_CHARS = 1000
# math-verify's timeouts use signal.alarm, which only works in the main thread; elsewhere they are off.
MATH_VERIFY_TIMEOUT_SECONDS = 5


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
    """MATH: the answer the response marks last (a box or a final-answer phrase) is equivalent to the ground truth
    per math-verify; the answer's leading expression is compared ("$5$ apples" -> 5, see answer_extraction.py).

    A response with no marked answer scores 0: the prompt asks for one, and guessing at the last expression
    would reward rambling. Any math-verify error or timeout scores 0.
    """
    from math_verify import parse, verify

    answer = extract_math_answer(response)
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
    "ifeval": ifeval_rows.ifeval,
    "code": code_tests.code,
}
# The verifiers that run in the trainer's process: a few linear-time regular expressions (under 50 ms on 32,000-character
# degenerate responses, measured). The others run in the reward worker, a process killed past --reward_timeout_s
# (math-verify's sympy, ifeval's checks and langdetect; reward_worker.py), except `code`, whose programs run in the
# sandbox, each test cut at --code_timeout_s.
IN_PROCESS_VERIFIERS = frozenset({"gsm8k", "arithmetic", "string_match"})
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
    "ifeval": "ifeval",
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
    "ifeval": ifeval_rows.check_ground_truth,
    "code": code_tests.check_ground_truth,
}


def warm_up(name: str) -> None:
    """Import and initialise what verifier `name` loads on its first call (math-verify's sympy, ~2 s; langdetect's
    profiles), so that the reward worker's first call is timed without it (reward_worker.LOAD_TIMEOUT_S)."""
    if name == "math":
        math("\\boxed{1}", "1")
    elif name == "ifeval":
        ifeval_rows.checks.detect_language("warm up")


def resolve_verifier_name(name: str) -> str:
    """Canonical verifier name for a dataset's `dataset`/`data_source` value (case-insensitive)."""
    canonical = VERIFIER_ALIASES.get(str(name).strip().lower())
    if canonical is None:
        raise ValueError(
            f"Unknown verifier {name!r}: known names are {', '.join(sorted(VERIFIER_ALIASES))}; set the row's "
            f"`dataset`/`data_source` to one of them or pass `--apply_verifiable_reward false`."
        )
    return canonical
