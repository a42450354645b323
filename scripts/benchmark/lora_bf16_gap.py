"""What a bf16 engine does to LoRA's merged weights, and the engine-vs-learner logprob gap it leaves.

    python scripts/benchmark/lora_bf16_gap.py --json gap.json

1. The rounding. A LoRA learner computing in bf16 (autocast) runs each adapted layer as `bf16(W) x + s B (A x)`: the
   adapters' update Delta = s B A is never rounded into W. An engine given the merged weights holds `bf16(W + Delta)`:
   where Delta is small against W's bf16 spacing (2^-8 of |W|), the sum rounds back to bf16(W). For SmolLM2-135M's
   layer-0 q_proj (576 x 576, its weights rounded to bf16 first, as a bf16 hub checkpoint holds them) and rank-16
   updates scaled to ||Delta|| / ||W|| = r: the share of Delta's norm the engine loses (||bf16(W + Delta) - bf16(W) -
   Delta|| / ||Delta||), and the share of W's elements the update does not move at all in the engine.
2. The policies. The single-process learner (SmolLM2-135M, its weights rounded to bf16 first) trains PPO steps on
   check_gpu's fixed rollout (8 responses, 1 minibatch, AdamW, constant learning rate): LoRA (rank 16, alpha 32, every
   linear layer) at `--lora_lr` and at `--full_lr`, and full fine-tuning at `--full_lr`, the rest alike. After each
   step in `--steps`, the logprobs of the rollout's response tokens under the learner's weights (LoRA: bf16 W plus
   the fp32 adapters, as a bf16 learner keeps them; full: its fp32 weights) and under the weights a bf16 engine holds
   (LoRA merged sync: bf16(W + Delta); `--lora_weight_sync adapter`: bf16 W plus the adapters, vLLM's LoRA layers;
   full: bf16(W_t)). Reported: the engine-vs-learner gap (mean and max |logprob| over the response tokens) and the
   share of the learner's move from step 0 (mean |logprob_t - logprob_0|) that the engine shows.

Only the weights' rounding is modelled (every forward runs in fp32): a bf16 forward adds activation rounding to every
variant alike. A full fine-tuning learner in bf16 autocast computes with bf16(W_t), the weights its engine holds: its
weight gap is 0 by construction, and what its bf16 copies miss of its fp32 masters is its "share of the move". This
CPU (AVX2, no native bf16) computes bf16 matmuls at 0.36 GFLOP/s, 80x slower than fp32: too slow for a bf16 trainer
run of the 135M model, so the runs' own `debug/vllm_vs_learner_logprob_diff_*` are for a GPU to measure.
"""

import argparse
import json
import os
import sys

import torch

RANK, ALPHA = 16, 32.0
RELATIVE_UPDATES = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2)


def rounding(model_path: str) -> list[dict]:
    from safetensors.torch import load_file

    weights = load_file(os.path.join(model_path, "model.safetensors"))
    base = weights["model.layers.0.self_attn.q_proj.weight"].bfloat16().float()  # as a bf16 checkpoint holds it
    generator = torch.Generator().manual_seed(0)
    lora_a = torch.randn(RANK, base.shape[1], generator=generator)
    lora_b = torch.randn(base.shape[0], RANK, generator=generator)
    direction = (ALPHA / RANK) * lora_b @ lora_a
    rows = []
    for relative in RELATIVE_UPDATES:
        delta = direction * (relative * base.norm() / direction.norm())
        engine = (base + delta).bfloat16().float()  # the merged weight a bf16 engine holds
        learner = base + delta  # what a bf16 learner's adapted layer computes with: bf16 W, the update apart
        rows.append({
            "relative_update": relative,
            "delta_norm_lost": ((engine - learner).norm() / delta.norm()).item(),
            "elements_not_moved": (engine == base).float().mean().item(),
        })  # fmt: skip
    return rows


def response_logprobs(model, sequences: list[list[int]], prompt_lengths: list[int]) -> torch.Tensor:
    """The logprob of every response token of `sequences` under `model` (fp32), concatenated."""
    out = []
    with torch.no_grad():
        for ids, start in zip(sequences, prompt_lengths):
            logits = model(torch.tensor([ids])).logits[0, start - 1 : -1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[start:])[:, None])[:, 0])
    return torch.cat(out)


