"""A preemption while the step waits on generation, and how every run says in summary.json how it ended.

- The learner's side of a step whose rollout does not come (the real GenerationThread, RolloutRequests and
  BatchCollector; behind the thread the scripted engine of tests/test_async_schedule.py, stalled on one batch): the
  given-up wait leaves every request of the step in flight, rollouts received by it included, so the checkpoint of
  the step before holds them all. tests/test_never_lose_a_run.py runs the same on the real trainer.
- summary.json's `status` and `reason` for each way a run ends that runs code: an error, a preemption with a
  checkpoint, KeyboardInterrupt, SystemExit (in process), and the exits at once, without a checkpoint (the
  preemption's deadline, a second signal), in a subprocess that really exits.
"""

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from open_instruct.generation.generation_thread import GenerationThread, WaitAbandoned
from open_instruct.generation.step_batch import BatchCollector
from open_instruct.rewards.manager import RewardConfig, RewardManager
from open_instruct.run import summary
from open_instruct.run.preemption import LAST_WORDS_S, WAIT_SHARE, Preempted, StopRequest
from open_instruct.run.tracking import MetricsLogger
from tests.support.scripted_engine import ScriptedEngine, start_requests

# ---- the learner's side of a step given up ---------------------------------------------------------------------------


class StallingEngine(ScriptedEngine):
    """The scripted engine, except that batch `stalled_batch` never completes: its steps are taken (between_steps
    included, so the thread still takes requests and stops when told) without it getting any longer."""

    def __init__(self, lengths: dict[int, int], stalled_batch: int):
        super().__init__(lengths)
        self.stalled_batch = stalled_batch
        self.stalled = threading.Event()

    def run_until_complete(self, batch_id, between_steps=None):
        if batch_id == self.stalled_batch:
            self.stalled.set()
            while True:
                between_steps()
                time.sleep(0.01)
        return super().run_until_complete(batch_id, between_steps)


def start_collector(engine, async_steps: int, zero_std_filter: bool = False) -> tuple[GenerationThread, BatchCollector]:
    thread, requests = start_requests(engine, async_steps)
    # One prompt a step; with the filter, every group (one response) has zero std: each step draws every extra batch.
    return thread, BatchCollector(requests, RewardManager(RewardConfig()), async_steps, 1, zero_std_filter,
                                  max_extra_batches=3, stop_token_ids=[])  # fmt: skip


def in_flight_of(collector: BatchCollector, learner_version: int) -> list[tuple[int, int, bool]]:
    """(batch id, policy version, whether its rollout is stored) of each request a checkpoint at `learner_version`
    holds in flight."""
    state = collector.rollouts.state_dict(learner_version=learner_version, wait_s=0.2)
    return [(r["batch_id"], r["policy_version"], r["rollout"] is not None) for r in state["in_flight"]]


@pytest.mark.parametrize("async_steps, in_flight", [
    (0, [(1, 1, False)]),  # sync: batch 1, of the checkpoint's own policy, generated again on resume: the same batch
    (1, [(1, 0, False), (2, 1, False)]),  # async: batch 1 (policy 0) and batch 2, sent by step 2 with policy 1
])  # fmt: skip
def test_a_step_given_up_on_its_rollout_leaves_its_requests_in_flight_for_the_checkpoint(async_steps, in_flight):
    engine = StallingEngine(dict.fromkeys(range(10), 3), stalled_batch=1)
    thread, collector = start_collector(engine, async_steps)
    try:
        assert collector.collect(learner_version=0, steps_left=4).rollout.batch_id == 0  # step 1
        with thread.abandoning_waits_when(engine.stalled.is_set):  # step 2 waits for batch 1
            with pytest.raises(WaitAbandoned, match="did not return a rollout in time"):
                collector.collect(learner_version=1, steps_left=3)
        assert in_flight_of(collector, learner_version=1) == in_flight
    finally:
        thread.shutdown()
    assert not thread.is_alive() and thread.error is None, thread.error_traceback


