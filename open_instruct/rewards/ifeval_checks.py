"""Instruction-following constraint checks: one set, shared by both IFEval row formats (see `ifeval`).

Each check is `check(text, **arguments) -> bool` on a response whose thinking was already stripped. The text units
they count are defined once here: words, sentences (`split_sentences`, our own splitter: NLTK's punkt needs a
download at run time), paragraphs (divided by `***` lines, or by blank lines) and languages (langdetect, seeded).

Relations compare a count with a target: "less than", "at least" (Google's IFEval), "at most", "around" (Tulu 3's,
within 10% of the target and at least 1), and "exactly" (what a format fixes for "appear N times").
"""

import json
import re
import threading

RELATIONS = ("less than", "at least", "at most", "around", "exactly")
# Abbreviations that are followed by more of their sentence ("Dr. Smith", "e.g. apples"): a period after them is
# never a sentence end. Abbreviations that often end a sentence ("etc.", "Inc.") are not listed: they end one when
# a capitalised word follows, as any word does.
NON_FINAL_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof st mt sr jr vs cf fig figs no nos approx ca e.g i.e viz al gen col lt sgt capt rev hon".split()
)
# A sentence end: a run of ., !, ? or … then closing quotes or brackets, then whitespace or the end of the text. The
# run is matched from its first character only (the lookbehind): tried from each character of a long run of dots,
# the search took quadratic time (85 s for 32,000 dots followed by a letter, a degenerate response a policy can write).
SENTENCE_END = re.compile(r"(?<![.!?\u2026])([.!?\u2026]+)([\"'\u201d\u2019)\]]*)(?=\s|$)")
PARAGRAPH_DIVIDER_LINE = re.compile(r"^[ \t]*\*[ \t]*\*[ \t]*\*[ \t]*$", re.MULTILINE)
BLANK_LINES = re.compile(r"\n[ \t]*\n")
BULLET_LINE = re.compile(r"^[ \t]*[*-][ \t]+\S", re.MULTILINE)
PLACEHOLDER = re.compile(r"\[[^\[\]\n]*\]")
# *highlighted* or **highlighted** on one line; the content must hold something besides spaces.
HIGHLIGHT = re.compile(r"\*\*([^\n*]+)\*\*|\*([^\n*]+)\*")
TITLE = re.compile(r"<<([^\n<>]+)>>")
ALL_CAPS_WORD = re.compile(r"\b[A-Z][A-Z0-9]*\b")
JSON_FENCE = "```"
TWO_RESPONSES_SEPARATOR = "******"
# langdetect's codes with their English names, so that a row may name a language either way ("de" or "German").
LANGUAGE_NAMES = {
    "af": "afrikaans", "ar": "arabic", "bg": "bulgarian", "bn": "bengali", "ca": "catalan", "cs": "czech",
    "cy": "welsh", "da": "danish", "de": "german", "el": "greek", "en": "english", "es": "spanish", "et": "estonian",
    "fa": "persian", "fi": "finnish", "fr": "french", "gu": "gujarati", "he": "hebrew", "hi": "hindi",
    "hr": "croatian", "hu": "hungarian", "id": "indonesian", "it": "italian", "ja": "japanese", "kn": "kannada",
    "ko": "korean", "lt": "lithuanian", "lv": "latvian", "mk": "macedonian", "ml": "malayalam", "mr": "marathi",
    "ne": "nepali", "nl": "dutch", "no": "norwegian", "pa": "punjabi", "pl": "polish", "pt": "portuguese",
    "ro": "romanian", "ru": "russian", "sk": "slovak", "sl": "slovenian", "so": "somali", "sq": "albanian",
    "sv": "swedish", "sw": "swahili", "ta": "tamil", "te": "telugu", "th": "thai", "tl": "tagalog", "tr": "turkish",
    "uk": "ukrainian", "ur": "urdu", "vi": "vietnamese", "zh": "chinese",
}  # fmt: skip
LANGUAGE_DETECTION_SEED = 0
_language_lock = threading.Lock()


# ---------------------------------------------------------------- text units


def split_sentences(text: str) -> list[str]:
    """The sentences of `text`, each stripped, in order.

    A sentence ends at `.`, `!`, `?` or an ellipsis (runs such as `?!` or `...` count once), with any closing quotes
    or brackets after it, when whitespace or the end of the text follows; and at a blank line (a paragraph, heading
    or list block without final punctuation is a sentence of its own). A period does not end a sentence:
    - inside a number or a word ("3.5", "example.com": no whitespace follows);
    - after an abbreviation that is always followed by more of its sentence ("Dr.", "e.g.", "vs.": see
      NON_FINAL_ABBREVIATIONS), after a single letter ("J. K. Rowling") or a dotted abbreviation ("U.S.");
    - when the next word starts with a lowercase letter ("Wait... what?" is one sentence; "etc. They" is two).
    `!` and `?` always end a sentence. Pieces with no letter or digit (a lone "***" divider) are not sentences.
    """
    sentences = []
    for block in BLANK_LINES.split(text):
        start = 0
        for end_match in SENTENCE_END.finditer(block):
            if _is_sentence_end(block, end_match):
                sentences.append(block[start : end_match.end()])
                start = end_match.end()
        sentences.append(block[start:])
    return [sentence.strip() for sentence in sentences if any(char.isalnum() for char in sentence)]


