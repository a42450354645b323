"""The learner side of GenerationThread's protocol: a failure of the thread reaches the learner with its cause,
and a wait on the queues ends with a message instead of hanging.

Only the first test starts the real engine (it fails at creation, after `import vllm`, ~10 s); the others need
a thread that is alive but never produces anything, or one that ended, which `serve` overrides give without an
engine. The last three put a thread whose engines "die", idle or never get ready beside a learner whose broadcast
breaks: which error the learner reports does not depend on a race (tests/test_engine_actors.py kills a real engine
actor, where it does), and learner rank 0 never sends before the engines said they are ready.
The full loop with a working engine runs in tests/test_ppo_trainer.py.
"""

import time

import pytest

from open_instruct.generation.generation_thread import (
    GenerationRequest,
    GenerationSettings,
    GenerationThread,
    GenerationThreadError,
)
from open_instruct.generation.vllm_engine import EngineConfig


def settings(model_path: str) -> GenerationSettings:
    return GenerationSettings(
        engine=EngineConfig(model_path, max_model_len=128),
        samples_per_prompt=1,
        temperature=1.0,
        response_length=8,
        stop_token_ids=[],
        stop_strings=None,
    )


class IdleGenerationThread(GenerationThread):
    """Alive, but never takes prompts nor returns rollouts: from the learner's side, a stuck engine."""

    def serve(self) -> None:
        self._stop_requested.wait()


class EndedGenerationThread(GenerationThread):
    """Returns from `serve` at once, without an error."""

    def serve(self) -> None:
        return


@pytest.fixture
def idle_thread():
    thread = IdleGenerationThread(settings("unused"), poll_s=0.05, timeout_s=1.0)
    thread.start()
    yield thread
    thread.shutdown()


def test_engine_creation_failure_reaches_the_learner_with_its_cause(tmp_path):
    missing = str(tmp_path / "no-model-here")
    thread = GenerationThread(settings(missing), poll_s=0.1, timeout_s=120.0)
    start = time.time()
    thread.start()
    with pytest.raises(GenerationThreadError) as error:
        thread.receive()
    seconds = time.time() - start

    message = str(error.value)
    assert message.startswith("The vLLM generation thread failed: ")
    assert missing in message  # vLLM's own error names the path it could not load
    assert "--- generation thread traceback ---" in message and "create_engine" in message
    assert error.value.__cause__ is thread.error
    assert seconds < 60, f"the failure took {seconds:.0f}s to reach the learner"  # the error, not the 120 s timeout
    thread.join(timeout=5)
    assert not thread.is_alive()
    # Every later call of the learner fails the same way at once.
    with pytest.raises(GenerationThreadError, match="generation thread failed"):
        thread.send(GenerationRequest(0, None, [[1, 2, 3]]))


def test_receive_times_out_with_a_message_when_no_rollout_arrives(idle_thread):
    start = time.time()
    with pytest.raises(TimeoutError) as error:
        idle_thread.receive()
    seconds = time.time() - start
    assert str(error.value) == (
        "Waited 1s for the generation thread to return a rollout; raise --queue_timeout_s if generation is this "
        "slow, or check that the engine is not stuck."
    )
    assert 1.0 <= seconds < 3.0
    assert idle_thread.is_alive()


def test_receive_eval_times_out_too(idle_thread):
    with pytest.raises(TimeoutError, match="to return the eval rollout"):
        idle_thread.receive_eval()


def test_a_thread_that_takes_no_request_lets_the_learner_send_only_one(idle_thread):
    """The prompt queue holds one request: the second send waits for the generator, then times out. (A working
    thread takes every request into its inbox at once; how far ahead the learner runs is --async_steps.)"""
    idle_thread.send(GenerationRequest(0, None, [[1, 2, 3]]))
    with pytest.raises(TimeoutError, match="Waited 1s for the generation thread to take new prompts"):
        idle_thread.send(GenerationRequest(1, None, [[4, 5, 6]]))


