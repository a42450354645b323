"""Which file runs beside which under scripts/test.sh's two workers, in what order, on how many threads
(tests/conftest.py's hooks and machine_turn use these; tests/README.md, "Two workers").

Four kinds of file (by the markers of its selected tests):
- a **Ray** file (`ray`) runs beside heavy and light files, never beside another Ray file;
- an **alone** file (`alone`: the two-node cluster with its engine actors) runs beside light files only;
- a **heavy** file (`e2e` or `slow`: trainer runs, engines, DeepSpeed ranks) runs beside anything but an alone file;
- a **light** file (none of these) runs beside anything.
Why: two Ray clusters at once, or the two-node cluster beside a trainer run, ran the 24 GiB machine into Ray's
memory monitor in two of the first three two-worker suite runs (it kills engine and learner workers at 95% of the
node's memory: 7 and 4 tests failed); every other pair of files fitted, a Ray file beside a trainer file included.

Two parts keep to these rules. `FileTurnScheduling` (the controller's xdist scheduler) gives a worker that needs
its next file the first file of `worker_file_order` that may start beside the files the other worker holds (or,
when none may, beside the most of them), so the workers rarely wait; `turn` (each file's module fixture, a lock
between the workers' processes) makes a file that must wait, wait: the scheduler picks before the current files end
and a file's tests can take longer than measured.
Threads: scripts/test.sh gives each worker, and so every process its tests start (trainers, Ray's nodes and actors,
engines), one torch thread: OpenMP threads spin while they wait for each other, so a process with two threads beside
another busy one on two cores crawls (the fast tier took 255 s with two threads per worker, 125 s with one; a Ray
file given both cores beside a heavy file took 1.7-1.8x its time alone).
"""

import contextlib
import fcntl
import json
import os
from collections.abc import Iterable
from pathlib import Path

from xdist.scheduler import LoadFileScheduling

ALONE, RAY, HEAVY, LIGHT = "alone", "ray", "heavy", "light"
KINDS_FILE = "file_kinds.json"  # in the run's temporary folder: the workers write it, the controller reads it

# Seconds each file took in a quiet one-process run (2-core EPYC, 2026-11-27; docs/testing.md, "The suite's time"):
# the workers take the files longest first, so the last file to end is a short one. Not listed: a few seconds. A
# wrong number costs time, never a result.
MEASURED_FILE_SECONDS = {
    "test_ray_resume.py": 211, "test_engine_actors.py": 258, "test_ray_learners.py": 185,
    "test_multinode_local.py": 177, "test_placement.py": 27, "test_ray_zygote.py": 24, "test_never_lose_a_run.py": 202, "test_resume.py": 134,
    "test_ppo_trainer.py": 115, "test_weight_broadcast.py": 82, "test_deepspeed_ranks.py": 86, "test_lora.py": 74,
    "test_packing.py": 70, "test_grpo.py": 40, "test_vllm_engine.py": 29, "test_ppo_learner.py": 28,
    "test_evaluate.py": 27, "test_bad_inputs.py": 25, "test_micro_batches.py": 23, "test_preemption.py": 22,
    "test_memory_plan.py": 20, "test_reward_function.py": 18, "test_reward_failures.py": 105, "test_dapo.py": 18, "test_tools_trainer.py": 17,
    "test_check_gpu.py": 16, "test_weight_transfer.py": 13, "test_engine_batches.py": 11, "test_checkpoint.py": 10,
    "test_sandbox.py": 10,
    # Mostly waiting (fake suites whose tests sleep): listed so that it runs early, beside the two-node file, and not
    # last with a core idle (19 s at 26% CPU at the end of the 2026-11-28 AVX2-only run).
    "test_worker_turns.py": 17,
}  # fmt: skip


def file_kind(items) -> str:
    """ALONE, RAY, HEAVY or LIGHT for the selected tests of one file (the fast tier's files are all light)."""
    if any(item.get_closest_marker("alone") for item in items):
        return ALONE
    if any(item.get_closest_marker("ray") for item in items):
        return RAY
    if any(item.get_closest_marker("e2e") or item.get_closest_marker("slow") for item in items):
        return HEAVY
    return LIGHT


def may_start_beside(kind: str, running: Iterable[str]) -> bool:
    """Whether a file of `kind` may start while files of the `running` kinds run on the other workers."""
    running = set(running)
    if kind == LIGHT:
        return True
    if kind == ALONE:
        return running <= {LIGHT}
    if ALONE in running:
        return False
    return kind == HEAVY or RAY not in running


