"""The learner's side of the generation thread: which prompts go out with which weights, and what is in flight.

`RolloutRequests.send(version)` takes the next prompts (reshuffled each pass over the data), attaches the learner's
weights of that policy version (in the request for the single-process learner's in-process engine; with Ray learners
as a transfer from learner rank 0 to the engines), and remembers the request until the learner receives its rollout.
A received rollout is checked to come from exactly the weights sent (the engines' checksums).

How far ahead: before the learner waits for a batch, `top_up` sends with its current weights until --async_steps K
requests are in flight beyond the one it waits for (sync mode: only that one). So batch b is sent with policy b-K-1
and trained on by policy b-1: every token is at most K versions older than the learner (with --inflight_updates
its later tokens are newer, down to 1 version old); `check_staleness` holds every rollout to that bound. Near the
end of the run only as many are sent as the steps left can use, and the generation thread is told (END). GRPO's
--filter_zero_std_groups may take several batches in a step: the requests are topped up before each.

A transfer has two deadlines, one per wait: first the engines must say they are ready to receive, which they do
when they have finished the batch (and eval) they were generating, within --queue_timeout_s like any wait on
generation (`time/engine_ready_wait`); only then does learner rank 0 start sending, and the transfer itself must end
within --vllm_sync_timeout_s (`time/weight_broadcast`). So a long generation never eats into the transfer's deadline
(nor into NCCL's watchdog), and the transfer time measures the transfer.

vLLM's sampling noise is seeded per request (`sampling_seed`, then per sample: engine_batches.request_seed), so every
batch depends only on (seed, request number, weights, prompts): a resumed run regenerates nothing differently.
"""

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from open_instruct.data.batches import PromptBatch, ShufflingIterator, prompt_batch
from open_instruct.environments.routing import environment_rows
from open_instruct.generation import generation_thread
from open_instruct.generation.generation_thread import (
    GenerationRequest,
    GenerationThread,
    GenerationThreadError,
    Rollout,
)
from open_instruct.generation.seams import BroadcastsWeights, HandsOutWeights
from open_instruct.generation.weight_broadcast import checksum_mismatch, run_beside


def sampling_seed(seed: int, request_index: int) -> int:
    """The seed of vLLM's sampling noise for the `request_index`-th rollout request of a run."""
    return int(np.random.SeedSequence([seed, request_index]).generate_state(1)[0])


# The request number that seeds the final eval's sampling (training requests count up from 0).
FINAL_EVAL_REQUEST = 2**31 - 1

# How long a failed broadcast waits for news of a dead engine (Ray notices a death in about 1 s; the generation
# thread's own wait may first spend cluster.PEER_DEATH_GRACE_S on an engine that failed after it).
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
    batch_id: int = 0  # the request's number in the run (the engine's name for its batch)
    # --inflight_updates: the batch as the engine held it when a checkpoint was taken (engine_batches.partial_batches)
    partial: dict | None = None
    sent: GenerationRequest | None = None  # what went to the generation thread (not checkpointed)

    @property
    def holds_weights(self) -> bool:
        """Its weights copy (snapshot_slot) is still needed: sent, and not yet loaded by the engine."""
        return self.sent is not None and not self.sent.weights_loaded.is_set()

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
            "batch_id": self.batch_id,
            "partial": self.partial,
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
            batch_id=data.get("batch_id", 0),
            partial=data.get("partial"),
        )


