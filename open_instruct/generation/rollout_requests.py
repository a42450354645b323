"""The learner's side of the generation thread: which prompts go out with which weights, and what is in flight.

`RolloutRequests.send(version)` takes the next prompts (reshuffled each pass over the data), attaches the learner's
weights of that policy version (in the request for the single-process learner's in-process engine; with Ray learners
as a transfer from learner rank 0 to the engines), and remembers the request until the learner receives its rollout.
A received rollout is checked to come from exactly the weights sent (the engines' checksums).

A transfer has two deadlines, one per wait: first the engines must say they are ready to receive, which they do
when they have finished the batch (and eval) they were generating, within --queue_timeout_s like any wait on
generation (`time/engine_ready_wait`); only then does learner rank 0 start sending, and the transfer itself must end
within --vllm_sync_timeout_s (`time/weight_broadcast`). So a long generation never eats into the transfer's deadline
(nor into NCCL's watchdog), and the transfer time measures the transfer.

vLLM's sampling noise is seeded per request (`sampling_seed`), so every batch depends only on (seed, request number,
weights, prompts): a resumed run regenerates nothing differently.
"""

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from open_instruct.data.batches import PromptBatch, ShufflingIterator, prompt_batch
from open_instruct.generation import generation_thread
from open_instruct.generation.generation_thread import (
    GenerationRequest,
    GenerationThread,
    GenerationThreadError,
    Rollout,
)
from open_instruct.generation.weight_broadcast import checksum_mismatch, run_beside


def sampling_seed(seed: int, request_index: int) -> int:
    """The seed of vLLM's sampling noise for the `request_index`-th rollout request of a run."""
    return int(np.random.SeedSequence([seed, request_index]).generate_state(1)[0])


# How long a failed broadcast waits for news of a dead engine (Ray notices a death in about 1 s; the generation
# thread's own wait may first spend learner_group.PEER_DEATH_GRACE_S on an engine that failed after it).
PEER_DEATH_GRACE_S = 15.0


@dataclass
class InFlight:
    """A rollout request the learner sent and has not trained on yet.

    Its rollout (and eval rollout) are received when the learner needs them, or earlier when a checkpoint
    stores them (see checkpoint.py: a resumed run trains on exactly the batch that was in flight).
    """

    prompts: PromptBatch
    prompt_indices: list[int]
    policy_version: int
    run_eval: bool
    rollout: Rollout | None = None
    eval_rollout: Rollout | None = None
    weights_sent: dict | None = None  # Ray learners: what learner rank 0 sent before this request (its checksum)
    snapshot_slot: int | None = None  # in-process engine: the learner's buffer holding this request's weights
    sampling_seed: int | None = None  # its sampling noise: a request generated again on resume draws the same

    def receive(self, generator: GenerationThread, within_s: float | None = None) -> Rollout | None:
        if self.rollout is None:
            self.rollout = generator.receive(within_s)
        return self.rollout

    def receive_eval(self, generator: GenerationThread, within_s: float | None = None) -> Rollout | None:
        if self.eval_rollout is None:
            self.eval_rollout = generator.receive_eval(within_s)
        return self.eval_rollout

    @property
    def complete(self) -> bool:
        """Its rollout (and eval rollout, if it asked for one) are here."""
        return self.rollout is not None and (not self.run_eval or self.eval_rollout is not None)

    def to_dict(self) -> dict:
        return {
            "prompt_indices": self.prompt_indices,
            "policy_version": self.policy_version,
            "run_eval": self.run_eval,
            "sampling_seed": self.sampling_seed,
            "weights_sent": self.weights_sent,  # the transfer before it (checked against its rollout, logged)
            "rollout": generation_thread.rollout_to_dict(self.rollout),
            "eval_rollout": generation_thread.rollout_to_dict(self.eval_rollout),
        }

    @classmethod
    def from_dict(cls, data: dict, dataset, tokenizer) -> "InFlight":
        return cls(
            prompt_batch(dataset, data["prompt_indices"], tokenizer),
            data["prompt_indices"],
            data["policy_version"],
            data["run_eval"],
            generation_thread.rollout_from_dict(data["rollout"]),
            generation_thread.rollout_from_dict(data["eval_rollout"]),
            weights_sent=data.get("weights_sent"),
            sampling_seed=data.get("sampling_seed"),
        )