def _is_sentence_end(block: str, end_match: re.Match) -> bool:
    """Whether the punctuation `end_match` found in `block` ends a sentence (see `split_sentences`)."""
    punctuation = end_match.group(1)
    if "!" in punctuation or "?" in punctuation:
        return True
    next_text = block[end_match.end() :].lstrip()
    if next_text and next_text[0].islower():
        return False
    if punctuation != ".":  # an ellipsis before a capitalised word or the end
        return True
    word = word_before(block, end_match.start())
    if not word:
        return True
    word = word.lstrip("\"'(\u201c\u2018[").lower()
    is_initial = len(word) == 1 and word.isalpha()
    is_dotted = "." in word and all(part.isalpha() and len(part) <= 2 for part in word.split("."))  # "u.s", "e.g"
    return not (word in NON_FINAL_ABBREVIATIONS or is_initial or is_dotted)


def word_before(block: str, end: int) -> str:
    """The run of non-space characters that ends at `end` ("" after a space). Walked back from `end`: a regular
    expression anchored at `end` is tried from every position before it, quadratic in a long block."""
    start = end
    while start > 0 and not block[start - 1].isspace():
        start -= 1
    return block[start:end]


def count_words(text: str) -> int:
    """Whitespace-separated tokens that hold a letter or digit ("don't" is one word; a "-" bullet is none)."""
    return sum(any(char.isalnum() for char in token) for token in text.split())


def divided_paragraphs(text: str) -> list[str] | None:
    """Paragraphs divided by `***` (or `* * *`) lines, stripped; None when one between two dividers is empty."""
    pieces = [piece.strip() for piece in PARAGRAPH_DIVIDER_LINE.split(text.strip())]
    while pieces and not pieces[0]:  # a divider before the first paragraph or after the last one is harmless
        pieces.pop(0)
    while pieces and not pieces[-1]:
        pieces.pop()
    return None if any(not piece for piece in pieces) else pieces


def blank_line_paragraphs(text: str) -> list[str]:
    """Paragraphs divided by blank lines, stripped, empty ones dropped."""
    return [piece.strip() for piece in BLANK_LINES.split(text) if piece.strip()]


def compare(count: int, relation: str, target: int) -> bool:
    """`count` stands in `relation` to `target` (see RELATIONS)."""
    if relation == "less than":
        return count < target
    if relation == "at least":
        return count >= target
    if relation == "at most":
        return count <= target
    if relation == "around":
        return abs(count - target) <= max(round(0.1 * target), 1)
    if relation == "exactly":
        return count == target
    raise ValueError(f"relation {relation!r} is not one of {', '.join(RELATIONS)}")


def whole_phrase_pattern(phrase: str) -> re.Pattern:
    """`phrase` as written (not a regex), case-insensitive, not inside a longer word."""
    return re.compile(r"(?<!\w)" + re.escape(phrase.strip()) + r"(?!\w)", re.IGNORECASE)


def detect_language(text: str) -> str | None:
    """langdetect's language code for `text` ("en", "zh-cn", ...), or None when it finds no language in it.

    Seeded: langdetect samples, and unseeded it can answer differently for the same text between calls. The seed is
    set on each call, under a lock, because it is a class attribute other code could change.
    """
    from langdetect import DetectorFactory, LangDetectException, detect

    with _language_lock:
        DetectorFactory.seed = LANGUAGE_DETECTION_SEED
        try:
            return detect(text.lower())  # case carries no language, and all-caps text confuses the n-gram profiles
        except LangDetectException:
            return None


# ---------------------------------------------------------------- checks


def contains_keywords(text: str, keywords: tuple[str, ...]) -> bool:
    """Every keyword appears, case-insensitively, anywhere in the text."""
    lowered = text.lower()
    return all(keyword.strip().lower() in lowered for keyword in keywords)


def keyword_frequency(text: str, keyword: str, count: int, relation: str) -> bool:
    """The keyword, as a whole word or phrase, appears `relation` `count` times."""
    return compare(len(whole_phrase_pattern(keyword).findall(text)), relation, count)


def avoids_words(text: str, words: tuple[str, ...]) -> bool:
    """None of the words appears as a whole word (case-insensitive): "bad" forbids "Bad", not "badge"."""
    return not any(whole_phrase_pattern(word).search(text) for word in words)


def letter_frequency(text: str, letter: str, count: int, relation: str) -> bool:
    """The letter (either case) appears `relation` `count` times."""
    return compare(text.lower().count(letter.lower()), relation, count)


def in_language(text: str, language: str) -> bool:
    """langdetect reads the text as `language` (a code; "zh" accepts zh-cn and zh-tw). Text it finds no language
    in (digits, symbols) fails: an empty answer must not earn the reward."""
    detected = detect_language(text)
    return detected is not None and (detected == language or detected.split("-")[0] == language)