class RolloutRequests:
    """The learner's side of the generation thread: which prompts go out with which policy, what is in flight.

    Its state (the prompt order, the evals done, the request count that seeds vLLM's sampling, and the rollouts in
    flight, received first, or as the engine held them) is part of a checkpoint.
    """

    def __init__(self, generator: GenerationThread, learner: HandsOutWeights | BroadcastsWeights, dataset, tokenizer, prompt_order: ShufflingIterator,
                 eval_prompts: PromptBatch | None, eval_freq: int, seed: int, sync_timeout_s: float,
                 broadcast: bool, async_steps: int = 1, with_rows: bool = False):  # fmt: skip
        """`broadcast`: the learner is Ray learner ranks, whose rank 0 sends the weights to the engines (else the
        single-process learner's tensors travel in the request). `async_steps`: --async_steps K, or 0 in sync mode.
        `with_rows` (--tools): each request carries its prompts' dataset rows, for their environments."""
        self.generator, self.learner, self.dataset, self.tokenizer = generator, learner, dataset, tokenizer
        self.prompt_order, self.eval_prompts, self.eval_freq, self.seed = prompt_order, eval_prompts, eval_freq, seed
        self.broadcast, self.sync_timeout_s = broadcast, sync_timeout_s
        self.async_steps = async_steps
        self.with_rows = with_rows
        self.in_flight: deque[InFlight] = deque()
        self.evaluated_versions: set[int] = set()
        self.requests_sent = 0  # training requests sent (each one batch), numbering them and seeding their sampling
        self.end_sent = False
        self.resume_metrics: dict[str, float] = {}  # where a resumed run differs (`Continuation`), for its first step

    @property
    def depth(self) -> int:
        """Requests in flight when the learner waits for the oldest: it and --async_steps more (sync: it alone)."""
        return self.async_steps + 1

    @property
    def prompts_received(self) -> int:
        """Prompts of the requests whose rollouts the learner took (trained on, or dropped by GRPO's filter): those
        handed out less those in flight. Restored with the checkpoint's prompt order and requests in flight."""
        return self.prompt_order.handed_out - sum(len(request.prompt_indices) for request in self.in_flight)

    def next_sampling_seed(self) -> int:
        self.requests_sent += 1
        return sampling_seed(self.seed, self.requests_sent - 1)

    def free_snapshot_slot(self) -> int:
        """A learner buffer for the next copy of the weights that no request in flight still holds: the engine takes
        a request's weights when it admits the request, and its buffer is free again from then."""
        busy = {request.snapshot_slot for request in self.in_flight if request.holds_weights}
        return next(slot for slot in range(len(busy) + 1) if slot not in busy)

    def send_weights_and(self, request: GenerationRequest, slot: int | None = None) -> dict | None:
        """Send `request` with the learner's weights of its policy version (version 0: the engine's initial ones).

        Single-process learner: the tensors travel in the request (copied into the learner's buffer `slot`). Ray
        learners: the request tells the engines to receive; once every engine has said it is ready (at the request's
        admission), learner rank 0 sends. Returns what it sent (checksum, timings) and how long the engines took to
        get ready.
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
            and version not in self.evaluated_versions  # async sends version 0 several times
        )
        if run_eval:
            self.evaluated_versions.add(version)
        seed = self.next_sampling_seed()
        batch_id = self.requests_sent - 1
        slot = self.free_snapshot_slot() if version > 0 and not self.broadcast else None
        request = GenerationRequest(version, None, prompts.token_ids, run_eval, sampling_seed=seed, batch_id=batch_id,
                                    rows=self.rows(indices))  # fmt: skip
        in_flight = InFlight(prompts, indices, version, run_eval, snapshot_slot=slot, sampling_seed=seed,
                             batch_id=batch_id, sent=request)  # fmt: skip
        self.in_flight.append(in_flight)
        in_flight.weights_sent = self.send_weights_and(request, slot)

    def rows(self, indices: list[int]) -> list[dict] | None:
        """The dataset rows of the prompts `indices`, for their environments (--tools); None without tools. Read from
        the dataset at each send, never kept in flight: the learner's side holds none."""
        return environment_rows(self.dataset, indices) if self.with_rows else None

    def top_up(self, version: int, steps_left: int) -> None:
        """Send with policy `version` until `depth` requests are in flight, or as many as the `steps_left` (this one
        included) can use; the first time that is fewer than `depth`, tell the generation thread (END), so that its
        engine stops waiting for batches that will not come."""
        target = min(self.depth, steps_left)
        while len(self.in_flight) < target:
            self.send(version)
        if target < self.depth and not self.end_sent:
            self.generator.send_end()
            self.end_sent = True

    def send_final_eval(self, version: int) -> Rollout:
        """The eval of the final policy (this also syncs its weights into the engines)."""
        seed = sampling_seed(self.seed, FINAL_EVAL_REQUEST)
        request = GenerationRequest(version, None, [], run_eval=True, sampling_seed=seed)
        sent = self.send_weights_and(request)
        rollout = self.generator.receive_eval()
        check_weight_sync(rollout, sent)
        return rollout

    def receive(self) -> tuple[InFlight, Rollout]:
        """The oldest request and its rollout, checked to come from the weights the learner sent. It leaves the requests
        in flight only once its rollout is here: a wait given up (WaitAbandoned) leaves it for the checkpoint."""
        request = self.in_flight[0]
        rollout = request.receive(self.generator)
        self.in_flight.popleft()
        check_weight_sync(rollout, request.weights_sent)
        return request, rollout

    def put_back(self, requests: list[InFlight]) -> None:
        """Requests received by a step that was given up (oldest first) are in flight again, their rollouts with them:
        the checkpoint of the step before stores them, and the resumed step trains on them."""
        self.in_flight.extendleft(reversed(requests))

    def state_dict(self, learner_version: int, wait_s: float | None = None, inflight_updates: bool = False,
                   steps_left: int | None = None) -> dict:
        """The prompt order, the evals done, the request count that seeds vLLM's sampling, and the requests in flight
        with the rollouts that came back (`learner_version`: the policy the checkpoint holds).

        A request generated by an older policy can only be stored with its rollout: it is waited for, at most
        `wait_s` seconds in all (a preemption's budget; None: as long as it takes). A request of the checkpoint's own
        policy is not waited for: on resume the same weights generate it again with the same seed, the same batch.
        With --inflight_updates the engine holds several batches: the oldest is waited for, and the others are stored
        as the engine holds them at that moment (their tokens so far), to be continued on resume. `steps_left`: the
        steps after the checkpoint's (None: as many as there are requests in flight)."""
        give_up = None if wait_s is None else time.monotonic() + wait_s

        def left() -> float | None:
            return None if give_up is None else max(0.0, give_up - time.monotonic())

        # When the learner sends no more batches (END), the engine decodes those it holds to the end with the weights it
        # has, admitting nothing (no newer weights, no re-seeded noise): a resumed engine, which gets the checkpoint's
        # weights, could not continue them as this one does. So they are all waited for, and the checkpoint holds their
        # rollouts. If the next step's `top_up` would send END, it is sent now: the engine waits for the learner's next
        # word where it stands either way, so the run generates what it would have.
        if inflight_updates and steps_left is not None and len(self.in_flight) >= min(self.depth, steps_left):
            self.top_up(learner_version, steps_left)  # sends nothing but END
        ended = inflight_updates and self.end_sent
        waiting = True
        for request in self.in_flight:  # rollouts come back in request order: stop waiting at the first one skipped
            if not waiting:
                break
            if request.policy_version == learner_version and not ended:
                waiting = False
                continue
            request.receive(self.generator, left())
            if request.run_eval and request.rollout is not None:
                request.receive_eval(self.generator, left())
            waiting = request.complete
            if inflight_updates and not ended:  # the next ones cannot complete before the learner's next request
                break
        if inflight_updates and any(not request.complete for request in self.in_flight):
            # At rest (the oldest came back): the engine waits for the next request, a point the rule fixes. Else at once.
            budget = left()
            deadline = 0.0 if not waiting else (float("inf") if budget is None else budget)
            snapshot = self.generator.snapshot(within_s=budget, deadline_s=deadline)
            partials = {} if snapshot is None else {p["batch_id"]: p for p in snapshot.partial_batches}
            for request in self.in_flight:
                if request.rollout is None:
                    request.partial = partials.get(request.batch_id)
                # The engine ran this request's eval when it admitted the batch, before any of its tokens: a batch
                # the engine holds has its eval waiting for the learner. Stored with it, or the resumed run, which
                # continues the batch and does not run its eval again, would wait for it forever.
                if request.partial is not None and request.run_eval and request.eval_rollout is None:
                    request.receive_eval(self.generator, left())
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

    def send_unfinished(self, learner_version: int) -> "Continuation":
        """After `load_state_dict`: put the batches the checkpoint holds half generated back into the engine (after the
        learner's weights, the checkpoint's), and send again the requests whose rollouts the checkpoint did not hold,
        with their own prompts and sampling seeds and the learner's weights. Returns where the resumed run then
        differs from the uninterrupted one (the trainer says so): the requests policy `learner_version` generates in
        place of an older one, and the half-generated batches it continues where the uninterrupted engine would have
        gone on with its own, older, weights first (a snapshot taken when a preemption's budget ran out, or after END).
        END, if it was sent, is sent again after them."""
        replaced = []
        partials = [request for request in self.in_flight if request.rollout is None and request.partial is not None]
        continued = [request.batch_id for request in partials if continued_with_other_policy(request.partial,
                                                                                             learner_version)]  # fmt: skip
        if partials:
            restore = GenerationRequest(learner_version, None, [], restore=[r.partial for r in partials])
            slot = self.free_snapshot_slot() if not self.broadcast else None
            self.send_weights_and(restore, slot)
        for request in self.in_flight:
            if request.partial is not None and request.run_eval and request.eval_rollout is None:
                # A checkpoint written before its eval was stored with it: the eval alone, of the learner's weights.
                if request.policy_version != learner_version:
                    replaced.append(request.policy_version)
                evaluation = GenerationRequest(learner_version, None, [], run_eval=True,
                                               sampling_seed=request.sampling_seed, batch_id=request.batch_id)  # fmt: skip
                slot = self.free_snapshot_slot() if learner_version > 0 and not self.broadcast else None
                self.send_weights_and(evaluation, slot)
            if request.complete or request.partial is not None:
                continue
            if 0 < request.policy_version < learner_version:  # version 0 sends no weights: the engine's initial ones
                replaced.append(request.policy_version)
            prompts = request.prompts.token_ids if request.rollout is None else []  # [] asks for the eval only
            if request.rollout is None and request.policy_version > 0:  # the tokens carry the weights that made them
                request.policy_version = learner_version
            regenerate = GenerationRequest(request.policy_version, None, prompts, request.run_eval and
                                           request.eval_rollout is None, sampling_seed=request.sampling_seed,
                                           batch_id=request.batch_id,
                                           rows=self.rows(request.prompt_indices) if prompts else None)  # fmt: skip
            slot = self.free_snapshot_slot() if request.policy_version > 0 and not self.broadcast else None
            request.weights_sent, request.snapshot_slot, request.sent = self.send_weights_and(regenerate, slot), slot, regenerate
        continuation = Continuation(replaced, continued)
        self.resume_metrics = continuation.metrics()
        return continuation

    def take_resume_metrics(self) -> dict[str, float]:
        """The resume's metrics (`Continuation.metrics`) once, for the first step after it; then nothing."""
        metrics, self.resume_metrics = self.resume_metrics, {}
        return metrics