class RolloutRequests:
    """The learner's side of the generation thread: which prompts go out with which policy, what is in flight.

    Its state (the prompt order, the evals done, the request count that seeds vLLM's sampling, and the rollouts in
    flight, received first) is part of a checkpoint.
    """

    def __init__(self, generator: GenerationThread, learner, dataset, tokenizer, prompt_order: ShufflingIterator,
                 eval_prompts: PromptBatch | None, eval_freq: int, seed: int, sync_timeout_s: float,
                 broadcast: bool):  # fmt: skip
        """`broadcast`: the learner is Ray learner ranks, whose rank 0 sends the weights to the engines (else the
        single-process learner's tensors travel in the request)."""
        self.generator, self.learner, self.dataset, self.tokenizer = generator, learner, dataset, tokenizer
        self.prompt_order, self.eval_prompts, self.eval_freq, self.seed = prompt_order, eval_prompts, eval_freq, seed
        self.broadcast, self.sync_timeout_s = broadcast, sync_timeout_s
        self.in_flight: deque[InFlight] = deque()
        self.evaluated_versions: set[int] = set()
        self.requests_sent = 0

    def next_sampling_seed(self) -> int:
        self.requests_sent += 1
        return sampling_seed(self.seed, self.requests_sent - 1)

    def free_snapshot_slot(self) -> int:
        """A learner buffer for the next copy of the weights that no request in flight holds: the engine loads a
        request's weights before it generates its rollout, so a received request's buffer is free again."""
        busy = {request.snapshot_slot for request in self.in_flight}
        return next(slot for slot in range(len(busy) + 1) if slot not in busy)

    def send_weights_and(self, request: GenerationRequest, slot: int | None = None) -> dict | None:
        """Send `request` with the learner's weights of its policy version (version 0: the engine's initial ones).

        Single-process learner: the tensors travel in the request (copied into the learner's buffer `slot`). Ray
        learners: the request tells the engines to receive; once every engine has said it is ready, learner rank 0
        sends. Returns what it sent (checksum, timings) and how long the engines took to get ready.
        """
        if request.policy_version == 0:
            self.generator.send(request)
            return None
        if not self.broadcast:
            request.weights = self.learner.weights_for_engine(slot)
            self.generator.send(request)
            return None
        request.broadcast = True
        self.generator.send(request)
        waiting_since = time.time()
        self.generator.wait_for(request.engines_ready, "have the engines ready to receive the weights")
        ready_wait = time.time() - waiting_since
        receivers = self.generator.weight_receivers  # (None only for a generation thread without an engine: tests)
        if receivers is not None and receivers.regroup_pending:  # an engine was lost, or its replacement loaded:
            receivers.regroup(self.learner)  # a new weight group before learner rank 0 sends
        sending = run_beside(self.learner.broadcast_weights)
        try:
            try:
                sent = sending.result(self.sync_timeout_s, "send its weights", watch=self.generator.raise_if_failed)
            finally:
                request.learner_done.set()  # the engines' side of an IPC transfer waits for it
        except GenerationThreadError:
            raise  # the engines' side failed first: that is already the cause
        except Exception:
            # An engine that dies mid-broadcast breaks it at once on learner rank 0's side ("Connection reset by
            # peer"); Ray tells the generation thread, which waits on the engines, of the death a moment later.
            # The death is the cause the user must read, so it goes first if it comes.
            self.generator.raise_if_it_fails_within(PEER_DEATH_GRACE_S)
            raise
        return {**sent, "ready_wait_seconds": ready_wait}

    def send(self, version: int) -> None:
        indices = next(self.prompt_order)
        prompts = prompt_batch(self.dataset, indices, self.tokenizer)
        run_eval = (
            self.eval_prompts is not None
            and self.eval_freq > 0
            and version % self.eval_freq == 0
            and version not in self.evaluated_versions  # async sends version 0 twice
        )
        if run_eval:
            self.evaluated_versions.add(version)
        seed = self.next_sampling_seed()
        slot = self.free_snapshot_slot() if version > 0 and not self.broadcast else None
        request = GenerationRequest(version, None, prompts.token_ids, run_eval, sampling_seed=seed)
        sent = self.send_weights_and(request, slot)
        self.in_flight.append(InFlight(prompts, indices, version, run_eval, weights_sent=sent, snapshot_slot=slot,
                                       sampling_seed=seed))  # fmt: skip

    def send_final_eval(self, version: int) -> Rollout:
        """The eval of the final policy (this also syncs its weights into the engines)."""
        request = GenerationRequest(version, None, [], run_eval=True, sampling_seed=self.next_sampling_seed())
        sent = self.send_weights_and(request)
        rollout = self.generator.receive_eval()
        check_weight_sync(rollout, sent)
        return rollout

    def receive(self) -> tuple[InFlight, Rollout]:
        """The oldest request and its rollout, checked to come from the weights the learner sent."""
        request = self.in_flight.popleft()
        rollout = request.receive(self.generator)
        check_weight_sync(rollout, request.weights_sent)
        return request, rollout

    def state_dict(self, learner_version: int, wait_s: float | None = None) -> dict:
        """The prompt order, the evals done, the request count that seeds vLLM's sampling, and the requests in flight
        with the rollouts that came back (`learner_version`: the policy the checkpoint holds).

        A request generated by an older policy (async) can only be stored with its rollout: it is waited for, at
        most `wait_s` seconds (a preemption's budget; None: as long as it takes). A request of the checkpoint's own
        policy is not waited for: on resume the same weights generate it again with the same seed, the same batch."""
        give_up = None if wait_s is None else time.monotonic() + wait_s
        waiting = True
        for request in self.in_flight:  # rollouts come back in request order: stop waiting at the first one skipped
            if not waiting or request.policy_version == learner_version:
                waiting = False
                continue
            left = None if give_up is None else max(0.0, give_up - time.monotonic())
            request.receive(self.generator, left)
            if request.run_eval and request.rollout is not None:
                left = None if give_up is None else max(0.0, give_up - time.monotonic())
                request.receive_eval(self.generator, left)
            waiting = request.complete
        return {
            "prompt_order": self.prompt_order.state_dict(),
            "evaluated_versions": sorted(self.evaluated_versions),
            "requests_sent": self.requests_sent,
            "in_flight": [request.to_dict() for request in self.in_flight],
        }

    def load_state_dict(self, state: dict) -> None:
        self.prompt_order.load_state_dict(state["prompt_order"])
        self.evaluated_versions, self.requests_sent = set(state["evaluated_versions"]), state["requests_sent"]
        self.in_flight.extend(InFlight.from_dict(item, self.dataset, self.tokenizer) for item in state["in_flight"])

    def send_unfinished(self, learner_version: int) -> list[int]:
        """After `load_state_dict`: send again the requests whose rollouts the checkpoint did not hold, with their own
        prompts and sampling seeds and the learner's weights (the checkpoint's). Returns the policy versions of those
        that policy `learner_version` generates in place of an older one: the resumed run then differs from the
        uninterrupted one (the trainer says so)."""
        replaced = []
        for request in self.in_flight:
            if request.complete:
                continue
            if 0 < request.policy_version < learner_version:  # version 0 sends no weights: the engine's initial ones
                replaced.append(request.policy_version)
            prompts = request.prompts.token_ids if request.rollout is None else []  # [] asks for the eval only
            regenerate = GenerationRequest(request.policy_version, None, prompts, request.run_eval and
                                           request.eval_rollout is None, sampling_seed=request.sampling_seed)  # fmt: skip
            slot = self.free_snapshot_slot() if request.policy_version > 0 and not self.broadcast else None
            request.weights_sent, request.snapshot_slot = self.send_weights_and(regenerate, slot), slot
        return replaced


