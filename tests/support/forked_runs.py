"""Trainer runs forked from a process that has already imported the trainer, instead of started by `python -m`.

A trainer process spends ~12 CPU-s of a 2-core machine importing torch, transformers, vLLM and Ray (~8 before it
reads its first flag, ~4 more as its engine and plots start), and the suite starts ~60 of them. Each pytest worker
keeps one *zygote*: a process started once, with the environment the runs get, that imports `PRELOAD_AT_START` and
`PRELOAD_LATER` (and compiles vLLM's logprob ranks, `compile_vllm_logprob_ranks`) and then only forks. A forked
child becomes the run: it takes the run's working folder, environment
(the zygote's, which the imports may have added to, as in a new process), argv, standard output and error (files),
prints what the imports of `PRELOAD_AT_START` printed, and runs the entry module as `__main__` (or the script, for
tests/support/inject_fault.py and the engine scripts) as `python -m` would, through the interpreter's normal exit. The
imports it finds done are the difference; tests/test_forked_runs.py compares a forked script with a new interpreter,
and test_never_lose_a_run.py's `same_command_twice` a forked trainer run with a `python -m` one (the same metrics and
weights, bit for bit).

What stays a new interpreter (`subprocess`): any command that is not `python -m <module>` or `python <script.py>`,
and any run whose environment differs from the zygote's in a variable a library may read at import time (only
`MAY_DIFFER`'s may), so a test that sets e.g. `HF_HUB_OFFLINE` or `HF_ENDPOINT` for its run gets a new process. Tests
about start-up itself (what a command imports, how fast a typo is answered) start their own subprocesses.
`OPEN_INSTRUCT_TEST_FORK=0` turns the zygote off (every run a new interpreter), e.g. to compare.

What a fork cannot give: a new interpreter's string-hash seed (every run forked from one zygote hashes strings
alike, so two runs compared for equality cannot differ by set order), and what `PRELOAD_LATER`'s imports print
(a new process writes it to its logs/libraries.log).

The zygote reaps its children and writes each one's exit status (`subprocess`'s convention: -N for signal N) to
the run's status file; `ForkedProcess` offers the `subprocess.Popen` methods the tests use (pid, poll, wait,
send_signal, terminate, kill, returncode). It must have no other thread when it forks (a lock another thread
holds stays held in the child forever): it refuses to serve, and every run falls back to `subprocess`, when its
imports left one running (e.g. torch's OpenMP workers where OMP_NUM_THREADS is not 1), but for pyarrow's jemalloc
thread (`FORK_SAFE_THREADS`).
"""

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent.parent.parent
# What a trainer run imports first: its entry point (torch, transformers, vLLM's top, the open_instruct it uses; ~8 s
# of a 2-core machine). What these print when imported, each forked run prints first, as a new process would.
PRELOAD_AT_START = ["open_instruct.ppo_vllm_thread_ray_gtrl", "open_instruct.grpo_vllm_thread_ray_gtrl"]
# What it imports later, as its engine, learner and plots start (~4 s more; from `python -X importtime`, 2026-11-28):
# forked runs find them done. What these print when imported (vLLM: "Triton is installed, but doesn't include CPU
# backend") a new process writes to its logs/libraries.log; a forked run does not have it.
PRELOAD_LATER = [
    "ray", "vllm._custom_ops", "vllm.config", "vllm.engine.arg_utils", "vllm.entrypoints.common.offline",
    "vllm.entrypoints.pooling.offline", "vllm.v1.worker.cpu_model_runner", "vllm.v1.worker.gpu_worker",
    "vllm.model_executor.models.llama", "matplotlib.backends.backend_agg", "matplotlib.figure",
]  # fmt: skip
# Read after start-up only (our own, by functions at run time), or by nothing a forked child shares with its zygote
# (pytest names the running test in PYTEST_CURRENT_TEST, which a run inherits).
MAY_DIFFER = {"PYTHONUNBUFFERED", "OPEN_INSTRUCT_CACHE", "OPEN_INSTRUCT_DEBUG", "PYTEST_CURRENT_TEST"}


