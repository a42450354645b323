"""Running the trainer as a user does, in a subprocess with a timeout, and reading what a finished run left.

Every run is a process of its own (`python -m open_instruct.ppo_vllm_thread_ray_gtrl ...`), because one process
cannot reliably create a second in-process vLLM engine, forked from a process that has done the trainer's imports
where it may be (tests/support/forked_runs.py), and has a timeout, so that a hang fails a test instead of the CI
job.
"""

import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file as load_safetensors
from transformers import AutoConfig, AutoTokenizer

from open_instruct.generation.vllm_engine import engine_dtype
from open_instruct.learner.saving import weights_sha256
from open_instruct.run.tracking import read_metrics
from tests.support.forked_runs import offline_env, start_run

TESTS_DIR = Path(__file__).resolve().parent.parent
TRAINER = [sys.executable, "-m", "open_instruct.ppo_vllm_thread_ray_gtrl"]
RUN_TIMEOUT_S = 300
RESPONSE_LENGTH = 16
ROLLOUT_BATCH_SIZE = 8  # 4 prompts x 2 samples per step
SMALL_RUN = [
    "--local_rollout_batch_size", "4",
    "--number_samples_per_prompt", "2",
    "--per_device_train_batch_size", "4",
    "--num_epochs", "1",
    "--response_length", str(RESPONSE_LENGTH),
]  # fmt: skip
# A handful of eval prompts with distinct sums, so a logged eval row maps back to its prompt by its ground truth.
EVAL_QUESTIONS = [(1, 1), (2, 3), (4, 0), (3, 4), (5, 3), (6, 3)]
STEP_METRICS = [
    "episode", "lr", "epoch",
    "objective/kl", "objective/scores", "objective/rlhf_reward", "objective/non_score_reward", "objective/entropy",
    "objective/loss", "objective/verifiable_correct_rate",
    "loss/policy_avg", "loss/value_avg",
    "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg",
    "time/from_scratch", "time/training", "time/generation", "time/weight_sync",
    "val/sequence_lengths", "val/num_stop_token_ids",
    "debug/vllm_vs_learner_logprob_diff_mean", "debug/vllm_vs_learner_logprob_diff_max",
    "debug/vllm_vs_learner_ratio_mean", "debug/vllm_vs_learner_ratio_min", "debug/vllm_vs_learner_ratio_max",
    "perf/tokens_per_second", "perf/padding_fraction", "perf/learner_flops_utilization",
]  # fmt: skip
# In sync mode with an fp32 engine the learner computes the logprobs of the very weights that sampled: measured
# ~4e-7 nats per token. A weight sync that misses a layer (the tied LM head did) gives 1e-2 to 1e-1.
SYNC_MAX_LOGPROB_DIFF = 1e-3
# ...when the learner computes in fp32 too. On a CPU with fast bf16, `--learner_compute_dtype auto` computes in bf16
# (measured ~6e-4 nats per token off the fp32 engine on the tiny model), so the tests of that bound pin fp32.
FP32_LEARNER = ["--learner_compute_dtype", "float32"]



def last_lines(text: str | bytes | None, count: int = 40) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-count:])


def run_command(
    command: list[str],
    cwd: Path,
    env: dict[str, str | None] | None = None,
    timeout_s: float = RUN_TIMEOUT_S,
    fork: bool = True,
) -> tuple[subprocess.CompletedProcess, float]:
    """Run `command` offline (no hub, wandb offline) unless `env` says otherwise (None: unset), forked from the
    worker's zygote where it may be and `fork` (tests/support/forked_runs.py; else a new interpreter); fail the test
    on a timeout."""
    full_env = {**offline_env(), **(env or {})}
    full_env = {name: value for name, value in full_env.items() if value is not None}
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="run_output_") as output:
        stdout, stderr = Path(output) / "stdout", Path(output) / "stderr"
        process = start_run(command, cwd, stdout, stderr, env=full_env, fork=fork)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            pytest.fail(f"`{' '.join(command)}` did not end within {timeout_s:.0f}s:\n"
                        f"{last_lines(stderr.read_text(errors='replace'))}")  # fmt: skip
        completed = subprocess.CompletedProcess(
            command, process.returncode, stdout.read_text(errors="replace"), stderr.read_text(errors="replace")
        )
    return completed, time.time() - start


