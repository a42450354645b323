"""Which file runs beside which under scripts/test.sh's two workers, in what order, on how many threads
(tests/conftest.py's pytest_collection_modifyitems and machine_turn use these; tests/README.md, "Two workers").

Three kinds of file (by the markers of its selected tests): a Ray file runs beside light files only, with every
core; a heavy file (e2e or slow: trainer runs, engines, DeepSpeed ranks) runs beside another heavy or a light file;
a light file (neither) runs beside anything. Why: two Ray clusters at once, or the two-node cluster beside a trainer run,
ran the 24 GiB machine into Ray's memory monitor in two of the first three two-worker suite runs (it kills engine
and learner workers at 95% of the node's memory: 7 and 4 tests failed); every other pair of files fitted.
Threads: scripts/test.sh gives each worker one torch thread (two workers with two threads each on two cores
oversubscribe them: the fast tier took 255 s so, 125 s with one each); a Ray file's turn gives it every core.
"""

import contextlib
import fcntl
import os
from pathlib import Path

ALONE, HEAVY, LIGHT = "alone", "heavy", "light"

# Seconds each file took in a quiet one-process run (2-core EPYC, 2026-11-27; docs/testing.md, "The suite's time"):
# the workers take the files longest first, so the last file to end is a short one. Not listed: a few seconds. A
# wrong number costs time, never a result.
MEASURED_FILE_SECONDS = {
    "test_ray_resume.py": 211, "test_engine_actors.py": 258, "test_ray_learners.py": 185,
    "test_multinode_local.py": 177, "test_placement.py": 27, "test_never_lose_a_run.py": 202, "test_resume.py": 134,
    "test_ppo_trainer.py": 115, "test_weight_broadcast.py": 82, "test_deepspeed_ranks.py": 86, "test_lora.py": 74,
    "test_packing.py": 70, "test_grpo.py": 40, "test_vllm_engine.py": 29, "test_ppo_learner.py": 28,
    "test_evaluate.py": 27, "test_bad_inputs.py": 25, "test_micro_batches.py": 23, "test_preemption.py": 22,
    "test_memory_plan.py": 20, "test_reward_function.py": 18, "test_dapo.py": 18, "test_tools_trainer.py": 17,
    "test_check_gpu.py": 16, "test_weight_transfer.py": 13, "test_engine_batches.py": 11, "test_checkpoint.py": 10,
    "test_sandbox.py": 10,
}  # fmt: skip


def file_kind(items) -> str:
    """ALONE, HEAVY or LIGHT for the selected tests of one file (the fast tier's files are all light)."""
    if any(item.get_closest_marker("ray") for item in items):
        return ALONE
    if any(item.get_closest_marker("e2e") or item.get_closest_marker("slow") for item in items):
        return HEAVY
    return LIGHT


def worker_file_order(files: dict[str, str]) -> list[str]:
    """The order the workers take the files in ({path: kind} -> paths): the Ray files first, longest first, each
    followed by its share of the light files (they fill the other worker while a Ray file has the machine), then the
    heavy files longest first, then the light files left. Pure; tests/test_worker_turns.py."""

    def seconds(path: str) -> float:
        return MEASURED_FILE_SECONDS.get(Path(path).name, 3)

    def longest_first(kind: str) -> list[str]:
        return sorted((path for path, k in files.items() if k == kind), key=lambda path: (-seconds(path), path))

    alone, heavy, light = longest_first(ALONE), longest_first(HEAVY), longest_first(LIGHT)
    light_share = sum(map(seconds, light)) / max(sum(map(seconds, alone)), 1)  # light seconds per Ray second
    order, owed = [], 0.0
    for path in alone:
        order.append(path)
        owed += seconds(path) * light_share
        while light and owed >= seconds(light[0]) / 2:
            owed -= seconds(light[0])
            order.append(light.pop(0))
    return order + heavy + light


class every_core_for_torch:
    """Until restore(): this process's torch on every core and OMP_NUM_THREADS unset, so the processes a Ray file's
    tests start (trainers, Ray's nodes, whose workers then get Ray's own default: a thread per logical CPU they hold)
    run as they do in one pytest process."""

    def __init__(self):
        import torch

        self.env, self.threads = os.environ.pop("OMP_NUM_THREADS", None), torch.get_num_threads()
        torch._C.set_num_threads(len(os.sched_getaffinity(0)))  # vLLM's CPU worker makes torch.set_num_threads a no-op

    def restore(self) -> None:
        import torch

        if self.env is not None:
            os.environ["OMP_NUM_THREADS"] = self.env
        torch._C.set_num_threads(self.threads)


@contextlib.contextmanager
def turn(run_folder: Path, kind: str):
    """One file's turn on the machine, by its kind: a readers-writer lock in `run_folder` (one per pytest run, shared
    by the workers), which a Ray file holds exclusive (and gets every core), a heavy file shared, a light file not at
    all; a turnstile makes new heavy files wait behind a waiting Ray file, which would otherwise wait forever."""
    if kind == LIGHT:
        yield
        return
    with open(run_folder / "turnstile.lock", "w") as turnstile, open(run_folder / "machine.lock", "w") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if kind == ALONE:
            # Waits for the heavy files running to end; new ones wait at the turnstile meanwhile.
            fcntl.flock(machine, fcntl.LOCK_EX)
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(machine, fcntl.LOCK_SH)
        threads = every_core_for_torch() if kind == ALONE else None
        try:
            yield
        finally:
            if threads is not None:
                threads.restore()
            fcntl.flock(machine, fcntl.LOCK_UN)