def test_a_thread_that_ended_without_an_error_is_reported():
    thread = EndedGenerationThread(settings("unused"), poll_s=0.05, timeout_s=30.0)
    thread.start()
    thread.join(timeout=5)
    start = time.time()
    with pytest.raises(GenerationThreadError, match="ended without an error before it could return a rollout"):
        thread.receive()
    assert time.time() - start < 1.0  # noticed at the first poll, not after the 30 s timeout


def test_shutdown_stops_an_idle_thread_promptly(idle_thread):
    start = time.time()
    idle_thread.shutdown()
    assert not idle_thread.is_alive()
    assert time.time() - start < 1.0


# ---- a failed weight broadcast waits for news of a dead engine ----------------------------------------------------


class EngineDiesWhileReceiving(GenerationThread):
    """Takes the broadcast request, says the engines are ready and, `after_s` later, fails as
    EngineGroup.receive_weights does when Ray reports that an engine actor died (a killed engine;
    tests/test_engine_actors.py kills a real one)."""

    after_s = 1.0

    def serve(self) -> None:
        request = self._next_request()
        assert request.broadcast
        request.engines_ready.set()
        time.sleep(self.after_s)
        raise RuntimeError("vLLM engine 1 died during receive_weights: The actor died unexpectedly")


class ReadyThenIdle(GenerationThread):
    """Takes the broadcast request, says the engines are ready, then never receives: live engines whose side of the
    transfer sits waiting while the learner's fails."""

    def serve(self) -> None:
        request = self._next_request()
        request.engines_ready.set()
        self._stop_requested.wait()


class NeverReady(GenerationThread):
    """Takes the broadcast request and never says the engines are ready (an engine still generating)."""

    def serve(self) -> None:
        self._next_request()
        self._stop_requested.wait()


class LearnerWhoseBroadcastBreaks:
    """Learner rank 0's side of the same broadcast: gloo fails at once when a receiver's connection drops."""

    calls = 0

    def broadcast_weights(self):
        self.calls += 1
        raise RuntimeError("learner rank 0 failed in broadcast_weights: RuntimeError: Connection reset by peer")


def send_broadcast(thread: GenerationThread, learner=None):
    from open_instruct.generation.rollout_requests import RolloutRequests

    thread.start()
    learner = learner or LearnerWhoseBroadcastBreaks()
    requests = RolloutRequests(thread, learner, None, None, None, None, 0, 0, sync_timeout_s=60, broadcast=True)
    return requests.send_weights_and(GenerationRequest(1, None, [[1, 2]]))


def test_a_broadcast_broken_by_a_dead_engine_reports_the_engine():
    thread = EngineDiesWhileReceiving(settings("unused"), poll_s=0.05, timeout_s=30.0)
    with pytest.raises(GenerationThreadError, match="vLLM engine 1 died during receive_weights"):
        send_broadcast(thread)


def test_a_broadcast_that_fails_on_its_own_reports_the_learner_after_the_grace(monkeypatch):
    from open_instruct.generation import rollout_requests

    monkeypatch.setattr(rollout_requests, "PEER_DEATH_GRACE_S", 1.0)
    thread = ReadyThenIdle(settings("unused"), poll_s=0.05, timeout_s=30.0)
    start = time.time()
    try:
        with pytest.raises(RuntimeError, match="^learner rank 0 failed in broadcast_weights"):
            send_broadcast(thread)
        assert 1.0 <= time.time() - start < 5.0
    finally:
        thread.shutdown()


def test_learner_rank_0_sends_nothing_until_the_engines_are_ready_and_that_wait_has_its_own_deadline():
    """The transfer starts only after the engines' round trip: engines that never get ready end the wait after
    --queue_timeout_s (the generation wait, here 1 s), with a message naming that wait, and nothing was sent."""
    thread = NeverReady(settings("unused"), poll_s=0.05, timeout_s=1.0)
    learner = LearnerWhoseBroadcastBreaks()
    start = time.time()
    try:
        with pytest.raises(TimeoutError, match="to have the engines ready to receive the weights; raise --queue_timeout_s"):
            send_broadcast(thread, learner)
    finally:
        thread.shutdown()
    assert learner.calls == 0, "learner rank 0 started sending before the engines were ready"
    assert 1.0 <= time.time() - start < 3.0
