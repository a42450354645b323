"""Reading a model's final answer out of its response text, for the verifiers in rewards/verifiers.py.

A response marks its answer with a box (`\\boxed{5}`, `\\boxed 5`, `\\fbox{5}`) or a phrase ("The answer is 5",
"Final answer: 5", "The answer to the question is 5", "**Final Answer**: 5", a "## Final Answer" heading with the
answer on the lines below). The marker that comes last in the response wins: a model that boxes 5 and then writes
"The answer is 6" answers 6, and one that says 6 and then boxes 5 answers 5. A marker without a usable answer
(an unbalanced box, a phrase followed by nothing or by a verdict such as "correct") is skipped, so an earlier good
marker still counts. The rules are listed for users in docs/data.md ("How answers are read"), and
tests/test_answer_extraction.py holds the mistakes they fix.
"""

import re
from decimal import Decimal, InvalidOperation

# A number as models write it: optional minus, digits with optional thousands separators, optional decimals, or
# a bare decimal fraction (".5"). The look-behind keeps "3-5" from reading as -5, "x2" as 2 and the tail of
# "1.2.3" as a number; a sentence's final period ("is 5.") is no decimal point since no digit follows it.
NUMBER_PATTERN = re.compile(r"(?<![\w.])-?(?:(?:\d{1,3}(?:,\d{3}(?!\d))+|\d+)(?:\.\d+)?|\.\d+)")
# `\boxed` and `\fbox`, but not a longer command that starts with those letters.
BOX_COMMAND_PATTERN = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
# "The answer is", "Final answer:", "The final answer is:", "The answer to this problem is", "**Final Answer**:",
# "**Final Answer:**", and "Final Answer" alone on its line (a markdown heading or bold line) above the answer.
ANSWER_PHRASE_PATTERN = re.compile(
    r"\b(?:final\s+)?answer(?:\s+to\s+(?:the|this)\s+(?:question|problem))?[*_]*\s*(?:is\b\s*:?|:)"
    r"|\bfinal\s+answer[*_:]*[ \t]*(?=\r?\n|$)",
    re.IGNORECASE,
)
# Words between the phrase and the answer that carry no answer: "The answer is therefore 6", "... is given by
# $x = 6$", "... is as follows:" (then the answer is on the next line).
FILLER_WORDS_PATTERN = re.compile(
    r"(?:therefore|thus|hence|so|then|indeed|clearly|simply|actually|just|now|given\s+by|as\s+follows"
    r"|(?:as\s+)?shown\s+below)\b[\s,:.]*",
    re.IGNORECASE,
)
# "The answer is correct", "... is not 5", "... is above": a remark about an answer, not one. After a box such a
# remark must not replace the boxed answer (the last marker wins, so it would otherwise).
VERDICT_PATTERN = re.compile(
    r"(?:correct|incorrect|right|wrong|clear|confirmed|verified|consistent|reasonable|plausible|valid|invalid"
    r"|helpful|not|above|boxed)\b",
    re.IGNORECASE,
)
# How far after a phrase its answer is looked for: far beyond any real answer, and it keeps a response that
# repeats "The answer is" thousands of times from costing quadratic time.
ANSWER_WINDOW_CHARS = 2000
SENTENCE_END_PATTERN = re.compile(r"\.(?:\s|$)")
# Math wrappers an answer may start with, opening -> closing; `$$` before `$` so that `$$5$$` reads as 5.
MATH_SPAN_DELIMITERS = (("$$", "$$"), ("\\[", "\\]"), ("\\(", "\\)"), ("$", "$"))
# An escaped dollar (`\$18`) is a currency sign inside the math, not a delimiter.
MATH_DELIMITER_PATTERN = re.compile(r"(?<!\\)\$\$|\\\[|\\\]|\\\(|\\\)|(?<!\\)\$")
# A word of two or more letters after a space (a LaTeX command has a backslash there instead): where the words
# after a math answer begin ("5, because ...", "5 apples", "\frac{1}{2} of the pie"). "or" and "and" join the parts
# of one answer ("x = 5 or x = -5"), which math-verify reads as a set.
TRAILING_WORD_PATTERN = re.compile(r",?\s+(?!(?:or|and)\b)[A-Za-z]{2,}\b")
ENGLISH_WORD_PATTERN = re.compile(r"[A-Za-z]{2,}\b")


def normalize_number_text(text: str) -> str:
    """Unicode minus to ASCII, so "−3" reads as -3."""
    return text.replace("\u2212", "-")


def last_number(text: str) -> Decimal | None:
    """The last number written in `text` ("1,234" -> 1234, "-3.50" -> -3.5, ".5" -> 0.5), or None when there is none."""
    matches = NUMBER_PATTERN.findall(normalize_number_text(text))
    if not matches:
        return None
    try:
        return Decimal(matches[-1].replace(",", ""))
    except InvalidOperation:
        return None