def test_a_filtering_step_given_up_puts_the_batches_it_drew_back_in_flight():
    """GRPO's --filter_zero_std_groups: step 1 drew batches 0 and 1 (all zero std) and waits for batch 2. Given up,
    batches 0 and 1 go back in flight with their rollouts: the resumed step trains on the same draws."""
    engine = StallingEngine(dict.fromkeys(range(10), 3), stalled_batch=2)
    thread, collector = start_collector(engine, async_steps=0, zero_std_filter=True)
    try:
        with thread.abandoning_waits_when(engine.stalled.is_set):
            with pytest.raises(WaitAbandoned):
                collector.collect(learner_version=0, steps_left=4)
        assert in_flight_of(collector, learner_version=0) == [(0, 0, True), (1, 0, True), (2, 0, False)]
    finally:
        thread.shutdown()


class HalfGeneratingEngine(StallingEngine):
    """The stalling engine with a snapshot and a restore, as engine_batches has them: each batch one response, its
    tokens so far tagged with their versions (None: it stalls on no batch)."""

    def partial_batches(self) -> list[dict]:
        return [{"batch_id": batch_id, "params": {}, "samples": [
                    {"token_ids": list(versions), "finish_reason": "stop" if len(versions) >= self.lengths[batch_id] else None}]}
                for batch_id, versions in self.batches.items()]  # fmt: skip

    def restore(self, partial_batches: list[dict]) -> None:
        for partial in partial_batches:
            self.batches[partial["batch_id"]] = list(partial["samples"][0]["token_ids"])


LENGTHS = {**dict.fromkeys(range(10), 6), 0: 3}  # batch 1 is half generated when batch 0 completes


def train_until(engine, steps: int, stall_at: int | None = None):
    """--async_steps 2 --inflight_updates (two batches in the engine), the trainer's order: step s tops up with policy
    s-1 and trains on batch s-1. With `stall_at`, that step waits for its batch, which never completes, and gives up
    (a preemption): the checkpoint is then the previous step's."""
    thread, requests = start_requests(engine, async_steps=2, batches_in_engine=2)
    for step in range(1, steps + 1):
        requests.top_up(version=step - 1, steps_left=6 - step + 1)
        if step == stall_at:
            with thread.abandoning_waits_when(engine.stalled.is_set):
                with pytest.raises(WaitAbandoned):
                    requests.receive()
        else:
            assert requests.receive()[1].batch_id == step - 1
    return thread, requests


def resume(state: dict, learner_version: int):
    """A fresh engine resumes the checkpoint `state` (as trainer_state.json holds it): what `send_unfinished` reports,
    and the versions of the tokens of the next batch the resumed learner trains on."""
    thread, requests = start_requests(HalfGeneratingEngine(LENGTHS, None), async_steps=2, batches_in_engine=2)
    try:
        requests.load_state_dict(json.loads(json.dumps(state)))
        continuation = requests.send_unfinished(learner_version=learner_version)
        requests.top_up(version=learner_version, steps_left=6 - learner_version)
        versions = requests.receive()[1].completions[0].versions
    finally:
        thread.shutdown()
    assert thread.error is None, thread.error_traceback
    return continuation, versions


def test_a_checkpoint_at_rest_continues_its_half_generated_batches_as_the_run_would():
    """At the end of step 1 the oldest batch comes back and the engine waits for the learner's next weights (the
    checkpoint's): the resumed engine loads those same weights, then continues. Nothing to report."""
    thread, requests = train_until(HalfGeneratingEngine(LENGTHS, None), steps=1)
    try:
        state = requests.state_dict(learner_version=1, inflight_updates=True, steps_left=5)
    finally:
        thread.shutdown()
    partials = [request["partial"] for request in state["in_flight"] if request["partial"] is not None]
    assert partials and all(partial["snapshot"] == {"at_rest": True, "engine_policy_version": 0} for partial in partials)
    continuation, _ = resume(state, learner_version=1)
    assert (continuation.regenerated, continuation.continued, continuation.metrics()) == ([], [], {})
    assert continuation.warnings("ckpt", 1) == []


