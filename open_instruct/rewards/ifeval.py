"""The `ifeval` verifier: instruction-following rows in either of the two formats that use `dataset: "ifeval"`.

- Tulu 3's (allenai/RLVR-GSM-MATH-IF-Mixed-Constraints): the ground truth is a JSON object with `func_name` (one of
  TULU_FUNCTIONS) and that function's arguments, the unused ones null; one constraint, scored 0 or 1.
- Google's IFEval (and the multi-constraint sets built on it): `instruction_id_list` (or `instruction_id`), a list of
  INSTRUCTIONS ids, and `kwargs`, one dict of arguments per id; the score is the fraction of constraints met
  (strict: on the response as written, not on the loosened variants IFEval's "loose" score also tries).

The format is read from the ground truth's shape. Both map their arguments onto the same checks (`ifeval_checks`);
each keeps the relation its reference applies ("N times" is exact in Tulu's, Google's compares with `relation`).
Everything up to the last `</think>` is dropped before checking. A constraint that lacks an argument it needs, or
that no registry knows, is refused with a ValueError: an argument is never guessed, as a random one would change the
verdict between calls. `check_ground_truth` runs the same parsing without a response, before any model loads.
"""

import ast
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from open_instruct.rewards import ifeval_checks as checks

THINK_END = "</think>"
# Python-literal ground truths ("[{'instruction_id': [...], 'kwargs': [{...}]}]", as some hub sets store them) are
# read with ast.literal_eval, which builds literals only; longer texts are refused rather than parsed.
MAX_LITERAL_CHARS = 100_000
CONSTRAINED_RESPONSE_OPTIONS = ("My answer is yes.", "My answer is no.", "My answer is maybe.")
SECTION_SPLITTER_FIELD = "section_spliter"  # Google's spelling, kept: rows carry it


@dataclass(frozen=True)
class Constraint:
    """A row-format constraint: the check it runs, `arguments` (the row's argument name -> the check's parameter
    name; all required), and `fixed` parameters the format decides (a relation, the options of a fixed choice)."""

    check: Callable[..., bool]
    arguments: dict[str, str] = field(default_factory=dict)
    fixed: dict[str, object] = field(default_factory=dict)


# Tulu 3's `func_name`s (open-instruct's IF functions) and their argument names.
TULU_FUNCTIONS: dict[str, Constraint] = {
    "verify_keywords": Constraint(checks.contains_keywords, {"keyword_list": "keywords"}),
    "verify_keyword_frequency": Constraint(
        checks.keyword_frequency, {"word": "keyword", "N": "count"}, {"relation": "exactly"}
    ),
    "validate_forbidden_words": Constraint(checks.avoids_words, {"forbidden_words": "words"}),
    "verify_letter_frequency": Constraint(
        checks.letter_frequency, {"letter": "letter", "N": "count"}, {"relation": "exactly"}
    ),
    "validate_response_language": Constraint(checks.in_language, {"language": "language"}),
    "verify_paragraph_count": Constraint(checks.divided_paragraph_count, {"N": "count"}),
    "validate_word_constraint": Constraint(checks.word_count, {"N": "count", "quantifier": "relation"}),
    "verify_sentence_constraint": Constraint(checks.sentence_count, {"N": "count", "quantifier": "relation"}),
    "validate_paragraphs": Constraint(
        checks.nth_paragraph_first_word, {"N": "count", "i": "nth", "first_word": "first_word"}
    ),
    "verify_postscript": Constraint(checks.has_postscript, {"postscript_marker": "marker"}),
    "validate_placeholders": Constraint(checks.placeholder_count, {"N": "count"}),
    "verify_bullet_points": Constraint(checks.bullet_count, {"N": "count"}),
    "validate_title": Constraint(checks.has_title),
    "validate_choice": Constraint(checks.answers_with_option, {"options": "options"}),
    "validate_highlighted_sections": Constraint(checks.highlighted_count, {"N": "count"}),
    "validate_sections": Constraint(
        checks.section_count, {"N": "count", "section_splitter": "splitter"}, {"relation": "exactly"}
    ),
    "validate_json_format": Constraint(checks.is_json),
    "validate_repeat_prompt": Constraint(checks.repeats_prompt, {"original_prompt": "prompt"}),
    "validate_two_responses": Constraint(checks.two_responses),
    "validate_uppercase": Constraint(checks.english_uppercase),
    "validate_lowercase": Constraint(checks.english_lowercase),
    "validate_frequency_capital_words": Constraint(
        checks.capital_word_frequency, {"N": "count", "quantifier": "relation"}
    ),
    "validate_end": Constraint(checks.ends_with, {"end_phrase": "phrase"}),
    "validate_quotation": Constraint(checks.is_quoted),
    "validate_no_commas": Constraint(checks.no_commas),
}