@dataclass
class Continuation:
    """Where a resumed run's first batches differ from the uninterrupted run's (`send_unfinished`)."""

    regenerated: list[int]  # policy versions of the batches the checkpoint's policy generates again in their place
    continued: list[int]  # batch ids the checkpoint's policy continues where older weights would have gone on first

    def warnings(self, checkpoint_path: str, learner_version: int) -> list[str]:
        lines = [f"the batch of policy {version} was not finished when {checkpoint_path} was written; policy "
                 f"{learner_version} generates it again, so from here this run differs from an uninterrupted one"
                 for version in self.regenerated]  # fmt: skip
        if self.continued:
            lines.append(
                f"{checkpoint_path} holds {len(self.continued)} half-generated batch(es) (batch "
                f"{', '.join(map(str, self.continued))}) snapshotted mid-batch, where the engine would have gone on with "
                f"older weights; policy {learner_version} continues them, so from here this run differs from an "
                "uninterrupted one (resume/batches_continued_with_other_policy)"
            )
        return lines

    def metrics(self) -> dict[str, float]:
        """Logged at the resumed run's first step when not zero (an exact resume logs none)."""
        metrics = {"resume/batches_regenerated_by_other_policy": float(len(self.regenerated)),
                   "resume/batches_continued_with_other_policy": float(len(self.continued))}  # fmt: skip
        return {key: value for key, value in metrics.items() if value}


