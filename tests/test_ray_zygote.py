"""The tests' Ray workers forked from a worker zygote (tests/support/ray_zygote.py) are the workers a new interpreter
gives: one Ray cluster of two nodes, the head starting its workers as Ray does (Ray's setup_worker.py, a new
interpreter) and the other through tests/support/ray_worker_start.py and a zygote (with nothing preloaded, so the
file stays quick); an actor on each reports what a worker sees, and the forked one's ends are checked: killed by
Ray, by SIGKILL, by its starter's end, and a SIGTERM to its starter."""

import json
import os
import signal
import socket
import sys
import time

import pytest

from tests.support.ray_runs import needs_loopback_namespace
from tests.support.ray_worker_start import ZYGOTE_VARIABLE
from tests.support.ray_zygote import RayWorkerZygote

pytestmark = [pytest.mark.ray, needs_loopback_namespace]


def reporter_class():
    """An actor class defined here, so that Ray ships it to the workers by value (pytest imports this file under a
    name the workers cannot import), with all it uses inside it."""

    class Reporter:
        """What a worker sees, as a Ray actor."""

        def report(self) -> dict:
            import threading

            import __main__

            def handler_name(handler) -> str:
                return getattr(handler, "__qualname__", str(handler))

            handled = ("SIGINT", "SIGTERM", "SIGPIPE", "SIGHUP", "SIGUSR1")
            return {
                "main": os.path.basename(__main__.__file__), "argv0": os.path.basename(sys.argv[0]),
                "path0": sys.path[0], "cwd": os.getcwd(), "niceness": os.getpriority(os.PRIO_PROCESS, 0),
                "own_process_group": os.getpgid(0) == os.getpid(), "dont_write_bytecode": sys.dont_write_bytecode,
                "handlers": {name: handler_name(signal.getsignal(getattr(signal, name))) for name in handled},
                "env": dict(os.environ),
                "threads": sorted(thread.name for thread in threading.enumerate()),
            }  # fmt: skip

        def pid(self) -> int:
            return os.getpid()

        def parent(self) -> int:
            return os.getppid()

        def worker_id(self) -> str:
            import ray

            return ray.get_runtime_context().get_worker_id()

    return Reporter


@pytest.fixture(scope="module")
def two_kinds_of_node(tmp_path_factory):
    """A head node whose workers start as Ray starts them, and a node whose workers are forked from a zygote."""
    import ray
    from ray.cluster_utils import Cluster

    zygote = RayWorkerZygote(dict(os.environ), preload=[])
    assert zygote.ready, zygote.why_not
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"new_interpreter": 2},
                                                            "include_dashboard": False})  # fmt: skip
    with zygote.raylet_environment():
        cluster.add_node(num_cpus=2, resources={"forked": 2}, **zygote.node_args())
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    yield ray.remote(reporter_class()), zygote
    ray.shutdown()
    cluster.shutdown()
    zygote.close()


def reporter_on(reporter_class, kind: str):
    return reporter_class.options(num_cpus=0, resources={kind: 1}).remote()