def matching_close_braces(text: str) -> dict[int, int]:
    """Position of each `{` -> position of its matching `}`, in one pass; unclosed braces are left out.

    One pass, so that a degenerate response repeating "\\boxed{1" thousands of times costs linear time, not a scan
    to the end for every box.
    """
    open_positions, matches = [], {}
    for position, character in enumerate(text):
        if character == "{":
            open_positions.append(position)
        elif character == "}" and open_positions:
            matches[open_positions.pop()] = position
    return matches


def box_markers(text: str) -> list[tuple[int, str]]:
    """(position, content) of every well-formed box: `\\boxed{...}`, `\\fbox{...}`, or `\\boxed 5` (no braces).

    Without braces the box holds the next token ("\\boxed 5." -> "5"), unless that is an English word ("in \\boxed
    form" is prose). A box whose braces never close is skipped.
    """
    markers, close_braces = [], None
    for command in BOX_COMMAND_PATTERN.finditer(text):
        position = command.end()
        while position < len(text) and text[position].isspace():
            position += 1
        if position < len(text) and text[position] == "{":
            close_braces = matching_close_braces(text) if close_braces is None else close_braces
            close = close_braces.get(position)
            content = None if close is None else text[position + 1 : close]
        else:
            token = re.match(r"[^\s$]*", text[position:]).group().rstrip(".,;:")
            content = token if token and not ENGLISH_WORD_PATTERN.fullmatch(token) else None
        if content is not None:
            markers.append((command.start(), content.strip()))
    return markers


def last_boxed_content(text: str) -> str | None:
    """Content of the last well-formed box in `text` (`\\boxed{}`, `\\boxed 5`, `\\fbox{}`); None if there is none."""
    markers = box_markers(text)
    return markers[-1][1] if markers else None


def clean_answer_text(text: str) -> str:
    """Strip whitespace, math dollars, markdown bold and a trailing period around an answer."""
    return text.strip().strip("$*").strip().rstrip(".").strip()


def leading_math_span(text: str) -> str | None:
    """The content of the math span `text` starts with (`$...$`, `$$...$$`, `\\[...\\]`, `\\(...\\)`), else None."""
    for opening, closing in MATH_SPAN_DELIMITERS:
        if text.startswith(opening):
            end = text.find(closing, len(opening))
            while end > 0 and text[end - 1] == "\\":  # an escaped `\$` does not close the span
                end = text.find(closing, end + 1)
            if end > len(opening):
                return text[len(opening) : end].strip()
    return None


def phrase_answer_text(tail: str) -> str | None:
    """The answer written right after a final-answer phrase; None when what follows is no answer.

    The answer is the math span the tail starts with, else the rest of the line up to the sentence's end. A phrase
    that ends its line ("The final answer is:", a "## Final Answer" heading) has its answer on the next non-empty line.
    """
    tail = tail.lstrip(" \t\r\n*_:")
    while filler := FILLER_WORDS_PATTERN.match(tail):
        tail = tail[filler.end() :]
    if VERDICT_PATTERN.match(tail):
        return None
    span = leading_math_span(tail)
    if span is not None:
        return span or None
    line = tail.split("\n", 1)[0]
    sentence_end = SENTENCE_END_PATTERN.search(line)
    if sentence_end:
        line = line[: sentence_end.start()]
    return clean_answer_text(line) or None


def phrase_markers(text: str) -> list[tuple[int, str]]:
    """(position, answer) of every final-answer phrase followed by an answer."""
    markers = []
    for phrase in ANSWER_PHRASE_PATTERN.finditer(text):
        answer = phrase_answer_text(text[phrase.end() : phrase.end() + ANSWER_WINDOW_CHARS])
        if answer is not None:
            markers.append((phrase.start(), answer))
    return markers


def extract_final_answer(response: str) -> str | None:
    """The model's final answer: the one its last marker (a box or a final-answer phrase) holds; None if unmarked.

    An empty box marks nothing. The answer is returned as written (a string answer keeps its words).
    """
    markers = [(position, answer) for position, answer in box_markers(response) if answer]
    markers += phrase_markers(response)
    if not markers:
        return None
    return max(markers)[1]


def leading_math_expression(answer: str) -> str:
    """The math expression an answer starts with, without math delimiters or the words after it.

    "$5$ apples" -> "5", "5, because 2 + 3 = 5" -> "5", "\\frac{1}{2} of the pie" -> "\\frac{1}{2}". Words inside
    braces or brackets stay ("5\\text{ dollars}", "(1, \\infty)"); an answer that starts with a word ("all real
    numbers") is kept whole.
    """
    span = leading_math_span(answer.strip())
    answer = MATH_DELIMITER_PATTERN.sub(" ", answer if span is None else span).strip()
    if ENGLISH_WORD_PATTERN.match(answer):
        return answer
    for word in TRAILING_WORD_PATTERN.finditer(answer):
        before = answer[: word.start()]
        depth = sum(before.count(opening) for opening in "{([") - sum(before.count(closing) for closing in "})]")
        if depth <= 0:
            return before.rstrip(" ,;:.")
    return answer


def extract_math_answer(response: str) -> str | None:
    """The math expression of the model's final answer (see `extract_final_answer`); None if unmarked or empty."""
    answer = extract_final_answer(response)
    if answer is None:
        return None
    return leading_math_expression(answer) or None
