"""Tool calls that run while the engine decodes: a sample whose turn ends is parked (taken out of the engine), its
turn starts here, and the engine steps the other samples; the engine takes the finished turns back at its next step
(generation/engine_batches.py).

Where a call runs:

- A call of a `Tool` (a `ToolEnvironment`'s: `--tools calculator python file.py:Class file.py:function`; a native
  turn's, `NativeToolEnvironment`'s; any environment with its `calls` and `observation`, `runs_calls`) runs in a
  worker process
  (`ToolWorker`) that builds the tool again from its --tools name: tools are stateless, so any process can answer.
  A call past --tool_timeout_s is cut: its process is killed (with whatever it started) and the next call starts a
  new one, so a hung tool costs no worker. --tool_workers threads run the calls, each with a process of its own (they
  start with their first call, ~0.2 s); the calls of one turn run --max_parallel_tool_calls at a time, and their
  outputs are joined in the calls' order.
- A tool registered in code at run time (`tools.TOOLS["name"] = Class` in the trainer's process) cannot be rebuilt by
  name in another process: its calls run in a thread. So does each step of a stateful `Environment` (user code holding
  one sample's state in the engine's process, which cannot move cheaply); a native one's (`step_calls`,
  `renders_turns`) too, its calls read before and its tool turns rendered after, in the engine's thread. A thread
  cannot be stopped: one past its time is left running, counted (tools/abandoned_threads) and warned about, and a
  stateful environment whose step hung is dropped and its sample ends (finish reason "environment_error"), since its
  state can no longer be trusted.

The processes are started with `python -m` (not forked: the engine's process holds vLLM's threads, whose locks a
fork would copy held) and talk JSON lines through pipes, never pickle (model-written text goes in, tool output
comes out): the process is rewards/worker.py's, serving this module's requests. A turn's calls are read
(`ParkedTurns.start`) and its observation assembled (`ParkedTurn.outcome`) in the engine's thread, where its tokenizer
lives (it cuts outputs to --tool_output_max_tokens and renders native tool turns): a pool thread never touches it.
"""

import atexit
import functools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from open_instruct.environments import tools
from open_instruct.rewards import worker as reward_worker

# Built-in tools a fresh process builds from their name (others registered in code at run time cannot be).
BUILT_IN_TOOLS = {"calculator": tools.Calculator, "python": tools.PythonTool}


class ToolWorker(reward_worker.RewardWorker):
    """A process that answers tool calls (`run`); killed past a call's time and started again at the next call."""

    MODULE = "open_instruct.environments.tool_pool"

    def load(self, name: str) -> None:
        """Start the process and build the tool `--tools name` there, if not yet: not the call's time (it has its own,
        longer, deadline). RewardError when it cannot."""
        with self._lock:
            if name not in self._loaded or self._process is None:
                loaded = self._ask({"tool": name, "load": True}, reward_worker.LOAD_TIMEOUT_S, f"building {name}")
                if "raised" in loaded:
                    raise reward_worker.RewardError(f"building {name} failed: {loaded['raised']}")
                self._loaded.add(name)

    def run(self, name: str, call: str | dict, timeout_s: float) -> tuple[str, bool]:
        """`tools.call_output` of the tool `--tools name` builds, in the process: (output, failed). RewardTimeout past
        `timeout_s` (the process is killed), RewardError when the process died."""
        with self._lock:
            answer = self._ask({"tool": name, "call": call}, timeout_s, f"after {timeout_s:g} s")
        return answer["output"], answer["failed"]


def answer_call(built: dict, request: dict) -> dict:
    """In the worker process: one request answered (`reward_worker.serve`)."""
    name = request["tool"]
    try:
        if name not in built:
            built[name] = tools.tool_class(name)()
        if request.get("load"):
            return {"loaded": True}
        output, failed = tools.call_output(built[name], request["call"])
    except BaseException as error:  # noqa: BLE001 - a tool's SystemExit too is the model's to read
        return {"raised": tools.failure_text(error)} if request.get("load") else {
            "output": f"Error: {tools.failure_text(error)}", "failed": True}  # fmt: skip
    return {"output": output, "failed": failed}


def runs_calls(environment: tools.Environment) -> bool:
    """Whether the pool runs the environment's turns call by call: it has `calls(model_text)` -> [(key into its `tools`,
    the call's text or arguments)], or (None, the error the model reads) for a call that cannot run, and
    `observation([(output, failed)]) -> observation` (ToolEnvironment's and NativeToolEnvironment's; any other
    environment's whole `step` runs in one thread). Both run in the engine's thread, so they may use its tokenizer."""
    return callable(getattr(environment, "calls", None)) and callable(getattr(environment, "observation", None))


def renders_turns(environment: tools.Environment) -> bool:
    """Whether the environment's step runs in three parts (native_tools.NativeEnvironment: a user's `step_calls`):
    `read_turn(text)` in the engine's thread, `answer_turn()` in a pool thread under the time limit, `render(answer)`
    back in the engine's thread, which makes its tool turns with the engine's tokenizer."""
    return all(callable(getattr(environment, name, None)) for name in ("read_turn", "answer_turn", "render"))