def worker_file_order(files: dict[str, str]) -> list[str]:
    """The workers' order of preference ({file: kind} -> files): the alone files (light files fill the other worker
    beside them), the Ray files (one after the other on one worker while the other takes the heavy files), the heavy
    files, the light files; longest first within each kind, so the last files to end are short. Pure."""
    rank = {ALONE: 0, RAY: 1, HEAVY: 2, LIGHT: 3}
    return sorted(files, key=lambda file: (rank[files[file]], -MEASURED_FILE_SECONDS.get(Path(file).name, 3), file))


def next_file(queue_kinds: list[str], running: Iterable[str]) -> int:
    """Which file of the queue (their kinds, in order) a worker takes next, beside the `running` kinds (the files the
    other worker holds): the first that may start beside them all; when none may, the first that may start beside the
    most of them, so it waits for one file, not for all (it then waits for its turn in `turn`). Pure.

    Why the fallback matters: on a machine half as fast, the other worker held the two-node file and a Ray file, no
    light file was left, and "the first of all" gave a second Ray file, which waited ~500 s for the first with a core
    idle; a heavy file only waits for the two-node file to end, then runs beside the Ray file."""
    running = list(running)  # may start beside them all = beside each of them, so the most is "all" when one may

    def files_beside(i: int) -> int:
        return sum(may_start_beside(queue_kinds[i], [other]) for other in running)

    return max(range(len(queue_kinds)), key=lambda i: (files_beside(i), -i))


def write_file_kinds(run_folder: Path, kinds: dict[str, str]) -> None:
    """A worker's kinds of the files it collected, for the controller (each worker writes the same, atomically)."""
    partial = run_folder / f"{KINDS_FILE}.{os.getpid()}"
    partial.write_text(json.dumps(kinds))
    partial.replace(run_folder / KINDS_FILE)


class FileTurnScheduling(LoadFileScheduling):
    """xdist's `--dist loadfile` (a whole file per worker at a time, in the collection's order), but the file a
    worker gets next is `next_file`'s: the first of the queue that may start beside the files the other worker holds
    (its current file and the next one it was given), given when one test of the worker's current file is left
    (`_reschedule`), so "holds" is what the other worker will run next, not only now."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self.run_folder = config._tmp_path_factory.getbasetemp()  # the workers' basetemps are folders in it
        self.kinds: dict[str, str] | None = None

    def _assign_work_unit(self, node) -> None:
        if self.kinds is None:  # the workers wrote it while collecting, before the controller schedules
            kinds_path = self.run_folder / KINDS_FILE
            self.kinds = json.loads(kinds_path.read_text()) if kinds_path.exists() else {}
        running = [
            self.kinds.get(file, LIGHT)
            for other, work in self.assigned_work.items()
            if other is not node
            for file, tests in work.items()
            if not all(tests.values())
        ]
        queue = list(self.workqueue)
        chosen = queue[next_file([self.kinds.get(file, LIGHT) for file in queue], running)]
        self.workqueue.move_to_end(chosen, last=False)
        super()._assign_work_unit(node)  # takes the queue's first

    def _reschedule(self, node) -> None:
        """xdist gives a worker its next file while two tests of the current one are left; this waits until one is
        left (a worker runs a test only once it knows the next, so one is the least), so the choice sees more of what
        the other worker is doing by then."""
        if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
            return
        super()._reschedule(node)


@contextlib.contextmanager
def turn(run_folder: Path, kind: str):
    """One file's turn on the machine, by its kind, with locks in `run_folder` (one per pytest run, shared by the
    workers): `ray.lock`, which a Ray file holds exclusive; `machine.lock`, a readers-writer lock which an alone file
    holds exclusive and a Ray or heavy file shared; a light file takes neither. A turnstile makes new Ray and heavy
    files wait behind a waiting alone file, which would otherwise wait as long as they kept coming."""
    if kind == LIGHT:
        yield
        return
    with contextlib.ExitStack() as held:
        if kind == RAY:
            ray_lock = held.enter_context(open(run_folder / "ray.lock", "w"))
            fcntl.flock(ray_lock, fcntl.LOCK_EX)
            held.callback(fcntl.flock, ray_lock, fcntl.LOCK_UN)
        turnstile = held.enter_context(open(run_folder / "turnstile.lock", "w"))
        machine = held.enter_context(open(run_folder / "machine.lock", "w"))
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if kind == ALONE:  # waits for the files running to end; new ones wait at the turnstile meanwhile
            fcntl.flock(machine, fcntl.LOCK_EX)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(machine, fcntl.LOCK_SH)
        held.callback(fcntl.flock, machine, fcntl.LOCK_UN)
        yield
