"""Peak memory and seconds of one learner step at long responses, with the vocabulary projection whole or in chunks.

    python scripts/benchmark/logprob_chunks.py                         # embedded SmolLM2-135M, 1024-token responses
    python scripts/benchmark/logprob_chunks.py --response_tokens 512 --chunk_sizes 0 1024 256 --json chunks.json

Each row runs in a fresh process: a single-process PPOLearner on the embedded model (fp32 compute: the tensors whose
size the chunks change are fp32 either way) takes `make_experience` and `train` on one synthetic rollout of
`--responses` responses of exactly `--response_tokens` tokens (the micro-batch is all of them, so one micro-batch
holds `--responses` x `--response_tokens` positions). The step's peak memory is the process's peak RSS (VmHWM)
after it was reset (/proc/self/clear_refs) once the models were loaded, minus the RSS at that point: what the step
itself needed on top of the models and optimizer. The step is timed twice (the first warms up oneDNN kernels) and
the second timing is reported. Each row runs with glibc's MALLOC_MMAP_THRESHOLD_ at 64 KiB, so that every tensor
above it is mapped on its own and leaves the resident set when freed: the peak RSS then follows the live tensors
(with glibc's default, a freed 32 MB block may stay in the heap and count again later). The rows run in `--rounds` interleaved rounds (the machine may be shared: each row's
fastest round is reported, and its peak memory, which does not depend on the load, from the same round). Prints a table and writes JSON with --json.
"""

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def one_row(chunk_size: int, responses: int, response_tokens: int, model: str, checkpointing: bool) -> dict:
    """In this process: build the learner, run the step twice, measure the second."""
    import torch

    from open_instruct.data.batches import PromptBatch
    from open_instruct.data.embedded import resolve_model_path
    from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
    from open_instruct.generation.vllm_engine import Completion
    from open_instruct.learner.ppo import PPOLearner
    from open_instruct.rewards.manager import RewardManager
    from open_instruct.run.args import compute_batch_sizes, parse_args

    path = resolve_model_path(model)
    flags = ["--model_name_or_path", path, "--logprob_chunk_size", str(chunk_size), "--learner_compute_dtype",
             "float32", "--local_rollout_batch_size", str(responses), "--number_samples_per_prompt", "1",
             "--per_device_train_batch_size", str(responses), "--num_mini_batches", "1", "--num_epochs", "1",
             "--total_episodes", str(responses), "--response_length", str(response_tokens), "--max_token_length",
             str(response_tokens + 128), "--max_prompt_token_length", "128", "--beta", "0", "--old_logprobs_from", "learner",
             "--gradient_checkpointing", str(checkpointing).lower()]  # fmt: skip
    args = parse_args(flags)
    tokenizer = load_tokenizer(path)
    torch.manual_seed(0)
    learner = PPOLearner(args, compute_batch_sizes(args), tokenizer, path, stop_token_ids_for(tokenizer, "eos"))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                           return_dict=False)  # fmt: skip
    prompts = PromptBatch([prompt] * responses, ["5"] * responses, ["arithmetic"] * responses, ["q"] * responses)
    generator = torch.Generator().manual_seed(0)
    completions = [
        Completion(row, torch.randint(100, 40000, (response_tokens,), generator=generator).tolist(), "5", "length")
        for row in range(responses)
    ]
    rewards = RewardManager(args.reward)
    seconds = []
    for attempt in range(2):
        if attempt == 1:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        before = rss_kib("VmRSS")
        start = time.perf_counter()
        experience, metrics, _ = learner.make_experience(prompts, completions, rewards)
        metrics.update(learner.train(experience))
        seconds.append(time.perf_counter() - start)
    vocab = learner.backend.hf_model(learner.policy).config.vocab_size
    return {
        "chunk_size": chunk_size,
        "responses": responses,
        "response_tokens": response_tokens,
        "vocab": vocab,
        "step_seconds": seconds[1],
        "step_peak_mib": (rss_kib("VmHWM") - before) / 1024,
        "whole_logits_fp32_mib": responses * response_tokens * vocab * 4 / 2**20,
        "policy_entropy": metrics["policy/entropy_avg"],
        "loss": metrics["objective/loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk_sizes", type=int, nargs="+", default=[0, 1024, 256])
    parser.add_argument("--responses", type=int, default=2)
    parser.add_argument("--response_tokens", type=int, default=1024)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gradient_checkpointing", action="store_true",
                        help="as the big recipes run: layer activations are recomputed, so the logits dominate the step")  # fmt: skip
    parser.add_argument("--json", default=None)
    parser.add_argument("--row", type=int, default=None, help=argparse.SUPPRESS)  # internal: one row, this process
    options = parser.parse_args()
    if options.row is not None:
        print(json.dumps(one_row(options.row, options.responses, options.response_tokens, options.model,
                                  options.gradient_checkpointing)))
        return
    best: dict[int, dict] = {}
    for _ in range(options.rounds):
        for chunk_size in options.chunk_sizes:
            command = [sys.executable, __file__, "--row", str(chunk_size), "--responses", str(options.responses),
                       "--response_tokens", str(options.response_tokens), "--model", options.model,
                       *(["--gradient_checkpointing"] if options.gradient_checkpointing else [])]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": REPO, "MALLOC_MMAP_THRESHOLD_": "65536"}
            done = subprocess.run(command, check=False, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                sys.exit(f"row {chunk_size} failed:\n{done.stderr[-3000:]}")
            row = json.loads(done.stdout.strip().splitlines()[-1])
            print(f"[chunks] chunk {chunk_size}: {row['step_seconds']:.1f}s, peak +{row['step_peak_mib']:.0f} MiB",
                  flush=True)  # fmt: skip
            if chunk_size not in best or row["step_seconds"] < best[chunk_size]["step_seconds"]:
                best[chunk_size] = row
    rows = [best[chunk_size] for chunk_size in options.chunk_sizes]
    base = rows[0]
    checkpointing = ", gradient checkpointing" if options.gradient_checkpointing else ""
    print(f"\n{options.responses} responses x {options.response_tokens} tokens{checkpointing}, vocab {base['vocab']} "
          f"(whole fp32 logits of the micro-batch: {base['whole_logits_fp32_mib']:.0f} MiB)\n")  # fmt: skip
    print("| --logprob_chunk_size | step seconds | x first row | step peak RSS (MiB) | x first row | loss | entropy |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['chunk_size']} | {row['step_seconds']:.2f} | {row['step_seconds'] / base['step_seconds']:.2f} | "
              f"{row['step_peak_mib']:.0f} | {row['step_peak_mib'] / base['step_peak_mib']:.2f} | {row['loss']:.6f} | "
              f"{row['policy_entropy']:.4f} |")  # fmt: skip
    if options.json:
        with open(options.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