def partial_samples(partial: dict) -> list[dict]:
    """A half-generated batch's samples: the in-process engine's, or every engine actor's slice of it."""
    if "engines" in partial:
        return [sample for engine in partial["engines"] if engine is not None for sample in engine["samples"]]
    return partial["samples"]


def continued_with_other_policy(partial: dict, learner_version: int) -> bool:
    """Whether a resumed engine, which continues `partial` with the checkpoint's weights (policy `learner_version`),
    generates other tokens than the uninterrupted engine did: the snapshot was not taken where the engine's next step
    was to load those weights (`at_rest`), the engine then held other weights, and some response was unfinished.
    A checkpoint written before snapshots said where they stood has no "snapshot": taken at rest."""
    where = partial.get("snapshot", {"at_rest": True})
    return (not where["at_rest"] and where["engine_policy_version"] != learner_version
            and any(sample["finish_reason"] is None for sample in partial_samples(partial)))  # fmt: skip


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


def check_staleness(rollout: Rollout, learner_version: int, max_lag: int) -> dict[str, float]:
    """`policy_version/staleness_{mean,max,min}`: how many versions older than the learner (`learner_version`, before
    this step's update) the policy that generated each response token is. The bound is enforced, not hoped for: a
    token more than `max_lag` (--async_steps; sync: 0) versions old, or from a policy the learner does not have yet,
    stops the run (the schedule rules it out, so it means a broken schedule)."""
    lags = [
        learner_version - version
        for completion in rollout.completions
        for version in (completion.versions or [rollout.policy_version] * len(completion.token_ids))
        if version is not None  # a tool's token: no policy generated it
    ]
    if not lags:
        return {}
    if max(lags) > max_lag or min(lags) < 0:
        raise RuntimeError(
            f"the learner at policy version {learner_version} got batch {rollout.batch_id} with tokens of policy "
            f"versions {learner_version - max(lags)}..{learner_version - min(lags)}, outside the bound of "
            f"{max_lag} version(s) behind (--async_steps); the schedule of rollout requests is broken."
        )
    return {
        "policy_version/staleness_mean": sum(lags) / len(lags),
        "policy_version/staleness_max": float(max(lags)),
        "policy_version/staleness_min": float(min(lags)),
    }
