"""Ray workers forked from a process that has already imported what they import, for the tests' Ray clusters.

A Ray worker that becomes a learner rank or an engine actor spends ~8-10 CPU-s of a 2-core machine importing torch,
transformers, peft, DeepSpeed, vLLM and open_instruct before its first call, and a suite run starts ~50 of them on
the `ray_cluster` fixture's nodes. The fixture starts one *worker zygote* beside the cluster, with the environment
the raylets get, that imports `PRELOAD` once and then only forks; the raylets start each worker through
tests/support/ray_worker_start.py, which asks the zygote for it (its docstring says how the worker's end and signals
reach the raylet). A forked child becomes the worker as Ray's setup_worker.py and `python default_worker.py` would
make it: its own process group, the starter's standard streams, environment, folder and priority, the runtime
environment's variables, and default_worker.py run as `__main__` through the interpreter's normal exit. A runtime
environment that changes how the worker starts (a command prefix, another Python, another entry point) is handed to
Ray's own setup_worker.py in the child.

The worker's environment may differ from the zygote's only in Ray's own variables (`RAY_*`, the raylet sets them per
worker and job) and `IMPORT_SAFE` (read after start-up); otherwise the zygote refuses and the starter becomes Ray's
setup_worker.py (the worker starts as a new interpreter). As for trainer runs (tests/support/forked_runs.py), the
zygote refuses to serve if its imports left a thread running. Clusters started otherwise (the two-node script, the
product's own `ray start`) never see it. `OPEN_INSTRUCT_TEST_FORK=0` turns it off with the trainer runs' zygote.
"""

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from tests.support.forked_runs import (
    CHECKOUT,
    MAY_DIFFER,
    PRELOAD_LATER,
    _exit_status,
    _import_printing_to,
    compile_vllm_logprob_ranks,
    differing_variables,
    threads_left,
)
from tests.support.ray_worker_start import ZYGOTE_VARIABLE, rays_own_setup_worker

# What the learner ranks and engine actors import before their first call: the actor classes' modules' own imports
# and what their constructors import (DeepSpeed, peft, vLLM's engine), but not Ray: its native core reads its
# configuration (the worker's job id among it) from the environment once, when first loaded, so each worker loads it
# itself (~0.5 s), with the modules that import it (the actor classes' own: open_instruct.learner.ray_group,
# open_instruct.generation.engine_actors).
PRELOAD = [
    "torch", "transformers", "peft", "deepspeed", "open_instruct.learner.algorithms",
    "open_instruct.learner.deepspeed_backend", "open_instruct.learner.weight_sender", "open_instruct.rewards.manager",
    "open_instruct.generation.vllm_engine", "open_instruct.generation.engine_batches",
    "open_instruct.generation.weight_transfer", "vllm.distributed.utils",
    *(name for name in PRELOAD_LATER if name != "ray" and not name.endswith(".offline")),  # (those two import ray)
]  # fmt: skip
# Read after start-up only, by nothing the zygote's imports keep: PYTHONDONTWRITEBYTECODE (a flag the child sets),
# SPT_NOENV (Ray sets it for its workers; setproctitle reads it when the worker first names itself).
IMPORT_SAFE = MAY_DIFFER | {ZYGOTE_VARIABLE, "PYTHONDONTWRITEBYTECODE", "SPT_NOENV"}


def _may_differ(name: str) -> bool:
    return name.startswith("RAY_") or name in IMPORT_SAFE


# ---- the zygote's side -----------------------------------------------------------------------------------------


def _serve(socket_path: str, preload: list[str], start_env: dict[str, str]) -> tuple[dict, list[int]] | None:
    """Import `preload`, then fork a worker per request on `socket_path`, answering each with the worker's pid and, once
    it has ended, its exit status, until the parent (the pytest worker) is gone. Returns (request, fds) in a child."""
    parent = os.getppid()
    _import_printing_to(preload, os.devnull, os.devnull)
    compile_vllm_logprob_ranks()
    others = threads_left(seconds=10)
    if "ray._raylet" in sys.modules:
        others.append("(none, but Ray's core was loaded: a preloaded module imports ray)")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(socket_path)
    listener.listen(64)
    print(json.dumps({"ready": not others, "threads": others}), flush=True)
    if others:
        return None
    starters = {}  # pid -> the connection of the starter that asked for it
    while os.getppid() == parent or starters:
        readable, _, _ = select.select([listener], [], [], 0.05)
        while starters:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = starters.pop(pid)
            try:
                connection.send(json.dumps({"exit": _exit_status(wait_status)}).encode())
            except OSError:  # the starter has ended first (killed with its process group): nobody to tell
                pass
            connection.close()
        if not readable or os.getppid() != parent:
            continue
        connection, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 4)
        request = json.loads(message)
        differing = sorted(name for name in differing_variables(request["env"], start_env) if not _may_differ(name))
        if differing or len(fds) != 4:
            connection.send(json.dumps({"refused": f"the worker's environment differs in {differing}"}).encode())
            connection.close()
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            listener.close()
            connection.close()
            for other in starters.values():
                other.close()
            return request, fds
        for fd in fds:
            os.close(fd)
        connection.send(json.dumps({"pid": pid}).encode())
        starters[pid] = connection
    return None


