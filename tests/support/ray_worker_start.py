"""How the tests' Ray clusters start a Python worker: this script stands in for Ray's own setup_worker.py
(`Cluster(..., setup_worker_path=...)`, tests/conftest.py's `ray_cluster`), so the raylet runs
`python ray_worker_start.py default_worker.py <the worker's arguments>`.

With `OPEN_INSTRUCT_RAY_ZYGOTE` naming the socket of a worker zygote (tests/support/ray_zygote.py: a process that has
imported what the workers import), it asks the zygote to fork the worker, with this process's arguments, environment,
folder, priority and standard streams, and stays as the process the raylet started until the worker ends: it passes
on SIGTERM, SIGINT and SIGHUP, exits with the worker's status, and its end (even by SIGKILL) ends the worker (a pipe
the worker watches). The raylet knows the worker by the pid the worker registers with, so Ray's kills reach the
worker itself. Without a zygote, or when the zygote refuses (an environment it cannot give), this process becomes
Ray's own setup_worker.py, as if it had never been here.

Imports only the standard library's smallest modules: it runs once per worker, ahead of everything else.
"""

import json
import os
import select
import signal
import socket
import sys

ZYGOTE_VARIABLE = "OPEN_INSTRUCT_RAY_ZYGOTE"
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def rays_own_setup_worker() -> str:
    import importlib.util

    ray_dir = os.path.dirname(importlib.util.find_spec("ray").origin)
    return os.path.join(ray_dir, "_private", "workers", "setup_worker.py")


def become_rays_own() -> None:
    os.execv(sys.executable, [sys.executable, rays_own_setup_worker(), *sys.argv[1:]])


def end_like(status: int) -> None:
    """Exit as the worker did: its code, or its signal (-N)."""
    if status < 0:
        if -status not in (signal.SIGKILL, signal.SIGSTOP):  # (those two cannot be caught anyway)
            signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status if status >= 0 else 128 - status)


def forked_by_zygote(path: str) -> tuple[socket.socket, int, int] | None:
    """Have the zygote at `path` fork the worker: (the connection, the worker's pid, the end of the pipe the worker
    watches that this process holds open until it ends), or None when the zygote refused it."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(path)
    watched, held = os.pipe()
    request = {"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd(),
               "niceness": os.getpriority(os.PRIO_PROCESS, 0)}  # fmt: skip
    socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2, watched])
    os.close(watched)
    reply = json.loads(connection.recv(1 << 16) or b"{}")
    if "pid" not in reply:
        print(f"[ray_worker_start] the zygote did not fork this worker: {reply.get('refused')}", file=sys.stderr)
        return None
    return connection, reply["pid"], held


def worker_status(connection: socket.socket, pid: int) -> int:
    """Pass signals on to the worker until it ends; its exit status, as the zygote reaped it."""
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, lambda number, _frame: os.kill(pid, number))
    try:
        end = connection.recv(1 << 16)
    except OSError:
        end = b""
    if end:
        return json.loads(end)["exit"]
    try:  # the zygote ended before the worker: wait for the worker itself (its status is lost with the zygote)
        select.select([os.pidfd_open(pid)], [], [])
    except ProcessLookupError:
        pass
    return 1


def main() -> None:
    path = os.environ.get(ZYGOTE_VARIABLE)
    forked = None
    if path:
        try:
            forked = forked_by_zygote(path)
        except OSError as error:  # no zygote listening (it refused to serve, or has ended)
            print(f"[ray_worker_start] no worker zygote at {path}: {error}", file=sys.stderr)
    if forked is None:  # (never once a worker was forked: the raylet would get two)
        become_rays_own()
    connection, pid, _held = forked
    end_like(worker_status(connection, pid))


if __name__ == "__main__":
    main()
