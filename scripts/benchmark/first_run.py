"""The first run (`ppo.sh` on a CPU): what each configuration's saved model learns per wall-clock second, over seeds.

    python scripts/benchmark/first_run.py                                   # every variant, seeds 1 2 3
    python scripts/benchmark/first_run.py --variants recipe fp32_full_critic --seeds 1
    python scripts/benchmark/first_run.py --runs_dir runs   # keep the runs; one already evaluated there is reused

Why: `ppo.sh` is a newcomer's first run and should take at most ten minutes on 2 cores of every CPU kind
while its saved model learns at least as much as the fp32 recipe's. The variants are flags on the CPU recipe
(`ppo_arithmetic_cpu.yaml`; `grpo` runs `grpo_arithmetic_cpu.yaml`), each spelled out in full so that a later
recipe change does not change what a variant means:

- `fp32_full_critic`: the recipe before the first-run speedups: an fp32 learner, the fp32 engine's logprobs as PPO's old ones, a
  value model of all 30 layers.
- `bf16_learner_logprobs`: a bf16 learner with its own old logprobs (one forward more) and the truncated importance
  weight to the engine's (what `--old_logprobs_from auto` picks where the probe picks bf16).
- `fp32_small_critic`: the critic cut to its first 8 layers (`--value_model_num_layers 8`), with mid-run evals.
- `auto_small_critic`: the same with the dtype and the old logprobs chosen at run time (`auto`: bf16 and the
  learner's own old logprobs where the probe finds bf16 fast).
- `small_critic_14_steps`: the recipe from the critic cut until 18 steps: `fp32_small_critic` with cheaper evals
  (8 samples a prompt at the start and the end, greedy and 2 samples in the 3 evals between), 14 steps.
- `small_critic_18_steps`: the same for 18 steps of 32 responses (576 episodes).
- `small_critic_lr15`: 14 steps at a learning rate of 1.5e-5 instead of 1e-5.
- `recipe`: `ppo_arithmetic_cpu.yaml` as shipped (`small_critic_18_steps`).
- `grpo`: no value model at all (`grpo.sh`'s recipe).

Each run's saved `model/` is evaluated by a fresh vLLM engine on all 81 questions of the embedded task (`python -m
open_instruct.evaluate ... --temperature 1.0 --samples 16`). Wall time is the trainer's command from start to exit
(engine start, first and final eval, save: `ppo.sh` without its install check). Prints a row per run and the mean,
min and collapses per variant, writes JSON and a plot of each run's sampled eval correct rate against wall-clock time.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

from learner_dtype import train_and_evaluate  # this folder is on sys.path when the script runs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PPO_CPU = "configs/train_configs/ppo_arithmetic_cpu.yaml"
GRPO_CPU = "configs/train_configs/grpo_arithmetic_cpu.yaml"
FP32 = ["--learner_compute_dtype", "float32", "--old_logprobs_from", "vllm"]
AUTO = ["--learner_compute_dtype", "auto", "--old_logprobs_from", "auto"]
ONE_EVAL = ["--num_evals", "1", "--eval_samples_per_prompt", "16"]
CHEAP_EVALS = ["--num_evals", "4", "--mid_run_eval_samples_per_prompt", "2", "--eval_samples_per_prompt", "8"]
SMALL_CRITIC = [*FP32, "--value_model_num_layers", "8", *CHEAP_EVALS]
MID_RUN_EVALS = ["--num_evals", "4", "--mid_run_eval_samples_per_prompt", "4", "--eval_samples_per_prompt", "16"]
VARIANTS = {
    "fp32_full_critic": (PPO_CPU, [*FP32, "--value_model_num_layers", "0", *ONE_EVAL]),
    "bf16_learner_logprobs": (PPO_CPU, ["--learner_compute_dtype", "bfloat16", "--old_logprobs_from", "learner",
                                        "--truncated_importance_sampling_ratio_cap", "2", "--value_model_num_layers",
                                        "0", *ONE_EVAL]),  # fmt: skip
    "fp32_small_critic": (PPO_CPU, [*FP32, "--value_model_num_layers", "8", *MID_RUN_EVALS]),
    "auto_small_critic": (PPO_CPU, [*AUTO, "--value_model_num_layers", "8", *MID_RUN_EVALS]),
    "small_critic_14_steps": (PPO_CPU, [*SMALL_CRITIC, "--total_episodes", "448", "--learning_rate", "1e-5"]),
    "small_critic_18_steps": (PPO_CPU, [*SMALL_CRITIC, "--total_episodes", "576", "--learning_rate", "1e-5"]),
    "small_critic_lr15": (PPO_CPU, [*SMALL_CRITIC, "--total_episodes", "448", "--learning_rate", "1.5e-5"]),
    "recipe": (PPO_CPU, []),  # the recipe as shipped (small_critic_18_steps)
    "grpo": (GRPO_CPU, [*FP32, *ONE_EVAL]),
}
BASE_SAMPLED = 0.306  # the base model's sampled correct rate on all 81 questions: below it, the run collapsed


def run(variant: str, seed: int, workdir: str) -> dict:
    config, flags = VARIANTS[variant]
    output_dir = os.path.join(workdir, f"{variant}_seed{seed}")
    command = [sys.executable, "-m", "open_instruct.ppo_vllm_thread_ray_gtrl", config, *flags, "--seed", str(seed),
               "--output_dir", output_dir, "--overwrite_output_dir", "true"]  # fmt: skip
    train_and_evaluate(command, output_dir)
    return summarize(variant, seed, output_dir)


def summarize(variant: str, seed: int, output_dir: str) -> dict:
    """One run's row: wall, steady step, the saved model's rates, and what the mid-run evals cost."""
    with open(os.path.join(output_dir, "evaluate.json")) as f:
        result = json.load(f)["results"][0]
    with open(os.path.join(output_dir, "wall_s.json")) as f:
        wall = json.load(f)["wall_s"]
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    steps = [line for line in lines if "time/step" in line]
    # A mid-run eval of policy v runs in the engine before the batch the learner waits for at the end of step v + 1
    # (async mode); its metrics are logged with step v + 2.
    mid_run = [line["step"] - 1 for line in steps if 0 < line.get("eval/policy_version", 0)]
    steady = statistics.median(line["time/step"] for line in steps[1:] if line["step"] not in mid_run)
    return {
        "variant": variant, "seed": seed, "wall_s": wall, "s_per_step": steady,
        "greedy_all": result["greedy_all"], "sampled_all": result["sampled_all"],
        "sampled_test": result["sampled_test"], "collapsed": result["sampled_all"] < BASE_SAMPLED,
        # the steps with a mid-run eval, over a steady step each: what those evals cost the run
        "mid_run_eval_s": sum(line["time/step"] - steady for line in steps if line["step"] in mid_run),
        # the final eval's line has no clock of its own: it ends its eval's seconds after the last step
        "evals": [(line.get("time/from_scratch", steps[-1]["time/from_scratch"] + line["time/eval_generation"]),
                   line["eval/sampled_correct_rate"]) for line in lines if "eval/sampled_correct_rate" in line],
    }  # fmt: skip


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 4.5))
    colors = {}
    for row in rows:
        labelled = row["variant"] in colors
        color = colors.setdefault(row["variant"], f"C{len(colors)}")
        seconds, rates = zip(*row["evals"]) if row["evals"] else ((), ())
        axes.plot(seconds, rates, "o-", color=color, alpha=0.8, label=None if labelled else row["variant"])
    axes.set_xlabel("seconds from the run's start")
    axes.set_ylabel("eval sampled correct rate (20 held-out)")
    axes.set_title("The run's own evals (20 held-out questions, sampled at T=1.0), one line per seed")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"[benchmark] wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--json", default="first_run.json")
    parser.add_argument("--plot", default="first_run.png")
    parser.add_argument("--runs_dir", default=None, help="keep each run here (default: a temporary folder); a run "
                        "already evaluated there is summarized, not run again")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.runs_dir or tmp
        for seed in args.seeds:
            for variant in args.variants:
                rows.append(run(variant, seed, workdir))
    keys = ["wall_s", "s_per_step", "greedy_all", "sampled_all", "sampled_test", "mid_run_eval_s"]
    print(f"\n{'variant':<24}{'seed':>5}" + "".join(f"{k:>15}" for k in keys))
    for row in rows:
        print(f"{row['variant']:<24}{row['seed']:>5}" + "".join(f"{row[k]:>15.3f}" for k in keys))
    summary = {}
    for variant in args.variants:
        mine = [r for r in rows if r["variant"] == variant]
        summary[variant] = {**{k: statistics.mean(r[k] for r in mine) for k in keys},
                            "min_greedy": min(r["greedy_all"] for r in mine),
                            "min_sampled": min(r["sampled_all"] for r in mine),
                            "collapsed": sum(r["collapsed"] for r in mine), "seeds": len(mine)}  # fmt: skip
        print(f"{variant + ' (mean)':<29}" + "".join(f"{summary[variant][k]:>15.3f}" for k in keys)
              + f"   min greedy {summary[variant]['min_greedy']:.3f}, min sampled {summary[variant]['min_sampled']:.3f},"
              f" collapsed {summary[variant]['collapsed']}/{len(mine)}")  # fmt: skip
    with open(args.json, "w") as f:
        json.dump({"rows": rows, "summary": summary}, f, indent=1)
    print(f"[benchmark] wrote {args.json}")
    plot(rows, args.plot)


if __name__ == "__main__":
    main()
