"""Tests for open_instruct.rewards.verifiers and rewards.manager: verifiers on model-style outputs, alias dispatch, RewardManager."""

import threading

import pytest
import torch

from open_instruct.rewards import verifiers
from open_instruct.rewards.manager import RewardConfig, RewardManager

# ---------------------------------------------------------------- answer extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1,234", "1234"),
        ("It costs $1,234,567.50 in total", "1234567.50"),
        ("x = -3.50 and then 12.", "12"),
        ("read pages 3-5", "5"),  # a hyphen between numbers is not a minus sign
        ("\u22127", "-7"),  # unicode minus
        ("no digits here", None),
    ],
)
def test_last_number(text, expected):
    number = verifiers.last_number(text)
    assert (None if number is None else str(number)) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{42}", "42"),
        ("\\boxed{1} no wait \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box wins
        ("\\boxed{\\frac{\\sqrt{3}}{2}} done", "\\frac{\\sqrt{3}}{2}"),  # nested braces
        ("\\boxed {7}", "7"),
        ("\\boxed{\\frac{1}{2}", None),  # unbalanced
        ("no box", None),
    ],
)
def test_last_boxed_content(text, expected):
    assert verifiers.last_boxed_content(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Let me compute.\nThe answer is 42.", "42"),
        ("The answer is 42. Let me double check: 41 is wrong.", "42"),
        ("Final answer: $\\frac{3}{4}$.", "\\frac{3}{4}"),
        ("The final answer is **3.5**.", "3.5"),
        ("Answer: Paris\nThat is all.", "Paris"),
        ("just some text", None),
    ],
)
def test_extract_final_answer_from_phrase(text, expected):
    assert verifiers.extract_final_answer(text) == expected


# ---------------------------------------------------------------- gsm8k


@pytest.mark.parametrize(
    "response, ground_truth, expected",
    [
        (
            "Natalia sold 48 clips in April and half as many, 24, in May. 48 + 24 = 72. "
            "So she sold 72 clips altogether.",
            "72",
            1.0,
        ),
        ("First 10 then 20 then 30. Total is 60 wait, 61", "60", 0.0),  # the last number wins
        ("The total is 1,234 dollars.", "1234", 1.0),
        ("The price is $3.50", "3.5", 1.0),
        ("She ends with -5 degrees", "-5", 1.0),
        ("#### 72", "72", 1.0),
        ("She has 18.00 left", "18", 1.0),
        ("", "72", 0.0),
        ("I don't know 🤷 ¯\\_(ツ)_/¯", "3", 0.0),
        ("The answer is 42.", "#### 42", 1.0),  # a GSM8K-style ground truth still reads
    ],
)
def test_gsm8k(response, ground_truth, expected):
    assert verifiers.gsm8k(response, ground_truth) == expected


def test_gsm8k_ground_truth_without_number_is_an_error():
    with pytest.raises(ValueError, match="'seventy' holds no number.*'gsm8k'"):
        verifiers.gsm8k("72", "seventy")


# ---------------------------------------------------------------- arithmetic


@pytest.mark.parametrize(
    "response, ground_truth, expected",
    [
        ("7 + 5 = 12. The final answer is 12.", "12", 1.0),
        ("Let's see: 7 + 5 is 12.", "12", 1.0),
        ("12", "12", 1.0),
        ("3 - 6 = -3", "-3", 1.0),
        ("617 * 2 = 1,234", "1234", 1.0),
        ("7 + 5 = 12, no wait, 13", "12", 0.0),
        ("What is 7 + 5? I think it is twelve.", "12", 0.0),  # "5" is the last number
        ("", "12", 0.0),
    ],
)
def test_arithmetic(response, ground_truth, expected):
    assert verifiers.arithmetic(response, ground_truth) == expected


def test_arithmetic_rejects_non_integer_ground_truth():
    with pytest.raises(ValueError, match="'2.5' is not an integer.*'gsm8k'"):
        verifiers.arithmetic("2.5", "2.5")


# ---------------------------------------------------------------- math (math-verify)