def _end_with_starter(watched: int) -> None:
    """The starter (the process the raylet started) has ended when its end of the pipe closes: so does the worker."""
    os.read(watched, 1)
    os.kill(os.getpid(), signal.SIGKILL)


def _become(request: dict, fds: list[int]) -> list[str]:
    """In the forked child: take the worker's streams, environment, folder and priority, as the starter has them.
    Returns the arguments for Ray's setup_worker.py."""
    os.setpgid(0, 0)  # the raylet starts each worker in a process group of its own
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    os.chdir(request["cwd"])
    os.setpriority(os.PRIO_PROCESS, 0, request["niceness"])
    threading.Thread(target=_end_with_starter, args=(fds[3],), name="ends_with_its_starter", daemon=True).start()
    return request["argv"]


def _run_worker(setup_worker_args: list[str]) -> None:
    """What Ray's setup_worker.py does for a plain runtime environment (its variables, then
    `exec python default_worker.py ...`), with default_worker.py run here as `__main__`."""
    import runpy

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--serialized-runtime-env-context", type=str)
    parser.add_argument("--language", type=str)
    args, worker_argv = parser.parse_known_args(setup_worker_args)
    context = json.loads(args.serialized_runtime_env_context or "{}")
    plain = (
        args.language == "PYTHON"
        and not context.get("command_prefix")
        and context.get("py_executable") in (None, sys.executable)
        and not context.get("override_worker_entrypoint")
    )
    if not plain:
        os.execv(sys.executable, [sys.executable, rays_own_setup_worker(), *setup_worker_args])
    os.environ.update(context.get("env_vars") or {})
    sys.argv = worker_argv
    sys.path[0] = os.path.dirname(os.path.realpath(worker_argv[0]))
    runpy.run_path(worker_argv[0], run_name="__main__")


def zygote_main(socket_path: str, preload: list[str]) -> None:
    """The worker zygote's code (`python -c`): serve, and in each child, become its worker."""
    served = _serve(socket_path, preload, dict(os.environ))
    if served is None:
        os._exit(0)
    _run_worker(_become(*served))


# ---- the pytest worker's side ----------------------------------------------------------------------------------


class RayWorkerZygote:
    """A worker zygote for a cluster about to start: `env` is what the raylets will get (with `variables()` added)."""

    def __init__(self, env: dict[str, str], preload: list[str] = PRELOAD):
        self._folder = tempfile.mkdtemp(prefix="ray_zygote_")
        self.socket_path = os.path.join(self._folder, "socket")
        self._process = subprocess.Popen(
            [sys.executable, "-c",
             f"from tests.support.ray_zygote import zygote_main; zygote_main({self.socket_path!r}, {list(preload)!r})"],
            cwd=CHECKOUT,
            env={**env, **self.variables()},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
        )
        ready = json.loads(self._process.stdout.readline() or b'{"ready": false, "threads": "none: it failed"}')
        self.ready = ready["ready"]
        self.why_not = "" if self.ready else f"threads other than the main one after its imports: {ready['threads']}"

    def variables(self) -> dict[str, str]:
        return {ZYGOTE_VARIABLE: self.socket_path}

    def node_args(self) -> dict[str, str]:
        """What a Ray node (`Cluster.add_node`) takes to start its Python workers through this zygote: nothing when
        it refused to serve (the node starts them as Ray does)."""
        return {"setup_worker_path": setup_worker_path()} if self.ready else {}

    @contextlib.contextmanager
    def raylet_environment(self):
        """While nodes start: their raylets inherit this process's environment with the zygote's socket, for the
        workers' starter; afterwards this process has its own again (a change to it would retire the trainer runs'
        zygote, tests/support/forked_runs.py)."""
        if not self.ready:
            yield
            return
        saved = os.environ.get(ZYGOTE_VARIABLE)
        os.environ[ZYGOTE_VARIABLE] = self.socket_path
        try:
            yield
        finally:
            if saved is None:
                os.environ.pop(ZYGOTE_VARIABLE)
            else:
                os.environ[ZYGOTE_VARIABLE] = saved

    def close(self) -> None:
        """No more workers (the cluster has shut down): end the zygote. A worker still running is ended by its
        starter, or its starter waits for it."""
        self._process.stdout.close()
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        shutil.rmtree(self._folder, ignore_errors=True)


def setup_worker_path() -> str:
    return str(Path(__file__).resolve().parent / "ray_worker_start.py")