def trained(model_path: str, lora: bool, learning_rate: str, at: list[int]) -> list[dict]:
    """The learner trained `max(at)` PPO steps; after each step in `at`, its logprobs against its bf16 engine's."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import check_gpu
    from transformers import AutoModelForCausalLM

    from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
    from open_instruct.learner import lora as lora_module
    from open_instruct.learner.ppo import PPOLearner
    from open_instruct.rewards.manager import RewardManager
    from open_instruct.run.args import compute_batch_sizes, parse_args

    tokenizer = load_tokenizer(model_path)
    prompts, completions = check_gpu.fixed_rollout(tokenizer)
    flags = ["--lora_rank", str(RANK), "--lora_alpha", str(ALPHA)] if lora else []
    args = parse_args(["--model_name_or_path", model_path, "--learner_compute_dtype", "float32", "--beta", "0.05",
                       "--local_rollout_batch_size", "4", "--number_samples_per_prompt", "2", "--num_epochs", "1",
                       "--per_device_train_batch_size", "8", "--num_mini_batches", "1", "--response_length", "16",
                       "--total_episodes", str(8 * max(at)), "--learning_rate", learning_rate,
                       "--lr_scheduler_type", "constant", "--seed", "3", *flags])  # fmt: skip
    torch.manual_seed(args.run.seed)
    learner = PPOLearner(args, compute_batch_sizes(args), tokenizer, model_path, stop_token_ids_for(tokenizer, "eos"))
    policy = learner.backend.hf_model(learner.policy)
    with torch.no_grad():  # W as a bf16 checkpoint holds it (B = 0: the adapters add nothing yet)
        for param in policy.parameters():
            param.copy_(param.bfloat16().float())
    engine = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    sequences = [prompts.token_ids[c.prompt_index] + c.token_ids for c in completions]
    starts = [len(prompts.token_ids[c.prompt_index]) for c in completions]
    start = response_logprobs(policy, sequences, starts)
    rows = []
    for step in range(1, max(at) + 1):
        experience, _, _ = learner.make_experience(prompts, completions, RewardManager(args.reward))
        learner.train(experience)
        if step not in at:
            continue
        learner_logprob = response_logprobs(policy, sequences, starts)
        weights = dict(lora_module.merged_weights(policy, torch.float32)) if lora else dict(policy.named_parameters())
        engine.load_state_dict({name: w.detach().bfloat16().float() for name, w in weights.items()}, strict=False)
        engines = {"merged sync" if lora else "bf16 copy": response_logprobs(engine, sequences, starts)}
        if lora:  # vLLM's LoRA layers compute with bf16 W (unchanged, rounded above) and the adapters apart
            engines["adapter sync"] = learner_logprob
        move = (learner_logprob - start).abs().mean().item()
        row = {"step": step, "learner_move_from_step_0": move}
        for name, logprob in engines.items():
            row[name] = {"gap_mean": (logprob - learner_logprob).abs().mean().item(),
                         "gap_max": (logprob - learner_logprob).abs().max().item(),
                         "share_of_move_shown": (logprob - start).abs().mean().item() / move}  # fmt: skip
        if lora:
            row["relative_update"] = relative_update(policy, lora_module)
        rows.append(row)
        print(json.dumps({"lora" if lora else "full": learning_rate, **row}), flush=True)
    return rows


def relative_update(policy, lora_module) -> float:
    """||Delta|| / ||W|| over every adapted layer together."""
    delta = base = 0.0
    with torch.no_grad():
        for layer in lora_module.lora_layers(policy):
            a, b = layer.lora_A[lora_module.ADAPTER].weight, layer.lora_B[lora_module.ADAPTER].weight
            delta += (layer.scaling[lora_module.ADAPTER] * b @ a).double().square().sum().item()
            base += layer.get_base_layer().weight.double().square().sum().item()
    return (delta / base) ** 0.5


def cpu_flags() -> list[str]:
    with open("/proc/cpuinfo") as file:
        flags = next((line.split(":", 1)[1].split() for line in file if line.startswith("flags")), [])
    return sorted(set(flags) & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lora_lr", default="2e-4", help="docs/lora.md's best on the embedded task")
    parser.add_argument("--full_lr", default="1e-5", help="the CPU PPO recipe's")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 3, 10])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from open_instruct.data.embedded import resolve_model_path

    path = resolve_model_path("embedded")
    result = {"command": " ".join(sys.argv), "cpu_flags": cpu_flags(), "rounding": rounding(path)}
    for row in result["rounding"]:
        print(f"||Delta||/||W|| {row['relative_update']:.0e}: bf16 merge loses {row['delta_norm_lost']:.1%} of "
              f"Delta's norm; {row['elements_not_moved']:.1%} of W's elements unmoved", flush=True)  # fmt: skip
    result["lora"] = trained(path, True, args.lora_lr, args.steps)
    result["lora_at_full_lr"] = trained(path, True, args.full_lr, args.steps)
    result["full"] = trained(path, False, args.full_lr, args.steps)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
