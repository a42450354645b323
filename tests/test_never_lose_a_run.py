"""Never lose a run, part 2: the ways a single run could still lose work or mislead, each met as a user meets it,
on the real trainer (tiny model, real vLLM engine, a few steps). Runs are subprocesses with a timeout.

- `same_command_twice`: on a fresh $OPEN_INSTRUCT_CACHE, a run (it builds the tiny model), a start with
  --overwrite_output_dir whose model folder is broken (it must leave the first run's files byte-identical), and the
  first command again (it must give the very same run, and replace the first one). The first run is a new
  interpreter, the second is forked from the pytest worker's zygote (tests/support/forked_runs.py): the same run
  also shows that a forked run is the run `python -m` gives. The command is the stalled
  run's below (sync mode, 2 steps), so that same run is also the uninterrupted reference of the stall test.
- A full disk (a small tmpfs as output_dir, tests/support/small_disk.py): a checkpoint that does not fit stops the run with
  one line and keeps the newest complete checkpoint; a final model that does not fit goes to --fallback_save_dir.
- Two SIGTERMs sent together to the process group (GNU timeout, SLURM): one preemption, a checkpoint, exit 143.
- A generation that cannot finish in time (tests/support/inject_fault.py generation_stalls) and SIGTERM while the learner
  waits on it: the step is given up, the previous one checkpointed (summary.json: preempted), and `--resume` ends
  the run equal to an uninterrupted one; a second SIGTERM meanwhile exits at once, and summary.json says so.
- An absurd learning rate: the divergence guard stops the run with its cause, naming the newest checkpoint.

Each test prints its seconds (pytest -s); docs/resume.md lists what a user sees in each case.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from open_instruct.learner.saving import weights_sha256
from open_instruct.run.tracking import read_metrics
from tests.support.forked_runs import start_run
from tests.support.inject_fault import STALL_MESSAGE
from tests.support.resume_runs import assert_same_run, comparable, finish, wait_for_step
from tests.support.small_disk import on_small_disk, small_disk_unavailable
from tests.support.trainer_runs import FP32_LEARNER, SMALL_RUN, TESTS_DIR, TRAINER, last_lines, run_command

pytestmark = [pytest.mark.e2e]

TINY_RUN = ["--model_name_or_path", "tiny", "--num_evals", "0", *SMALL_RUN]


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1] if text.strip() else ""


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes (the lock file aside: a run may create it empty)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".run.lock"}  # fmt: skip


def report_seconds(name: str, seconds: float) -> None:
    print(f"\n[timing] {name}: {seconds:.1f}s")


def report_line(name: str, line: str) -> None:
    """What the user saw (pytest -s prints it; docs/resume.md's table quotes these)."""
    print(f"[line] {name}: {line}")


# Sync mode, 2 steps: the generation of step 2's batch stalls (tests/support/inject_fault.py generation_stalls), so SIGTERM
# finds the learner waiting for a rollout that never comes. The batch is the checkpoint's own policy's, so the resumed
# run generates it again exactly (async mode would generate an older policy's batch with the newer one, and warn).
STALL_PREEMPTION_S = 20  # the step waits 10 s of it (preemption.WAIT_SHARE), the checkpoint has the rest
STALLED_RUN = TINY_RUN + ["--total_episodes", "16", "--async_mode", "false", *FP32_LEARNER,
                          "--preemption_timeout_s", str(STALL_PREEMPTION_S)]  # fmt: skip


# ---- overwrite and reproducibility: the same command twice on a fresh cache ----------------------------------------


@dataclass
class TwoRuns:
    first_metrics: list[dict]
    first_model: bytes
    first_run_id: str
    after_broken_start: dict[str, bytes]
    before_broken_start: dict[str, bytes]
    broken_exit_code: int
    broken_stderr: str
    second: Path
    second_stderr: str
    seconds: dict[str, float]


@pytest.fixture(scope="module")
def same_command_twice(smollm2_dir, tmp_path_factory) -> TwoRuns:
    workdir = tmp_path_factory.mktemp("same_command")
    cache = workdir / "cache"
    shutil.copytree(smollm2_dir, cache / "models" / Path(smollm2_dir).name)  # no tiny model: the first run builds it
    env = {"OPEN_INSTRUCT_CACHE": str(cache)}
    output_dir = workdir / "output"
    # The stalled run's flags: the second run is also the uninterrupted reference its resume must equal.
    command = TRAINER + STALLED_RUN + ["--output_dir", str(output_dir), "--overwrite_output_dir", "true"]
    seconds = {}

    start = time.time()
    # A new interpreter, as a user starts it; the second run is forked from the worker's zygote, as most of the suite's
    # are (tests/support/forked_runs.py): their equality below is also what shows that forking changes no run.
    first, _ = run_command(command, cwd=workdir, env=env, fork=False)
    seconds["first run (builds the tiny model)"] = time.time() - start
    assert first.returncode == 0, last_lines(first.stderr)
    first_metrics = read_metrics(str(output_dir / "metrics.jsonl"))
    first_model = (output_dir / "model" / "model.safetensors").read_bytes()

    # A model folder whose weights file was cut off: config and tokenizer pass the checks, the load fails.
    broken_model = workdir / "broken_model"
    shutil.copytree(cache / "models" / "tiny-llama-smollm2-tokenizer", broken_model)
    with open(broken_model / "model.safetensors", "r+b") as f:
        f.truncate(1_000_000)
    before = snapshot(output_dir)
    broken_command = [flag if flag != "tiny" else str(broken_model) for flag in command]
    start = time.time()
    broken, _ = run_command(broken_command, cwd=workdir, env=env)
    seconds["start with a broken model folder"] = time.time() - start
    after = snapshot(output_dir)

    start = time.time()
    second, _ = run_command(command, cwd=workdir, env=env)
    seconds["the same command again"] = time.time() - start
    assert second.returncode == 0, last_lines(second.stderr)
    return TwoRuns(first_metrics, first_model, first_metrics[0]["run_id"], after, before, broken.returncode,
                   broken.stderr, output_dir, second.stdout + second.stderr, seconds)  # fmt: skip


def test_a_failed_start_with_overwrite_output_dir_keeps_the_earlier_run(same_command_twice):
    runs = same_command_twice
    report_seconds("start with a broken model folder", runs.seconds["start with a broken model folder"])
    report_line("start with a broken model folder", last_line(runs.broken_stderr))
    assert runs.broken_exit_code == 1, last_lines(runs.broken_stderr)
    assert last_line(runs.broken_stderr).startswith("error: the run failed: "), last_lines(runs.broken_stderr)
    assert "put the earlier run back in" in runs.broken_stderr
    assert runs.after_broken_start == runs.before_broken_start, "the earlier run's files changed"
    kept = {"model/model.safetensors", "metrics.jsonl", "summary.json", "logs/libraries.log"}
    assert kept <= set(runs.after_broken_start)


def test_the_same_command_gives_the_same_run_and_an_overwrite_replaces_the_earlier_one(same_command_twice):
    runs = same_command_twice
    for name, seconds in runs.seconds.items():
        report_seconds(name, seconds)
    second_metrics = read_metrics(str(runs.second / "metrics.jsonl"))
    assert {row["run_id"] for row in second_metrics} != {runs.first_run_id}, "the earlier run was replaced"
    assert [comparable(row) for row in second_metrics] == [comparable(row) for row in runs.first_metrics]
    second_model = (runs.second / "model" / "model.safetensors").read_bytes()
    assert second_model == runs.first_model, "the same weights, bit for bit"
    assert "deleted the earlier run" in runs.second_stderr
    assert not (runs.second / ".earlier-run").exists()


# ---- a full disk -------------------------------------------------------------------------------------------------


def small_disk_or_skip() -> None:
    if reason := small_disk_unavailable():
        pytest.skip(reason)


def test_a_checkpoint_that_does_not_fit_stops_the_run_and_keeps_the_newest_complete_one(tmp_path):
    """A tiny-model checkpoint (policy, value model, both Adam states) is ~0.16 GB: the disk holds one, not two."""
    small_disk_or_skip()
    output_dir, kept = tmp_path / "output", tmp_path / "kept"
    out = re.escape(str(output_dir))
    output_dir.mkdir()
    kept.mkdir()
    command = TRAINER + TINY_RUN + ["--total_episodes", "24", "--save_freq", "1", "--keep_last_n", "1",
                                   "--output_dir", str(output_dir)]  # fmt: skip
    start = time.time()
    process, _ = run_command(on_small_disk(str(output_dir), 260, command, copy_to=str(kept)), cwd=tmp_path)
    report_seconds("checkpoint on a full disk", time.time() - start)
    assert process.returncode == 1, last_lines(process.stderr)
    line = last_line(process.stderr)
    report_line("checkpoint on a full disk", line)
    assert re.fullmatch(
        rf"error: checkpoint step_2 not written: no space left on {out}/checkpoints \(needs ~0\.1\d+ GB, "
        rf"0\.\d+ GB free\); the newest checkpoint is {out}/checkpoints/step_1 \(resume with --resume\)",
        line,
    ), line
    assert "Traceback" not in process.stderr and "unexpected pos" not in process.stderr
    # What the small disk held at the end (copied out of it): step_1, complete and loadable; no half-written step_2.
    assert sorted(os.listdir(kept / "checkpoints")) == ["step_1"]
    step_1 = kept / "checkpoints" / "step_1"
    assert (step_1 / "COMPLETE").is_file()
    assert json.loads((step_1 / "trainer_state.json").read_text())["step"] == 1
    state = torch.load(step_1 / "learner.pt", weights_only=False)
    assert all(torch.isfinite(t).all() for t in state["policy"].values())
    summary = json.loads((kept / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["last_checkpoint"] == str(output_dir / "checkpoints" / "step_1")


# What the trainer checks at start, before any model loads: the data and the models' folders, then the disk. One
# process (one import of the trainer, ~5 s) answers for every case: argv[1] is a JSON list of [output_dir, save_freq].
CHECKPOINT_SPACE_AT_START = """
import json
import sys
from open_instruct.ppo_vllm_thread_ray_gtrl import load_data
from open_instruct.run.args import compute_batch_sizes, parse_args
from open_instruct.trainer_outputs import checkpoint_space_problem
for index, (output_dir, save_freq) in enumerate(json.loads(sys.argv[1])):
    args = parse_args(sys.argv[2:] + ["--save_freq", save_freq, "--output_dir", output_dir])
    print(f"problem {index}:", checkpoint_space_problem(args, compute_batch_sizes(args), load_data(args)))
"""
DISK_CASES = [
    (12, "1", r"{out} has 0\.01\d+ GB free, less than the ~0\.1[5-7]\d* GB a checkpoint needs: the run would stop at "
              r"its first checkpoint \(--save_freq 1\); free space there, or pass --save_freq -1 \(no checkpoints\)"),
    (260, "1", "None"),  # the disk that holds one checkpoint (test above)
    (12, "-1", "None"),  # no checkpoints
]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint_space_at_start(tmp_path_factory) -> tuple[list[str], list[str]]:
    """Each DISK_CASES case's output_dir (a small disk of its size, each its own) and what the start said there."""
    small_disk_or_skip()
    folder = tmp_path_factory.mktemp("disks")
    output_dirs = [str(folder / f"case_{index}_{disk_mb}mb") for index, (disk_mb, _, _) in enumerate(DISK_CASES)]
    cases = [[output_dir, save_freq] for output_dir, (_, save_freq, _) in zip(output_dirs, DISK_CASES)]
    command = [sys.executable, "-c", CHECKPOINT_SPACE_AT_START, json.dumps(cases), *TINY_RUN, "--total_episodes", "16"]
    for output_dir, (disk_mb, _, _) in zip(output_dirs, DISK_CASES):
        os.mkdir(output_dir)
        command = on_small_disk(output_dir, disk_mb, command)  # nested: each mount in its own namespace, all seen
    process, _ = run_command(command, cwd=Path(__file__).parent.parent)
    assert process.returncode == 0, last_lines(process.stderr)
    said = {line.split(": ", 1)[0]: line.split(": ", 1)[1] for line in process.stdout.splitlines()
            if line.startswith("problem ")}  # fmt: skip
    return output_dirs, [said[f"problem {index}"] for index in range(len(DISK_CASES))]


@pytest.mark.parametrize("case", range(len(DISK_CASES)), ids=[f"{mb}-{freq}" for mb, freq, _ in DISK_CASES])
def test_a_disk_that_cannot_hold_one_checkpoint_is_named_at_start(checkpoint_space_at_start, case):
    """The tiny PPO run's checkpoint (policy, value model, both Adam states) is ~0.16 GB: on a 12 MB disk the run would
    train until its first --save_freq step and stop there, so the start says so, as it does for the final model."""
    output_dirs, problems = checkpoint_space_at_start
    expected = DISK_CASES[case][2]
    assert re.fullmatch(expected.format(out=re.escape(output_dirs[case])), problems[case]), problems[case]


def test_a_final_model_that_does_not_fit_goes_to_the_fallback_folder(tmp_path):
    small_disk_or_skip()
    output_dir, rescued = tmp_path / "output", tmp_path / "rescued"
    output_dir.mkdir()
    command = TRAINER + TINY_RUN + ["--total_episodes", "16", "--output_dir", str(output_dir), "--run_name", "small",
                                   "--fallback_save_dir", str(rescued)]  # fmt: skip
    start = time.time()
    process, _ = run_command(on_small_disk(str(output_dir), 12, command), cwd=tmp_path)
    report_seconds("final model on a full disk", time.time() - start)
    assert process.returncode == 1, last_lines(process.stderr)
    model_dir = rescued / "small" / "model"
    out, rescued_model = re.escape(str(output_dir)), re.escape(str(model_dir))
    line = last_line(process.stderr)
    report_line("final model on a full disk", line)
    match = re.fullmatch(
        rf"error: the final model did not fit in {out}/model: no space left on {out} \(needs ~0\.0\d+ GB, "
        rf"0\.0\d+ GB free\); saved it in {rescued_model} instead \(weights_sha256 (\w+)\); move it to "
        rf"{out}/model once there is room",
        line,
    )
    assert match, line
    assert "[ppo] warning: " + str(output_dir) + " has " in process.stderr, "said at start, long before the save"
    from transformers import AutoModelForCausalLM

    assert weights_sha256(load_file(str(model_dir / "model.safetensors"))) == match.group(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert all(torch.isfinite(param).all() for param in model.parameters())


# ---- one preemption, two signals -----------------------------------------------------------------------------------


def test_two_sigterms_to_the_process_group_give_one_checkpoint_and_exit_143(tmp_path):
    output_dir = tmp_path / "output"
    output_dir.mkdir()
    command = TRAINER + TINY_RUN + ["--total_episodes", "64", "--output_dir", str(output_dir)]
    start = time.time()
    process = start_run(command, tmp_path, tmp_path / "run.log",
                        start_new_session=True)  # its own process group, as under `timeout` or SLURM
    process.log_path = tmp_path / "run.log"
    wait_for_step(process, output_dir, 1)
    # GNU timeout signals the child, then the whole group. Two signals that arrive before Python runs the handler
    # are merged into one call, so the second is sent once the trainer has taken the first (its line is out): the
    # handler then sees two, within milliseconds, as it does when the main thread is between two torch calls.
    os.killpg(process.pid, signal.SIGTERM)
    deadline = time.time() + 30
    while "SIGTERM received" not in process.log_path.read_text(errors="replace") and time.time() < deadline:
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGTERM)
    exit_code, output = finish(process)
    report_seconds("two SIGTERMs", time.time() - start)
    assert exit_code == 128 + signal.SIGTERM, last_lines(output)
    line = last_line(output)
    report_line("two SIGTERMs", line)
    assert re.fullmatch(r"error: stopped by SIGTERM after step \d+; checkpoint saved in .*/checkpoints/step_\d+; "
                        r"resume with the same command plus --resume", line), line  # fmt: skip
    checkpoint_dir = Path(line.split("checkpoint saved in ")[1].split(";")[0])
    assert (checkpoint_dir / "COMPLETE").is_file()
    assert "stopped without a new checkpoint" not in output


# ---- a preemption while the step waits on a generation that cannot finish in time --------------------------------

def start_stalled_run(tmp_path: Path, output_dir: Path) -> subprocess.Popen:
    """The stalled run, once the learner waits on the stalled generation (step 1 logged)."""
    command = [sys.executable, str(TESTS_DIR / "support" / "inject_fault.py"), "generation_stalls", *STALLED_RUN,
               "--output_dir", str(output_dir)]  # fmt: skip
    process = start_run(command, tmp_path, tmp_path / f"{output_dir.name}.log")
    process.log_path = tmp_path / f"{output_dir.name}.log"
    wait_for_step(process, output_dir, 1)
    deadline = time.time() + 60
    while STALL_MESSAGE not in process.log_path.read_text(errors="replace"):
        assert process.poll() is None and time.time() < deadline, last_lines(process.log_path.read_text())
        time.sleep(0.1)
    return process


def test_sigterm_while_generation_stalls_checkpoints_the_last_step_and_resumes_exactly(tmp_path, same_command_twice):
    reference = same_command_twice.second  # STALLED_RUN's flags, uninterrupted (the tiny model built the same way)
    output_dir = tmp_path / "output"
    stalled = start_stalled_run(tmp_path, output_dir)
    sent = time.time()
    stalled.send_signal(signal.SIGTERM)
    exit_code, output = finish(stalled)
    seconds = time.time() - sent
    report_seconds("SIGTERM while generation stalls, to exit", seconds)
    line = last_line(output)
    report_line("SIGTERM while generation stalls", line)
    assert exit_code == 128 + signal.SIGTERM, last_lines(output)
    step_1 = output_dir / "checkpoints" / "step_1"
    assert line == (f"error: stopped by SIGTERM after step 1; checkpoint saved in {step_1}; resume with the same "
                    "command plus --resume"), last_lines(output)  # fmt: skip
    assert re.search(r"step 2 waited \d+s for its rollout, \d+s of them after SIGTERM: giving up step 2, "
                     r"checkpointing step 1", output), last_lines(output)  # fmt: skip
    assert (step_1 / "COMPLETE").is_file() and seconds < STALL_PREEMPTION_S
    written = json.loads((output_dir / "summary.json").read_text())
    assert written["status"] == "preempted" and written["reason"] == line.removeprefix("error: ")
    assert written["last_step"] == 1 and written["last_checkpoint"] == str(step_1)

    resumed, _ = run_command(TRAINER + STALLED_RUN + ["--output_dir", str(output_dir), "--resume"], cwd=tmp_path)
    assert resumed.returncode == 0, last_lines(resumed.stderr)
    assert "generates it again" not in resumed.stderr  # the batch of step 2 is the checkpoint's own policy's
    assert_same_run(output_dir, reference)
    written = json.loads((output_dir / "summary.json").read_text())
    assert written["status"] == "completed" and written["reason"] == "trained all 2 steps"


def test_a_second_sigterm_while_generation_stalls_says_how_the_run_ended_in_summary_json(tmp_path):
    """The second signal (4 s after the first, before the step gives up its wait) stops the run at once, without a
    checkpoint: summary.json says so, not `running`."""
    output_dir = tmp_path / "output"
    stalled = start_stalled_run(tmp_path, output_dir)
    stalled.send_signal(signal.SIGTERM)
    time.sleep(4)
    stalled.send_signal(signal.SIGTERM)
    exit_code, output = finish(stalled)
    assert exit_code == 128 + signal.SIGTERM, last_lines(output)
    line = last_line(output)
    report_line("a second SIGTERM while generation stalls", line)
    assert re.fullmatch(r"error: a second SIGTERM came \d+s after the first: stopped without a new checkpoint; there "
                        r"is no complete checkpoint \(resume with --resume\)", line), line  # fmt: skip
    written = json.loads((output_dir / "summary.json").read_text())
    assert written == {"status": "preempted", "reason": line.removeprefix("error: "), "last_step": 1,
                       "last_checkpoint": None}  # fmt: skip


# ---- the divergence guard ------------------------------------------------------------------------------------------


def test_an_exploding_run_stops_with_its_cause_and_names_the_newest_checkpoint(tmp_path):
    """Learning rate 10, warmed up linearly over 2 of 4 steps: step 1 trains at 0 (a sane checkpoint), step 2 at 5."""
    output_dir = tmp_path / "output"
    command = TRAINER + TINY_RUN + ["--total_episodes", "36", "--learning_rate", "10", "--warmup_ratio", "0.5",
                                   "--save_freq", "1", "--output_dir", str(output_dir)]  # fmt: skip
    start = time.time()
    process, _ = run_command(command, cwd=tmp_path)
    report_seconds("exploding run", time.time() - start)
    assert process.returncode == 1, last_lines(process.stderr)
    line = last_line(process.stderr)
    report_line("exploding run", line)
    assert line.startswith("error: stopped: the policy diverged at step 2: the policy's weight norm is "), line
    assert f"Lower --learning_rate (now 10); the newest checkpoint is {output_dir}/checkpoints/step_1" in line, line
    assert "Traceback" not in process.stderr
    # The settings that work but not as written were named at start (36 is 4 steps of 8 and 4 more).
    assert "[ppo] warning: --total_episodes 36 is not a multiple of a step's 8 responses" in process.stdout
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "diverged" in summary["error"]
    assert not (output_dir / "model").exists() and not (output_dir / "checkpoints" / "step_2").exists()
    state = torch.load(output_dir / "checkpoints" / "step_1" / "learner.pt", weights_only=False)
    assert all(torch.isfinite(t).all() for t in state["policy"].values())
    steps = [row["step"] for row in read_metrics(str(output_dir / "metrics.jsonl")) if "episode" in row]
    assert steps == [1, 2], "the diverged step is logged, so metrics.jsonl shows what happened"
