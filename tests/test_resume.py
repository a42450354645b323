"""Never lose a run, tested as a user would meet it: real trainer processes, real vLLM, the tiny model.

- `reference`: an uninterrupted run of 8 steps with a checkpoint every 2 steps.
- `interrupted`: the same flags (another run name), stopped and resumed twice:
    1. SIGTERM after step 2 has been logged: the run finishes its step, writes a checkpoint and exits 143 with a
       line saying how to resume. Before that, a second run on the same output_dir is refused (the lock).
    2. `--resume`; kill -9 once step 5 is logged (the newest checkpoint is step 4); a torn half line is appended
       to metrics.jsonl, as a kill in the middle of a write leaves it.
    3. `--resume` again, to the end.
  Its metrics of every step, evals included, equal the reference run's (timings and run id aside), and so does
  the final model, byte for byte.
- A NaN injected into one policy loss stops a run (exit 1, the cause in one line, no NaN weight on disk); in
  process, on a real learner: the bad update is never applied, or with --skip_nonfinite_updates only it is skipped.
"""

import json
import math
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from open_instruct.run.flops import is_timing
from open_instruct.run.tracking import read_metrics
from tests.test_ppo_trainer import FP32_LEARNER, RUN_TIMEOUT_S, SMALL_RUN, TESTS_DIR, TRAINER, last_lines, run_command

NUM_STEPS = 8
# The reference and the interrupted run are two runs: with `--learner_compute_dtype auto` each would time its own
# probe, and a busy machine can tip one of them to the other dtype (a CI run failed so at step 5's KL). A resumed
# run keeps its own run's dtype (test_a_resumed_learner_computes_in_the_dtype_its_run_computed_in).
RUN_FLAGS = [
    "--model_name_or_path", "tiny",
    "--total_episodes", str(8 * NUM_STEPS),
    "--num_evals", "2",
    "--eval_samples_per_prompt", "2",
    "--save_freq", "2",
    "--save_model_freq", "4",
    "--keep_last_n", "2",
    *FP32_LEARNER,
    *SMALL_RUN,
]  # fmt: skip
SIGTERM_EXIT_BOUND_S = 60.0


def offline_env() -> dict:
    import os

    return {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def start(output_dir: Path, log_name: str, *extra: str) -> subprocess.Popen:
    """Start a run in the background; its output goes to a file (a full pipe would block it)."""
    command = TRAINER + RUN_FLAGS + ["--output_dir", str(output_dir), *extra]
    log = open(output_dir.parent / log_name, "w")
    process = subprocess.Popen(command, cwd=output_dir.parent, env=offline_env(), stdout=log, stderr=subprocess.STDOUT)
    process.log_path = Path(log.name)
    return process


def log_of(process: subprocess.Popen) -> str:
    return process.log_path.read_text(errors="replace")


def logged_steps(output_dir: Path) -> set[int]:
    try:
        return {row["step"] for row in read_metrics(str(output_dir / "metrics.jsonl")) if "episode" in row}
    except (FileNotFoundError, ValueError):
        return set()


def wait_for_step(process: subprocess.Popen, output_dir: Path, step: int) -> None:
    deadline = time.time() + RUN_TIMEOUT_S
    while step not in logged_steps(output_dir):
        if process.poll() is not None:
            pytest.fail(f"the run ended (exit {process.returncode}) before step {step}:\n{last_lines(log_of(process))}")
        if time.time() > deadline:
            process.kill()
            pytest.fail(f"step {step} was not logged within {RUN_TIMEOUT_S}s")
        time.sleep(0.1)


def finish(process: subprocess.Popen) -> tuple[int, str]:
    try:
        process.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"the run did not end within {RUN_TIMEOUT_S}s")
    return process.returncode, log_of(process)


def comparable(row: dict) -> dict:
    return {key: value for key, value in row.items() if not is_timing(key) and key != "run_id"}


