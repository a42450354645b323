"""Never lose a multi-node run: Ray learner ranks on DeepSpeed checkpoint, stop on SIGTERM and resume exactly.

Real trainer processes driving 2 learner ranks (one per Ray node of a two-node cluster on 127.0.0.1) and the
in-process vLLM engine, the tiny model, fp32 compute. For each ZeRO stage, a reference run of 6 steps with a
checkpoint every 2, against the same flags interrupted:

- ZeRO-3, async: SIGTERM once step 2 is logged (the run writes a checkpoint, every rank its partitions in parallel,
  and exits 143 with the resume line), `--resume`, `kill -9` of the driver once the checkpoint of step 4 is complete,
  `--resume` to the end.
- ZeRO-2, sync: learner rank 1 dies in the middle of writing the checkpoint of step 4 (tests/support/inject_fault.py): the run
  ends naming it, no step_4 checkpoint exists, not even half of one, and step_2 is intact; `--resume` from it to the
  end. In sync mode the rollout in flight at a checkpoint is the checkpoint's own policy's: it is not waited for
  but generated again on resume, and gives the same batch.

Every metric of every step, evals included (timings aside), and the saved final model equal the reference's, and
so does the model snapshot of step 4 (--save_model_freq).
"""

import signal
import subprocess
import time
from pathlib import Path

import pytest

from open_instruct.run.tracking import read_metrics
from tests.support.forked_runs import start_run
from tests.support.ray_runs import needs_loopback_namespace, ray_trainer_command
from tests.support.resume_runs import assert_same_model, assert_same_run, finish, logged_steps
from tests.support.trainer_runs import FP32_LEARNER, RUN_TIMEOUT_S, TESTS_DIR, last_lines, run_command

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.slow, needs_loopback_namespace]
# One logical CPU per Ray node (tests/conftest.py's ray_cluster), as in test_ray_learners.py.
RAY_CPUS_PER_NODE = 1

NUM_STEPS = 6
ROLLOUT_BATCH_SIZE = 8  # responses per step with ray_trainer_command's flags (test_ray_learners: 16 episodes, 2 steps)
FLAGS = [
    "--total_episodes", str(ROLLOUT_BATCH_SIZE * NUM_STEPS),
    "--num_evals", "2",
    "--eval_samples_per_prompt", "2",
    "--save_freq", "2",
    "--save_model_freq", "4",
    "--keep_last_n", "2",
    "--learning_rate", "1e-3",
    "--lr_scheduler_type", "linear",
    *FP32_LEARNER,
]  # fmt: skip
SIGTERM_EXIT_BOUND_S = 90.0


def command(tiny_model_dir, ray_cluster, eval_file, output_dir: Path, stage: int, async_mode: bool, *extra: str):  # noqa: F811
    return ray_trainer_command(
        tiny_model_dir, ray_cluster, eval_file, output_dir, "--deepspeed_stage", str(stage),
        "--async_mode", str(async_mode).lower(), *FLAGS, *extra,
    )  # fmt: skip


def start(cmd: list[str], log_path: Path) -> subprocess.Popen:
    process = start_run(cmd, log_path.parent, log_path)
    process.log_path = log_path
    return process


def wait_until(process: subprocess.Popen, done, what: str) -> None:
    deadline = time.time() + RUN_TIMEOUT_S
    while not done():
        if process.poll() is not None:
            pytest.fail(f"the run ended (exit {process.returncode}) before {what}:\n"
                        f"{last_lines(process.log_path.read_text(errors='replace'))}")  # fmt: skip
        if time.time() > deadline:
            process.kill()
            pytest.fail(f"no {what} within {RUN_TIMEOUT_S}s")
        time.sleep(0.1)


def checkpoint_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("[ppo] checkpoint ")]


def run_reference(tiny_model_dir, ray_cluster, eval_file, workdir: Path, stage: int, async_mode: bool) -> Path:  # noqa: F811
    output_dir = workdir / "output"
    process, _ = run_command(command(tiny_model_dir, ray_cluster, eval_file, output_dir, stage, async_mode), workdir)
    assert process.returncode == 0, last_lines(process.stderr)
    print(f"\nZeRO-{stage} reference: " + "; ".join(checkpoint_lines(process.stderr + process.stdout)))
    return output_dir


@pytest.fixture(scope="module")
def zero3_reference(tiny_model_dir, ray_cluster, eval_file, tmp_path_factory) -> Path:  # noqa: F811
    return run_reference(tiny_model_dir, ray_cluster, eval_file, tmp_path_factory.mktemp("zero3_reference"), 3, True)


@pytest.fixture(scope="module")
def zero2_reference(tiny_model_dir, ray_cluster, eval_file, tmp_path_factory) -> Path:  # noqa: F811
    return run_reference(tiny_model_dir, ray_cluster, eval_file, tmp_path_factory.mktemp("zero2_reference"), 2, False)