class CallPool:
    """`workers` threads that run calls; each thread owns one ToolWorker process (`worker()`)."""

    def __init__(self, workers: int):
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="tool-call")
        self.local = threading.local()
        self.processes: list[ToolWorker] = []

    def submit(self, function: Callable, *args) -> Future:
        return self.executor.submit(function, *args)

    def worker(self) -> ToolWorker:
        """The calling thread's worker process."""
        if getattr(self.local, "worker", None) is None:
            self.local.worker = ToolWorker()
            self.processes.append(self.local.worker)
        return self.local.worker

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        for process in self.processes:
            process.stop()


POOLS: dict[int, CallPool] = {}  # one per --tool_workers in this process: evals and training batches share it


def shared_pool(workers: int) -> CallPool:
    if workers not in POOLS:
        POOLS[workers] = CallPool(workers)
    return POOLS[workers]


def close_pools() -> None:
    for pool in POOLS.values():
        pool.close()
    POOLS.clear()


atexit.register(close_pools)
os.register_at_fork(after_in_child=POOLS.clear)  # a forked child's pools are the parent's threads and processes


def process_name(names: list[str], tool: tools.Tool) -> str | None:
    """The --tools name a fresh process builds this tool's class from (a user's file, path.py:Class, or a built-in),
    or None: its calls run in threads."""
    for name in names:
        try:
            rebuilt = tools.tool_class(name) if ":" in name else BUILT_IN_TOOLS.get(name)
        except ValueError:
            continue
        if type(tool) is rebuilt and (":" in name or tools.TOOLS.get(name) is rebuilt):
            return name
    return None


@dataclass
class CallResult:
    """One call's answer: what the model reads, whether the tool failed, and how it went."""

    output: str
    failed: bool = False
    seconds: float = 0.0
    timed_out: bool = False
    abandoned_thread: bool = False  # it ran in a thread, which is left running past its time


def timeout_text(timeout_s: float) -> str:
    return f"Error: the call took longer than {timeout_s:g} s and was stopped"


def run_call(pool: CallPool, name: str | None, tool: tools.Tool, call: str | dict | None, timeout_s: float) -> CallResult:
    """One call, on a pool thread: in that thread's worker process, which builds the tool from its --tools `name`, or
    (`name` None) in a thread of its own, left running past `timeout_s`."""
    if call is None:
        return CallResult(*tools.call_output(tool, call))
    if name is not None:
        worker, started = pool.worker(), time.monotonic()
        try:
            worker.load(name)
            started = time.monotonic()
            output, failed = worker.run(name, call, timeout_s)
        except reward_worker.RewardTimeout:
            return CallResult(timeout_text(timeout_s), seconds=timeout_s, timed_out=True)
        except reward_worker.RewardError as error:
            output, failed = f"Error: the tool's process failed: {error}", True
        return CallResult(output, failed, time.monotonic() - started)
    attempt = tools.run_guarded([functools.partial(tools.call_output, tool, call)], timeout_s)[0]
    if attempt.timed_out:
        return CallResult(timeout_text(timeout_s), seconds=timeout_s, timed_out=True, abandoned_thread=True)
    if attempt.error is not None:  # call_output answers every Exception; this is a BaseException
        return CallResult(f"Error: {attempt.error}", True, attempt.seconds)
    return CallResult(*attempt.value, attempt.seconds)


@dataclass
class TurnOutcome:
    """What a parked turn gave the engine: the observation to append, the environment's reward and done, and counts.
    `environment_lost`: a stateful environment's step ran past its time (its thread abandoned): the sample ends.
    `cut`: the observation is still to be cut to --tool_output_max_tokens (a ToolEnvironment cuts each output).
    `calls`: the calls the turn made (tools/calls_per_sample, --max_tool_calls): each of a turn's calls, or one step."""

    observation: object  # str, or tools.TokenObservation
    reward: float = 0.0
    done: bool = False
    seconds: float = 0.0
    errors: int = 0
    timeouts: int = 0
    outputs_cut: int = 0
    abandoned_threads: int = 0
    environment_lost: bool = False
    cut: bool = True
    calls: int = 1