@pytest.mark.parametrize(
    "response, ground_truth, expected",
    [
        ("Half of it, so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("We get $\\frac{\\sqrt{3}}{2}$, i.e. \\boxed{\\frac{\\sqrt{3}}{2}}.", "\\frac{\\sqrt3}{2}", 1.0),
        ("First guess \\boxed{5}. Recheck: actually \\boxed{6}.", "6", 1.0),  # the last box wins
        ("First guess \\boxed{5}. Recheck: actually \\boxed{6}.", "5", 0.0),
        ("So $x = -3$. The answer is $-3$.", "-3", 1.0),
        ("Final answer: \\dfrac{3}{4}", "0.75", 1.0),
        ("\\boxed{2\\pi}", "2\\pi", 1.0),
        ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", 1.0),
        ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
        ("The result is 0.5 I believe", "0.5", 0.0),  # no marked answer
        ("", "1", 0.0),
        ("\\boxed{", "1", 0.0),
        ("\\boxed{}", "1", 0.0),
        ("\\boxed{\\frac{1}{}}} ∮∯ ☃ \x00", "1", 0.0),  # garbage never raises
        ("\\boxed{" + "1+" * 2000 + "1}", "1", 0.0),  # over-long answers are not parsed
    ],
)
def test_math(response, ground_truth, expected):
    assert verifiers.math(response, ground_truth) == expected


def test_math_works_outside_the_main_thread():
    # math-verify's signal-based timeout raises outside the main thread; the verifier must switch it off there.
    results = []
    worker = threading.Thread(target=lambda: results.append(verifiers.math("\\boxed{\\frac{1}{2}}", "0.5")))
    worker.start()
    worker.join()
    assert results == [1.0]
    assert verifiers.math_verify_timeout() == verifiers.MATH_VERIFY_TIMEOUT_SECONDS


# ---------------------------------------------------------------- string_match and format


@pytest.mark.parametrize(
    "response, ground_truth, expected",
    [
        ("Paris", "paris", 1.0),
        ("  New   York City. ", "new york city", 1.0),
        ("Let me think about capitals.\nThe answer is Paris.", "Paris", 1.0),
        ("The answer is Paris, France.", "Paris", 0.0),
        ("I think it is Paris", "Paris", 0.0),  # no final-answer phrase: the whole response must match
        ("", "Paris", 0.0),
    ],
)
def test_string_match(response, ground_truth, expected):
    assert verifiers.string_match(response, ground_truth) == expected


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<think>7 + 5 is 12</think><answer>12</answer>", 1.0),
        ("  <think>\nreasoning\n</think>\n\n<answer> 12 </answer>\n", 1.0),
        ("<answer>12</answer><think>late</think>", 0.0),
        ("<think>a</think><answer>12</answer> trailing text", 0.0),
        ("preamble <think>a</think><answer>12</answer>", 0.0),
        ("<think>a</think><answer>1</answer><answer>2</answer>", 0.0),
        ("<think>a<think>b</think><answer>1</answer>", 0.0),
        ("12", 0.0),
    ],
)
def test_r1_format(response, expected):
    assert verifiers.r1_format(response) == expected


# ---------------------------------------------------------------- name resolution


@pytest.mark.parametrize(
    "name, expected",
    [
        ("openai/gsm8k", "gsm8k"),
        ("GSM8K", "gsm8k"),
        ("lighteval/MATH", "math"),
        ("DigitalLearningGmbH/MATH-lighteval", "math"),
        ("HuggingFaceH4/MATH-500", "math"),
        (" Math ", "math"),
        ("arithmetic", "arithmetic"),
        ("String_Match", "string_match"),
    ],
)
def test_resolve_verifier_name(name, expected):
    assert verifiers.resolve_verifier_name(name) == expected


def test_every_alias_points_at_a_verifier():
    assert set(verifiers.VERIFIER_ALIASES.values()) == set(verifiers.VERIFIERS)
    assert all(alias == alias.lower() for alias in verifiers.VERIFIER_ALIASES)


def test_unknown_verifier_name_error_says_how_to_fix():
    with pytest.raises(ValueError) as error:
        verifiers.resolve_verifier_name("my/code_dataset")
    message = str(error.value)
    assert "'my/code_dataset'" in message
    assert "openai/gsm8k" in message and "arithmetic" in message
    assert "--apply_verifiable_reward false" in message


# ---------------------------------------------------------------- RewardManager


def test_validate_rejects_unknown_name_and_no_reward():
    RewardManager(RewardConfig()).validate(["openai/gsm8k", "MATH", None])
    with pytest.raises(ValueError, match="Unknown verifier 'nope'"):
        RewardManager(RewardConfig()).validate(["gsm8k", "nope"])
    # unknown names do not matter when verifiable rewards are off and a reward model scores
    RewardManager(RewardConfig(apply_verifiable_reward=False, reward_model_multiplier=1.0)).validate(["nope"])
    with pytest.raises(ValueError, match="No reward is enabled"):
        RewardManager(RewardConfig(apply_verifiable_reward=False)).validate(["gsm8k"])


def test_score_dispatches_by_alias_and_reports_metrics():
    manager = RewardManager(RewardConfig(verification_reward=10.0))
    score, metrics = manager.score(
        responses=["so 72", "so 71", "\\boxed{\\frac{1}{2}}", "7 + 5 = 12"],
        ground_truths=["72", "72", "0.5", "13"],
        verifier_names=["openai/gsm8k", "GSM8K", "HuggingFaceH4/MATH-500", "arithmetic"],
        stopped=[True, True, True, False],
    )
    torch.testing.assert_close(score, torch.tensor([10.0, 0.0, 10.0, 0.0]))
    assert score.dtype == torch.float32
    assert metrics.pop("time/reward") >= 0  # the verifiers' wall time
    assert metrics == {
        "val/num_non_stop": 1.0,
        "objective/verifiable_correct_rate": 0.5,  # 2 of 4
        "objective/arithmetic_correct_rate": 0.0,
        "objective/gsm8k_correct_rate": 0.5,
        "objective/math_correct_rate": 1.0,
        # each verifier's responses it could not score (none here): reward_failures
        **{f"reward/{kind}/{name}": 0.0 for kind in ("errors", "timeouts") for name in ("arithmetic", "gsm8k", "math")},
    }