def test_zero3_sigterm_then_kill_9_then_resume_gives_the_uninterrupted_runs_metrics_and_model(
    tiny_model_dir, ray_cluster, eval_file, zero3_reference, tmp_path  # noqa: F811
):
    """Slow (~6 min): a 6-step reference run and the same run started three times on two Ray nodes; each start
    brings up two DeepSpeed ranks and an engine. One scenario per test, because each start is the cost."""
    output_dir = tmp_path / "output"
    cmd = command(tiny_model_dir, ray_cluster, eval_file, output_dir, 3, True)

    # 1. SIGTERM once step 2 is logged: a checkpoint of the step it finishes, exit 143, the resume line.
    first = start(cmd, tmp_path / "first.log")
    wait_until(first, lambda: 2 in logged_steps(output_dir), "step 2")
    sent = time.time()
    first.send_signal(signal.SIGTERM)
    exit_code, log = finish(first)
    sigterm_to_exit_s = time.time() - sent
    last_line = log.strip().splitlines()[-1]
    print(f"\nZeRO-3 SIGTERM to exit: {sigterm_to_exit_s:.1f}s; {'; '.join(checkpoint_lines(log))}; {last_line}")
    assert exit_code == 128 + signal.SIGTERM, last_lines(log)
    assert last_line.startswith("error: stopped by SIGTERM after step ") and "--resume" in last_line, last_line
    stopped_after = int(last_line.split("after step ")[1].split(";")[0])
    assert f"checkpoints/step_{stopped_after}" in last_line
    assert sigterm_to_exit_s < SIGTERM_EXIT_BOUND_S
    step_dir = output_dir / "checkpoints" / f"step_{stopped_after}"
    # Each rank's own files: its DeepSpeed partitions of both trained models and its generators.
    for rank in (0, 1):
        assert (step_dir / f"rank_{rank}.pt").is_file()
        for role in ("policy", "value_model"):
            assert list((step_dir / role / "engine").glob(f"*zero_pp_rank_{rank}_*optim_states.pt")), (role, rank)

    # 2. Resume; kill -9 the driver once the checkpoint of step 4 is complete.
    resumed = start(cmd + ["--resume"], tmp_path / "resumed.log")
    wait_until(resumed, lambda: (output_dir / "checkpoints" / "step_4" / "COMPLETE").is_file()
               and (output_dir / "model_step_4" / "config.json").is_file(), "checkpoint and model snapshot of step 4")
    resumed.kill()
    resumed.wait()
    resumed_log = resumed.log_path.read_text(errors="replace")
    assert "resuming run" in resumed_log and f"step_{stopped_after} (step {stopped_after})" in resumed_log

    # 3. Resume to the end.
    final, _ = run_command(cmd + ["--resume"], tmp_path)
    assert final.returncode == 0, last_lines(final.stderr)
    assert "from " + str(output_dir / "checkpoints" / "step_4") in final.stderr + final.stdout
    assert_same_run(output_dir, zero3_reference)
    # --save_model_freq 4: the Ray ranks' fp32 masters of step 4 as a loadable folder, as the reference's.
    assert_same_model(output_dir / "model_step_4", zero3_reference / "model_step_4")


def test_zero2_a_rank_dying_while_writing_a_checkpoint_leaves_the_previous_one_to_resume_exactly(
    tiny_model_dir, ray_cluster, eval_file, zero2_reference, tmp_path  # noqa: F811
):
    """Slow (~5 min): a 6-step reference run, the run whose rank dies, and its resume, each a start of two
    DeepSpeed ranks and an engine on two Ray nodes."""
    output_dir = tmp_path / "output"
    cmd = command(tiny_model_dir, ray_cluster, eval_file, output_dir, 2, False)
    faulty = [cmd[0], str(TESTS_DIR / "support" / "inject_fault.py"), "learner_rank_dies_in_checkpoint", *cmd[3:]]
    assert cmd[1:3] == ["-m", "open_instruct.ppo_vllm_thread_ray_gtrl"]
    process, _ = run_command(faulty, tmp_path)
    last_line = process.stderr.strip().splitlines()[-1]
    assert process.returncode == 1, last_lines(process.stderr)
    assert "learner rank 1" in last_line and "died" in last_line, last_line
    assert "the newest checkpoint is " + str(output_dir / "checkpoints" / "step_2") in last_line
    # No step_4, complete or not, no staging folder: only step_2, whole.
    assert sorted(path.name for path in (output_dir / "checkpoints").iterdir()) == ["step_2"]
    assert max(row["step"] for row in read_metrics(str(output_dir / "metrics.jsonl"))) == 4

    final, _ = run_command(cmd + ["--resume"], tmp_path)
    assert final.returncode == 0, last_lines(final.stderr)
    assert "warning: the batch of policy" not in final.stderr  # the batch in flight was generated again, exactly
    assert_same_run(output_dir, zero2_reference)