def test_batches_of_older_policies_not_stored_when_the_budget_ran_out_are_reported_as_regenerated():
    """Step 4 waits for batch 3 (policy 1), which never completes; the checkpoint of step 3 gives up on it within its
    budget (0.2 s), so batches 3 and 4 (policies 1 and 2) are stored without their tokens, and the resumed run has
    policy 3 generate them: a warning each, and a metric at the resumed run's first step."""
    engine = HalfGeneratingEngine(LENGTHS, stalled_batch=3)
    thread, requests = train_until(engine, steps=4, stall_at=4)
    try:
        state = requests.state_dict(learner_version=3, wait_s=0.2, inflight_updates=True, steps_left=3)
    finally:
        thread.shutdown()
    stored = [(r["batch_id"], r["policy_version"], r["rollout"] is None, r["partial"] is None) for r in state["in_flight"]]
    assert stored == [(3, 1, True, True), (4, 2, True, True), (5, 3, True, True)]
    continuation, versions = resume(state, learner_version=3)
    assert continuation.regenerated == [1, 2] and continuation.continued == []
    assert continuation.metrics() == {"resume/batches_regenerated_by_other_policy": 2.0}
    assert [line.split(";")[0] for line in continuation.warnings("ckpt", 3)] == [
        "the batch of policy 1 was not finished when ckpt was written", "the batch of policy 2 was not finished when "
        "ckpt was written"]  # fmt: skip
    assert set(versions) == {3}  # batch 3, all of it generated by the checkpoint's policy


def test_batches_snapshotted_mid_batch_are_reported_as_continued_by_another_policy():
    """A snapshot answered between two engine steps (its deadline passed: not where the rule fixes it) while the
    engine decodes batch 1 with policy 0: the uninterrupted engine would have gone on with policy 0, the resumed one
    continues with the checkpoint's (policy 1). The checkpoint records where the snapshot stood; the resume reports
    it (a warning, a metric)."""
    engine = HalfGeneratingEngine(LENGTHS, stalled_batch=1)
    thread, requests = train_until(engine, steps=2, stall_at=2)
    try:
        snapshot = thread.snapshot(within_s=5.0, deadline_s=0.0)
        partials = {partial["batch_id"]: partial for partial in snapshot.partial_batches}
        for request in requests.in_flight:
            request.partial = partials.get(request.batch_id)
        state = {"prompt_order": requests.prompt_order.state_dict(), "evaluated_versions": [],
                 "requests_sent": requests.requests_sent, "in_flight": [r.to_dict() for r in requests.in_flight]}  # fmt: skip
    finally:
        thread.shutdown()
    assert not snapshot.at_rest and sorted(partials) == [1, 2]
    assert all(partial["snapshot"] == {"at_rest": False, "engine_policy_version": 0} for partial in partials.values())
    continuation, versions = resume(state, learner_version=1)
    assert continuation.continued == [1, 2] and continuation.regenerated == []
    assert continuation.metrics() == {"resume/batches_continued_with_other_policy": 2.0}
    [warning] = continuation.warnings("ckpt", 1)
    assert "holds 2 half-generated batch(es) (batch 1, 2) snapshotted mid-batch" in warning
    before = partials[1]["samples"][0]["token_ids"]  # the versions of batch 1's tokens at the snapshot: policy 0's
    assert before and set(before) == {0} and versions == before + [1] * (6 - len(before))  # then the checkpoint's


def test_a_preempted_wait_runs_out_of_patience_at_its_share_of_the_budget():
    stop = StopRequest("unused", timeout_s=0.4)
    assert not stop.out_of_patience()  # no stop requested: a wait never gives up
    stop.signum, stop.received_at = signal.SIGTERM, time.monotonic()  # as the handler sets them, without its timer
    assert not stop.out_of_patience()
    time.sleep(WAIT_SHARE * 0.4 + 0.05)
    assert stop.out_of_patience()


# ---- summary.json: how the run ended -------------------------------------------------------------------------------


def read_summary(output_dir) -> dict:
    return json.loads((output_dir / "summary.json").read_text())


def make_complete_checkpoint(output_dir, step: int) -> str:
    folder = output_dir / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "COMPLETE").write_text("{}")
    return str(folder)


