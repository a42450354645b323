"""Tests for open_instruct.rewards.answer_extraction: how the verifiers read a model's final answer.

Each extraction mistake the issue lists has its own test, then a hand-labelled set of model-style responses checks
the verifiers' verdicts end to end (the expected verdict is the one a careful grader gives).
"""

import time

import pytest

from open_instruct.rewards import verifiers
from open_instruct.rewards.answer_extraction import (
    extract_final_answer,
    extract_math_answer,
    last_boxed_content,
    last_number,
    leading_math_expression,
)

# ---------------------------------------------------------------- each mistake the issue lists


@pytest.mark.parametrize(
    "response",
    [
        "Adding the two parts gives the total.\n\nThe final answer is:\n\n12",
        "So we conclude.\nThe final answer is:\n$12$",
        "The answer is\n12\n",
        "Final answer:\n\n   \n12.",
        "Putting it together, the final answer is: \n\\[ 12 \\]",
    ],
)
def test_answer_on_the_line_after_the_phrase(response):
    assert extract_math_answer(response) == "12"


@pytest.mark.parametrize(
    "response",
    [
        "Working...\n**Final Answer**: 12",
        "Working...\n**Final Answer:** 12",
        "Working...\n**Final answer:** $12$",
        "Working...\n## Final Answer\n12",
        "Working...\n### Final Answer\n\n$$12$$\n",
        "Working...\n**Final Answer**\n\n\\[\n12\n\\]",
        "Working...\n## Final Answer\n\n$$\n12\n$$",
    ],
)
def test_markdown_final_answer_and_heading(response):
    assert extract_math_answer(response) == "12"


@pytest.mark.parametrize(
    "response, expected",
    [
        ("The answer is \\( \\frac{1}{2} \\).", "\\frac{1}{2}"),
        ("The answer is \\[ \\frac{1}{2} \\]", "\\frac{1}{2}"),
        ("The answer is $$\\frac{1}{2}$$.", "\\frac{1}{2}"),
        ("Final answer: \\(x = 3\\)", "x = 3"),
        ("The answer is: \\[\\sqrt{2}\\] which is about 1.41.", "\\sqrt{2}"),
    ],
)
def test_answers_wrapped_in_math_delimiters(response, expected):
    assert extract_math_answer(response) == expected


@pytest.mark.parametrize(
    "response, expected",
    [
        ("The answer is 5, because 2 + 3 = 5.", "5"),
        ("The answer is $5$ apples.", "5"),
        ("The answer is 5 dollars.", "5"),
        ("Final answer: \\frac{1}{2} of the pie", "\\frac{1}{2}"),
        ("The answer is 12 cm^2 in total", "12"),
        ("The answer is 5\\text{ dollars}", "5\\text{ dollars}"),  # words inside braces belong to the answer
        ("The answer is (1, \\infty) since the log needs x > 1", "(1, \\infty)"),
        ("The answer is x = 4, which checks out.", "x = 4"),
        ("The answer is x = 5 or x = -5.", "x = 5 or x = -5"),  # "or" joins two roots of one answer
        ("**Answer:** $\\$18$ per ticket", "\\$18"),  # an escaped dollar is part of the math
    ],
)
def test_answer_followed_by_words_reads_its_leading_expression(response, expected):
    assert extract_math_answer(response) == expected


def test_string_answers_keep_their_words():
    # string_match compares whole answers: "Paris, France" is not "Paris", and a city name keeps all its words.
    assert extract_final_answer("The answer is Paris, France.") == "Paris, France"
    assert leading_math_expression("New York City") == "New York City"
    assert extract_math_answer("The answer is all real numbers.") == "all real numbers"


@pytest.mark.parametrize(
    "response",
    [
        "The answer to the question is 7.",
        "So the answer to this problem is 7",
        "Therefore, the answer to the problem is $7$.",
        "THE ANSWER TO THIS QUESTION IS: 7",
        "Thus the answer is therefore 7.",
        "The answer is given by $7$.",
        "The answer is as follows:\n\\[ 7 \\]",
        "The final answer is shown below.\n\n7",
    ],
)
def test_answer_to_the_question_phrasings(response):
    assert extract_math_answer(response) == "7"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed 5", "5"),
        ("so $\\boxed 5$.", "5"),
        ("\\boxed -3.", "-3"),
        ("\\boxed\\pi", "\\pi"),
        ("\\fbox{5}", "5"),
        ("We get \\fbox{\\frac{1}{2}} finally", "\\frac{1}{2}"),
        ("\\boxed{5} and then a stray \\boxed", "5"),  # a last \boxed with nothing boxed keeps the earlier box
        ("\\boxed{5} then \\boxed{\\frac{1}{2}", "5"),  # a last box that never closes keeps the earlier box
        ("\\boxed{5}; we write answers in \\boxed notation", "5"),  # prose about boxes is no box
        ("\\boxedfoo{5}", None),  # another command
    ],
)
def test_boxes_without_braces_fbox_and_broken_last_boxes(text, expected):
    assert last_boxed_content(text) == expected


