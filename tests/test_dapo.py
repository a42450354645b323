"""DAPO's two GRPO additions: the soft overlong penalty and dynamic sampling (--filter_zero_std_groups), on hand-made
batches, then end to end in the GRPO trainer with --async_steps 2 --inflight_updates (the filter draws several
rollouts in one step, each topped up and held to the staleness bound).
"""

import math
import sys

import pytest
import torch

from open_instruct.data.batches import PromptBatch
from open_instruct.generation.generation_thread import Rollout
from open_instruct.generation.step_batch import GroupFilter, Scored, join_groups, join_rollouts, split_groups
from open_instruct.generation.vllm_engine import Completion
from open_instruct.rewards.manager import PrecomputedScores, RewardConfig, RewardManager, overlong_penalty
from open_instruct.run.tracking import read_metrics
from tests.support.trainer_runs import run_to_completion


def test_overlong_penalty_by_hand():
    # --response_length 20, buffer 4: no penalty up to 16 tokens, then -factor * (L - 16) / 4.
    lengths = torch.tensor([1, 16, 17, 18, 20])
    assert overlong_penalty(lengths, 20, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(lengths, 20, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]


def test_the_overlong_penalty_adds_to_training_scores_and_not_to_evals():
    manager = RewardManager(RewardConfig(overlong_buffer_length=4, overlong_penalty_factor=1.0), max_response_length=20)
    responses, truths, names, stopped = ["it is 5", "it is 4"], ["5", "5"], ["arithmetic"] * 2, [True, True]
    score, metrics = manager.score(responses, truths, names, stopped, None, [18, 3])
    assert score.tolist() == [0.5, 0.0]  # right but long (1 - 0.5); wrong and short
    assert metrics["objective/overlong_penalty"] == -0.25
    assert metrics["objective/verifiable_correct_rate"] == 0.5  # the correct rate is the verifiers' alone
    eval_score, eval_metrics = manager.score(responses, truths, names, stopped)  # an eval passes no lengths
    assert eval_score.tolist() == [1.0, 0.0] and "objective/overlong_penalty" not in eval_metrics


def rollout_of(scores_by_prompt: list[list[float]], base: int = 0,
               correct_by_prompt: list[list[float]] | None = None) -> tuple[PromptBatch, list[Completion], Scored]:  # fmt: skip
    """A hand-made rollout, each response 2 tokens long; its verdicts are its scores unless given."""
    prompts = PromptBatch([[base + i] for i in range(len(scores_by_prompt))], [str(base + i) for i in range(len(scores_by_prompt))],
                          ["arithmetic"] * len(scores_by_prompt), [f"prompt {base + i}" for i in range(len(scores_by_prompt))])  # fmt: skip
    completions = [Completion(i, [base + i, j], f"answer {j}", "stop", [0.0, 0.0], [0, 0])
                   for i, scores in enumerate(scores_by_prompt) for j in range(len(scores))]  # fmt: skip
    correct = correct_by_prompt or scores_by_prompt
    return prompts, completions, Scored(torch.tensor([s for scores in scores_by_prompt for s in scores]),
                                        torch.tensor([c for values in correct for c in values]), [2] * len(completions),
                                        {})  # fmt: skip


def test_the_filter_keeps_groups_whose_verdicts_differ_not_their_lengths():
    """DAPO eq. 11 and verl filter on accuracy: an all-correct group whose scores differ only by the overlong penalty
    (1.0 and 0.75) is dropped under --filter_metric correct, as an all-wrong one is; `score` keeps it."""
    scores, verdicts = [[1.0, 0.75], [1.0, 0.0], [0.0, -0.5]], [[1, 1], [1, 0], [0, 0]]
    by_verdict = GroupFilter(groups_per_step=1, max_extra_batches=0, metric="correct")
    by_verdict.add(split_groups(*rollout_of(scores, correct_by_prompt=verdicts)))
    assert [g.token_ids for g in by_verdict.kept] == [[1]] and len(by_verdict.dropped) == 2
    by_score = GroupFilter(groups_per_step=1, max_extra_batches=0, metric="score")
    by_score.add(split_groups(*rollout_of(scores, correct_by_prompt=verdicts)))
    assert [g.token_ids for g in by_score.kept] == [[0], [1], [2]]


def test_the_managers_verdicts_leave_out_the_penalties_that_shape_the_score():
    manager = RewardManager(RewardConfig(overlong_buffer_length=4, non_stop_penalty=True), max_response_length=20)
    score, correct, metrics = manager.score_and_correct(["it is 5", "it is 5", "it is 4"], ["5", "5", "5"],
                                                        ["arithmetic"] * 3, [True, False, True], None, [2, 18, 2])  # fmt: skip
    assert score.tolist() == [1.0, -1.0, 0.0] and correct.tolist() == [1.0, 1.0, 0.0]
    assert metrics["val/num_non_stop"] == 1.0 and metrics["objective/overlong_penalty"] == pytest.approx(-0.5 / 3)


def test_zero_std_groups_are_dropped_more_are_drawn_and_the_surplus_is_discarded():
    groups = GroupFilter(groups_per_step=3, max_extra_batches=4)
    groups.add(split_groups(*rollout_of([[1, 1], [0, 1], [0, 0]], base=0)))  # one group differs
    assert not groups.full
    groups.add(split_groups(*rollout_of([[0, 1], [1, 1], [1, 0]], base=10)))  # two more: full
    assert groups.full
    chosen, metrics = groups.batch()
    assert [g.token_ids for g in chosen] == [[1], [10], [12]]
    assert metrics == {"filter/zero_std_groups_dropped": 3.0, "filter/extra_batches": 1.0, "filter/filled_groups": 0.0,
                       "filter/discarded_groups": 0.0}  # fmt: skip
    prompts, completions, scores = join_groups(chosen)
    assert prompts.token_ids == [[1], [10], [12]] and prompts.ground_truths == ["1", "10", "12"]
    assert [(c.prompt_index, c.token_ids) for c in completions] == [(0, [1, 0]), (0, [1, 1]), (1, [10, 0]), (1, [10, 1]),
                                                                    (2, [12, 0]), (2, [12, 1])]  # fmt: skip
    assert scores.tolist() == [0.0, 1.0, 0.0, 1.0, 1.0, 0.0]


def test_when_the_extra_draws_run_out_the_step_is_filled_with_dropped_groups():
    groups = GroupFilter(groups_per_step=2, max_extra_batches=1)
    groups.add(split_groups(*rollout_of([[1, 1], [0, 0]], base=0)))
    groups.add(split_groups(*rollout_of([[0, 1], [1, 1]], base=10)))
    assert groups.full  # 1 extra draw allowed, 1 taken
    chosen, metrics = groups.batch()
    assert [g.token_ids for g in chosen] == [[10], [0]]  # the group that differs, then the first dropped one
    assert metrics["filter/filled_groups"] == 1.0 and metrics["filter/zero_std_groups_dropped"] == 3.0
    surplus = GroupFilter(groups_per_step=1, max_extra_batches=0)
    surplus.add(split_groups(*rollout_of([[0, 1], [1, 0]], base=0)))
    assert surplus.batch()[1]["filter/discarded_groups"] == 1.0


def test_precomputed_scores_answer_the_learners_score_call():
    scorer = PrecomputedScores(torch.tensor([1.0, 0.0]), {"objective/verifiable_correct_rate": 0.5})
    score, metrics = scorer.score(["a", "b"], ["1", "1"], ["arithmetic"] * 2, [True, True], None, [2, 2])
    assert score.tolist() == [1.0, 0.0] and metrics == {"objective/verifiable_correct_rate": 0.5}
    with pytest.raises(ValueError, match="2 precomputed scores for 3 responses"):
        scorer.score(["a", "b", "c"], ["1"] * 3, ["arithmetic"] * 3, [True] * 3)


def test_joined_rollouts_keep_the_oldest_version_and_sum_their_timings():
    first = Rollout(3, [], {"generation": 1.0, "engine_idle": 0.5}, batch_id=7)
    second = Rollout(4, [], {"generation": 2.0}, batch_id=8)
    joined = join_rollouts([first, second], [])
    assert joined.policy_version == 3 and joined.batch_id == 7
    assert joined.timings == {"generation": 3.0, "engine_idle": 0.5}


# ---- end to end -------------------------------------------------------------------------------------------------------


def test_the_prompts_received_count_every_draw_and_not_those_in_flight():
    """`epoch` is the prompts of the rollouts the learner took over the dataset's size: a step of GRPO's filter that
    took 3 rollouts of 4 prompts counts 12, and the requests still in flight count nothing yet."""
    from open_instruct.data.batches import ShufflingIterator
    from open_instruct.generation.rollout_requests import InFlight, RolloutRequests

    order = ShufflingIterator(num_items=10, batch_size=4, seed=0)
    requests = RolloutRequests(None, None, None, None, order, None, 0, 0, 1.0, broadcast=False, async_steps=2)
    for _ in range(5):  # 5 requests sent (the order wraps into its second pass), the last 2 still in flight
        requests.in_flight.append(InFlight(None, next(order), 0, False))
        if len(requests.in_flight) > 2:
            requests.in_flight.popleft()
    assert requests.prompts_received == 12 and order.handed_out == 20


@pytest.mark.e2e
def test_grpo_with_dynamic_sampling_and_the_overlong_penalty_in_flight(varied_length_model_dir, tmp_path):
    """The tiny model never answers right, so its scores differ only by the overlong penalty (a buffer of 12 of 16
    tokens on a model whose answers stop at 2..16 tokens): under --filter_metric score some groups differ, others do
    not and are dropped. The step's `epoch` counts every draw, and its non-stop count and overlong penalty are those
    of the batch trained on (its scores are the penalty alone: the model is never right)."""
    command = [
        sys.executable, "-m", "open_instruct.grpo_vllm_thread_ray_gtrl",
        "--model_name_or_path", varied_length_model_dir,
        "--local_rollout_batch_size", "4", "--number_samples_per_prompt", "2", "--per_device_train_batch_size", "4",
        "--response_length", "16", "--total_episodes", "32", "--num_evals", "0",
        "--filter_zero_std_groups", "true", "--filter_max_extra_batches", "3", "--filter_metric", "score",
        "--overlong_buffer_length", "12", "--async_steps", "2", "--inflight_updates", "true",
        "--output_dir", str(tmp_path / "output"),
    ]  # fmt: skip
    run_to_completion(command, cwd=tmp_path)
    steps = [row for row in read_metrics(str(tmp_path / "output" / "metrics.jsonl")) if "policy_version/learner" in row]
    assert len(steps) == 4
    assert sum(row["filter/zero_std_groups_dropped"] for row in steps) > 0
    assert sum(row["filter/extra_batches"] for row in steps) > 0
    for row in steps:
        # What was trained: the groups that differ, plus the fill; the GRPO learner measures it on its own batch.
        assert row["grpo/zero_std_groups_frac"] == pytest.approx(row["filter/filled_groups"] / 4)
        assert row["policy_version/staleness_max"] <= 2
        assert math.isfinite(row["loss/policy_avg"]) and row["objective/overlong_penalty"] <= 0
        assert row["objective/overlong_penalty"] == pytest.approx(row["objective/scores"], abs=1e-6)
        assert row["val/num_non_stop"] == 8 - row["val/num_stop_token_ids"]
    draws = [1 + row["filter/extra_batches"] for row in steps]
    for index, row in enumerate(steps):  # 4 prompts a draw
        assert row["epoch"] == pytest.approx(steps[0]["epoch"] * sum(draws[: index + 1]) / draws[0])