# pyarrow's jemalloc starts a background thread when it loads (every run imports it through `datasets`); jemalloc
# holds all its locks across a fork (pthread_atfork), as `datasets`' own forked workers rely on.
FORK_SAFE_THREADS = {"jemalloc_bg_thd"}


def fork_enabled() -> bool:
    return os.environ.get("OPEN_INSTRUCT_TEST_FORK", "1") != "0"


# ---- the zygote's side -----------------------------------------------------------------------------------------


def _exit_status(wait_status: int) -> int:
    return -os.WTERMSIG(wait_status) if os.WIFSIGNALED(wait_status) else os.WEXITSTATUS(wait_status)


def _write_atomically(path: str, text: str) -> None:
    staging = path + ".writing"
    with open(staging, "w") as f:
        f.write(text)
    os.replace(staging, path)


def other_threads() -> list[str]:
    """The names of this process's threads but the main one and the fork-safe native ones."""
    names = []
    for thread in os.listdir("/proc/self/task"):
        if int(thread) != os.getpid():
            with open(f"/proc/self/task/{thread}/comm") as f:
                names.append(f.read().strip())
    return [name for name in names if name not in FORK_SAFE_THREADS]


def _import_printing_to(modules: list[str], stdout: str, stderr: str) -> None:
    """Import `modules` with this process's fds 1 and 2 sent to the files `stdout` and `stderr`."""
    import importlib

    kept = os.dup(1), os.dup(2)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in zip((1, 2), kept):
            os.dup2(saved, fd)
            os.close(saved)


# The vocabulary of the tests' models (the embedded SmolLM2 and the tiny model built with its tokenizer): the width
# of the logprobs that vLLM's compiled rank function is compiled for (`compile_vllm_logprob_ranks`).
TEST_MODELS_VOCAB_SIZE = 49152


