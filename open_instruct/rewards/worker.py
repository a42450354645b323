"""A process that scores one response at a time and can be killed: where the --reward_function and the verifiers that
may run long on one response run (all but verifiers.IN_PROCESS_VERIFIERS, a few linear-time regular expressions,
and `code`, whose programs run in the sandbox with walls and timeouts of their own).

Why a process: a verifier's time is not bounded by its own code. sympy under math-verify can run for minutes on one
answer (its signal-based timeout works only in a main thread), a --reward_function is the user's code, and a regular
expression can backtrack for minutes on a degenerate response. A thread cannot be stopped: one abandoned past its
deadline keeps its core, its memory and whatever lock it holds until it returns. A process is killed at the deadline
(`call` raises RewardTimeout) and the next call starts a new one; the functions are loaded again there (from the
same module, or the user's file at its absolute path).

Cost (docs/measurements/2026-12-07-epyc/reward_worker_overhead.json, a loaded 2-core machine): the process starts
once (0.2 s; a function's first call also imports it: math-verify's sympy 1.3 s, langdetect's profiles 0.8 s), then
each call is a round trip of two JSON lines through pipes, 72-184 us more than the same call in-process: a few
milliseconds a step. The cheapest verifiers stay in-process (verifiers.IN_PROCESS_VERIFIERS: gsm8k takes ~10 us).

The protocol: one JSON line a request on the process's stdin, {"function", "response", "ground_truth"} (a
request with "load" only loads the function); one JSON line an answer, on a descriptor of its own (the process's
standard output goes to its standard error, so a function that prints cannot break the protocol): {"value": x} (x a
float, NaN included), {"returned": repr} (not a number) or {"raised": "Type: message"}. JSON, never pickle: the
answers come from functions that read model output.

`function` is a verifier's name in `verifiers.VERIFIERS` or a --reward_function spec (an absolute path and a name).
"""

import atexit
import json
import numbers
import os
import select
import signal
import subprocess
import sys
import threading
import time

# The package's folder is put on the worker's PYTHONPATH: it imports this checkout, whatever its working directory.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Starting the process and importing a function (math-verify's sympy: ~2 s on an idle 2-core machine, several times
# that beside a training step) are not the response's time: they have their own, longer deadline.
LOAD_TIMEOUT_S = 120.0
SHOWN_CHARS = 200  # of a returned value's repr, or an error's message


class RewardTimeout(Exception):
    """The function ran past its deadline; its process was killed."""


class RewardError(Exception):
    """The function raised, returned something that is not a number, or its process died; the message says which."""


class RewardWorker:
    """`call(function, response, ground_truth, timeout_s)`: the function's number for one response, computed in the
    worker process. Thread-safe (one call at a time); the process starts at the first call and after a kill. (The
    tool-call workers, environments/tool_pool.py, are this process serving another module's requests: `MODULE`.)"""

    MODULE = "open_instruct.rewards.worker"  # what the process runs: `python -m MODULE parent_pid` (its `serve`)

    def __init__(self):
        self._forget()

    def _forget(self) -> None:
        """No process: at start, and in a forked child (a trainer forked from a test's zygote), where the parent's
        process and pipes are the parent's own."""
        self._process: subprocess.Popen | None = None
        self._loaded: set[str] = set()  # the functions the current process has imported
        self._buffer = b""
        self._lock = threading.Lock()

    def call(self, function: str, response: str, ground_truth: str | None, timeout_s: float) -> float:
        """The number `function(response, ground_truth)` returned (NaN and values outside [0, 1] included: the
        caller decides); RewardTimeout past `timeout_s` seconds, RewardError for anything else that went wrong."""
        with self._lock:
            if function not in self._loaded:
                loaded = self._ask({"function": function, "load": True}, LOAD_TIMEOUT_S, f"loading {function}")
                if "raised" in loaded:
                    raise RewardError(f"loading it failed: {loaded['raised']}")
                self._loaded.add(function)
            answer = self._ask({"function": function, "response": response, "ground_truth": ground_truth}, timeout_s,
                               f"after {timeout_s:g} s")  # fmt: skip
        if "value" in answer:
            return answer["value"]
        if "returned" in answer:
            raise RewardError(f"returned {answer['returned']}, not a number")
        raise RewardError(answer["raised"])

    def _ask(self, request: dict, timeout_s: float, what: str) -> dict:
        if self._process is None or self._process.poll() is not None:
            self._start()
        try:
            self._process.stdin.write((json.dumps(request) + "\n").encode())
            self._process.stdin.flush()
            line = self._read_line(time.monotonic() + timeout_s)
        except TimeoutError:
            self.stop()
            raise RewardTimeout(f"timed out {what}") from None
        except (BrokenPipeError, EOFError):
            code = self.stop()
            raise RewardError(f"its process died (exit code {code})") from None
        return json.loads(line)

    def _start(self) -> None:
        self.stop()
        path = os.environ.get("PYTHONPATH")
        env = {**os.environ, "PYTHONPATH": PACKAGE_ROOT + (os.pathsep + path if path else "")}
        # Its own session: a kill takes whatever the function started, and Ctrl-C at the terminal reaches the trainer
        # alone (which stops the worker).
        self._process = subprocess.Popen(
            [sys.executable, "-m", self.MODULE, str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True, bufsize=0,
        )  # fmt: skip
        self._loaded.clear()
        self._buffer = b""

    def _read_line(self, deadline: float) -> bytes:
        fd = self._process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            if select.select([fd], [], [], remaining)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EOFError
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def stop(self) -> int | None:
        """Kill the process (and anything it started) if one runs; its exit code."""
        process, self._process = self._process, None
        if process is None:
            return None
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for stream in (process.stdin, process.stdout):
            try:
                stream.close()
            except OSError:  # a pipe whose reader is gone: nothing to flush
                pass
        return process.wait()


# One worker per process: the verifiers are stateless, and a pytest process or a trainer scores with several managers.
WORKER = RewardWorker()
atexit.register(WORKER.stop)
os.register_at_fork(after_in_child=WORKER._forget)


# ---------------------------------------------------------------- inside the worker process


def load(function: str):
    """The callable `function` names: a --reward_function spec (it holds a ':') or a verifier's name."""
    if ":" in function:
        from open_instruct.rewards.reward_function import load_reward_function

        return load_reward_function(function)
    from open_instruct.rewards.verifiers import VERIFIERS, warm_up

    warm_up(function)
    return VERIFIERS[function]


def shown(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def answer_of(functions: dict, request: dict) -> dict:
    name = request["function"]
    try:
        if name not in functions:
            functions[name] = load(name)
        if request.get("load"):
            return {"loaded": True}
        value = functions[name](request["response"], request["ground_truth"])
        if isinstance(value, numbers.Real):
            return {"value": float(value)}
        return {"returned": shown(repr(value))}
    except BaseException as error:  # noqa: BLE001 - whatever the function raises (sys.exit included) is its answer
        return {"raised": shown(f"{type(error).__name__}: {error}")}


def serve(parent_pid: int, answer=answer_of) -> None:
    """Answer requests from stdin until it closes (`answer(loaded, request) -> dict`, `loaded` a dict it may keep what
    it loaded in); die with the parent (a killed trainer leaves no worker behind)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before the line above
        return
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # what the functions print goes to stderr (the trainer's library log)
    sys.stdout = sys.stderr
    functions: dict = {}
    for line in sys.stdin.buffer:
        answers.write(json.dumps(answer(functions, json.loads(line))) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
