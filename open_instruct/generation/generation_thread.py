"""The vLLM generation thread and the bounded queues that feed it (Cleanba-style actor/learner).

The learner (main thread) and the generator (this thread) talk only through three queues of
size 1:

    param_prompt_Q : learner -> generator   GenerationRequest(policy_version, weights, prompts, run_eval)
    response_Q     : generator -> learner   Rollout(policy_version, completions, timings)
    eval_Q         : generator -> learner   Rollout of the eval prompts, greedy and sampled (when run_eval)

How far ahead the learner may run is the learner's own rule (rollout_requests.RolloutRequests keeps --async_steps K
requests in flight beyond the batch it trains on); this thread decides only when each request enters the engine,
by one rule of the rollout's progress, never of timing, so that what is generated is the same in every run:

- `batches_in_engine` 1 (sync, and async without --inflight_updates): a request is admitted when the engine is
  empty: its weights are loaded, its batch is generated alone, then the next request is admitted. A request waits in
  this thread's inbox until then; the weights it carries (a copy, or learner rank 0's transfer) are loaded at its
  admission.
- `batches_in_engine` K (--inflight_updates): the engine decodes K batches together. When the oldest completes, the
  next request is admitted before another step is taken: its weights are loaded into the engine while the other K-1
  batches are half generated (an in-flight update; engine_batches.py: they go on under the new weights, every token
  tagged with the version that produced it), and its prompts join them. The engine waits for that request if the
  learner has not sent it yet (the learner sends it before it waits for the oldest batch, so it comes as soon as the
  previous step has trained), and decodes fewer batches only after the learner said no more are coming (`END`).

Evals run at their request's admission, right after its weights are loaded (the batches in the engine advance with
them). A snapshot of the batches in the engine (the learner's checkpoint) is answered where the thread waits for a
request, a point the rule fixes, or between two steps once the snapshot's deadline has passed.

Behind the thread sits either one vLLM engine in this process (`InProcessEngine`: the single-process learner's
tensors are handed over by reference) or engine actors on Ray (engine_actors.EngineGroup, --vllm_num_engines). With
Ray learners, a request with `broadcast=True` makes the engines (actors, or the in-process one) receive the weights
learner rank 0 sends: first a round trip in which every engine says it is ready (`engines_ready`, awaited by the
learner under --queue_timeout_s, since the engines may still be generating), then the transfer itself, which the
learner starts only then, under --vllm_sync_timeout_s (rollout_requests.py).

Failure handling: any exception in the thread is stored and the thread ends; every queue wait in
the learner wakes up at least every `poll_s` seconds, sees the failure and raises it with its
cause. A wait longer than `timeout_s` raises with a message instead of hanging. Inside `abandoning_waits_when(cond)`
a wait that `cond()` says has gone on long enough raises WaitAbandoned (a preemption: the learner gives up a step
whose rollout does not come in time, and checkpoints the step before).
"""

import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

from open_instruct.generation import vllm_engine
from open_instruct.generation.engine_batches import EngineBatches
from open_instruct.generation.seams import Engine
from open_instruct.run import console
from open_instruct.run.args import ConfigError
from open_instruct.run.devices import pin_this_thread


@dataclass
class GenerationRequest:
    policy_version: int
    weights: list[tuple[str, torch.Tensor]] | None  # None: keep the engine's current weights
    prompt_token_ids: list[list[int]]
    run_eval: bool = False
    broadcast: bool = False  # Ray learners: receive this version's weights from learner rank 0 first
    # The handshake of a broadcast: set by this thread when every engine is ready to receive (learner rank 0 starts
    # sending then), and by the learner when its side of the transfer ended (IPC: it drove the engines itself).
    engines_ready: threading.Event = field(default_factory=threading.Event)
    learner_done: threading.Event = field(default_factory=threading.Event)
    # Set by this thread once the request's weights are in the engine: the learner's copy of them is free again.
    weights_loaded: threading.Event = field(default_factory=threading.Event)
    # Re-seeds the sampling noise before this request's generation (sampled eval: sampling_seed + 1), so that its
    # samples depend only on (seed, weights, prompts), not on what the engine generated before: exact resume.
    sampling_seed: int | None = None
    batch_id: int = 0  # the request's number in the run: the engine's name for its batch
    # With --tools: each prompt's dataset row (environments.routing.environment_rows), for its environment's
    # `reset`; the engine's alone, never the learner's.
    rows: list[dict] | None = None
    # Resume: batches the checkpoint holds half generated (engine_batches partial_batches), put back into the engine
    # after the request's weights are loaded; their rollouts come back in batch order like any other.
    restore: list[dict] = field(default_factory=list)
    # Filled by this thread at admission: the weight sync's seconds, and (engine actors) what each worker received.
    timings: dict[str, float] = field(default_factory=dict)
    checksums: list[list[dict]] = field(default_factory=list)


