"""Sync vs async (--async_steps K = 1, 2, 4), with and without --inflight_updates, on a workload with a long tail of
response lengths and the engine and the learner on cores of their own: one invocation, one machine, one table.

    python scripts/benchmark/async_vs_sync.py                          # the default workload below, all modes
    python scripts/benchmark/async_vs_sync.py --modes sync k2_inflight --steps 6
    python scripts/benchmark/async_vs_sync.py --steps 4 -- --model_name_or_path tiny   # flags after -- go to every run
    python scripts/benchmark/async_vs_sync.py --runs_dir runs   # keep the runs; a mode already completed there is reused

Each mode is one trainer run (a subprocess, the same seed and flags). Placement: `--vllm_cpu_cores 1` gives the
in-process engine's thread the last core and the learner the others, as a cluster gives engines and learners devices
of their own; "sync, all cores" (both on every core, one after the other) is printed beside it for reference.

The workload (`WORKLOAD`): GRPO on the 61 embedded arithmetic questions with 8 word problems mixed in, whose
step-by-step answers run to the length limit: most responses are a dozen tokens and a few are 10x longer, so a
batch generated on its own waits for its longest answers (the long tail; docs/speed.md). The eval is the 20 held-out
arithmetic questions, at the start and the end. The learner takes its old
logprobs itself in every mode (the same learner work; K > 1 needs them for its correction) and packs its micro-batches.

Per mode, over the steps after the first two (the pipeline fills): seconds per step, trained responses per second,
the engine's and the learner's idle fractions (perf/engine_idle_fraction: waiting for requests or for the learner to
take a rollout; perf/learner_idle_fraction: waiting for a rollout), the staleness of the trained tokens, and the
training correct rate against wall-clock seconds (the learning curve: speed must not be bought with learning), with
the sampled eval of the final policy. Writes JSON and a plot of the curves.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKLOAD = [
    "configs/train_configs/grpo_arithmetic_cpu.yaml",
    "--dataset_mixer_list", "embedded_arithmetic", "1.0", "embedded_word_problems", "8",
    "--dataset_mixer_eval_list", "embedded_arithmetic", "1.0",
    "--response_length", "192", "--max_token_length", "448", "--max_prompt_token_length", "256",
    "--local_rollout_batch_size", "8", "--number_samples_per_prompt", "4", "--num_mini_batches", "2",
    "--old_logprobs_from", "learner", "--max_tokens_per_micro_batch", "2048",
    "--num_evals", "1", "--eval_samples_per_prompt", "4",
]  # fmt: skip
SPLIT = ["--vllm_cpu_cores", "1"]
MODES = {
    "sync_all_cores": ("sync, all cores (reference)", ["--async_mode", "false"]),
    "sync": ("sync", ["--async_mode", "false", *SPLIT]),
    "k1": ("K=1", ["--async_steps", "1", *SPLIT]),
    "k2": ("K=2", ["--async_steps", "2", *SPLIT]),
    "k4": ("K=4", ["--async_steps", "4", *SPLIT]),
    "k2_inflight": ("K=2, in-flight updates", ["--async_steps", "2", "--inflight_updates", "true", *SPLIT]),
    "k4_inflight": ("K=4, in-flight updates", ["--async_steps", "4", "--inflight_updates", "true", *SPLIT]),
}
COLUMNS = ["s/step", "responses/s", "engine idle", "learner idle", "staleness", "train correct", "eval sampled", "wall s"]


def completed_rows(output_dir: str, steps: int) -> list[dict] | None:
    """The metrics of a run in `output_dir` that completed `steps` steps (a --runs_dir kept from before), else None."""
    try:
        with open(os.path.join(output_dir, "summary.json")) as f:
            if json.load(f).get("status") != "completed":
                return None
        with open(os.path.join(output_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    except (OSError, ValueError):
        return None
    return rows if sum("policy_version/learner" in r for r in rows) == steps else None


def run_mode(flags: list[str], steps: int, output_dir: str, extra: list[str]) -> list[dict]:
    responses_per_step = 32
    rows = completed_rows(output_dir, steps)
    if rows is not None:
        print(f"[benchmark] reusing the completed run in {output_dir}", flush=True)
        return rows
    command = [sys.executable, "-m", "open_instruct.grpo_vllm_thread_ray_gtrl", *WORKLOAD,
               "--total_episodes", str(steps * responses_per_step), *flags, *extra, "--output_dir", output_dir]  # fmt: skip
    print(f"[benchmark] {' '.join(command)}", flush=True)
    subprocess.run(command, check=True, cwd=REPO)
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summarize(rows: list[dict]) -> dict:
    steps = [r for r in rows if "policy_version/learner" in r]
    steady = steps[2:] or steps
    step_s = mean([r["time/step"] for r in steady])
    responses = steps[0]["episode"] / steps[0]["step"]
    evals = [r for r in rows if "eval/sampled_correct_rate" in r]
    return {
        "s/step": step_s,
        "responses/s": responses / step_s,
        "engine idle": mean([r.get("perf/engine_idle_fraction", float("nan")) for r in steady]),
        "learner idle": mean([r["perf/learner_idle_fraction"] for r in steady]),
        "staleness": mean([r["policy_version/staleness_mean"] for r in steady]),
        "train correct": mean([r["objective/verifiable_correct_rate"] for r in steps[-3:]]),
        "eval sampled": evals[-1]["eval/sampled_correct_rate"] if evals else float("nan"),
        "wall s": steps[-1]["time/from_scratch"],
        "curve": [(r["time/from_scratch"], r["objective/verifiable_correct_rate"]) for r in steps],
    }


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for mode, result in results.items():
        seconds, correct = zip(*result["curve"])
        ax.plot(seconds, correct, marker="o", markersize=3, label=MODES[mode][0])
    ax.set_xlabel("wall-clock seconds from the start of the run")
    ax.set_ylabel("training correct rate (the step's responses)")
    ax.set_title("Learning per wall-clock second, by mode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default="async_vs_sync.json")
    parser.add_argument("--plot", default="async_vs_sync.png")
    parser.add_argument("--runs_dir", default=None, help="keep each mode's run here (default: a temporary folder); "
                        "a mode that already completed there is summarized, not run again")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        runs_dir = args.runs_dir or tmp
        for mode in args.modes:
            results[mode] = summarize(run_mode(MODES[mode][1], args.steps, os.path.join(runs_dir, mode), extra))
    print(f"\n{'mode':<30}" + "".join(f"{c:>14}" for c in COLUMNS))
    for mode, result in results.items():
        print(f"{MODES[mode][0]:<30}" + "".join(f"{result[c]:>14.3f}" for c in COLUMNS))
    if "sync" in results:
        base = results["sync"]["responses/s"]
        print("\nthroughput over sync (same placement): " + ", ".join(
            f"{MODES[m][0]} {r['responses/s'] / base:.2f}x" for m, r in results.items() if m != "sync"))  # fmt: skip
    with open(args.json, "w") as f:
        json.dump({"workload": WORKLOAD, "extra": extra, "steps": args.steps, "modes": results}, f, indent=1)
    plot(results, args.plot)
    print(f"[benchmark] wrote {args.json} and {args.plot}")


if __name__ == "__main__":
    main()
