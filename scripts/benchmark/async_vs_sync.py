"""Measure the step time of async vs sync PPO on the same settings, in one invocation.

    python scripts/benchmark/async_vs_sync.py                       # embedded SmolLM2, CPU/GPU config
    python scripts/benchmark/async_vs_sync.py --model_name_or_path tiny --total_episodes 48

Runs the trainer twice (subprocesses, same seed and flags, only --async_mode differs), then prints the
mean seconds per step split into generation / weight sync / scoring / training / learner wait, and the
ratio sync/async. The first step is left out of the means: it includes engine warm-up in both modes.
Extra flags go to both runs.
"""

import json
import os
import subprocess
import sys
import tempfile

PARTS = ["time/step", "time/generation", "time/weight_sync", "time/scoring", "time/training", "time/learner_wait"]


def default_config() -> str:
    try:
        gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
    except FileNotFoundError:
        gpu = False
    return f"configs/train_configs/ppo_arithmetic_{'gpu' if gpu else 'cpu'}.yaml"


def run(async_mode: bool, output_dir: str, extra: list[str]) -> list[dict]:
    command = [
        sys.executable, "-m", "open_instruct.ppo_vllm_thread_ray_gtrl", default_config(),
        "--total_episodes", "96", "--num_evals", "0",
        *extra, "--async_mode", str(async_mode).lower(), "--output_dir", output_dir,
    ]
    print(f"[benchmark] {' '.join(command)}", flush=True)
    subprocess.run(command, check=True)
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "time/step" in r]


def mean_parts(records: list[dict]) -> dict[str, float]:
    steady = records[1:] or records
    return {part: sum(r[part] for r in steady) / len(steady) for part in PARTS}


def main() -> None:
    extra = sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        results = {mode: mean_parts(run(mode == "async", os.path.join(tmp, mode), extra)) for mode in ("async", "sync")}
    print(f"\n{'seconds per step':>18} " + " ".join(f"{p.removeprefix('time/'):>12}" for p in PARTS))
    for mode, parts in results.items():
        print(f"{mode:>18} " + " ".join(f"{parts[p]:12.2f}" for p in PARTS))
    ratio = results["sync"]["time/step"] / results["async"]["time/step"]
    print(f"\nsync / async step time: {ratio:.2f}x")


if __name__ == "__main__":
    main()