def divided_paragraph_count(text: str, count: int) -> bool:
    """Exactly `count` paragraphs divided by `***` lines, none of them empty."""
    paragraphs = divided_paragraphs(text)
    return paragraphs is not None and len(paragraphs) == count


def word_count(text: str, count: int, relation: str) -> bool:
    return compare(count_words(text), relation, count)


def sentence_count(text: str, count: int, relation: str) -> bool:
    return compare(len(split_sentences(text)), relation, count)


def nth_paragraph_first_word(text: str, count: int, nth: int, first_word: str) -> bool:
    """Exactly `count` blank-line paragraphs, and paragraph `nth` (from 1) starts with `first_word` (case and
    surrounding punctuation ignored)."""
    paragraphs = blank_line_paragraphs(text)
    if len(paragraphs) != count or not 1 <= nth <= count:
        return False
    words = paragraphs[nth - 1].split()
    return bool(words) and words[0].strip("\"'*#.,:;!?()[]").lower() == first_word.strip().lower()


def has_postscript(text: str, marker: str) -> bool:
    """A line starts with the marker (case and spaces between its letters ignored: "P.S." matches "p. s.") and
    something follows it."""
    letters = [re.escape(char) for char in marker.strip() if not char.isspace()]
    pattern = re.compile(r"^[ \t*_]*" + r"\s?".join(letters) + r"[ \t*_:.-]*\S", re.IGNORECASE | re.MULTILINE)
    return pattern.search(text) is not None


def placeholder_count(text: str, count: int) -> bool:
    """At least `count` square-bracket placeholders such as [address]."""
    return len(PLACEHOLDER.findall(text)) >= count


def bullet_count(text: str, count: int) -> bool:
    """Exactly `count` markdown bullet lines ("* item" or "- item"); `***` divider lines are not bullets."""
    bullets = [match for match in BULLET_LINE.finditer(text)]
    dividers = len(PARAGRAPH_DIVIDER_LINE.findall(text))
    return len(bullets) - dividers == count


def has_title(text: str) -> bool:
    """A title in double angular brackets, <<like this>>, with something in it."""
    return any(title.strip() for title in TITLE.findall(text))


def answers_with_option(text: str, options: tuple[str, ...]) -> bool:
    """One of the options appears in the response as written."""
    return any(option.strip() in text for option in options)


def highlighted_count(text: str, count: int) -> bool:
    """At least `count` sections highlighted with markdown, *like this* or **like this**."""
    return sum(1 for bold, italic in HIGHLIGHT.findall(text) if (bold or italic).strip()) >= count


def section_count(text: str, splitter: str, count: int, relation: str) -> bool:
    """Sections marked with the splitter and a number ("Section 1", "SECTION 2") number `relation` `count`."""
    pattern = re.compile(r"(?<!\w)" + re.escape(splitter.strip()) + r"[ \t]*\d+")
    return compare(len(pattern.findall(text)), relation, count)


def is_json(text: str) -> bool:
    """The whole response is JSON, alone or in one ```json fence."""
    text = text.strip()
    # The fence is cut off by hand: the regular expression it replaces (a lazy body between optional spaces) took
    # longer than a minute on a fence followed by 8,000 spaces.
    if len(text) >= 2 * len(JSON_FENCE) and text.startswith(JSON_FENCE) and text.endswith(JSON_FENCE):
        text = text[len(JSON_FENCE) : -len(JSON_FENCE)]
        text = (text[4:] if text[:4].lower() == "json" else text).strip()
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def repeats_prompt(text: str, prompt: str) -> bool:
    """The response starts with the request, repeated word for word (case and surrounding spaces ignored)."""
    return text.strip().lower().startswith(prompt.strip().lower())


def two_responses(text: str) -> bool:
    """Two different, non-empty responses separated by one line of six asterisks."""
    parts = [part.strip() for part in text.split(TWO_RESPONSES_SEPARATOR)]
    return len(parts) == 2 and all(parts) and parts[0] != parts[1]


def english_uppercase(text: str) -> bool:
    """English, and no lowercase letter (at least one uppercase one)."""
    return text.isupper() and in_language(text, "en")


def english_lowercase(text: str) -> bool:
    """English, and no uppercase letter (at least one lowercase one)."""
    return text.islower() and in_language(text, "en")


def capital_word_frequency(text: str, count: int, relation: str) -> bool:
    """Words in capital letters only ("NASA", "I") number `relation` `count`."""
    return compare(len(ALL_CAPS_WORD.findall(text)), relation, count)


def ends_with(text: str, phrase: str) -> bool:
    """The response ends with the phrase (case, surrounding spaces and a closing quotation mark ignored)."""
    return text.strip().strip('"').strip().lower().endswith(phrase.strip().lower())


def is_quoted(text: str) -> bool:
    """The whole response is wrapped in double quotation marks."""
    text = text.strip()
    return len(text) > 1 and text[0] in '"\u201c' and text[-1] in '"\u201d'


def no_commas(text: str) -> bool:
    return "," not in text and "\uff0c" not in text
