"""The learner's useful work per second on one real rollout, by phase: tokens/s, padding fraction, FLOPs utilization
and peak memory, padded and (once packing exists) packed.

    python scripts/benchmark/learner_work.py                     # the mixed-length word problems recipe
    python scripts/benchmark/learner_work.py --config configs/train_configs/ppo_arithmetic_cpu.yaml
    python scripts/benchmark/learner_work.py --max_tokens_per_micro_batch 4096   # adds a packed row

One rollout of the config's first prompts is sampled once by the real vLLM engine (the embedded model). Then a fresh
learner per row runs `make_experience` and `train` on that same rollout, and its own work accounting (the step's
`perf/*` metrics, open_instruct/run/flops.py) gives, per phase (experience: the no-grad forwards before the update;
train: the PPO epochs' forwards and backwards and optimizer steps):

- tokens/s: the rollout's real prompt + response tokens over the phase's seconds;
- padding: padded / total token slots of the phase's passes;
- util: useful FLOP/s over the peak measured at start in the compute dtype (run/devices.py);
- peak MiB: the process's peak RSS during the phase above its RSS before it (VmHWM, reset per phase), with glibc's
  MALLOC_MMAP_THRESHOLD_ at 64 KiB so that freed tensors go back to the system and each phase's peak is its own.

Rows: `padded` (today's fixed-row micro-batches); `packed` when --max_tokens_per_micro_batch is given (the flag goes
through to the learner; a tree without it reports the row as not available). Prints a table and writes JSON.
"""

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MMAP_THRESHOLD = "65536"
DEFAULT_CONFIG = "configs/train_configs/ppo_word_problems_cpu.yaml"


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:"))


def reset_peak_rss() -> int:
    """Reset VmHWM to the current RSS (Linux: clear_refs 5); returns that RSS in KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_kib("VmRSS")


def phase_row(work, seconds: float, peak: float, peak_mib: float) -> dict:
    metrics = work.metrics(peak)
    return {
        "seconds": seconds,
        "real_tokens": work.real_tokens,
        "token_slots": work.passes_token_slots,
        "tflops": work.flops / 1e12,
        "tokens_per_second": work.real_tokens / seconds,
        "padding_fraction": metrics["perf/padding_fraction"],
        "flops_utilization": work.flops / seconds / peak,
        "peak_mib": peak_mib,
    }


def run_learner(argv: list[str], path, tokenizer, prompts, completions, stop_token_ids) -> dict:
    """A fresh learner of `argv` through make_experience and train on the rollout: each phase's work and memory."""
    from open_instruct.learner.algorithms import learner_class
    from open_instruct.rewards.manager import RewardManager
    from open_instruct.run import devices
    from open_instruct.run.args import compute_batch_sizes, parse_args
    from open_instruct.run.flops import LearnerWork

    args = parse_args(argv)
    torch.manual_seed(args.run.seed)
    learner = learner_class(args.ppo.algorithm)(args, compute_batch_sizes(args), tokenizer, path, stop_token_ids)
    peak, peak_source = devices.peak_flops_per_second(learner.device, learner.compute_dtype)
    gc.collect()
    before = reset_peak_rss()
    start = time.perf_counter()
    experience, _, _ = learner.make_experience(prompts, completions, RewardManager(args.reward))
    experience_seconds = time.perf_counter() - start
    experience_mib = (rss_kib("VmHWM") - before) / 1024
    experience_work = copy.copy(learner.work)
    before = reset_peak_rss()
    start = time.perf_counter()
    step_metrics = learner.train(experience)
    train_seconds = time.perf_counter() - start
    train_mib = (rss_kib("VmHWM") - before) / 1024
    train_work = LearnerWork(
        real_tokens=experience_work.real_tokens,
        passes_real_tokens=learner.work.passes_real_tokens - experience_work.passes_real_tokens,
        passes_token_slots=learner.work.passes_token_slots - experience_work.passes_token_slots,
        flops=learner.work.flops - experience_work.flops,
    )
    result = {
        "compute_dtype": devices.dtype_name(learner.compute_dtype),
        "peak_tflops": peak / 1e12,
        "peak_source": peak_source,
        "experience": phase_row(experience_work, experience_seconds, peak, experience_mib),
        "train": phase_row(train_work, train_seconds, peak, train_mib),
        "step": phase_row(learner.work, experience_seconds + train_seconds, peak, max(experience_mib, train_mib)),
        "logged": {key: value for key, value in step_metrics.items() if key.startswith("perf/")},
    }
    del learner, experience
    gc.collect()
    return result


def main() -> None:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:  # glibc reads it at start: run again with it
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD})
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--max_tokens_per_micro_batch", type=int, default=0,
                        help="adds a packed row with this token budget (0: padded only)")  # fmt: skip
    parser.add_argument("--json", default="learner_work.json")
    options, extra = parser.parse_known_args()

    from learner_phases import sample_rollout

    from open_instruct.run.args import ConfigError, compute_batch_sizes, parse_args

    base_argv = [options.config, "--num_evals", "0", *extra]
    base = parse_args(base_argv)
    start = time.perf_counter()
    path, tokenizer, prompts, completions, stop_token_ids = sample_rollout(base, compute_batch_sizes(base))
    lengths = sorted(len(c.token_ids) for c in completions)
    seconds = time.perf_counter() - start
    print(f"[bench] rollout: {len(completions)} responses of {lengths[0]}..{lengths[-1]} tokens (median "
          f"{statistics.median(lengths):g}), sampled in {seconds:.0f}s; {options.config}", flush=True)
    rollout = (path, tokenizer, prompts, completions, stop_token_ids)
    print("[bench] warm-up learner on 4 responses (not timed)", flush=True)
    run_learner(base_argv, path, tokenizer, prompts, completions[:4], stop_token_ids)

    rows = [("padded", base_argv)]
    if options.max_tokens_per_micro_batch:
        rows.append(("packed", [*base_argv, "--max_tokens_per_micro_batch", str(options.max_tokens_per_micro_batch)]))
    results = {"config": options.config, "response_lengths": lengths, "torch_threads": torch.get_num_threads(),
               "rows": {}}  # fmt: skip
    for name, argv in rows:
        print(f"[bench] {name}", flush=True)
        try:
            results["rows"][name] = run_learner(argv, *rollout)
        except ConfigError as error:
            print(f"[bench] {name}: not available in this tree ({error})", flush=True)

    print(f"\n{'row / phase':<20}{'seconds':>9}{'tokens/s':>10}{'padding':>9}{'TFLOP':>8}{'util':>8}{'peak MiB':>10}")
    for name, row in results["rows"].items():
        for phase in ("experience", "train", "step"):
            r = row[phase]
            print(f"{name + ' ' + phase:<20}{r['seconds']:9.1f}{r['tokens_per_second']:10.1f}"
                  f"{r['padding_fraction']:9.3f}{r['tflops']:8.2f}{r['flops_utilization']:8.3f}{r['peak_mib']:10.0f}")
        print(f"  ({row['compute_dtype']}, peak {row['peak_tflops']:.3f} TFLOP/s: {row['peak_source']})")
    with open(options.json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"[bench] wrote {options.json}")


if __name__ == "__main__":
    main()
