"""Learner seconds per response by phase, before and after each switch that cuts learner work, in one invocation.

    python scripts/benchmark/learner_phases.py                      # the CPU (or GPU) debug config's batch
    python scripts/benchmark/learner_phases.py --repeats 2 --json learner_phases.json

One real rollout is sampled once with vLLM from the config's prompts (the CPU debug recipe: 8 prompts x 4
samples, 32 response tokens at temperature 0.7, with the engine's logprobs). Then, for each row of the table, a
fresh learner (the config plus that row's flags) runs `make_experience` and `train` on that same rollout, and
the learner's own `time/*` metrics give the phases:

- old_logprob: the policy's no-grad forward for the old logprobs (skipped with --old_logprobs_from vllm);
- ref_logprob: the reference model's forward (skipped with --beta 0);
- value: the value model's forward for the old values (PPO only);
- experience: all of `make_experience` (the above plus scoring and advantages);
- train: the PPO epochs (policy and value forward + backward and the optimizer steps).

Rows are cumulative: each adds one switch to the row above (the bf16 row forces bf16 compute; the next one lets
the start-up probe choose, as `auto` does in a run). The last row is GRPO on the same rollout (no value model).
The first learner of the invocation warms up (oneDNN kernels, the allocator) before the table's rows, so the
first row does not pay for it. Prints a table (seconds per response, and the ratio to the first row), JSON.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

ROWS = [
    ("baseline: learner old logprobs, beta 0.05, fp32", ["--old_logprobs_from", "learner", "--beta", "0.05",
                                                         "--learner_compute_dtype", "float32"]),  # fmt: skip
    ("+ --old_logprobs_from vllm", ["--old_logprobs_from", "vllm", "--beta", "0.05", "--learner_compute_dtype",
                                    "float32"]),  # fmt: skip
    ("+ --beta 0 (no reference model)", ["--old_logprobs_from", "vllm", "--beta", "0", "--learner_compute_dtype",
                                         "float32"]),  # fmt: skip
    ("+ --learner_compute_dtype bfloat16 (forced)", ["--old_logprobs_from", "vllm", "--beta", "0",
                                                    "--learner_compute_dtype", "bfloat16"]),  # fmt: skip
    ("+ --learner_compute_dtype auto (probe)", ["--old_logprobs_from", "vllm", "--beta", "0",
                                               "--learner_compute_dtype", "auto"]),  # fmt: skip
    ("GRPO (no value model), with auto", ["--algorithm", "grpo", "--old_logprobs_from", "vllm", "--beta", "0",
                                          "--learner_compute_dtype", "auto"]),  # fmt: skip
]
PHASES = {
    "old_logprob": "time/old_logprob_forward",
    "ref_logprob": "time/ref_logprob_forward",
    "value": "time/value_forward",
    "experience": "experience",
    "train": "train",
}


def default_config() -> str:
    kind = "gpu" if torch.cuda.is_available() else "cpu"
    return f"configs/train_configs/ppo_arithmetic_{kind}.yaml"


def sample_rollout(args, sizes):
    """One rollout of the config's first prompts, sampled by a fresh vLLM engine (freed before the learners load)."""
    from open_instruct.data.batches import prompt_batch
    from open_instruct.data.embedded import resolve_model_path
    from open_instruct.data.prompt_dataset import build_prompt_datasets
    from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
    from open_instruct.generation import vllm_engine

    path = resolve_model_path(args.model.model_name_or_path)
    tokenizer = load_tokenizer(path)
    train_dataset, _ = build_prompt_datasets(args.data, tokenizer)
    prompts = prompt_batch(train_dataset, list(range(sizes.prompts_per_step)), tokenizer)
    stop_token_ids = stop_token_ids_for(tokenizer, args.gen.stop_token)
    llm = vllm_engine.create_engine(
        vllm_engine.EngineConfig(path, max_model_len=args.gen.max_token_length, seed=args.run.seed)
    )
    params = vllm_engine.sampling_params(
        n=args.ppo.number_samples_per_prompt,
        temperature=args.gen.temperature,
        max_tokens=args.gen.response_length,
        stop_token_ids=stop_token_ids,
        seed=args.run.seed,
        with_logprobs=True,
    )
    completions = vllm_engine.generate(llm, prompts.token_ids, params)
    del llm
    gc.collect()
    return path, tokenizer, prompts, completions, stop_token_ids


def time_row(argv: list[str], path, tokenizer, prompts, completions, stop_token_ids) -> dict[str, float]:
    from open_instruct.learner.algorithms import learner_class
    from open_instruct.rewards.manager import RewardManager
    from open_instruct.run.args import compute_batch_sizes, parse_args

    args = parse_args(argv)
    torch.manual_seed(args.run.seed)
    learner = learner_class(args.ppo.algorithm)(args, compute_batch_sizes(args), tokenizer, path, stop_token_ids)
    start = time.perf_counter()
    experience, metrics, _ = learner.make_experience(prompts, completions, RewardManager(args.reward))
    metrics["experience"] = time.perf_counter() - start
    start = time.perf_counter()
    learner.train(experience)
    metrics["train"] = time.perf_counter() - start
    del learner, experience
    gc.collect()
    return {phase: metrics.get(key, 0.0) for phase, key in PHASES.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=default_config())
    parser.add_argument("--repeats", type=int, default=2, help="learners per row (the median is reported)")
    parser.add_argument("--json", default="learner_phases.json")
    options, extra = parser.parse_known_args()

    from open_instruct.run.args import compute_batch_sizes, parse_args

    base_argv = [options.config, "--num_evals", "0", *extra]
    base = parse_args(base_argv)
    path, tokenizer, prompts, completions, stop_token_ids = sample_rollout(base, compute_batch_sizes(base))
    responses = len(completions)
    tokens = sum(len(c.token_ids) for c in completions)
    print(f"[bench] rollout: {responses} responses, {tokens} response tokens; config {options.config}", flush=True)

    results = {"config": options.config, "responses": responses, "response_tokens": tokens, "rows": []}
    print("[bench] warm-up learner (not timed)", flush=True)
    time_row([*base_argv, *ROWS[0][1]], path, tokenizer, prompts, completions, stop_token_ids)
    for name, flags in ROWS:
        runs = []
        for _ in range(options.repeats):
            print(f"[bench] {name}", flush=True)
            runs.append(time_row([*base_argv, *flags], path, tokenizer, prompts, completions, stop_token_ids))
        seconds = {phase: statistics.median(run[phase] for run in runs) for phase in PHASES}
        total = seconds["experience"] + seconds["train"]
        results["rows"].append({"row": name, "flags": flags, "seconds": seconds, "total_seconds": total,
                                "seconds_per_response": total / responses})  # fmt: skip

    first = results["rows"][0]["total_seconds"]
    header = f"{'learner, s per response':<44}" + "".join(f"{phase:>12}" for phase in PHASES)
    print(f"\n{header}{'total':>10}{'speed-up':>10}")
    for row in results["rows"]:
        cells = "".join(f"{row['seconds'][phase] / responses:12.3f}" for phase in PHASES)
        print(f"{row['row']:<44}{cells}{row['seconds_per_response']:10.3f}{first / row['total_seconds']:9.2f}x")
    print(f"(torch threads: {torch.get_num_threads()}; one rollout of {responses} responses for every row)")
    with open(options.json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"[bench] wrote {options.json}")


if __name__ == "__main__":
    main()