# Google's IFEval instruction ids and their `kwargs` names.
INSTRUCTIONS: dict[str, Constraint] = {
    "keywords:existence": Constraint(checks.contains_keywords, {"keywords": "keywords"}),
    "keywords:frequency": Constraint(
        checks.keyword_frequency, {"keyword": "keyword", "frequency": "count", "relation": "relation"}
    ),
    "keywords:forbidden_words": Constraint(checks.avoids_words, {"forbidden_words": "words"}),
    "keywords:letter_frequency": Constraint(
        checks.letter_frequency, {"letter": "letter", "let_frequency": "count", "let_relation": "relation"}
    ),
    "language:response_language": Constraint(checks.in_language, {"language": "language"}),
    "length_constraints:number_sentences": Constraint(
        checks.sentence_count, {"num_sentences": "count", "relation": "relation"}
    ),
    "length_constraints:number_paragraphs": Constraint(checks.divided_paragraph_count, {"num_paragraphs": "count"}),
    "length_constraints:number_words": Constraint(checks.word_count, {"num_words": "count", "relation": "relation"}),
    "length_constraints:nth_paragraph_first_word": Constraint(
        checks.nth_paragraph_first_word, {"num_paragraphs": "count", "nth_paragraph": "nth", "first_word": "first_word"}
    ),
    "detectable_content:number_placeholders": Constraint(checks.placeholder_count, {"num_placeholders": "count"}),
    "detectable_content:postscript": Constraint(checks.has_postscript, {"postscript_marker": "marker"}),
    "detectable_format:number_bullet_lists": Constraint(checks.bullet_count, {"num_bullets": "count"}),
    "detectable_format:constrained_response": Constraint(
        checks.answers_with_option, fixed={"options": CONSTRAINED_RESPONSE_OPTIONS}
    ),
    "detectable_format:number_highlighted_sections": Constraint(checks.highlighted_count, {"num_highlights": "count"}),
    "detectable_format:multiple_sections": Constraint(
        checks.section_count, {SECTION_SPLITTER_FIELD: "splitter", "num_sections": "count"}, {"relation": "at least"}
    ),
    "detectable_format:json_format": Constraint(checks.is_json),
    "detectable_format:title": Constraint(checks.has_title),
    "combination:two_responses": Constraint(checks.two_responses),
    "combination:repeat_prompt": Constraint(checks.repeats_prompt, {"prompt_to_repeat": "prompt"}),
    "startend:end_checker": Constraint(checks.ends_with, {"end_phrase": "phrase"}),
    "startend:quotation": Constraint(checks.is_quoted),
    "change_case:capital_word_frequency": Constraint(
        checks.capital_word_frequency, {"capital_frequency": "count", "capital_relation": "relation"}
    ),
    "change_case:english_capital": Constraint(checks.english_uppercase),
    "change_case:english_lowercase": Constraint(checks.english_lowercase),
    "punctuation:no_comma": Constraint(checks.no_commas),
}


# ---------------------------------------------------------------- arguments


def _count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError("a whole number >= 0")
    number = float(value)
    if not number.is_integer() or number < 0:
        raise TypeError("a whole number >= 0")
    return int(number)