@pytest.mark.parametrize("error, status, reason", [
    (RuntimeError("boom"), "failed", "RuntimeError: boom"),
    (KeyboardInterrupt(), "interrupted", "interrupted by the keyboard (KeyboardInterrupt)"),
    (SystemExit(143), "interrupted", "stopped by sys.exit(143) (SystemExit)"),
])  # fmt: skip
def test_a_run_that_raises_says_how_it_ended(tmp_path, error, status, reason):
    logger = MetricsLogger(str(tmp_path))
    logger.set_summary("status", "running")
    checkpoint = make_complete_checkpoint(tmp_path, 2)
    summary.record_failure(str(tmp_path), logger, error, last_step=3)
    written = read_summary(tmp_path)
    assert (written["status"], written["reason"]) == (status, reason)
    assert written["last_step"] == 3 and written["last_checkpoint"] == checkpoint


def test_a_preempted_run_says_which_checkpoint_it_wrote(tmp_path):
    logger = MetricsLogger(str(tmp_path))
    checkpoint = make_complete_checkpoint(tmp_path, 1)
    summary.record_failure(str(tmp_path), logger, Preempted(signal.SIGTERM, 1, checkpoint), last_step=1)
    written = read_summary(tmp_path)
    assert written["status"] == "preempted" and written["last_checkpoint"] == checkpoint
    assert written["reason"] == f"stopped by SIGTERM after step 1; checkpoint saved in {checkpoint}; resume with " \
                                "the same command plus --resume"  # fmt: skip


EXITS_AT_ONCE = textwrap.dedent("""
    import os, signal, sys, time
    from open_instruct.run import summary
    from open_instruct.run.preemption import StopRequest
    from open_instruct.run.tracking import MetricsLogger

    output_dir, timeout_s, second_signal_after_s, holding_the_lock = sys.argv[1:]
    logger = MetricsLogger(output_dir)
    logger.set_summary("status", "running")
    stop = StopRequest(output_dir, float(timeout_s))
    stop.last_words = lambda line: summary.record_exit_without_checkpoint(output_dir, logger, line, 3)
    stop.install()
    os.kill(os.getpid(), signal.SIGTERM)
    if float(second_signal_after_s) > 0:
        time.sleep(float(second_signal_after_s))
        if holding_the_lock == "yes":  # the signal interrupts the main thread while it writes a metrics line
            logger._lock.acquire()
        print(f"second signal at {time.time()}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)  # a step that does not end
""")


@pytest.mark.parametrize("timeout_s, second_signal_after_s, holding_the_lock, reason", [
    (1.0, 0.0, "no", "no checkpoint within 1s of SIGTERM (--preemption_timeout_s)"),
    (60.0, 4.0, "no", "a second SIGTERM came 4s after the first"),
    (60.0, 4.0, "yes", "a second SIGTERM came 4s after the first"),
])  # fmt: skip
def test_an_exit_without_a_checkpoint_says_so_in_summary_json(tmp_path, timeout_s, second_signal_after_s,
                                                              holding_the_lock, reason):  # fmt: skip
    """The deadline's exit and the second signal's write summary.json. A second signal that interrupts the main
    thread while it holds the lock summary.json needs gives up on it after preemption.LAST_WORDS_S: the exit comes."""
    process = subprocess.run([sys.executable, "-c", EXITS_AT_ONCE, str(tmp_path), str(timeout_s),
                              str(second_signal_after_s), holding_the_lock], capture_output=True, text=True,
                             timeout=90)  # fmt: skip
    ended = time.time()
    assert process.returncode == 128 + signal.SIGTERM, process.stderr
    line = f"{reason}: stopped without a new checkpoint; there is no complete checkpoint (resume with --resume)"
    assert process.stderr.strip().splitlines()[-1] == f"error: {line}"
    written = read_summary(tmp_path)
    if holding_the_lock == "yes":
        second_signal_at = float(process.stderr.split("second signal at ")[1].split()[0])
        assert written["status"] == "running" and ended - second_signal_at < LAST_WORDS_S + 5
    else:
        assert written == {"status": "preempted", "reason": line, "last_step": 3, "last_checkpoint": None}