def test_empty_last_box_keeps_the_earlier_answer():
    assert extract_final_answer("\\boxed{5} and \\boxed{}") == "5"


@pytest.mark.parametrize(
    "response, expected",
    [
        ("First try: \\boxed{5}. Wait, I made an error. The answer is 6.", "6"),
        ("\\boxed{5}\n\nHmm, recheck: 2 * 3 = 6.\n**Final Answer**: 6", "6"),
        ("\\fbox{5} no. Final answer: 6", "6"),
        ("The answer is 6. Hmm, let me recount... so \\boxed{5}", "5"),
        ("Final answer: 6\nActually, correcting myself: $\\boxed{5}$", "5"),
        ("The answer is $\\boxed{5}$.", "5"),  # the phrase and its own box agree
    ],
)
def test_the_last_marker_wins(response, expected):
    assert extract_final_answer(response) == expected


@pytest.mark.parametrize(
    "response",
    [
        "\\boxed{5}\n\nI hope this answer is helpful!",
        "\\boxed{5}\n\nLet me verify the answer is correct: 2 + 3 = 5. Yes.",
        "\\boxed{5}. The answer is not 6.",
        "\\boxed{5}. The final answer is therefore confirmed.",
        "\\boxed{5}\n\nThe answer is above.",
        "\\boxed{5}\nThe final answer is:",  # the phrase ends the response: nothing to read
    ],
)
def test_a_remark_about_the_answer_after_a_box_is_no_marker(response):
    assert extract_final_answer(response) == "5"


@pytest.mark.parametrize(
    "text, expected",
    [
        (".5", "0.5"),
        ("half a cup is .5 cups", "0.5"),
        ("it drops by -.25", "-0.25"),
        ("costs $.75 each", "0.75"),
        ("The answer is 5.", "5"),  # a sentence's final period is no decimal point
        ("The answer is 0.5.", "0.5"),
        ("see section 1.2.3", "1.2"),  # a version-like tail is not a new number
        ("wait... 7", "7"),
        ("after 3..5 it is 9", "9"),
        ("version v1.5", None),
    ],
)
def test_numbers_with_a_bare_decimal_point(text, expected):
    number = last_number(text)
    assert (None if number is None else str(number)) == expected


def test_degenerate_repetitions_are_read_in_linear_time():
    # RL policies do fall into loops; a scan to the end of the response for every unclosed box took 12 s on 27k
    # characters, which stalls the scoring of a whole batch.
    repeated_boxes = "\\boxed{1 " * 10_000 + "\\boxed{7}"
    repeated_phrases = "The answer is 5 and " * 10_000 + "The answer is 7."
    started = time.perf_counter()
    assert extract_final_answer(repeated_boxes) == "7"
    assert extract_final_answer(repeated_phrases) == "7"
    assert time.perf_counter() - started < 1.0


# ---------------------------------------------------------------- hand-labelled responses, verdicts end to end

