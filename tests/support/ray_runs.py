"""What the tests that start Ray, or several processes talking TCP, share: the loopback-namespace guard, a trainer
command on the test's Ray cluster (the `ray_cluster` fixture in tests/conftest.py), and polling with a deadline."""

import os
import time
from pathlib import Path

import pytest

from tests.support.trainer_runs import RESPONSE_LENGTH, RUN_TIMEOUT_S, TRAINER

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