def _text(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise TypeError("a non-empty string")
    return value


def _texts(value: object) -> tuple[str, ...]:
    """A list of non-empty strings; a string holding a JSON or Python list is read as that list."""
    if isinstance(value, str):
        value = _literal(value)
    if not isinstance(value, list | tuple) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise TypeError("a non-empty list of non-empty strings")
    return tuple(value)


def _relation(value: object) -> str:
    if value not in checks.RELATIONS:
        raise TypeError(f"one of {', '.join(repr(r) for r in checks.RELATIONS)}")
    return value


def _letter(value: object) -> str:
    if not isinstance(value, str) or len(value) != 1 or not value.isalpha():
        raise TypeError("a single letter")
    return value


def _language(value: object) -> str:
    """A langdetect code ("de") or its English name ("German") -> the code."""
    codes_by_name = {name: code for code, name in checks.LANGUAGE_NAMES.items()}
    if isinstance(value, str) and value.strip().lower() in checks.LANGUAGE_NAMES:
        return value.strip().lower()
    if isinstance(value, str) and value.strip().lower() in codes_by_name:
        return codes_by_name[value.strip().lower()]
    raise TypeError("a language code such as 'de' or an English name such as 'German' (see LANGUAGE_NAMES)")


# What each check parameter must hold, and how a row's value becomes it.
PARAMETERS: dict[str, Callable[[object], object]] = {
    "count": _count, "nth": _count, "relation": _relation, "keywords": _texts, "words": _texts, "options": _texts,
    "keyword": _text, "first_word": _text, "marker": _text, "splitter": _text, "prompt": _text, "phrase": _text,
    "letter": _letter, "language": _language,
}  # fmt: skip


def _literal(text: str) -> object:
    """A JSON or Python literal; ValueError when `text` is neither."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    if len(text) > MAX_LITERAL_CHARS:
        raise ValueError(f"not JSON, and longer than {MAX_LITERAL_CHARS} characters")
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as error:
        raise ValueError("neither JSON nor a Python literal") from error


# ---------------------------------------------------------------- ground truths


@dataclass(frozen=True)
class BoundConstraint:
    """One constraint of a row, its arguments read: `check(text, **parameters)`."""

    name: str
    check: Callable[..., bool]
    parameters: tuple[tuple[str, object], ...]

    def __call__(self, text: str) -> bool:
        return self.check(text, **dict(self.parameters))


class _Refusal(ValueError):
    """A ground truth the verifier cannot grade; its message is one line that names the row's content."""


def _shown(ground_truth: str) -> str:
    return repr(ground_truth if len(ground_truth) <= 120 else ground_truth[:117] + "...")


def _bind(name: str, constraint: Constraint, arguments: dict, registry: dict[str, Constraint]) -> BoundConstraint:
    """The constraint with the row's arguments read; raises _Refusal naming what is missing or wrong.

    Arguments another constraint of the same format takes are ignored (converted rows carry every argument name,
    most of them null); a name no constraint of the format takes is refused, as it is most likely a misspelt one.
    """
    format_name = "Tulu 3" if registry is TULU_FUNCTIONS else "IFEval"
    arguments = {key: value for key, value in arguments.items() if value is not None and key != "func_name"}
    known = {argument for other in registry.values() for argument in other.arguments}
    unknown = sorted(set(arguments) - known)
    if unknown:
        raise _Refusal(
            f"{format_name} constraint {name!r} got arguments {unknown} that no {format_name} constraint takes; "
            f"rename them to {sorted(constraint.arguments) or 'nothing (it takes no arguments)'} or remove them"
        )
    parameters = dict(constraint.fixed)
    for argument, parameter in constraint.arguments.items():
        if argument not in arguments:
            raise _Refusal(
                f"{format_name} constraint {name!r} needs argument {argument!r} ({_expected(parameter)}), which the "
                "row lacks; add it (arguments are never guessed)"
            )
        try:
            parameters[parameter] = PARAMETERS[parameter](arguments[argument])
        except (TypeError, ValueError) as error:
            raise _Refusal(
                f"{format_name} constraint {name!r} argument {argument!r} is {arguments[argument]!r}, expected "
                f"{error}; fix the row"
            ) from None
    return BoundConstraint(name, constraint.check, tuple(sorted(parameters.items())))


def _expected(parameter: str) -> str:
    """What the parameter must hold, from its reader's error."""
    try:
        PARAMETERS[parameter](None)
    except (TypeError, ValueError) as error:
        return str(error)
    return "a value"


def _tulu_constraints(ground_truth: dict) -> tuple[BoundConstraint, ...]:
    func_name = ground_truth["func_name"]
    if func_name not in TULU_FUNCTIONS:
        raise _Refusal(f"unknown func_name {func_name!r}; expected one of {', '.join(sorted(TULU_FUNCTIONS))}")
    return (_bind(func_name, TULU_FUNCTIONS[func_name], ground_truth, TULU_FUNCTIONS),)


def _ifeval_constraints(ground_truth: dict) -> tuple[BoundConstraint, ...]:
    ids = ground_truth.get("instruction_id_list", ground_truth.get("instruction_id"))
    if isinstance(ids, str):
        ids = [ids]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise _Refusal(
            f"the instruction ids are {ids!r}, expected a non-empty list of ids such as 'punctuation:no_comma'"
        )
    kwargs = ground_truth.get("kwargs")
    kwargs = [{} for _ in ids] if kwargs is None else kwargs
    if isinstance(kwargs, dict):
        kwargs = [kwargs]
    if not isinstance(kwargs, list) or len(kwargs) != len(ids):
        raise _Refusal(f"`kwargs` is {kwargs!r}, expected a list of {len(ids)} dicts, one per instruction id")
    bound = []
    for instruction_id, arguments in zip(ids, kwargs):
        if instruction_id not in INSTRUCTIONS:
            raise _Refusal(
                f"unknown instruction id {instruction_id!r}; expected one of Google's IFEval ids "
                f"({', '.join(sorted(INSTRUCTIONS))})"
            )
        if arguments is not None and not isinstance(arguments, dict):
            raise _Refusal(f"the kwargs of {instruction_id!r} are {arguments!r}, expected a dict")
        bound.append(_bind(instruction_id, INSTRUCTIONS[instruction_id], arguments or {}, INSTRUCTIONS))
    return tuple(bound)


@functools.lru_cache(maxsize=8192)
def constraints_of(ground_truth: str) -> tuple[BoundConstraint, ...]:
    """The constraints an ifeval ground truth holds, in either format; ValueError (one line) when it cannot be graded.
    Cached: each prompt is sampled several times with the same ground truth."""
    try:
        if not isinstance(ground_truth, str):
            raise _Refusal(f"the ground truth is a {type(ground_truth).__name__}, expected its JSON text")
        try:
            parsed = _literal(ground_truth)
        except ValueError as error:
            raise _Refusal(f"the ground truth is {error}") from None
        if isinstance(parsed, list) and len(parsed) == 1:  # open-instruct's newer rows wrap the object in a list
            parsed = parsed[0]
        if isinstance(parsed, str):  # ... whose element may itself be JSON text
            parsed = _literal(parsed)
        if not isinstance(parsed, dict):
            raise _Refusal(f"the ground truth is a {type(parsed).__name__}, expected a JSON object")
        is_tulu = "func_name" in parsed
        is_ifeval = "instruction_id_list" in parsed or "instruction_id" in parsed
        if is_tulu == is_ifeval:
            raise _Refusal(
                "expected either `func_name` (Tulu 3's format) or `instruction_id_list`/`instruction_id` with `kwargs` "
                f"(Google's IFEval format), found keys {sorted(parsed)}"
            )
        return _tulu_constraints(parsed) if is_tulu else _ifeval_constraints(parsed)
    except _Refusal as refusal:
        raise ValueError(
            f"ifeval ground truth {_shown(str(ground_truth))}: {refusal} (docs/data.md, 'Instruction-following rows')."
        ) from None


def strip_thinking(response: str) -> str:
    """The answer after the last `</think>`: constraints apply to what the user reads, not to the reasoning."""
    return response.rsplit(THINK_END, 1)[-1].strip()


def constraint_results(response: str, ground_truth: str) -> list[tuple[str, bool]]:
    """(constraint name, met) for each constraint of the row."""
    answer = strip_thinking(response)
    return [(constraint.name, bool(answer) and constraint(answer)) for constraint in constraints_of(ground_truth)]


def ifeval(response: str, ground_truth: str) -> float:
    """The fraction of the row's constraints the response meets (0 or 1 for Tulu 3's one-constraint rows)."""
    results = constraint_results(response, ground_truth)
    return sum(met for _, met in results) / len(results)


def check_ground_truth(ground_truth: str) -> None:
    """Raise ValueError (one line: the row's content, what is wrong, the fix) for a ground truth `ifeval` cannot grade."""
    constraints_of(ground_truth)
