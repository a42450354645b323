"""What the tests that start Ray, or several processes talking TCP, share: the loopback-namespace guard, a trainer
command on the test's Ray cluster (the `ray_cluster` fixture in tests/conftest.py), polling with a deadline, and
killing one of a run's actors to see how the run ends."""

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.forked_runs import start_run
from tests.support.trainer_runs import RESPONSE_LENGTH, RUN_TIMEOUT_S, TRAINER, last_lines

needs_loopback_namespace = pytest.mark.skipif(
    os.environ.get("OPEN_INSTRUCT_LOOPBACK_ONLY") != "1",
    reason="Ray listens on every interface: run through scripts/test.sh, which uses a loopback-only namespace",
)


def ray_trainer_command(tiny_model_dir, ray_cluster, eval_file, output_dir: Path, *flags: str) -> list[str]:
    return TRAINER + [
        "--model_name_or_path", tiny_model_dir,
        "--ray_address", ray_cluster.address,
        "--num_learners_per_node", "1", "1",
        "--local_rollout_batch_size", "4",
        "--number_samples_per_prompt", "2",
        "--per_device_train_batch_size", "2",
        "--num_epochs", "1",
        "--response_length", str(RESPONSE_LENGTH),
        "--dataset_mixer_eval_list", str(eval_file), "1.0",
        "--output_dir", str(output_dir),
        *flags,
    ]  # fmt: skip


def wait_for(condition, what: str, describe_process, timeout_s: float = RUN_TIMEOUT_S, poll_s: float = 0.5):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(poll_s)
    pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}; the trainer's output:\n{describe_process()}")


def printed_pid(stdout: str, prefix: str) -> int | None:
    """The pid on the first stdout line that starts with `prefix` (e.g. "[ppo] learner rank 1: pid "), else None."""
    for line in stdout.splitlines():
        if line.startswith(prefix):
            return int(line.removeprefix(prefix).split()[0])
    return None


@dataclass
class RunAfterAKill:
    returncode: int
    stderr: str
    seconds: float  # from the kill to the run's end


def kill_an_actor_and_wait_for_the_run_to_end(command: list[str], tmp_path: Path, output_dir: Path, pid_prefix: str,
                                              actor: str) -> RunAfterAKill:  # fmt: skip
    """Start the trainer `command` (writing to `output_dir`), wait for the stdout line `pid_prefix` + pid that names
    the actor's process and for the run's first training step, SIGKILL the actor, and wait for the run to end: the
    test fails if it still runs 120 s after the kill. `actor` names it in the failure messages ("engine 1")."""
    stdout_path, stderr_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    process = start_run(command, tmp_path, stdout_path, stderr_path)
    try:
        def trainer_output() -> str:
            return last_lines(stdout_path.read_text()) + "\n" + last_lines(stderr_path.read_text())

        pid = wait_for(lambda: printed_pid(stdout_path.read_text(), pid_prefix), f"{actor}'s pid", trainer_output)
        wait_for(lambda: (output_dir / "metrics.jsonl").exists(), "the first training step", trainer_output)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run still runs 120 s after {actor} was killed:\n{last_lines(stderr_path.read_text())}")
        seconds = time.time() - killed_at
    finally:
        if process.poll() is None:
            process.kill()
    return RunAfterAKill(process.returncode, stderr_path.read_text(), seconds)