def compile_vllm_logprob_ranks(vocab_size: int = TEST_MODELS_VOCAB_SIZE) -> None:
    """Compile what every run compiles first: vLLM ranks each sampled token's logprob with a `torch.compile`d function
    (vllm.v1.sample.ops.logprobs.batched_count_greater_than), which a process compiles at its first generation asking
    for logprobs: ~2 s of a 2-core machine, from inductor's disk cache, in every run and engine actor. Compiled once in
    a zygote, the forked processes find it compiled (dynamo keeps compiled code with the function). Called as vLLM's
    sampler calls it: float32 logprobs whose row count is symbolic, `vocab_size` columns (another width recompiles
    in the run, as without this). Inductor shows a progress bar when it compiles anew: the monitor thread tqdm starts
    for it is ended, so that the zygote forks with no thread but its own. Nothing in a zygote that did not import vLLM
    (one for other commands). A compile that fails costs the runs their ~2 s, not their zygote: it is reported on the
    zygote's stderr and the zygote serves."""
    if "vllm" not in sys.modules:
        return
    import traceback

    import torch
    from torch._inductor import config as inductor_config
    from tqdm import tqdm

    # A cache miss compiles C++ in a pool of inductor's compile threads (one per core unless
    # TORCHINDUCTOR_COMPILE_THREADS says otherwise; vLLM's import sets it, sometimes after inductor read it), whose
    # threads stay: measured with a cold cache, 2 cores. In this process, here, compile in it.
    compile_threads, inductor_config.compile_threads = inductor_config.compile_threads, 1
    try:
        from vllm.v1.sample.ops.logprobs import batched_count_greater_than

        logprobs = torch.randn(2, vocab_size)
        sampled = logprobs[:, :1].clone()
        torch._dynamo.decorators.mark_unbacked(logprobs, 0)
        torch._dynamo.decorators.mark_unbacked(sampled, 0)
        batched_count_greater_than(logprobs, sampled)
    except Exception:  # noqa: BLE001 - a speed-up only
        print(f"the zygote could not compile vLLM's logprob ranks (each run will):\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)  # fmt: skip
    finally:
        inductor_config.compile_threads = compile_threads
    if tqdm.monitor is not None:
        tqdm.monitor.exit()
        tqdm.monitor = None


def threads_left(seconds: float) -> list[str]:
    """`other_threads()`, given `seconds` to end on their own (a compile's or an import's helper thread that is
    finishing when the imports return)."""
    deadline = time.time() + seconds
    while (others := other_threads()) and time.time() < deadline:
        time.sleep(0.05)
    return others


def _serve(requests: int, replies: int, at_start: list[str], later: list[str], printed: str) -> dict | None:
    """Import the modules (and compile vLLM's logprob ranks), then fork a child per request read from the fd
    `requests` (a JSON line each), answering each with the child's pid on the fd `replies`, until `requests` closes
    and the children have ended. Returns the request in a child, None in the zygote at the end."""
    _import_printing_to(at_start, printed + ".stdout", printed + ".stderr")
    _import_printing_to(later, os.devnull, os.devnull)
    compile_vllm_logprob_ranks()
    others = threads_left(seconds=10)
    os.write(replies, (json.dumps({"ready": not others, "threads": others}) + "\n").encode())
    if others:
        sys.exit(0)
    status_of = {}  # pid -> the status file of the run
    pending = b""
    open_for_requests = True
    while open_for_requests or status_of:
        readable, _, _ = select.select([requests] if open_for_requests else [], [], [], 0.05)
        while status_of:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _write_atomically(status_of.pop(pid), str(_exit_status(wait_status)))
        if not readable:
            continue
        chunk = os.read(requests, 1 << 16)
        if not chunk:  # closed (a retired zygote, the end of the session): exit once the runs have ended
            open_for_requests = False
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                os.close(requests)
                os.close(replies)
                return request
            status_of[pid] = request["status"]
            os.write(replies, (json.dumps({"pid": pid}) + "\n").encode())


def _become(request: dict) -> None:
    """In the forked child: take the run's folder, environment, streams and argv, as a new process would have them.
    Its signal handlers are already a new interpreter's: the zygote is one, started by the same pytest worker, and
    never sets any."""
    if request["new_session"]:
        os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    stdout = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    stderr = (
        stdout
        if request["stderr"] == request["stdout"]
        else os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    )
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    for fd in {stdout, stderr}:
        os.close(fd)
    for fd, suffix in ((1, ".stdout"), (2, ".stderr")):  # what the imports of PRELOAD_AT_START printed
        with open(request["printed"] + suffix, "rb") as f:
            os.write(fd, f.read())
    os.chdir(request["cwd"])
    # The run's environment equals the zygote's but for MAY_DIFFER (forkable): keep what the imports added to it, as
    # they would have in a new process, and take the run's MAY_DIFFER variables.
    for name in MAY_DIFFER:
        if name in request["env"]:
            os.environ[name] = request["env"][name]
        else:
            os.environ.pop(name, None)


def _run(request: dict) -> None:
    """Run the request's module or script as `__main__`; its SystemExit ends this interpreter as it would end one
    started by `python -m`."""
    import runpy

    _become(request)
    argv = request["argv"]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.realpath(argv[0])
        sys.argv = [argv[0], *argv[1:]]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")


def zygote_main(requests: int, replies: int, at_start: list[str], later: list[str], printed: str) -> None:
    """The zygote process's code (`python -c`): serve, and in each child, run its request."""
    request = _serve(requests, replies, at_start, later, printed)
    if request is None:
        os._exit(0)
    _run(request)


# ---- the pytest worker's side ----------------------------------------------------------------------------------


class ForkedProcess:
    """A run forked by the zygote, with the `subprocess.Popen` methods the tests use."""

    def __init__(self, args: list[str], pid: int, status_path: Path, zygote: subprocess.Popen):
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._status_path = status_path
        self._zygote = zygote

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self._status_path.exists():
            self.returncode = int(self._status_path.read_text())
        elif self._zygote.poll() is not None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:  # ended, and nobody is left to say how
                raise RuntimeError(f"the zygote ended (exit {self._zygote.returncode}) before it reported how run "
                                   f"{self.pid} ended: `{' '.join(self.args)}`") from None  # fmt: skip
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """A process that imports `at_start` and `later` once, then forks a run per `start`."""

    def __init__(self, env: dict[str, str], at_start: list[str], later: list[str]):
        self.env = dict(env)
        self._lock = threading.Lock()
        self._folder = Path(tempfile.mkdtemp(prefix="zygote_"))  # the runs' status files, what the imports printed
        self._count = 0
        requests_read, self._requests = os.pipe()
        self._replies, replies_write = os.pipe()
        code = (f"from tests.support.forked_runs import zygote_main; zygote_main({requests_read}, {replies_write}, "
                f"{list(at_start)!r}, {list(later)!r}, {str(self._folder / 'printed')!r})")  # fmt: skip
        own_stderr = self._folder / "zygote.stderr"  # the zygote's own messages (its runs write to their files)
        with open(own_stderr, "wb") as stderr:
            self._process = subprocess.Popen(
                [sys.executable, "-c", code],
                cwd=CHECKOUT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stderr=stderr,
                pass_fds=(requests_read, replies_write),
            )
        os.close(requests_read)
        os.close(replies_write)
        self._reply_lines = os.fdopen(self._replies, "rb")
        line = self._reply_lines.readline()
        ready = json.loads(line) if line else {"ready": False, "threads": []}
        self.ready = ready["ready"]
        if self.ready:
            self.why_not = ""
        elif line:
            self.why_not = f"threads other than the main one after the zygote's imports: {ready['threads']}"
        else:
            self.why_not = f"it ended before it was ready: {own_stderr.read_text(errors='replace')[-2000:]}"

    def start(
        self,
        argv: list[str],
        cwd: Path,
        env: dict[str, str],
        stdout: Path,
        stderr: Path,
        start_new_session: bool = False,
    ) -> ForkedProcess:
        """Fork a run of `python *argv` (argv[0] is "-m" or a script)."""
        differing = differing_variables(env, self.env) - MAY_DIFFER
        if differing:
            raise ValueError(f"a forked run would have the zygote's {sorted(differing)}: start it as a new process")
        with self._lock:
            self._count += 1
            status_path = self._folder / f"run_{self._count}"
            request = {"argv": argv, "cwd": str(cwd), "env": env, "stdout": str(stdout), "stderr": str(stderr),
                       "status": str(status_path), "new_session": start_new_session,
                       "printed": str(self._folder / "printed")}  # fmt: skip
            os.write(self._requests, (json.dumps(request) + "\n").encode())
            reply = self._reply_lines.readline()
        if not reply:
            raise RuntimeError(f"the zygote died (exit {self._process.poll()})")
        return ForkedProcess([sys.executable, *argv], json.loads(reply)["pid"], status_path, self._process)

    def close(self, wait: bool = True) -> None:
        """No more runs: the zygote exits once those it forked have ended (`wait`: wait for that)."""
        if not self._reply_lines.closed:
            os.close(self._requests)
            self._reply_lines.close()
        if wait:
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:  # a run a failed test left behind: the zygote ends after it
                return
            shutil.rmtree(self._folder, ignore_errors=True)


class _Worker:
    # The pytest worker's environment before its first test (`remember_starting_environment`, from conftest.py).
    starting_environment: dict[str, str] | None = None


def remember_starting_environment() -> None:
    """Take the worker's environment as it is now, before any test, as the base of its runs' (`offline_env`)."""
    _Worker.starting_environment = dict(os.environ)


def offline_env() -> dict[str, str]:
    """The tests' runs' environment (no hub, wandb offline, unbuffered output), which the zygote is started with: the
    worker's environment before its first test, with its `MAY_DIFFER` variables as they are now. What tests in the
    worker's own process add to its environment stays out, as it is out of a user's shell: an engine built in the
    worker sets ~10 of vLLM's variables (LD_PRELOAD, VLLM_DIST_IDENT, ...), Ray's driver its own (PYTHONBREAKPOINT);
    each such change made the runs after it differ from their zygote's environment, which then had to start anew (5
    times in a suite run, ~18 CPU-s each)."""
    base = _Worker.starting_environment if _Worker.starting_environment is not None else os.environ
    now = {name: os.environ[name] for name in MAY_DIFFER if name in os.environ}
    kept = {name: value for name, value in base.items() if name not in MAY_DIFFER}
    return {**kept, **now, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1"}  # fmt: skip


_zygote: Zygote | None = None


def _shared_zygote() -> Zygote | None:
    """This worker's zygote, with the runs' environment (`offline_env`). Should that change (it is the worker's
    environment before its first test, so nothing a test does in the worker changes it), the runs after it get a new
    zygote with it, and the old one ends once its runs have."""
    import atexit
    import warnings

    global _zygote
    env = offline_env()
    changed = sorted(differing_variables(env, _zygote.env) - MAY_DIFFER) if _zygote is not None else []
    if changed:
        warnings.warn(
            f"the worker's environment changed ({', '.join(changed)}): a new zygote for the runs", stacklevel=3
        )
        _zygote.close(wait=False)
        _zygote = None
    if _zygote is None:
        _zygote = Zygote(env, PRELOAD_AT_START, PRELOAD_LATER)
        atexit.register(_zygote.close)
        if not _zygote.ready:
            warnings.warn(f"this worker's runs start as new interpreters: the zygote refused ({_zygote.why_not})",
                          stacklevel=3)  # fmt: skip
    return _zygote if _zygote.ready else None


def forkable(command: list[str], env: dict[str, str], zygote_env_: dict[str, str]) -> bool:
    """Whether `command` with `env` may run forked from a zygote with `zygote_env_`."""
    if len(command) < 2 or command[0] != sys.executable:
        return False
    if not (command[1] == "-m" and len(command) > 2 or command[1].endswith(".py")):
        return False
    return differing_variables(env, zygote_env_) <= MAY_DIFFER


def differing_variables(env: dict[str, str], other: dict[str, str]) -> set[str]:
    return {name for name in env.keys() | other.keys() if env.get(name) != other.get(name)}


def start_run(
    command: list[str],
    cwd: Path,
    stdout: Path,
    stderr: Path | None = None,
    env: dict[str, str] | None = None,
    start_new_session: bool = False,
    fork: bool = True,
):
    """`command` (`[sys.executable, "-m", module, ...]` or `[sys.executable, script.py, ...]`) writing to the new
    files `stdout` and `stderr` (or both to `stdout`), with `env` (default: offline_env()): forked from this worker's
    zygote when it may be (and `fork`), else `subprocess.Popen`. The result has Popen's pid, poll, wait, send_signal,
    terminate, kill and returncode."""
    stderr = stderr or stdout
    env = offline_env() if env is None else env
    for path in {stdout, stderr}:
        open(path, "wb").close()
    if fork and fork_enabled() and forkable(command, env, offline_env()):
        zygote = _shared_zygote()  # its environment is offline_env()'s but for MAY_DIFFER
        if zygote is not None:
            return zygote.start(command[1:], cwd, env, stdout, stderr, start_new_session)
    out = open(stdout, "ab")
    err = out if stderr == stdout else open(stderr, "ab")
    try:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=start_new_session)  # fmt: skip
    finally:
        out.close()
        if err is not out:
            err.close()