def test_non_stop_penalty_replaces_the_score():
    config = RewardConfig(non_stop_penalty=True, penalty_reward_value=-3.0, reward_model_multiplier=0.5)
    score, metrics = RewardManager(config).score(
        responses=["72", "72", "71"],
        ground_truths=["72", "72", "72"],
        verifier_names=["gsm8k"] * 3,
        stopped=[True, False, False],
        rm_scores=torch.tensor([2.0, 2.0, 2.0]),
    )
    # row 0: 0.5 * 2 + 1 = 2; rows 1 and 2 did not stop: -3 whatever they scored
    torch.testing.assert_close(score, torch.tensor([2.0, -3.0, -3.0]))
    assert metrics["val/num_non_stop"] == 2.0
    assert metrics["objective/verifiable_correct_rate"] == pytest.approx(2 / 3)  # before the penalty


def test_score_combines_reward_model_verifier_and_format():
    config = RewardConfig(
        verification_reward=2.0,
        reward_model_multiplier=0.5,
        add_r1_style_format_reward=True,
        r1_style_format_reward=0.25,
    )
    responses = [
        "<think>7 + 5 = 12</think><answer>12</answer>",  # correct and formatted
        "12",  # correct, not formatted
        "<think>hmm</think><answer>11</answer>",  # wrong, formatted
        "an open question",  # no ground truth: reward model only (plus format)
    ]
    score, metrics = RewardManager(config).score(
        responses,
        ground_truths=["12", "12", "12", None],
        verifier_names=["arithmetic", "arithmetic", "arithmetic", None],
        stopped=[True] * 4,
        rm_scores=torch.tensor([1.0, -1.0, 4.0, 3.0]),
    )
    # 0.5 * rm + 2 * correct + 0.25 * formatted
    expected = torch.tensor([0.5 + 2 + 0.25, -0.5 + 2 + 0.0, 2.0 + 0 + 0.25, 1.5 + 0 + 0])
    torch.testing.assert_close(score, expected)
    assert metrics["objective/verifiable_correct_rate"] == pytest.approx(2 / 3)  # rows with a ground truth only
    assert metrics["objective/format_reward"] == pytest.approx(0.5)
    assert metrics["val/num_non_stop"] == 0.0


def test_reward_model_only_ignores_ground_truth_when_verifiable_reward_is_off():
    config = RewardConfig(apply_verifiable_reward=False, reward_model_multiplier=2.0)
    score, metrics = RewardManager(config).score(["72"], ["72"], ["gsm8k"], [True], rm_scores=torch.tensor([0.25]))
    torch.testing.assert_close(score, torch.tensor([0.5]))
    assert "objective/verifiable_correct_rate" not in metrics


def test_row_without_any_reward_source_is_an_error():
    with pytest.raises(ValueError, match="Row 1 has no reward source"):
        RewardManager(RewardConfig()).score(["72", "hi"], ["72", None], ["gsm8k", None], [True, True])


def test_row_with_ground_truth_but_no_verifier_name_is_an_error():
    with pytest.raises(ValueError, match="Row 0 has a ground truth but no verifier name"):
        RewardManager(RewardConfig()).score(["72"], ["72"], [None], [True])


def test_mismatched_lengths_are_an_error():
    with pytest.raises(ValueError, match="2 responses.*'stopped': 1"):
        RewardManager(RewardConfig()).score(["1", "2"], ["1", "2"], ["gsm8k", "gsm8k"], [True])


def test_score_from_a_worker_thread():
    # The trainer scores in a thread; math-verify must not trip over its main-thread-only timeout.
    results = []

    def score_in_thread():
        results.append(RewardManager(RewardConfig()).score(["\\boxed{\\frac{1}{2}}"], ["0.5"], ["math"], [True]))

    worker = threading.Thread(target=score_in_thread)
    worker.start()
    worker.join()
    score, metrics = results[0]
    torch.testing.assert_close(score, torch.tensor([1.0]))
    assert metrics["objective/math_correct_rate"] == 1.0


def test_reward_config_defaults():
    config = RewardConfig()
    assert config.apply_verifiable_reward and config.verification_reward == 1.0
    assert config.reward_model_multiplier == 0.0
    assert not config.add_r1_style_format_reward and config.r1_style_format_reward == 1.0
    assert not config.non_stop_penalty and config.penalty_reward_value == -1.0