END = "end"  # sent by the learner when no more scheduled batches come (the engine then decodes fewer than K)


@dataclass
class Rollout:
    policy_version: int  # the weights that generated these completions (with in-flight updates: their first tokens)
    completions: list[vllm_engine.Completion]
    timings: dict[str, float] = field(default_factory=dict)
    sampled_completions: list[vllm_engine.Completion] = field(default_factory=list)  # eval only: at temperature
    # Engine actors: per engine, the checksums of the weights each of its workers received in the sync before this
    # rollout (the learner compares them with what it sent); empty for the in-process engine.
    weight_checksums: list[list[dict]] = field(default_factory=list)
    # Engine actors: `engine/restarts` so far, and `time/engine_restart` when a replacement joined in this sync.
    engine_metrics: dict[str, float] = field(default_factory=dict)
    batch_id: int = 0


@dataclass
class GenerationSettings:
    engine: vllm_engine.EngineConfig
    samples_per_prompt: int
    temperature: float
    response_length: int
    stop_token_ids: list[int]
    stop_strings: list[str] | None
    eval_prompt_token_ids: list[list[int]] | None = None
    eval_samples_per_prompt: int = 0  # sampled eval at the training temperature, besides greedy
    # The evals between the first (policy 0) and the final (policy `final_policy_version`) sample this many instead.
    mid_run_eval_samples_per_prompt: int | None = None
    final_policy_version: int | None = None
    batches_in_engine: int = 1  # batches decoded together: --async_steps with --inflight_updates, else 1
    cpu_cores: list[int] | None = None  # --vllm_cpu_cores: the cores this thread (its engine) runs on; None: all
    # --tools: {"names", "max_calls", "timeout_s", "output_max_tokens", "wrapper"} (tool_settings); None: no tools
    tools: dict | None = None
    eval_rows: list[dict] | None = None  # with --tools or an agent: each eval prompt's dataset row
    # --rollout_agent: {"spec", "concurrency", "timeout_s", "max_calls", "failed", "host", "port", "parser",
    # "chat_template_name", "served_name"} (run.args.agent_settings); None: the dataset's prompts are the rollouts
    agent: dict | None = None


def eval_samples_per_prompt(settings: GenerationSettings, policy_version: int) -> int:
    """Sampled responses per eval prompt: --mid_run_eval_samples_per_prompt between the first and the final eval."""
    mid_run = 0 < policy_version and policy_version != settings.final_policy_version
    if mid_run and settings.mid_run_eval_samples_per_prompt is not None:
        return settings.mid_run_eval_samples_per_prompt
    return settings.eval_samples_per_prompt


