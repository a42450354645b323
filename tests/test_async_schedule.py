"""Which policy version generates which batch, for sync mode and --async_steps K = 1, 2, 3, with and without
--inflight_updates: hand-worked tables against the real GenerationThread and RolloutRequests, driven step by step as
the trainer's loop drives them (`top_up`, then `receive`), and the staleness bound they are held to.

The engine behind the thread is a stand-in that gives each response a scripted length and generates one token per
running response per step, each tagged with the version of the weights it holds, as EngineBatches does
(tests/test_engine_batches.py runs the real vLLM engine; the trainer tests run the whole loop): only with scripted
lengths can the tables below be worked out by hand.
"""

import pytest

from open_instruct.generation.generation_thread import Rollout
from open_instruct.generation.rollout_requests import check_staleness
from open_instruct.generation.vllm_engine import Completion
from tests.support.scripted_engine import ScriptedEngine, start_requests


def run_schedule(async_steps: int, batches_in_engine: int, lengths: list[int], steps: int):
    """The trainer's loop without training: per step (learner version step-1) top up, receive, check staleness.
    Returns per step (batch id, the versions of its tokens, the staleness metrics) and the engine."""
    engine = ScriptedEngine(dict(enumerate(lengths)))
    thread, requests = start_requests(engine, async_steps, batches_in_engine)
    trained = []
    try:
        for step in range(1, steps + 1):
            requests.top_up(version=step - 1, steps_left=steps - step + 1)
            _, rollout = requests.receive()
            trained.append((rollout.batch_id, rollout.completions[0].versions,
                            check_staleness(rollout, step - 1, async_steps)))  # fmt: skip
    finally:
        thread.shutdown()
    assert thread.error is None, thread.error_traceback
    return trained, engine


@pytest.mark.parametrize(
    "async_steps, versions_of_batches",
    [
        (0, [0, 1, 2, 3, 4, 5]),  # sync: batch b by policy b, the learner's own
        (1, [0, 0, 1, 2, 3, 4]),  # Cleanba's off-by-one: batch b by policy b-1
        (2, [0, 0, 0, 1, 2, 3]),  # batch b by policy b-2
        (3, [0, 0, 0, 0, 1, 2]),  # batch b by policy b-3
    ],
)
def test_one_batch_at_a_time_batch_b_is_generated_by_policy_b_minus_k(async_steps, versions_of_batches):
    lengths = [2, 6, 5, 4, 2, 3]
    trained, engine = run_schedule(async_steps, 1, lengths, steps=6)
    assert [batch_id for batch_id, _, _ in trained] == list(range(6))
    for (batch_id, versions, staleness), version, step in zip(trained, versions_of_batches, range(1, 7)):
        assert versions == [version] * lengths[batch_id], f"batch {batch_id}"
        assert staleness["policy_version/staleness_max"] == step - 1 - version <= async_steps
    # Each new policy is loaded into an empty engine: between batches, never into one that is generating.
    assert all(in_engine == [] for _, in_engine in engine.loads)


def test_in_flight_updates_load_each_policy_into_the_half_generated_batches():
    """--async_steps 2 --inflight_updates, batches of one response of 2, 6, 5, 4, 2 tokens, worked by hand:

    engine step  1  2  3  4  5  6 | 7 | 8  9  10        (the engine decodes 2 batches at a time)
    batch 0      0  0             |   |                 done at step 2; batch 2 joins (sent with policy 0)
    batch 1      0  0  0  0  0  0 |   |                 done at step 6: batch 3 joins with policy 1, loaded now
    batch 2            0  0  0  0 | 1 |                 its 5th token from policy 1; done: batch 4 joins, policy 2
    batch 3                       | 1 | 2  2  2         tokens from policies 1 and 2
    batch 4                           | 2  2
    """
    trained, engine = run_schedule(2, 2, [2, 6, 5, 4, 2, 3], steps=5)
    assert [versions for _, versions, _ in trained] == [[0, 0], [0] * 6, [0, 0, 0, 0, 1], [1, 2, 2, 2], [2, 2]]
    # The learner at policy s-1 trains at step s: staleness of each batch's tokens.
    lags = [(s["policy_version/staleness_min"], s["policy_version/staleness_max"]) for _, _, s in trained]
    assert lags == [(0, 0), (1, 1), (1, 2), (1, 2), (2, 2)]
    assert trained[2][2]["policy_version/staleness_mean"] == pytest.approx((2 * 4 + 1) / 5)
    # Policy 1 was loaded while batch 2 was half generated, policy 2 while batch 3 was.
    assert engine.loads[:2] == [(1, [2]), (2, [3])]


def test_a_token_older_than_the_bound_or_from_a_later_policy_stops_the_run():
    def rollout(versions):
        return Rollout(0, [Completion(0, list(range(len(versions))), "", "stop", None, versions)], batch_id=7)

    assert check_staleness(rollout([3, 4, 5]), learner_version=5, max_lag=2) == {
        "policy_version/staleness_mean": 1.0, "policy_version/staleness_max": 2.0, "policy_version/staleness_min": 0.0,
    }  # fmt: skip
    with pytest.raises(RuntimeError, match=r"batch 7 with tokens of policy versions 2\.\.5, outside the bound of 2"):
        check_staleness(rollout([2, 4, 5]), learner_version=5, max_lag=2)
    with pytest.raises(RuntimeError, match="outside the bound of 0"):
        check_staleness(rollout([5, 6]), learner_version=5, max_lag=0)