def starter_of(worker_id: str) -> int:
    """The pid of the process the raylet started for this worker: tests/support/ray_worker_start.py."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(arg.endswith("ray_worker_start.py") for arg in argv) and f"--worker-id={worker_id}" in argv:
            return int(pid)
    raise AssertionError(f"no starter for worker {worker_id}")


def environ_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        pairs = [entry.decode().split("=", 1) for entry in f.read().split(b"\0") if entry]
    return dict(pairs)


def wait_until_gone(pid: int, timeout_s: float = 30) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its parent is gone too
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return
        time.sleep(0.1)
    raise AssertionError(f"process {pid} still runs {timeout_s:.0f}s later")


def test_a_forked_worker_sees_what_a_worker_started_by_ray_sees(two_kinds_of_node):
    import ray

    reporter_class, _ = two_kinds_of_node
    new, forked = (reporter_on(reporter_class, kind) for kind in ("new_interpreter", "forked"))
    new_report, forked_report = ray.get([new.report.remote(), forked.report.remote()], timeout=60)
    # The forked worker has exactly the environment the raylet gave its starter (the job's id, Ray's variables), and
    # what Ray's worker sets itself once it runs (PYTHONBREAKPOINT, both workers).
    starters_env = environ_of(starter_of(ray.get(forked.worker_id.remote(), timeout=60)))
    assert forked_report["env"] == {**starters_env, "PYTHONBREAKPOINT": new_report["env"]["PYTHONBREAKPOINT"]}
    assert forked_report["threads"] == sorted([*new_report["threads"], "ends_with_its_starter"])
    for report in (new_report, forked_report):
        report.pop("threads")
        # Per worker and node: Ray's own (the prestarted worker on the head has no job id yet), the zygote's socket,
        # and what bash's `exec` in Ray's setup_worker.py adds.
        report["env"] = {name: value for name, value in report["env"].items()
                         if not name.startswith("RAY_") and name not in (ZYGOTE_VARIABLE, "PWD", "SHLVL", "_")}  # fmt: skip
    assert forked_report == new_report
    assert forked_report["main"] == "default_worker.py" and forked_report["own_process_group"]
    # ...and it was forked: its parent is the zygote, not the raylet that started the other.
    forked_parent, new_parent = ray.get([forked.parent.remote(), new.parent.remote()], timeout=60)
    with open(f"/proc/{forked_parent}/cmdline", "rb") as f:
        assert b"zygote_main" in f.read()
    with open(f"/proc/{new_parent}/cmdline", "rb") as f:
        assert b"raylet" in f.read()
    for actor in (new, forked):
        ray.kill(actor)


@pytest.mark.parametrize("how", ["ray.kill", "SIGKILL to the worker", "SIGKILL to its starter", "SIGTERM to its starter"])
def test_a_forked_worker_ends_as_ray_expects_and_takes_its_starter_with_it(two_kinds_of_node, how):
    """Whichever of the two processes is ended, both end, and Ray sees the actor die."""
    import ray

    reporter_class, _ = two_kinds_of_node
    actor = reporter_on(reporter_class, "forked")
    pid, worker_id = ray.get([actor.pid.remote(), actor.worker_id.remote()], timeout=60)
    starter = starter_of(worker_id)
    if how == "ray.kill":
        ray.kill(actor)
    elif how == "SIGKILL to the worker":
        os.kill(pid, signal.SIGKILL)
    else:
        os.kill(starter, signal.SIGKILL if how == "SIGKILL to its starter" else signal.SIGTERM)
    wait_until_gone(pid)
    wait_until_gone(starter)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.pid.remote(), timeout=30)


def test_a_zygote_refuses_a_worker_whose_environment_it_cannot_give(two_kinds_of_node):
    """A variable a library may read at import (here HF_HUB_OFFLINE) differs: the starter is told why, and becomes
    Ray's own setup_worker.py (tests/support/ray_worker_start.py)."""
    _, zygote = two_kinds_of_node
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    connection.connect(zygote.variables()[ZYGOTE_VARIABLE])
    env = {**os.environ, "HF_HUB_OFFLINE": "0" if os.environ.get("HF_HUB_OFFLINE") == "1" else "1",
           "RAY_JOB_ID": "01000000"}  # fmt: skip
    request = {"argv": ["default_worker.py"], "env": env, "cwd": os.getcwd(), "niceness": 0}
    read_end, write_end = os.pipe()
    socket.send_fds(connection, [json.dumps(request).encode()], [0, 1, 2, read_end])
    reply = json.loads(connection.recv(1 << 16))
    assert "HF_HUB_OFFLINE" in reply["refused"] and "RAY_JOB_ID" not in reply["refused"], reply
    connection.close()
    for fd in (read_end, write_end):
        os.close(fd)

