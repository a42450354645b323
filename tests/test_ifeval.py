"""The ifeval verifier: every constraint of both row formats with a response that meets it and one that does not
(all written here), fraction scoring, `</think>` stripping, refusals of rows it cannot grade, the sentence splitter,
and language detection that gives the same verdict every time, in any process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from open_instruct.rewards import ifeval_checks
from open_instruct.rewards.ifeval import INSTRUCTIONS, TULU_FUNCTIONS, check_ground_truth, constraint_results, ifeval
from open_instruct.rewards.manager import RewardConfig, RewardManager
from open_instruct.rewards.verifiers import GROUND_TRUTH_CHECKS, VERIFIERS, resolve_verifier_name

GERMAN = "Ich habe heute einen langen Spaziergang im Park gemacht und die Sonne sehr genossen."
ENGLISH = "I went for a long walk in the park today and enjoyed the sunshine very much."
END_PHRASE = "Is there anything else I can help with?"

# func_name -> (its arguments, a response that meets the constraint, one that does not)
TULU_CASES = {
    "verify_keywords": ({"keyword_list": ["cat", "moon"]}, "The cat looked at the Moon tonight.", "The cat slept."),
    "verify_keyword_frequency": (
        {"word": "blue", "N": 2}, "Blue sky, a bluebird, blue sea.", "Blue sky, blue sea, blue boat."
    ),
    "validate_forbidden_words": ({"forbidden_words": ["bad", "evil"]}, "A badge is good.", "That was a Bad idea."),
    "verify_letter_frequency": ({"letter": "z", "N": 2}, "Zoe saw a zebra.", "Zoe saw a lion."),
    "validate_response_language": ({"language": "de"}, GERMAN, ENGLISH),
    "verify_paragraph_count": ({"N": 2}, "First part.\n* * *\nSecond part.", "First part.\n\nSecond part."),
    "validate_word_constraint": (
        {"N": 5, "quantifier": "at most"}, "Cats are nice pets.", "Cats are very nice and friendly pets."
    ),
    "verify_sentence_constraint": (
        {"N": 3, "quantifier": "at least"}, "Dr. Smith came. He sat down! Was it late?", "Dr. Smith paid 3.5 dollars. He left."
    ),
    "validate_paragraphs": (
        {"N": 2, "i": 2, "first_word": "Finally"}, "Cats sleep a lot.\n\nFinally, they eat.", "Cats sleep.\n\nThen they eat."
    ),
    "verify_postscript": ({"postscript_marker": "P.S."}, "Hi Tom.\n\nP.S. Bring snacks.", "Hi Tom. Bring snacks."),
    "validate_placeholders": ({"N": 2}, "Send it to [name] at [address].", "Send it to [name]."),
    "verify_bullet_points": ({"N": 2}, "* apples\n* pears", "* apples\n* pears\n- plums"),
    "validate_title": ({}, "<<Ode to Rain>>\nRain falls.", "Ode to Rain\nRain falls."),
    "validate_choice": ({"options": ["My answer is yes.", "My answer is no."]}, "My answer is no.", "Perhaps."),
    "validate_highlighted_sections": ({"N": 2}, "*First* and **second** points.", "*First* point only."),
    "validate_sections": (
        {"N": 2, "section_splitter": "SECTION"}, "SECTION 1\nIntro.\nSECTION 2\nEnd.", "SECTION 1\nIntro and end."
    ),
    "validate_json_format": ({}, '```json\n{"a": 1}\n```', '{"a": 1} is the answer.'),
    "validate_repeat_prompt": (
        {"original_prompt": "Write a haiku about rain."}, "Write a haiku about rain. Soft rain.", "Soft rain on the roof."
    ),
    "validate_two_responses": ({}, "Yes, it is.\n******\nNo, it is not.", "Yes.\n******\nYes."),
    "validate_uppercase": ({}, ENGLISH.upper(), ENGLISH),
    "validate_lowercase": ({}, ENGLISH.lower(), ENGLISH),
    "validate_frequency_capital_words": ({"N": 2, "quantifier": "at least"}, "NASA and ESA fly.", "NASA flies."),
    "validate_end": ({"end_phrase": END_PHRASE}, f"Done. {END_PHRASE}", f"{END_PHRASE} Bye."),
    "validate_quotation": ({}, '"Hello there."', 'Hello "there".'),
    "validate_no_commas": ({}, "Red and blue.", "Red, blue."),
}  # fmt: skip

# instruction id -> (its kwargs, a response that meets the constraint, one that does not)
GOOGLE_CASES = {
    "keywords:existence": ({"keywords": ["cat", "moon"]}, "The cat looked at the Moon.", "The cat slept."),
    "keywords:frequency": (
        {"keyword": "blue", "frequency": 3, "relation": "less than"}, "Blue sky, blue sea.", "Blue sky, blue sea, blue boat."
    ),
    "keywords:forbidden_words": ({"forbidden_words": ["evil"]}, "Nothing devilish.", "An evil plan."),
    "keywords:letter_frequency": (
        {"letter": "e", "let_frequency": 3, "let_relation": "at least"}, "Eve sees trees.", "A cat."
    ),
    "language:response_language": ({"language": "de"}, GERMAN, ENGLISH),
    "length_constraints:number_sentences": (
        {"num_sentences": 2, "relation": "less than"}, "It costs 3.5 dollars, e.g. cheap.", "One. Two."
    ),
    "length_constraints:number_paragraphs": ({"num_paragraphs": 2}, "One.\n***\nTwo.", "One.\n***\n\n***\nTwo."),
    "length_constraints:number_words": ({"num_words": 4, "relation": "at least"}, "I like red apples.", "I like red."),
    "length_constraints:nth_paragraph_first_word": (
        {"num_paragraphs": 3, "nth_paragraph": 1, "first_word": "dogs"},
        "Dogs bark.\n\nCats purr.\n\nBirds sing.", "Cats purr.\n\nDogs bark.\n\nBirds sing.",
    ),
    "detectable_content:number_placeholders": ({"num_placeholders": 1}, "Dear [name], hi.", "Dear Sam, hi."),
    "detectable_content:postscript": ({"postscript_marker": "P.P.S"}, "Bye.\nP.P.S see you", "Bye. See you."),
    "detectable_format:number_bullet_lists": ({"num_bullets": 3}, "* a\n* b\n* c", "* a\n* b"),
    "detectable_format:constrained_response": ({}, "My answer is maybe.", "I am not sure."),
    "detectable_format:number_highlighted_sections": ({"num_highlights": 1}, "A *key* point.", "A ** point."),
    "detectable_format:multiple_sections": (
        {"section_spliter": "Section", "num_sections": 2}, "Section 1\nA.\nSection 2\nB.", "Section 1\nA and B."
    ),
    "detectable_format:json_format": ({}, '{"answer": [1, 2]}', "answer: [1, 2]"),
    "detectable_format:title": ({}, "<<My Day>>\nIt was fine.", "<<>>\nIt was fine."),
    "combination:two_responses": ({}, "Tea.\n******\nCoffee.", "Tea.\n******\nCoffee.\n******\nWater."),
    "combination:repeat_prompt": (
        {"prompt_to_repeat": "Name a fruit."}, "name a fruit. Apple.", "Apple. Name a fruit."
    ),
    "startend:end_checker": ({"end_phrase": "Any other questions?"}, '"Sure. Any other questions?"', "Any other questions? No."),
    "startend:quotation": ({}, '"Quoted."', "Not quoted."),
    "change_case:capital_word_frequency": (
        {"capital_frequency": 2, "capital_relation": "less than"}, "Only NASA here.", "NASA and ESA here."
    ),
    "change_case:english_capital": ({}, ENGLISH.upper(), GERMAN.upper()),
    "change_case:english_lowercase": ({}, ENGLISH.lower(), GERMAN.lower()),
    "punctuation:no_comma": ({}, "No commas here.", "One, two."),
}  # fmt: skip


def tulu_row(func_name: str, **arguments) -> str:
    """A Tulu 3 ground truth as the hub stores it: every argument name present, the unused ones null."""
    names = {name for constraint in TULU_FUNCTIONS.values() for name in constraint.arguments}
    return json.dumps({"func_name": func_name, **dict.fromkeys(sorted(names)), **arguments})


def google_row(ids: list[str], kwargs: list[dict]) -> str:
    return json.dumps({"instruction_id_list": ids, "kwargs": kwargs})


def test_every_constraint_has_a_case():
    """A checker added without a test case fails here."""
    assert set(TULU_CASES) == set(TULU_FUNCTIONS)
    assert set(GOOGLE_CASES) == set(INSTRUCTIONS)
    assert len(TULU_FUNCTIONS) == 25 and len(INSTRUCTIONS) == 25  # open-instruct's 25 functions, Google's 25 ids


@pytest.mark.parametrize("func_name", sorted(TULU_CASES))
def test_tulu_constraint(func_name):
    arguments, meets, fails = TULU_CASES[func_name]
    ground_truth = tulu_row(func_name, **arguments)
    assert ifeval(meets, ground_truth) == 1.0
    assert ifeval(fails, ground_truth) == 0.0


@pytest.mark.parametrize("instruction_id", sorted(GOOGLE_CASES))
def test_google_constraint(instruction_id):
    kwargs, meets, fails = GOOGLE_CASES[instruction_id]
    ground_truth = google_row([instruction_id], [kwargs])
    assert ifeval(meets, ground_truth) == 1.0
    assert ifeval(fails, ground_truth) == 0.0


def test_google_score_is_the_fraction_of_constraints_met():
    ground_truth = google_row(
        ["punctuation:no_comma", "keywords:existence", "startend:end_checker"],
        [{}, {"keywords": ["tea"]}, {"end_phrase": "Cheers."}],
    )
    assert ifeval("I drink tea. Cheers.", ground_truth) == 1.0
    assert ifeval("I drink tea, hot. Cheers.", ground_truth) == pytest.approx(2 / 3)
    assert ifeval("Coffee, black.", ground_truth) == 0.0


def test_ground_truth_shapes_open_instruct_and_google_store():
    """`instruction_id` instead of `instruction_id_list`; a one-element list around the object, as JSON or as a
    Python literal with None; Google's kwargs with null entries; all read as the same constraint."""
    shapes = [
        json.dumps({"instruction_id": ["punctuation:no_comma"], "kwargs": [None]}),
        json.dumps([{"instruction_id": ["punctuation:no_comma"], "kwargs": [{}]}]),
        str([{"instruction_id": ["punctuation:no_comma"], "kwargs": [{"num_words": None}]}]),
        json.dumps([json.dumps({"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]})]),
    ]
    for ground_truth in shapes:
        assert (ifeval("No commas.", ground_truth), ifeval("A, b.", ground_truth)) == (1.0, 0.0), ground_truth


def test_thinking_is_stripped_before_checking():
    ground_truth = tulu_row("validate_no_commas")
    assert ifeval("<think>First, commas, everywhere.</think>\nA plain answer.", ground_truth) == 1.0
    assert ifeval("<think>Plain.</think>\nAn answer, with a comma.", ground_truth) == 0.0
    # Nothing after the thinking: nothing to meet a constraint with, even one an empty text would pass.
    assert (
        ifeval("<think>I will avoid evil.</think>", tulu_row("validate_forbidden_words", forbidden_words=["x"])) == 0.0
    )


def test_the_verifier_is_registered_and_logged_under_its_name():
    assert resolve_verifier_name("ifeval") == "ifeval" and VERIFIERS["ifeval"] is ifeval
    manager = RewardManager(RewardConfig())
    ground_truths = [tulu_row("validate_no_commas"), google_row(["punctuation:no_comma"], [{}])]
    _, metrics = manager.score(["Yes.", "Yes, no."], ground_truths, ["ifeval", "IFEval"], [True, True])
    assert metrics["objective/ifeval_correct_rate"] == 0.5


@pytest.mark.parametrize(
    ("ground_truth", "message"),
    [
        (tulu_row("verify_keywordz"), "unknown func_name 'verify_keywordz'"),
        (google_row(["keywords:existance"], [{}]), "unknown instruction id 'keywords:existance'"),
        (tulu_row("validate_word_constraint", N=50), "needs argument 'quantifier'"),
        (tulu_row("verify_bullet_points"), "'verify_bullet_points' needs argument 'N' (a whole number >= 0)"),
        (
            google_row(["keywords:frequency"], [{"keyword": "cat", "relation": "at least"}]),
            "needs argument 'frequency'",
        ),
        (google_row(["detectable_content:postscript"], [{}]), "needs argument 'postscript_marker'"),
        (google_row(["language:response_language"], [{"language": "Klingon"}]), "argument 'language' is 'Klingon'"),
        (google_row(["length_constraints:number_words"], [{"num_words": "many", "relation": "at least"}]), "is 'many'"),
        (google_row(["length_constraints:number_words"], [{"num_words": 5, "relation": "roughly"}]), "is 'roughly'"),
        (google_row(["length_constraints:number_words"], [{"num_word": 5, "relation": "at least"}]), "['num_word']"),
        (google_row(["punctuation:no_comma", "startend:quotation"], [{}]), "expected a list of 2 dicts"),
        (json.dumps({"prompt": "hi"}), "expected either `func_name`"),
        ("the answer is 5", "neither JSON nor a Python literal"),
    ],
)
def test_rows_it_cannot_grade_are_refused_in_one_line(ground_truth, message):
    """Refused by the check the trainer runs before models load and by the verifier alike; never graded with a
    guessed argument."""
    for refuse in (GROUND_TRUTH_CHECKS["ifeval"], check_ground_truth, lambda truth: ifeval("Some answer.", truth)):
        with pytest.raises(ValueError) as error:
            refuse(ground_truth)
        assert message in str(error.value) and "\n" not in str(error.value)
        assert str(error.value).startswith("ifeval ground truth '")


@pytest.mark.parametrize(
    ("text", "sentences"),
    [
        ("Dr. Smith arrived. He sat down.", ["Dr. Smith arrived.", "He sat down."]),
        ("It costs 3.5 dollars. Cheap!", ["It costs 3.5 dollars.", "Cheap!"]),
        ("Wait... what? Really?!", ["Wait... what?", "Really?!"]),
        ("It ended... Then we left.", ["It ended...", "Then we left."]),
        ('He said "Hi." Then he left.', ['He said "Hi."', "Then he left."]),
        ("Fruit, e.g. apples, i.e. Fuji. Yes.", ["Fruit, e.g. apples, i.e. Fuji.", "Yes."]),
        ("J. K. Rowling lives in the U.S. and writes.", ["J. K. Rowling lives in the U.S. and writes."]),
        ("Pears, plums, etc. They are ripe.", ["Pears, plums, etc.", "They are ripe."]),
        ("Visit example.com today. Version 2.0 is out", ["Visit example.com today.", "Version 2.0 is out"]),
        ("# Title\n\nBody text here. More.\n\n***", ["# Title", "Body text here.", "More."]),
        ("", []),
    ],
)
def test_sentence_splitter(text, sentences):
    assert ifeval_checks.split_sentences(text) == sentences


def test_language_detection_gives_the_same_verdict_every_call():
    """langdetect samples at random: unseeded, "Hello world" reads as English or Dutch from call to call."""
    assert len({ifeval_checks.detect_language("Hello world") for _ in range(20)}) == 1
    ground_truth = tulu_row("validate_response_language", language="en")
    assert len({ifeval("Hello world", ground_truth) for _ in range(20)}) == 1


def test_language_detection_gives_the_same_verdict_in_another_process():
    """The checks module imports nothing of open_instruct: loaded alone, it starts quickly in a fresh process."""
    texts = ["Hello world", "pizza pasta", GERMAN]
    script = (
        "import importlib.util, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('checks', {str(Path(ifeval_checks.__file__))!r})\n"
        "checks = importlib.util.module_from_spec(spec); spec.loader.exec_module(checks)\n"
        f"print(json.dumps([checks.detect_language(text) for text in {texts!r}]))\n"
    )
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    assert json.loads(other.stdout) == [ifeval_checks.detect_language(text) for text in texts]


def test_text_without_a_language_fails_the_language_check():
    assert ifeval_checks.in_language("12345 !!!", "en") is False


@pytest.mark.parametrize("name", ["ifeval_tulu.jsonl", "ifeval_google.jsonl"])
def test_shipped_fixtures_load_and_every_row_can_be_graded(name):
    """The fixtures the CPU demo trains on (`--dataset_mixer_list open_instruct/data/fixtures/<name> N`)."""
    from open_instruct.data.prompt_dataset import load_prompt_dataset

    path = Path(__file__).resolve().parents[1] / "open_instruct" / "data" / "fixtures" / name
    rows = load_prompt_dataset([str(path), "1.0"], ["train"], seed=0).to_list()
    assert 8 <= len(rows) <= 12
    kinds = set()
    for row in rows:
        assert resolve_verifier_name(row["dataset"]) == "ifeval"
        check_ground_truth(row["ground_truth"])
        kinds.update(constraint_name for constraint_name, _ in constraint_results("", row["ground_truth"]))
    assert len(kinds) >= 8  # many constraint kinds, not one repeated


def test_a_ground_truth_stored_as_an_object_is_read_as_its_json_text(tmp_path):
    """A JSON file (or parquet struct) may hold the constraint set as an object rather than as a string."""
    from open_instruct.data.prompt_dataset import load_prompt_dataset

    constraints = {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "Name a colour.", "ground_truth": constraints, "dataset": "ifeval"}) + "\n")
    (row,) = load_prompt_dataset([str(path), "1.0"], ["train"], seed=0).to_list()
    assert json.loads(row["ground_truth"]) == constraints
    assert ifeval("Red.", row["ground_truth"]) == 1.0 and ifeval("Red, blue.", row["ground_truth"]) == 0.0