class InProcessEngine:
    """One vLLM engine inside this process: weights arrive as tensors (by reference) and are loaded in place, or, beside
    Ray learner ranks, from learner rank 0's transfer (the same receiving side as an engine actor's; no model travels
    through Ray's object store). The seams.Engine the generation thread calls, as engine_actors.EngineGroup is."""

    num_workers = 1
    regroup_pending = False  # the weight group never changes (engine actors: restarts)
    restarts = 0  # it lives and dies with this process: never restarted

    def __init__(self, config: vllm_engine.EngineConfig):
        self.llm = vllm_engine.create_engine(config)
        self.batches = EngineBatches(self.llm)
        self.transfer = None

    def wait_until_ready(self) -> None:
        pass  # loaded when constructed

    def regroup(self, learner) -> None:
        pass  # never pending: no engine of this weight group can be lost and replaced

    # ---- the receiving side of a transfer from Ray learners (as engine_actors.EngineGroup) ----
    def device_reports(self) -> list[dict]:
        from open_instruct.generation.weight_transfer import engine_device_reports

        return engine_device_reports(self.llm)

    def join_weight_group(self, transfer) -> None:
        from open_instruct.generation import weight_transfer

        if transfer.transport == "ipc":
            raise ConfigError(
                "the trainer's in-process engine shares a GPU with a learner rank, which only engine actors can "
                "(CUDA IPC); pass --vllm_num_engines N --single_gpu_mode, or --vllm_sync_backend gloo."
            )
        weight_transfer.join(self.llm, transfer, first_rank=1)
        self.transfer = transfer

    def ready_to_receive(self, policy_version: int) -> None:
        pass  # it runs in the generation thread itself, which is between two engine steps when it gets here

    def receive_weights(self, policy_version: int, learner_done: threading.Event) -> list[dict]:
        from open_instruct.generation.weight_transfer import receive, transfer_result

        start = time.time()
        with self.batches.new_weights(policy_version):
            per_worker = receive(self.llm, self.transfer)
        return [transfer_result(per_worker, time.time() - start)]

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]], policy_version: int) -> float:
        with self.batches.new_weights(policy_version):
            return vllm_engine.load_weights(self.llm, named_tensors)

    # ---- the batches in the engine (engine_batches.EngineBatches) ----
    def admit(self, batch_id: int, prompt_token_ids: list[list[int]], params: dict, sampling_seed: int | None,
              rows: list[dict] | None = None) -> None:  # fmt: skip
        self.batches.admit(batch_id, prompt_token_ids, params, sampling_seed, rows)

    def run_until_complete(self, batch_id: int, between_steps=None) -> list[vllm_engine.Completion]:
        return self.batches.run_until_complete(batch_id, between_steps)

    def partial_batches(self) -> list[dict]:
        return self.batches.partial_batches()

    def restore(self, partial_batches: list[dict]) -> None:
        self.batches.restore(partial_batches)

    def engine_steps(self) -> int:
        return self.batches.steps

    def restart_metrics(self) -> dict[str, float]:
        return {}  # never restarted

    def batch_metrics(self, batch_id) -> dict[str, float]:
        return self.batches.agents.metrics_of(batch_id) if self.batches.agents is not None else {}

    def shutdown(self) -> None:
        if self.batches.agents is not None:
            self.batches.agents.close()
        console.keep_until_exit(self.llm)  # the engine goes with this process (its shutdown would only free memory)


@dataclass
class Snapshot:
    """A learner's request for the batches in the engine as they stand (a checkpoint), answered by the thread."""

    deadline: float  # after it, answered between two engine steps, not only where the thread waits for a request
    answered: threading.Event = field(default_factory=threading.Event)
    partial_batches: list[dict] = field(default_factory=list)
    at_rest: bool = True  # answered where the rule fixes it (a wait for a request), not at the deadline


class GenerationThreadError(RuntimeError):
    pass


class GenerationStopped(Exception):
    """Raised between two engine steps when the thread is told to stop."""


class WaitAbandoned(Exception):
    """Raised in a learner's wait inside `abandoning_waits_when` once its condition holds: what was awaited has not
    come, and the learner stops waiting for it (the request stays in flight)."""


