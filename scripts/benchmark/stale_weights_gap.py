"""The engine-vs-learner logprob gap of a working weight sync against a skipped one, on the settings of check_gpu.py's
`single_gpu_run` (the single-GPU debug recipe in sync mode), run on this CPU with the embedded model: the numbers the
check's bound GAP_BOUND_STALE_WEIGHTS stands on.

    python scripts/benchmark/stale_weights_gap.py                      # stale at 3 learning rates, synced at the last
    python scripts/benchmark/stale_weights_gap.py --learning_rates 3e-5 --json gaps.json

Each run is 3 PPO steps of configs/train_configs/ppo_arithmetic_gpu.yaml (its epochs, minibatches, schedule and
temperature) with a smaller rollout (8 prompts x 4), fp32 engine and learner (so a synced engine agrees to rounding),
--async_mode false (the engine samples with the weights the learner computes with: any gap past rounding is the
sync's), the gap's guard off (--max_vllm_logprob_diff 0). "stale" runs tests/support/inject_fault.py skip_weight_sync: the engine
keeps its start weights while the learner trains. Prints `debug/vllm_vs_learner_logprob_diff_mean` per step.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETTINGS = [
    "configs/train_configs/ppo_arithmetic_gpu.yaml", "--model_name_or_path", "embedded", "--async_mode", "false",
    "--local_rollout_batch_size", "8", "--per_device_train_batch_size", "16", "--response_length", "64",
    "--max_token_length", "320", "--total_episodes", "96", "--num_evals", "0", "--max_vllm_logprob_diff", "0",
    "--learner_compute_dtype", "float32", "--vllm_dtype", "float32",
]  # fmt: skip


def gaps_of_run(stale: bool, learning_rate: str, folder: str) -> tuple[list[float], str]:
    """The run's gap per step, and how it ended ("exit 0", or the last line of a run its own guards stopped: a stale
    engine at a high learning rate trips the divergence guard once its gap is logged)."""
    output = os.path.join(folder, f"{'stale' if stale else 'synced'}_{learning_rate}")
    entry = [os.path.join(REPO, "tests", "support", "inject_fault.py"), "skip_weight_sync"] if stale else \
        ["-m", "open_instruct.ppo_vllm_thread_ray_gtrl"]  # fmt: skip
    command = [sys.executable, *entry, *SETTINGS, "--learning_rate", learning_rate, "--output_dir", output]
    env = {**os.environ, "PYTHONPATH": REPO, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    process = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    metrics = os.path.join(output, "metrics.jsonl")
    if process.returncode != 0 and not os.path.exists(metrics):
        raise SystemExit(f"run failed (exit {process.returncode}): {process.stderr[-2000:]}")
    with open(metrics) as f:
        steps = [json.loads(line) for line in f]
    key = "debug/vllm_vs_learner_logprob_diff_mean"
    ended = "exit 0" if process.returncode == 0 else process.stderr.strip().splitlines()[-1]
    return [m[key] for m in steps if key in m], ended


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learning_rates", nargs="+", default=["3e-6", "3e-5", "1e-4"])
    parser.add_argument("--json")
    options = parser.parse_args()
    results = []
    # A synced fp32 engine agrees to rounding at any learning rate: one synced run, at the largest.
    runs = [(False, options.learning_rates[-1])] + [(True, learning_rate) for learning_rate in options.learning_rates]
    with tempfile.TemporaryDirectory() as folder:
        for stale, learning_rate in runs:
            gaps, ended = gaps_of_run(stale, learning_rate, folder)
            results.append({"learning_rate": learning_rate, "sync": "skipped" if stale else "working", "gaps": gaps,
                             "ended": ended})  # fmt: skip
            print(f"lr {learning_rate}, sync {results[-1]['sync']}: gap per step "
                  f"{', '.join(f'{gap:.2e}' for gap in gaps)} ({ended})", flush=True)  # fmt: skip
    if options.json:
        with open(options.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