def check_weight_sync(rollout: Rollout, sent: dict | None) -> None:
    """Every engine worker received exactly what learner rank 0 broadcast for this rollout's policy version."""
    if sent is None:
        return
    for engine, worker_checksums in enumerate(rollout.weight_checksums):
        for worker, checksum in enumerate(worker_checksums):
            mismatch = checksum_mismatch(sent["checksum"], checksum)
            if mismatch:
                raise RuntimeError(
                    f"vLLM engine {engine} (worker {worker}) did not receive the weights of policy version "
                    f"{rollout.policy_version} intact: {mismatch}; a partial or corrupted weight broadcast."
                )


def broadcast_metrics(sent: dict | None) -> dict:
    """Learner rank 0's side of the weight transfer from Ray learners (absent for the single-process learner):
    `time/engine_ready_wait` the wait for the engines to be ready to receive, `time/weight_broadcast` the transfer
    alone; the gloo transport's copy into buckets and bucket count besides."""
    if sent is None:
        return {}
    metrics = {
        "time/engine_ready_wait": sent["ready_wait_seconds"],
        "time/weight_broadcast": sent["seconds"],
        "weight_broadcast/megabytes": sent["bytes"] / 2**20,
    }
    if "copy_seconds" in sent:
        metrics["time/weight_broadcast_copy"] = sent["copy_seconds"]
    if "buckets" in sent:
        metrics["weight_broadcast/buckets"] = sent["buckets"]
    return metrics