class GenerationThread(threading.Thread):
    """Owns the vLLM engine: admit requests (their weights, evals and batches), step the engine, hand back rollouts, until
    told to stop."""

    def __init__(self, settings: GenerationSettings, poll_s: float = 1.0, timeout_s: float = 1800.0,
                 engine: Engine | None = None):  # fmt: skip
        """`engine`: engine actors already created (engine_actors.EngineGroup); None: start one in this process."""
        super().__init__(name="vllm-generation", daemon=True)
        self.settings = settings
        self.engine = engine
        self.param_prompt_Q: queue.Queue = queue.Queue(maxsize=1)
        self.response_Q: queue.Queue = queue.Queue(maxsize=1)
        self.eval_Q: queue.Queue = queue.Queue(maxsize=1)
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.error: BaseException | None = None
        self.error_traceback = ""
        self._stop_requested = threading.Event()
        self._engine_ready = threading.Event()
        self.local_engine: InProcessEngine | None = None  # the engine of this thread, once created
        # This thread's side: requests taken from the learner and not admitted yet, the requests whose batches are in
        # the engine (oldest first), and a snapshot the learner asked for.
        self.inbox: deque = deque()
        self.admitted: deque[GenerationRequest] = deque()
        self.ended = False  # the learner sent END: no more scheduled batches
        self.engine_version = 0  # the policy version of the weights in the engine (its initial ones: 0)
        self.snapshot_request: Snapshot | None = None
        self.idle_seconds = 0.0  # waiting for a request, or for the learner to take a rollout, since the last rollout
        self.abandon_waits: Callable[[], bool] | None = None  # the learner's waits give up once it returns True

    # ---- generator side (this thread) ----
    def run(self) -> None:
        try:
            self.serve()
        except BaseException as error:  # noqa: BLE001 - everything must reach the learner
            self.error_traceback = traceback.format_exc()
            self.error = error  # last: the learner reads the traceback as soon as it sees the error

    def serve(self) -> None:
        if self.settings.cpu_cores is not None:
            pin_this_thread(self.settings.cpu_cores)  # before the engine starts its threads
        if self.engine is None:
            self.local_engine = InProcessEngine(self.settings.engine)
        engine = self.weight_receivers
        self._engine_ready.set()
        capacity = self.settings.batches_in_engine
        busy_since = time.time()
        try:
            self._serve_requests(engine, capacity, busy_since)
        except GenerationStopped:
            return

    def _serve_requests(self, engine, capacity: int, busy_since: float) -> None:
        while not self._stop_requested.is_set():
            # Admit until the engine holds `capacity` batches (after END: whatever comes, when it is empty).
            while (len(self.admitted) < capacity and not self.ended) or (self.ended and not self.admitted):
                request = self._next_request()
                if request is None:
                    return
                if request == END:
                    self.ended = True
                    continue
                self._admit(engine, request)
            oldest = self.admitted[0]
            start = time.time()
            completions = engine.run_until_complete(oldest.batch_id, self._between_steps)
            self.admitted.popleft()
            timings = {"generation": time.time() - start, **oldest.timings}
            timings["engine_idle"], self.idle_seconds = self.idle_seconds, 0.0
            timings["engine_busy"] = time.time() - busy_since - timings["engine_idle"]
            busy_since = time.time()
            rollout = Rollout(oldest.policy_version, completions, timings, weight_checksums=oldest.checksums,
                              engine_metrics={**engine.restart_metrics(), **engine.batch_metrics(oldest.batch_id)},
                              batch_id=oldest.batch_id)  # fmt: skip
            self._put(self.response_Q, rollout, "the learner to take the last rollout", at_rest=True)

    def _params(self, n: int, temperature: float, with_logprobs: bool = False) -> dict:
        settings = self.settings
        # No per-request vLLM seed: the engine's seeded generator must advance, or every step replays one stream.
        return dict(n=n, temperature=temperature, with_logprobs=with_logprobs, max_tokens=settings.response_length,
                    stop_token_ids=settings.stop_token_ids, stop_strings=settings.stop_strings,
                    tools=settings.tools, agent=settings.agent)  # fmt: skip

    def _admit(self, engine, request: GenerationRequest) -> None:
        """The request's weights into the engine (an in-flight update when batches are in it), its eval, its batch."""
        settings = self.settings
        if request.broadcast or request.weights is not None:
            self.engine_version = request.policy_version
        if request.broadcast:
            engine.ready_to_receive(request.policy_version)
            request.engines_ready.set()  # learner rank 0 starts its transfer now
            synced = engine.receive_weights(request.policy_version, request.learner_done)
            request.timings["weight_sync"] = max(result["seconds"] for result in synced)
            request.checksums = [result["checksums"] for result in synced]
        elif request.weights is not None:
            request.timings["weight_sync"] = engine.load_weights(request.weights, request.policy_version)
            request.timings["weight_sync_bytes"] = sum(t.numel() * t.element_size() for _, t in request.weights)
        request.weights_loaded.set()
        request.weights = None  # the learner's buffer is free again
        if request.restore:
            engine.restore(request.restore)
            self.admitted.extend(GenerationRequest(partial["policy_version"], None, [], batch_id=partial["batch_id"])
                                 for partial in request.restore)  # fmt: skip
        if request.run_eval and settings.eval_prompt_token_ids:
            self._run_eval(engine, request)
        if request.prompt_token_ids:  # an eval-only request (the final eval) has no training prompts
            # Training samples come with their logprobs: the learner checks every step that it computes the same ones.
            params = self._params(settings.samples_per_prompt, settings.temperature, with_logprobs=True)
            engine.admit(request.batch_id, request.prompt_token_ids, params, request.sampling_seed, request.rows)
            self.admitted.append(request)

    def _run_eval(self, engine, request: GenerationRequest) -> None:
        """Greedy, then sampled (its own seed), on the weights just loaded; the batches in the engine advance with it."""
        settings, start = self.settings, time.time()
        prompts = settings.eval_prompt_token_ids
        engine.admit(("eval", request.batch_id), prompts, self._params(1, 0.0), None, settings.eval_rows)
        greedy = engine.run_until_complete(("eval", request.batch_id), self._between_steps)
        # An agent's eval: its agent/* counts, and how many sampled runs per prompt there were (a rollout that failed
        # leaves no completion to count).
        metrics = engine.batch_metrics(("eval", request.batch_id))
        sampled, samples_per_prompt = [], eval_samples_per_prompt(settings, request.policy_version)
        if samples_per_prompt > 0:
            seed = None if request.sampling_seed is None else request.sampling_seed + 1
            engine.admit(("sampled eval", request.batch_id), prompts,
                         self._params(samples_per_prompt, settings.temperature), seed, settings.eval_rows)  # fmt: skip
            sampled = engine.run_until_complete(("sampled eval", request.batch_id), self._between_steps)
            engine.batch_metrics(("sampled eval", request.batch_id))
            metrics["sampled_rollouts_per_prompt"] = samples_per_prompt
        eval_rollout = Rollout(request.policy_version, greedy, {"eval_generation": time.time() - start}, sampled,
                               request.checksums, engine_metrics=metrics, batch_id=request.batch_id)  # fmt: skip
        self._put(self.eval_Q, eval_rollout, "the learner to take the last eval rollout", at_rest=False)

    # ---- this thread's waits: each one takes the learner's requests in and answers its snapshot ----
    def _service(self, at_rest: bool) -> None:
        """Take every request the learner sent into the inbox (so that its sends never wait on this thread's own
        waits), and answer a snapshot if this is a place for one: `at_rest` (a wait the rule fixes) or its deadline
        has passed."""
        while True:
            try:
                self.inbox.append(self.param_prompt_Q.get_nowait())
            except queue.Empty:
                break
        snapshot = self.snapshot_request
        if snapshot is not None and (at_rest or time.time() >= snapshot.deadline):
            engine = self.weight_receivers
            versions = {request.batch_id: request.policy_version for request in self.admitted}
            # Where the batches stood: taken at rest and before END, the next thing the engine does is load the
            # learner's next weights (the checkpoint's); else it would first go on with its own (`engine_version`).
            where = {"at_rest": at_rest and not self.ended, "engine_policy_version": self.engine_version}
            snapshot.partial_batches = [{**partial, "policy_version": versions[partial["batch_id"]], "snapshot": where}
                                        for partial in engine.partial_batches() if partial["batch_id"] in versions]  # fmt: skip
            snapshot.at_rest = at_rest
            self.snapshot_request = None
            snapshot.answered.set()

    def _between_steps(self) -> None:
        if self._stop_requested.is_set():
            raise GenerationStopped()
        self._service(at_rest=False)

    def _next_request(self):
        """The next request (or END), waiting for it in `poll_s` slices; None when told to stop. A wait longer than
        `timeout_s` raises."""
        started = time.time()
        try:
            while not self._stop_requested.is_set():
                self._service(at_rest=True)
                if self.inbox:
                    return self.inbox.popleft()
                if time.time() - started > self.timeout_s:
                    raise TimeoutError(f"The generation thread waited {self.timeout_s:.0f}s for the next prompts from "
                                       "the learner.")  # fmt: skip
                try:
                    self.inbox.append(self.param_prompt_Q.get(timeout=min(self.poll_s, 0.05)))
                except queue.Empty:
                    pass
            return None
        finally:
            self.idle_seconds += time.time() - started

    def _put(self, q: queue.Queue, item, what: str, at_rest: bool) -> None:
        """`at_rest`: a place the rule fixes (a batch just completed, the next not admitted), where a snapshot may be
        answered before its deadline."""
        started = time.time()
        try:
            while not self._stop_requested.is_set():
                self._service(at_rest)
                try:
                    return q.put(item, timeout=min(self.poll_s, 0.05))
                except queue.Full:
                    if time.time() - started > self.timeout_s:
                        raise TimeoutError(f"The generation thread waited {self.timeout_s:.0f}s for {what}.") from None
        finally:
            self.idle_seconds += time.time() - started

    # ---- learner side (main thread) ----
    def send(self, request: GenerationRequest) -> None:
        self._learner_wait(lambda timeout: self.param_prompt_Q.put(request, timeout=timeout), "take new prompts")

    def receive(self, within_s: float | None = None) -> Rollout | None:
        """The next rollout; with `within_s`, None if it has not come by then (a preempted run's checkpoint)."""
        return self._learner_wait(self.response_Q.get, "return a rollout", within_s)

    def receive_eval(self, within_s: float | None = None) -> Rollout | None:
        return self._learner_wait(self.eval_Q.get, "return the eval rollout", within_s)

    def send_end(self) -> None:
        """No more scheduled batches come: the engine may decode fewer than --async_steps batches from here on."""
        self._learner_wait(lambda timeout: self.param_prompt_Q.put(END, timeout=timeout), "take the end of the batches")

    def snapshot(self, within_s: float | None = None, deadline_s: float = 0.0) -> Snapshot | None:
        """The batches in the engine as they stand (a checkpoint's), answered where the thread next waits for a request
        or, after `deadline_s`, between two engine steps; None if no answer came within `within_s` (engine actors
        answer only where the thread waits)."""
        request = Snapshot(deadline=time.time() + deadline_s)
        self.snapshot_request = request

        def answered(timeout: float) -> Snapshot:
            if not request.answered.wait(timeout):
                raise queue.Empty
            return request

        result = self._learner_wait(answered, "take a snapshot of the batches in the engine", within_s)
        if result is None:
            self.snapshot_request = None
        return result

    @contextmanager
    def abandoning_waits_when(self, condition: Callable[[], bool]):
        """The learner's waits in this block raise WaitAbandoned once `condition()` is True (checked every `poll_s`)."""
        self.abandon_waits = condition
        try:
            yield
        finally:
            self.abandon_waits = None

    def _learner_wait(self, call, what: str, within_s: float | None = None):
        deadline = time.time() + self.timeout_s
        give_up = None if within_s is None else time.time() + within_s
        while True:
            self.raise_if_failed()
            try:
                return call(timeout=self.poll_s if give_up is None else max(0.0, min(self.poll_s, give_up - time.time())))
            except (queue.Empty, queue.Full):
                if not self.is_alive():
                    self.raise_if_failed()
                    raise GenerationThreadError(f"The generation thread ended without an error before it could {what}.") from None
                if give_up is not None and time.time() >= give_up:
                    return None
                if self.abandon_waits is not None and self.abandon_waits():
                    raise WaitAbandoned(f"the generation thread did not {what} in time") from None
                if time.time() > deadline:
                    raise TimeoutError(
                        f"Waited {self.timeout_s:.0f}s for the generation thread to {what}; raise "
                        f"--queue_timeout_s if generation is this slow, or check that the engine is not stuck."
                    ) from None

    def wait_for(self, event: threading.Event, what: str) -> None:
        """Wait for `event`, set by this thread, as for a rollout: its failure raises at once, and after --queue_timeout_s
        a TimeoutError says what was awaited."""

        def wait_for_event(timeout: float) -> None:
            if not event.wait(timeout):
                raise queue.Empty

        self._learner_wait(wait_for_event, what)

    @property
    def weight_receivers(self) -> Engine | None:
        """The engine behind this thread, which receives the weights: the engine actors, or this thread's own engine
        (None until the thread has created it)."""
        return self.engine if self.engine is not None else self.local_engine

    def wait_until_ready(self) -> None:
        """Block until the engine is up (on a shared GPU, vLLM must size its cache before the learner allocates)."""
        self.wait_for(self._engine_ready, "start the vLLM engine")
        self.weight_receivers.wait_until_ready()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise GenerationThreadError(
                f"The vLLM generation thread failed: {type(self.error).__name__}: {self.error}\n"
                f"--- generation thread traceback ---\n{self.error_traceback}"
            ) from self.error

    def raise_if_it_fails_within(self, seconds: float) -> None:
        """Give the thread `seconds` to end with an error (then raise it, as raise_if_failed); a healthy thread
        costs the whole wait. For the learner whose own call just failed in a way a dead engine would cause."""
        self.join(timeout=seconds)
        self.raise_if_failed()

    def shutdown(self) -> None:
        self._stop_requested.set()
        self.join(timeout=self.poll_s * 5)
        if self.local_engine is not None:  # engine actors are the trainer's to stop
            self.local_engine.shutdown()


def rollout_to_dict(rollout) -> dict | None:
    return None if rollout is None else asdict(rollout)


def rollout_from_dict(data: dict | None):
    from open_instruct.generation.vllm_engine import Completion

    if data is None:
        return None
    completions = [Completion(**c) for c in data["completions"]]
    sampled = [Completion(**c) for c in data.get("sampled_completions", [])]
    return Rollout(data["policy_version"], completions, data.get("timings", {}), sampled,
                   engine_metrics=data.get("engine_metrics", {}), batch_id=data.get("batch_id", 0))  # fmt: skip
