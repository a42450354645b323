"""What the CPU recipe's saved model learns with a bf16 learner vs an fp32 one, over several seeds, on this machine.

    python scripts/benchmark/learner_dtype.py                                  # ppo_arithmetic_cpu.yaml, seeds 1 2 3
    python scripts/benchmark/learner_dtype.py --seeds 1 --variants float32 bfloat16_learner_logprobs
    python scripts/benchmark/learner_dtype.py --runs_dir runs   # keep the runs; one already evaluated there is reused

Why: vLLM computes in fp32 on CPUs, and where bf16 matmuls are fast the learner computes in bf16, so
the engine's logprobs of the sampled tokens and the learner's differ (`debug/vllm_vs_learner_logprob_diff_mean`).
With `--old_logprobs_from vllm` (the recipe's: no old-logprob forward) that gap enters every PPO ratio. The
variants:

- `float32`: the learner computes in fp32 like the engine: the ratio starts at exactly 1.
- `bfloat16`: the recipe as it is where the probe picks bf16: the gap enters every ratio.
- `bfloat16_learner_logprobs`: bf16, with the learner's own old logprobs (one forward more) and truncated importance
  sampling against the engine's: the ratio starts at 1 and the engine's rounding is corrected token by token.

Each run is the recipe (its own steps and evals); its saved `model/` is then evaluated by a fresh vLLM engine on all
81 questions of the embedded task (`python -m open_instruct.evaluate ... --temperature 1.0 --samples 16`). Prints a
table per run and the means per variant (wall_s: the run's own clock from its start to its last step, the evaluation
not included), and writes JSON.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = {
    "float32": ["--learner_compute_dtype", "float32"],
    "bfloat16": ["--learner_compute_dtype", "bfloat16"],
    "bfloat16_learner_logprobs": ["--learner_compute_dtype", "bfloat16", "--old_logprobs_from", "learner",
                                  "--truncated_importance_sampling_ratio_cap", "2"],  # fmt: skip
}


def train_and_evaluate(command: list[str], output_dir: str) -> dict:
    """Run the trainer `command` (writing `output_dir`), then evaluate its saved model by a fresh engine on all 81
    questions; a run already evaluated there is reused. Returns the evaluation's row; the run's wall-clock seconds
    go to output_dir/wall_s.json."""
    evaluation = os.path.join(output_dir, "evaluate.json")
    if os.path.exists(evaluation):
        print(f"[benchmark] reusing the evaluated run in {output_dir}", flush=True)
    else:
        print(f"[benchmark] {' '.join(command)}", flush=True)
        started = time.time()
        subprocess.run(command, check=True, cwd=REPO)
        with open(os.path.join(output_dir, "wall_s.json"), "w") as f:
            json.dump({"wall_s": time.time() - started}, f)
        subprocess.run([sys.executable, "-m", "open_instruct.evaluate", os.path.join(output_dir, "model"),
                        "--temperature", "1.0", "--samples", "16", "--output_json", evaluation], check=True, cwd=REPO)  # fmt: skip
    with open(evaluation) as f:
        return json.load(f)["results"][0]


def run(config: str, variant: str, seed: int, workdir: str) -> dict:
    output_dir = os.path.join(workdir, f"{variant}_seed{seed}")
    command = [sys.executable, "-m", "open_instruct.ppo_vllm_thread_ray_gtrl", config, *VARIANTS[variant],
               "--seed", str(seed), "--output_dir", output_dir]  # fmt: skip
    result = train_and_evaluate(command, output_dir)
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if "policy_version/learner" in r]
    gap = [r["debug/vllm_vs_learner_logprob_diff_mean"] for r in steps]
    return {
        "variant": variant, "seed": seed, "wall_s": steps[-1]["time/from_scratch"], "greedy_all": result["greedy_all"],
        "sampled_all": result["sampled_all"], "sampled_test": result["sampled_test"],
        "gap_first": gap[0], "gap_last": gap[-1], "gap_max_over_run": max(gap),
        "entropy_first": steps[0]["objective/entropy"], "entropy_last": steps[-1]["objective/entropy"],
        "s_per_step": statistics.mean(r["time/step"] for r in steps[1:]),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/train_configs/ppo_arithmetic_cpu.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--variants", nargs="+", default=["float32", "bfloat16"], choices=list(VARIANTS))
    parser.add_argument("--json", default="learner_dtype.json")
    parser.add_argument("--runs_dir", default=None, help="keep each run here (default: a temporary folder); a run "
                        "already evaluated there is summarized, not run again")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.runs_dir or tmp
        for seed in args.seeds:
            for variant in args.variants:
                rows.append(run(args.config, variant, seed, workdir))
                print(json.dumps(rows[-1]), flush=True)
    keys = ["wall_s", "s_per_step", "greedy_all", "sampled_all", "sampled_test", "gap_first", "gap_last",
            "entropy_first", "entropy_last"]  # fmt: skip
    print(f"\n{'variant':<28}{'seed':>5}" + "".join(f"{k:>14}" for k in keys))
    for row in rows:
        print(f"{row['variant']:<28}{row['seed']:>5}" + "".join(f"{row[k]:>14.3f}" for k in keys))
    means = {}
    for variant in args.variants:
        mine = [r for r in rows if r["variant"] == variant]
        means[variant] = {k: statistics.mean(r[k] for r in mine) for k in keys}
        print(f"{variant + ' (mean)':<33}" + "".join(f"{means[variant][k]:>14.3f}" for k in keys))
    with open(args.json, "w") as f:
        json.dump({"config": args.config, "rows": rows, "means": means}, f, indent=1)
    print(f"[benchmark] wrote {args.json}")


if __name__ == "__main__":
    main()