# (verifier, response, ground truth, verdict a careful grader gives). The first group was written for the kinds of
# mistakes above; the rest are plain correct and incorrect answers as models write them.
LABELLED_RESPONSES = [
    # answer on the next line
    ("math", "Sum the parts: 7 + 5.\nThe final answer is:\n\n12", "12", 1.0),
    ("math", "Sum the parts: 7 + 5.\nThe final answer is:\n\n13", "12", 0.0),
    ("math", "The ratio simplifies.\nFinal answer:\n$\\frac{2}{3}$", "\\frac{2}{3}", 1.0),
    ("math", "The answer is\n\n\\[ 2\\sqrt{2} \\]", "2\\sqrt{2}", 1.0),
    # markdown and headings
    ("math", "Compute the area: 4 * 9 = 36.\n\n**Final Answer**: 36", "36", 1.0),
    ("math", "Compute the area: 4 * 9 = 36.\n\n**Final Answer:** $36$", "36", 1.0),
    ("math", "Compute the area: 4 * 9 = 36.\n\n**Final Answer:** 35", "36", 0.0),
    ("math", "Steps...\n\n## Final Answer\n\n$$\\frac{\\pi}{4}$$", "\\frac{\\pi}{4}", 1.0),
    ("math", "Steps...\n\n### Final Answer\n-2", "-2", 1.0),
    ("math", "Steps...\n\n**Final Answer**\n\\[\n-2\n\\]", "-2", 1.0),
    ("math", "Steps...\n\n## Final Answer\n\n2", "-2", 0.0),
    # math delimiters
    ("math", "Therefore the answer is \\( \\frac{3}{5} \\).", "\\frac{3}{5}", 1.0),
    ("math", "Therefore the answer is \\[ 0.6 \\]", "\\frac{3}{5}", 1.0),
    ("math", "Final answer: $$x^2 + 1$$", "x^2+1", 1.0),
    ("math", "The answer is \\(\\sqrt{3}\\).", "\\sqrt{2}", 0.0),
    # answers followed by words
    ("math", "The answer is 8, because each side has length 2.", "8", 1.0),
    ("math", "The answer is $8$ apples.", "8", 1.0),
    ("math", "The answer is 8 dollars.", "8", 1.0),
    ("math", "The final answer is \\frac{1}{4} of the cake", "\\frac14", 1.0),
    ("math", "The answer is 9 apples, since 3 * 3 = 9.", "8", 0.0),
    # "answer to the question"
    ("math", "The answer to the question is 15.", "15", 1.0),
    ("math", "Hence the answer to this problem is $15$.", "15", 1.0),
    ("math", "So the answer to the problem is 14.", "15", 0.0),
    # boxes without braces, \fbox, broken last boxes
    ("math", "Hence $\\boxed 7$.", "7", 1.0),
    ("math", "Hence \\boxed 7", "8", 0.0),
    ("math", "We obtain \\fbox{42}.", "42", 1.0),
    ("math", "We obtain \\fbox{\\frac{1}{3}}", "\\frac{1}{3}", 1.0),
    ("math", "So \\boxed{10}. (Answers go in \\boxed", "10", 1.0),
    ("math", "So \\boxed{10}. Hmm, or \\boxed{11", "10", 1.0),
    ("math", "\\boxed{}", "10", 0.0),
    # the last marker wins
    ("math", "So \\boxed{5}. Wait, I double counted. The answer is 6.", "6", 1.0),
    ("math", "So \\boxed{5}. Wait, I double counted. The answer is 6.", "5", 0.0),
    ("math", "The answer is 6. Hmm, recount: 2 + 3 = 5, so \\boxed{5}", "5", 1.0),
    ("math", "The answer is 6. Hmm, recount: 2 + 3 = 5, so \\boxed{5}", "6", 0.0),
    ("math", "\\boxed{5}\n\nLet me check the answer is correct: 2 + 3 = 5. Yes.", "5", 1.0),
    ("math", "\\boxed{5}\n\nI hope this answer is helpful.", "5", 1.0),
    ("math", "First guess \\boxed{4}. Recheck: actually \\boxed{5}.", "5", 1.0),
    ("math", "First guess \\boxed{4}. Recheck: actually \\boxed{5}.", "4", 0.0),
    # a bare decimal point
    ("math", "The answer is $\\boxed{.5}$", "\\frac{1}{2}", 1.0),
    ("gsm8k", "Each gets half a pizza, that is .5 of a pizza", "0.5", 1.0),
    ("gsm8k", "The probability is .25", "0.25", 1.0),
    ("gsm8k", "So the answer is 5.", "5", 1.0),
    ("gsm8k", "He pays $.75 per apple, so 4 apples cost $3.", "3", 1.0),
    ("gsm8k", "She needs .5 more cups, so 2.5 cups.", "2.5", 1.0),
    ("gsm8k", "It comes to .5 of the total", "5", 0.0),
    # plain correct and incorrect answers
    ("math", "Expanding, $(x+1)^2 = x^2 + 2x + 1$, so the coefficient is \\boxed{2}.", "2", 1.0),
    ("math", "The roots are 2 and 3, so their sum is \\boxed{5}.", "5", 1.0),
    ("math", "The roots are 2 and 3, so their product is \\boxed{5}.", "6", 0.0),
    ("math", "Simplify: $\\frac{6}{8} = \\frac{3}{4}$. Final answer: $\\frac{3}{4}$", "0.75", 1.0),
    ("math", "The area is $\\pi r^2 = 9\\pi$.\n\nThe answer is $9\\pi$.", "9\\pi", 1.0),
    ("math", "The area is $\\pi r^2 = 9\\pi$.\n\nThe answer is $6\\pi$.", "9\\pi", 0.0),
    ("math", "\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", 1.0),
    ("math", "The solution set is $\\boxed{(-\\infty, 2)}$.", "(-\\infty,2)", 1.0),
    ("math", "The solution set is $\\boxed{(-\\infty, 2]}$.", "(-\\infty,2)", 0.0),
    ("math", "I computed 12 but I am not sure.", "12", 0.0),  # no marked answer
    ("math", "x = 3 satisfies the equation, so the answer is $x = 3$.", "3", 1.0),
    ("math", "Therefore, the final answer is: $\\boxed{17}$. I hope it is correct.", "17", 1.0),
    ("math", "Therefore, the final answer is: $\\boxed{16}$. I hope it is correct.", "17", 0.0),
    ("math", "Answer: 100", "100", 1.0),
    ("math", "Answer: 1000", "100", 0.0),
    ("gsm8k", "Natalia sold 48 in April and 24 in May, 72 in all.\n#### 72", "72", 1.0),
    ("gsm8k", "The total is 1,250 dollars.", "1250", 1.0),
    ("gsm8k", "She has 20 left. Wait, she gave 3 away: 17", "20", 0.0),
    ("gsm8k", "He earns $12.50 an hour.", "12.5", 1.0),
    ("gsm8k", "The temperature fell to -4 degrees.", "-4", 1.0),
    ("string_match", "Let me think.\nThe answer is Paris.", "Paris", 1.0),
    ("string_match", "The answer is B.", "B", 1.0),
    ("string_match", "I pick A. Hmm, no. The answer is C.", "A", 0.0),
    ("string_match", "\\boxed{B}\n\nI hope this answer is clear.", "B", 1.0),
    ("string_match", "The answer to the question is Paris.", "Paris", 1.0),
    ("string_match", "**Final Answer:** Paris", "Paris", 1.0),
    # written after the fixes, to check them on responses they were not tuned to
    ("math", "<think>\n2+3 is 5, the answer is 5.\n</think>\n\nThe sum is $\\boxed{5}$.", "5", 1.0),
    ("math", "Let me reconsider.\n\n**Answer:** 25\\%", "25\\%", 1.0),
    ("math", "**Answer:** $\\$18$", "18", 1.0),
    ("math", "The angle measures $30^\\circ$, so the answer is $\\boxed{30^\\circ}$.", "30", 1.0),
    ("math", "The answer is: $\\boxed{\\text{(B)}}$", "\\text{(B)}", 1.0),
    ("math", "The answer is 1,000.", "1000", 1.0),
    ("math", "The solutions are $x = 2$ and $x = 3$. The answer is $2, 3$.", "2, 3", 1.0),
    ("math", "Final answer: $-\\frac{1}{2}$", "-\\frac12", 1.0),
    ("math", "Final answer: $-\\frac{1}{2}$", "\\frac12", 0.0),
    ("math", "So the final answer is $\\boxed{12}$ square units.", "12", 1.0),
    ("math", "## Step 3: Conclude\nThe final answer is: $\\boxed{3}$", "3", 1.0),
    ("math", "## Step 3: Conclude\nThe final answer is: $\\boxed{4}$", "3", 0.0),
    ("math", "The answer is $\\dfrac{7}{2}$, or $3.5$.", "3.5", 1.0),
    ("math", "We need $n = 6$.\n\nFinal Answer: The final answer is $6$. I hope it is correct.", "6", 1.0),
    ("math", "We need $n = 6$.\n\nFinal Answer: The final answer is $7$. I hope it is correct.", "6", 0.0),
    ("math", "**Final Answer**\n\\[\n\\boxed{\\sqrt{5}}\n\\]", "\\sqrt5", 1.0),
    ("math", "Thus $\\boxed{0.5}$ is the probability.", "\\frac{1}{2}", 1.0),
    ("math", "Thus the probability is .5", "\\frac{1}{2}", 0.0),  # no marker
    ("math", "The answer is .5", "\\frac{1}{2}", 1.0),
    ("math", "The answer is x=5 or x=-5.", "\\pm 5", 1.0),  # both roots, joined by "or"
    ("math", "**Final answer: 9**", "9", 1.0),
    ("math", "The answer is **9**.", "9", 1.0),
    ("math", "\\boxed{9}\n\nThe answer is 9 because 3^2 = 9.", "9", 1.0),
    ("math", "I think the answer is 10, but let me check. 4+5=9. So the answer is \\boxed{9}.", "9", 1.0),
    ("math", "I think the answer is 10, but let me check. 4+5=9. So the answer is \\boxed{9}.", "10", 0.0),
    ("gsm8k", "She saves $1,200 a year, so in 3 years $3,600.", "3600", 1.0),
    ("gsm8k", "The answer is 3.5 hours.", "3.5", 1.0),
    ("string_match", "Answer: (C)", "(C)", 1.0),
    ("string_match", "The answer is yes.", "yes", 1.0),
    ("string_match", "The answer is no.", "yes", 0.0),
]


@pytest.mark.parametrize("verifier_name, response, ground_truth, expected", LABELLED_RESPONSES)
def test_hand_labelled_verdicts(verifier_name, response, ground_truth, expected):
    assert verifiers.VERIFIERS[verifier_name](response, ground_truth) == expected