@dataclass
class ParkedTurn:
    """One sample's turn while it runs: `key` the engine's, the environment, and each call's result as it arrives."""

    key: int
    environment: tools.Environment
    calls_left: int
    results: list = field(default_factory=list)  # CallResult per call, or one tools.StepOutcome (an Environment's)
    errors_before: int = 0

    def outcome(self) -> TurnOutcome:
        """The turn's outcome; in the engine's thread (a ToolEnvironment cuts its outputs with the engine's tokenizer, a
        NativeToolEnvironment renders its tool turns with it)."""
        if runs_calls(self.environment):
            cuts_before = getattr(self.environment, "outputs_cut", 0)
            observation = self.environment.observation([(r.output, r.failed) for r in self.results])
            return TurnOutcome(observation, calls=len(self.results), seconds=sum(r.seconds for r in self.results),
                               errors=sum(r.failed for r in self.results), timeouts=sum(r.timed_out for r in self.results),
                               outputs_cut=getattr(self.environment, "outputs_cut", 0) - cuts_before,
                               abandoned_threads=sum(r.abandoned_thread for r in self.results), cut=False)  # fmt: skip
        step = self.results[0]
        observation, cut, calls, cuts_before = step.observation, True, 1, getattr(self.environment, "outputs_cut", 0)
        if renders_turns(self.environment):  # its results (or its error's text) as the template's tool turns
            observation, cut, calls = self.environment.render(observation), False, len(self.environment.turn_calls)
        errors = step.error or (not step.timed_out and self.environment.errors > self.errors_before)
        return TurnOutcome(observation, step.reward, step.done, step.seconds, int(errors), int(step.timed_out),
                           getattr(self.environment, "outputs_cut", 0) - cuts_before, int(step.timed_out),
                           environment_lost=step.timed_out, cut=cut, calls=calls)  # fmt: skip


class ParkedTurns:
    """The turns one engine has parked. `start` runs a turn on the shared pool of --tool_workers; `finished` hands
    back the turns done since it was last called (waiting up to `wait_s` for one when none is)."""

    def __init__(self):
        self.done: queue.Queue[ParkedTurn] = queue.Queue()
        self.pending = 0  # started, not yet handed back

    def start(self, key: int, environment: tools.Environment, text: str, settings: dict) -> None:
        """Start the turn `text` of `environment`; `settings` are the batch's params["tools"] (names, timeout_s,
        workers, max_parallel_calls; the last two absent from a checkpoint that predates them)."""
        pool = shared_pool(settings.get("workers", 8))
        timeout_s = settings["timeout_s"]
        self.pending += 1
        if not runs_calls(environment):
            turn = ParkedTurn(key, environment, 1, [None], errors_before=environment.errors)
            native = renders_turns(environment)
            if native:  # a native environment: its calls read here, its results rendered in `outcome`
                environment.read_turn(text)
                step = environment.answer_turn
            else:
                step = functools.partial(environment.step, text)
            future = pool.submit(lambda: tools.guarded_steps([step], timeout_s, per_call=native)[0])
            future.add_done_callback(functools.partial(self._answered, turn, 0, None, threading.Lock()))
            return
        failed = []  # a turn whose calls cannot be read
        try:
            calls = environment.calls(text)
        except Exception as error:  # a subclass's own parsing: the model reads its failure, the engine goes on
            calls, failed = [], [CallResult(f"Error: {tools.failure_text(error)}", True)]
        turn = ParkedTurn(key, environment, len(calls), [None] * len(calls) + failed)
        queued = iter(list(enumerate(calls)))
        lock = threading.Lock()

        def start_next() -> None:
            with lock:
                index, (place, call) = next(queued, (None, (None, None)))
            if index is None:
                return
            if place is None:  # a call that cannot run (a native call's bad JSON, ...): `call` is the error to read
                future = Future()
                future.set_result(CallResult(call, True))
            else:
                tool = environment.tools[place]
                future = pool.submit(run_call, pool, process_name(settings["names"], tool), tool, call, timeout_s)
            future.add_done_callback(functools.partial(self._answered, turn, index, start_next, lock))

        for _ in range(max(1, min(settings.get("max_parallel_calls", 4), len(calls)))):
            start_next()
        if not calls:
            self.done.put(turn)

    def _answered(self, turn: ParkedTurn, index: int, start_next, lock: threading.Lock, future: Future) -> None:
        """A call of `turn` is done (on the pool's thread): its result is kept, the turn's next call starts, and the
        turn is done when its last call is."""
        try:
            result = future.result()
        except BaseException as error:  # noqa: BLE001 - the pool's own failure: the model reads it, the run goes on
            text = f"Error: {tools.failure_text(error)}"
            result = CallResult(text, True) if runs_calls(turn.environment) else tools.StepOutcome(text, 0.0, False, 0.0, True)
        with lock:
            turn.results[index] = result
            turn.calls_left -= 1
            last = turn.calls_left == 0
        if last:
            self.done.put(turn)
        elif start_next is not None:
            start_next()

    def finished(self, wait_s: float = 0.0) -> list[ParkedTurn]:
        """The turns done since the last call; with `wait_s`, waits that long for one when none is (never when none
        is pending)."""
        turns = []
        if wait_s > 0 and self.pending:
            try:
                turns.append(self.done.get(timeout=wait_s))
            except queue.Empty:
                pass
        while True:
            try:
                turns.append(self.done.get_nowait())
            except queue.Empty:
                break
        self.pending -= len(turns)
        return turns


if __name__ == "__main__":
    reward_worker.serve(int(sys.argv[1]), answer_call)