def assert_same_run(output_dir: Path, reference: Path) -> None:
    """Every logged row (timings and run id aside) and the final model of a run equal the reference run's, to
    float tolerance."""
    expected = [comparable(row) for row in read_metrics(str(reference / "metrics.jsonl"))]
    resumed = [comparable(row) for row in read_metrics(str(output_dir / "metrics.jsonl"))]
    assert [row["step"] for row in resumed] == [row["step"] for row in expected]
    for got, want in zip(resumed, expected):
        assert got.keys() == want.keys(), f"step {want['step']}"
        for key, value in want.items():
            if isinstance(value, float):
                assert math.isclose(got[key], value, rel_tol=1e-5, abs_tol=1e-6), f"step {want['step']} {key}"
            else:
                assert got[key] == value, f"step {want['step']} {key}"

    assert_same_model(output_dir / "model", reference / "model")


def assert_same_model(model_dir: Path, reference_dir: Path) -> None:
    """Two saved HF folders hold the same weights (to float tolerance), and the first loads with transformers."""
    from transformers import AutoModelForCausalLM

    reference_weights = load_file(str(reference_dir / "model.safetensors"))
    weights = load_file(str(model_dir / "model.safetensors"))
    assert reference_weights.keys() == weights.keys()
    for name, tensor in reference_weights.items():
        torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    loaded = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).named_parameters())
    name, tensor = next(iter(reference_weights.items()))
    torch.testing.assert_close(loaded[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@dataclass
class Interrupted:
    output_dir: Path
    sigterm_exit_code: int
    sigterm_stderr: str
    sigterm_to_exit_s: float
    refused_exit_code: int
    refused_stderr: str
    step_at_kill: int
    checkpoints_at_kill: list[str]
    resume_stderr: str


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("reference")
    process, _ = run_command(TRAINER + RUN_FLAGS + ["--output_dir", str(workdir / "output")], cwd=workdir)
    assert process.returncode == 0, last_lines(process.stderr)
    return workdir / "output"


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> Interrupted:
    workdir = tmp_path_factory.mktemp("interrupted")
    output_dir = workdir / "output"
    output_dir.mkdir()

    # 1. SIGTERM after step 2. Before it, a second run on the same output_dir, while the first one is paused
    #    (SIGSTOP: it still holds the lock, and does not run ahead while the second one starts).
    first = start(output_dir, "first.log")
    wait_for_step(first, output_dir, 2)
    first.send_signal(signal.SIGSTOP)
    second, _ = run_command(TRAINER + RUN_FLAGS + ["--output_dir", str(output_dir), "--resume"], cwd=workdir)
    first.send_signal(signal.SIGCONT)
    sent = time.time()
    first.send_signal(signal.SIGTERM)
    sigterm_exit_code, sigterm_stderr = finish(first)
    sigterm_to_exit_s = time.time() - sent

    # 2. Resume, kill -9 after step 5, leave a torn line behind.
    resumed = start(output_dir, "resumed.log", "--resume")
    wait_for_step(resumed, output_dir, 5)
    resumed.kill()
    resumed.wait()
    step_at_kill = max(logged_steps(output_dir))
    checkpoints_at_kill = sorted(path.name for path in (output_dir / "checkpoints").iterdir())
    with open(output_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "objective/kl": 0.12')

    # 3. Resume to the end.
    final, _ = run_command(TRAINER + RUN_FLAGS + ["--output_dir", str(output_dir), "--resume"], cwd=workdir)
    assert final.returncode == 0, last_lines(final.stderr)
    return Interrupted(
        output_dir, sigterm_exit_code, sigterm_stderr, sigterm_to_exit_s, second.returncode, second.stderr,
        step_at_kill, checkpoints_at_kill, final.stdout + final.stderr,
    )  # fmt: skip


def test_sigterm_writes_a_checkpoint_and_exits_with_how_to_resume(interrupted):
    last_line = interrupted.sigterm_stderr.strip().splitlines()[-1]
    print(f"\nSIGTERM to exit: {interrupted.sigterm_to_exit_s:.1f}s; {last_line}")
    assert interrupted.sigterm_exit_code == 128 + signal.SIGTERM, last_lines(interrupted.sigterm_stderr)
    assert last_line.startswith("error: stopped by SIGTERM after step ")
    assert "resume with the same command plus --resume" in last_line
    stopped_after = int(last_line.split("after step ")[1].split(";")[0])
    assert stopped_after >= 2
    assert f"checkpoints/step_{stopped_after}" in last_line
    assert interrupted.sigterm_to_exit_s < SIGTERM_EXIT_BOUND_S


def test_a_second_run_on_a_locked_output_dir_is_refused(interrupted):
    last_line = interrupted.refused_stderr.strip().splitlines()[-1]
    assert interrupted.refused_exit_code == 2, last_lines(interrupted.refused_stderr)
    assert "is in use by run ppo__1__" in last_line and "pid" in last_line, last_line


def test_kill_9_then_resume_gives_the_uninterrupted_runs_metrics_and_model(reference, interrupted):
    assert interrupted.step_at_kill >= 5
    assert interrupted.checkpoints_at_kill[-1] == "step_4"  # the kill came after the checkpoint of step 4
    assert "resuming run" in interrupted.resume_stderr and "from " in interrupted.resume_stderr
    assert "dropped a cut-off last line" in interrupted.resume_stderr  # the torn line was repaired, with a warning
    # --save_model_freq 4: a loadable model of step 4 before the end, the same in both runs (the last step's is the
    # final model, not written twice).
    for run in (reference, interrupted.output_dir):
        assert sorted(path.name for path in run.glob("model_step_*")) == ["model_step_4"]
    assert_same_model(interrupted.output_dir / "model_step_4", reference / "model_step_4")

    rows = read_metrics(str(interrupted.output_dir / "metrics.jsonl"))
    assert len({row["run_id"] for row in rows}) == 1, "a resumed run keeps its run id"
    assert_same_run(interrupted.output_dir, reference)
    summary = json.loads((interrupted.output_dir / "summary.json").read_text())
    assert summary["status"] == "completed"
    checkpoints = sorted(path.name for path in (interrupted.output_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_6", "step_8"], "--keep_last_n 2 keeps the two newest complete checkpoints"


# ---- non-finite values ---------------------------------------------------------------------------------------------

NAN_RUN = [
    sys.executable, str(TESTS_DIR / "inject_fault.py"), "nan_loss",
    "--model_name_or_path", "tiny", "--total_episodes", "24", "--num_evals", "0", "--save_freq", "1", *SMALL_RUN,
]  # fmt: skip


def all_finite(state: dict) -> bool:
    return all(torch.isfinite(t).all() for t in state.values() if isinstance(t, torch.Tensor) and t.is_floating_point())


def test_a_nan_loss_stops_the_run_and_no_nan_weight_reaches_disk(tmp_path):
    process, _ = run_command(NAN_RUN + ["--output_dir", str(tmp_path / "output")], cwd=tmp_path)
    last_line = process.stderr.strip().splitlines()[-1]
    assert process.returncode == 1, last_lines(process.stderr)
    assert last_line.startswith("error: stopped: non-finite loss in a PPO minibatch"), last_line
    assert "--skip_nonfinite_updates" in last_line and "Traceback" not in process.stderr
    output_dir = tmp_path / "output"
    assert not (output_dir / "model").exists()
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and "non-finite loss" in summary["error"]
    for checkpoint in (output_dir / "checkpoints").iterdir():
        state = torch.load(checkpoint / "learner.pt", weights_only=False)
        assert all_finite(state["policy"]) and all_finite(state["value_model"]), checkpoint


@pytest.fixture
def learner_and_batch(tiny_model_dir):
    """A real PPOLearner on the tiny model (no vLLM) and one made-up rollout of 8 responses, half of them correct."""
    from open_instruct.rl.rewards import RewardManager
    from open_instruct.data.tokenizer import load_tokenizer
    from open_instruct.run.args import compute_batch_sizes, parse_args
    from open_instruct.learner.ppo import PPOLearner
    from open_instruct.data.batches import PromptBatch
    from open_instruct.generation.vllm_engine import Completion

    args = parse_args(["--model_name_or_path", tiny_model_dir, "--dataset_mixer_list", "unused.jsonl", "1.0",
                       *SMALL_RUN, "--num_mini_batches", "2", "--total_episodes", "16"])  # fmt: skip
    tokenizer = load_tokenizer(tiny_model_dir)
    learner = PPOLearner(args, compute_batch_sizes(args), tokenizer, tiny_model_dir, [tokenizer.eos_token_id])
    prompt = tokenizer.encode("What is 2 + 3?")
    prompts = PromptBatch([prompt] * 4, ["5"] * 4, ["arithmetic"] * 4, ["What is 2 + 3?"] * 4)
    completions = []
    for index in range(8):
        text = f"The answer is {5 if index % 2 else 7}"
        completions.append(Completion(prompt_index=index // 2, token_ids=tokenizer.encode(text) + [tokenizer.eos_token_id],
                                      text=text, finish_reason="stop"))  # fmt: skip
    experience, _, _ = learner.make_experience(prompts, completions, RewardManager(args.reward))
    return learner, experience


def test_a_resumed_learner_computes_in_the_dtype_its_run_computed_in(learner_and_batch, tmp_path, capsys):
    """`--learner_compute_dtype auto` times a probe at each start, and a busy machine can tip it: the checkpoint
    keeps the dtype the run computed in, and a resumed learner computes in it whatever its own probe chose."""
    from open_instruct.run.checkpoint import save_checkpoint

    learner, experience = learner_and_batch
    chosen_at_start = learner.compute_dtype
    other = torch.bfloat16 if chosen_at_start == torch.float32 else torch.float32
    learner.compute_dtype = other  # the run before the checkpoint computed in the other dtype
    path = save_checkpoint(str(tmp_path), 1, learner, {"step": 1}, learner.args, keep_last_n=1).path
    learner.compute_dtype = chosen_at_start  # a new start: its probe chose otherwise

    state = torch.load(Path(path) / "learner.pt", weights_only=False)
    assert state["compute_dtype"] == str(other).removeprefix("torch.")
    learner.load_state_dict(state)
    assert learner.compute_dtype == other
    assert f"computing in {state['compute_dtype']}, as the run did before this checkpoint" in capsys.readouterr().out
    assert all(math.isfinite(value) for value in learner.train(experience).values())

    del state["compute_dtype"]  # a checkpoint written before the dtype was saved: the start's choice stands
    learner.compute_dtype = chosen_at_start
    learner.load_state_dict(state)
    assert learner.compute_dtype == chosen_at_start


def nan_on_first_call(monkeypatch) -> None:
    from open_instruct import rl

    real_policy_loss, calls = rl.policy_loss, []

    def policy_loss(*args, **kwargs):
        calls.append(1)
        pg_loss, *rest = real_policy_loss(*args, **kwargs)
        return (pg_loss * float("nan") if len(calls) == 1 else pg_loss, *rest)

    monkeypatch.setattr(rl, "policy_loss", policy_loss)


def policy_weights(learner) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in learner.backend.hf_model(learner.policy).named_parameters()}


def test_a_nan_loss_leaves_the_weights_untouched(learner_and_batch, monkeypatch):
    from open_instruct.run.checkpoint import NonFiniteError

    learner, experience = learner_and_batch
    before = policy_weights(learner)
    nan_on_first_call(monkeypatch)
    with pytest.raises(NonFiniteError, match="non-finite loss in a PPO minibatch"):
        learner.train(experience)
    assert all(torch.equal(param, before[name]) for name, param in policy_weights(learner).items())


def test_skip_nonfinite_updates_skips_only_the_bad_update(learner_and_batch, monkeypatch):
    learner, experience = learner_and_batch
    learner.args.run.skip_nonfinite_updates = True
    before = policy_weights(learner)
    nan_on_first_call(monkeypatch)
    metrics = learner.train(experience)  # two minibatches: the first is skipped, the second applied
    assert metrics["train/skipped_updates"] == 1.0
    after = policy_weights(learner)
    assert all(torch.isfinite(param).all() for param in after.values())
    assert any(not torch.equal(param, before[name]) for name, param in after.items())
