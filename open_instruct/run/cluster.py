"""The Ray cluster a run uses (started here, or joined with --ray_address) and the one wait over Ray actors that every
caller uses: all results in order, or the first actor to die or raise named with its cause, or a deadline.

Imported only when Ray is used: the single-process trainer never loads ray.
"""

import logging
import os
import socket
import time
import uuid

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError

log = logging.getLogger(__name__)


def node_address_with_free_port() -> tuple[str, int]:
    address = ray.util.get_node_ip_address()
    with socket.socket() as sock:
        sock.bind((address, 0))
        return address, sock.getsockname()[1]


def write_folder_token(folder: str) -> tuple[str, str]:
    """A file with a random token in `folder` (the driver's side of `folder_problem`); returns its path and token."""
    token = uuid.uuid4().hex
    path = os.path.join(folder, f".open_instruct_same_folder_{token}")
    with open(path, "w") as f:
        f.write(token)
    return path, token


def folder_problem(folder: str, token: str) -> str | None:
    """Run on another node: None when `folder` there is the driver's (it holds the driver's token file) and this
    process can write into it; else what is wrong, in a few words."""
    if not os.path.isabs(folder):
        return f"{folder} is relative"
    try:
        with open(os.path.join(folder, f".open_instruct_same_folder_{token}")) as f:
            if f.read() != token:
                return "it holds another run's token"
    except OSError as error:
        where = f"node {ray.get_runtime_context().get_node_id()[:12]}" if ray.is_initialized() else "there"
        return f"the file the driver just wrote into it is not there on {where}: {type(error).__name__}"
    probe = os.path.join(folder, f".open_instruct_write_probe_{uuid.uuid4().hex}")
    try:
        with open(probe, "w") as f:
            f.write("")
        os.remove(probe)
    except OSError as error:
        return f"it is not writable there: {error.strerror or type(error).__name__}"
    return None


# Ray starts its worker processes at nice 15, a background priority: fine beside Ray's own daemons, but our actors
# (learner ranks, engines) are the run's work, and at nice 15 a rank gets a few percent of a core that any ordinary
# process also wants (the driver's generation thread, another job), while its peers wait for it in every collective.
# Measured on a 2-core CPU machine: two ZeRO-3 ranks beside one busy process took 2.1x their time alone.
RAY_WORKER_NICENESS = "RAY_worker_niceness"


def niceness_warning(name: str, niceness: int) -> str | None:
    """The warning for an actor that runs at a lower CPU priority than ordinary processes, or None. Pure."""
    if niceness <= 0:
        return None
    return (f"[ppo] warning: {name} runs at nice {niceness} (Ray's default for its workers), so any other busy process "
            f"on its node takes the CPU from it; start Ray with {RAY_WORKER_NICENESS}=0 "
            "(scripts/train/multinode/ray_node_setup.sh does)")  # fmt: skip


def start_ray(ray_address: str | None, num_actors: int) -> None:
    if ray.is_initialized():
        return
    started = time.time()
    if ray_address is not None:
        ray.init(address=ray_address, log_to_driver=True)
    else:  # a local instance with a logical CPU for each actor (learner, engine), even on a machine with fewer cores
        os.environ.setdefault(RAY_WORKER_NICENESS, "0")  # the local raylet starts the workers with this environment
        ray.init(num_cpus=max(os.cpu_count() or 1, num_actors), include_dashboard=False)
    log.info(f"[ppo] Ray {'joined at ' + ray_address if ray_address else 'started locally'} in {time.time() - started:.1f}s")


def stop_ray() -> None:
    """Disconnect this driver: Ray ends the job's actors (and a cluster `start_ray` started here)."""
    if ray.is_initialized():
        ray.shutdown()


class ActorDied(RuntimeError):
    """An actor's process is gone (`position`: its call's index in the refs waited on). Raised by `wait_for_actors`
    only for a caller that can carry on without the actor (engine restarts); an exception raised inside an actor is
    never one."""

    def __init__(self, message: str, position: int):
        super().__init__(message)
        self.position = position


def wait_for_actors(refs: list, names: list[str], method: str, timeout_s: float, failure: type[RuntimeError],
                    timeout_advice: str, died: type[ActorDied] | None = None) -> list:  # fmt: skip
    """All results, in order; the first actor to die or raise ends the wait (as `failure`, naming it), whatever the
    others are doing, and so does the deadline. `died`: what the death of an actor raises instead of `failure` (the
    same message), for a caller that replaces dead actors."""
    name_of = dict(zip(refs, names))
    results, pending = {}, list(refs)
    deadline = time.time() + timeout_s
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.time()))
        if not done:
            waiting = ", ".join(name_of[ref] for ref in pending)
            raise failure(f"{waiting} did not finish {method} within {timeout_s:.0f}s; {timeout_advice}.")
        ref = done[0]
        try:
            results[ref] = ray.get(ref)
        except RayActorError as error:
            message = f"{name_of[ref]} died during {method}: {death_cause(error)}"
            raise (died(message, refs.index(ref)) if died else failure(message)) from None
        except RayTaskError as error:
            cause = error.cause if error.cause is not None else error
            failed = f"{name_of[ref]} failed in {method}: {type(cause).__name__}: {first_line(cause)}"
            death = first_death(pending, name_of, method, PEER_DEATH_GRACE_S)
            if death is not None:  # it failed because a peer of its collective died: the death goes first
                raise failure(f"{death} (then {failed})") from error
            raise failure(failed) from error
        except RayError as error:  # e.g. OutOfMemoryError: Ray's memory monitor killed the actor's worker
            message = f"{name_of[ref]} was lost during {method}: {type(error).__name__}: {first_line(error)}"
            raise (died(message, refs.index(ref)) if died else failure(message)) from None
    return [results[ref] for ref in refs]


# A collective (weight broadcast, ZeRO gather) fails on every peer of a process that dies, often before Ray has
# noticed the death itself (it does within about a second): a failure waits this long for a death among the others.
PEER_DEATH_GRACE_S = 5.0


def first_death(refs: list, name_of: dict, method: str, grace_s: float) -> str | None:
    """'<actor> died during <method>: <cause>' for the first of `refs` whose actor dies within `grace_s`, else None
    (their other results and errors are dropped: the caller is already failing)."""
    deadline = time.time() + grace_s
    while refs and time.time() < deadline:
        done, refs = ray.wait(refs, num_returns=1, timeout=max(0.0, deadline - time.time()))
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError as error:
                return f"{name_of[ref]} died during {method}: {death_cause(error)}"
            except RayError:
                continue
    return None


def death_cause(error: RayActorError) -> str:
    """Ray's several-line report of a dead actor, cut to the line that says why it died."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    because = [line for line in lines if "because" in line]
    return (because or lines or [type(error).__name__])[0]


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
