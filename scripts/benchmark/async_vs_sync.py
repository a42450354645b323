"""Measure the step time of async vs sync PPO on the same settings, in one invocation.

    python scripts/benchmark/async_vs_sync.py                       # embedded SmolLM2, CPU/GPU config
    python scripts/benchmark/async_vs_sync.py --model_name_or_path tiny --total_episodes 48

Runs the trainer twice (subprocesses, same seed and flags, only --async_mode differs), then prints the
mean seconds per step split into generation / weight sync / scoring / training / learner wait, the ratio
sync/async, and each mode's overlap efficiency max(T_gen, T_learner) / T_step, where T_learner = scoring +
training: 1.0 means the step takes only as long as its slower half (generation fully hidden behind the
learner, or the reverse); sync mode, which runs them one after the other, is near min/sum + max/sum below 1.
The first step is left out of the means: it includes engine warm-up in both modes. Extra flags go to both
runs; `--json PATH` (default async_vs_sync.json) is where the results go.
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


def overlap_efficiency(parts: dict[str, float]) -> float:
    learner = parts["time/scoring"] + parts["time/training"]
    return max(parts["time/generation"], learner) / parts["time/step"]


def main() -> None:
    extra = sys.argv[1:]
    json_path = "async_vs_sync.json"
    if "--json" in extra:
        at = extra.index("--json")
        json_path = extra[at + 1]
        extra = extra[:at] + extra[at + 2 :]
    with tempfile.TemporaryDirectory() as tmp:
        results = {mode: mean_parts(run(mode == "async", os.path.join(tmp, mode), extra)) for mode in ("async", "sync")}
    print(f"\n{'seconds per step':>18} " + " ".join(f"{p.removeprefix('time/'):>12}" for p in PARTS) + "     overlap")
    for mode, parts in results.items():
        parts["overlap_efficiency"] = overlap_efficiency(parts)
        print(f"{mode:>18} " + " ".join(f"{parts[p]:12.2f}" for p in PARTS) + f"{parts['overlap_efficiency']:12.2f}")
    ratio = results["sync"]["time/step"] / results["async"]["time/step"]
    print(f"\nsync / async step time: {ratio:.2f}x; overlap efficiency max(T_gen, T_learner) / T_step: "
          f"async {results['async']['overlap_efficiency']:.2f}, sync {results['sync']['overlap_efficiency']:.2f}")
    with open(json_path, "w") as f:
        json.dump({"flags": extra, "sync_over_async_step_time": ratio, **results}, f, indent=2)
    print(f"[benchmark] wrote {json_path}")


if __name__ == "__main__":
    main()