def run_to_completion(
    command: list[str], cwd: Path, env: dict[str, str | None] | None = None
) -> subprocess.CompletedProcess:
    process, _ = run_command(command, cwd, env)
    assert process.returncode == 0, f"the run failed (exit code {process.returncode}):\n{last_lines(process.stderr)}"
    return process


@dataclass
class Run:
    output_dir: Path
    num_steps: int
    async_mode: bool

    @property
    def model_dir(self) -> Path:
        return self.output_dir / "model"

    def metrics(self) -> list[dict]:
        return read_metrics(str(self.output_dir / "metrics.jsonl"))

    def step_lines(self) -> list[dict]:
        """The one line per training step (eval-only lines, like the final eval's, have no learner version)."""
        return [line for line in self.metrics() if "policy_version/learner" in line]

    def eval_rows(self, policy_version: int) -> list[dict]:
        with open(self.output_dir / "samples.jsonl") as f:
            rows = [json.loads(line) for line in f]
        return [r for r in rows if r["table"] == "eval_completions" and r["policy_version"] == policy_version]


def eval_messages(eval_file: Path) -> dict[str, list[dict]]:
    with open(eval_file) as f:
        rows = [json.loads(line) for line in f]
    return {row["ground_truth"]: row["messages"] for row in rows}


def is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def hf_greedy(model, tokenizer, prompt: list[int]) -> list[int]:
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        output = model.generate(
            input_ids,
            max_new_tokens=RESPONSE_LENGTH,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    return output[0, input_ids.shape[1] :].tolist()


def explain_mismatch(model, tokenizer, prompt: list[int], vllm_ids: list[int], hf_ids: list[int]) -> str:
    """Where the two greedy outputs part, and the learner's top-2 logit margin there (a bf16 tie or a real bug?)."""
    first = next((i for i, (a, b) in enumerate(zip(vllm_ids, hf_ids)) if a != b), min(len(vllm_ids), len(hf_ids)))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + hf_ids[:first]])).logits[0, -1].float()
    top2 = logits.topk(2).values
    return (
        f"vLLM {tokenizer.decode(vllm_ids)!r} != transformers {tokenizer.decode(hf_ids)!r}; they part at token "
        f"{first}, where the learner's top-2 logit margin is {(top2[0] - top2[1]).item():.4f} "
        f"(max logit {top2[0].item():.3f})"
    )


def assert_saved_weights_are_the_learners(output_dir: Path) -> None:
    """The digest the run computed from the learner's in-memory weights at save time equals the saved file's."""
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["save_dtype"] == "float32" and AutoConfig.from_pretrained(output_dir / "model").dtype == torch.float32
    saved_weights = load_safetensors(str(output_dir / "model" / "model.safetensors"))
    assert {t.dtype for t in saved_weights.values()} == {torch.float32}
    assert weights_sha256(saved_weights) == summary["weights_sha256"], "the saved file is not the learner's weights"


def fresh_engine_greedy(model_dir: Path, eval_file: Path, rows: list[dict], workdir: Path,
                        adapter_dir: Path | None = None) -> tuple[list, list]:  # fmt: skip
    """(prompts, greedy completion ids) of `rows`' eval questions from a fresh vLLM engine on `model_dir`, in the
    learner's dtype, run in a subprocess (tests/support/vllm_greedy.py); with `adapter_dir`, `model_dir` is the base and the
    engine serves that LoRA adapter (vLLM's `LoRARequest`)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    messages = eval_messages(eval_file)
    prompts = [
        tokenizer.apply_chat_template(messages[row["ground_truth"]], add_generation_prompt=True, return_dict=False)
        for row in rows
    ]
    prompts_path = workdir / "prompts.json"
    prompts_path.write_text(json.dumps(prompts))
    process = run_to_completion(
        [sys.executable, str(TESTS_DIR / "support" / "vllm_greedy.py"), str(model_dir), str(prompts_path), str(RESPONSE_LENGTH),
         engine_dtype(), *([str(adapter_dir)] if adapter_dir is not None else [])],
        cwd=workdir,
    )  # fmt: skip
    return prompts, json.loads(process.stdout.strip().splitlines()[-1])
