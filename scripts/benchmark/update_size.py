"""How far a few PPO updates move a model, and how many of check_gpu.py's 16 greedy eval answers they change: the
numbers behind check_gpu's MIN_RELATIVE_UPDATE (single_gpu_run) and its transfer checks' learning rate (a stale engine
must answer some prompt otherwise, or the transfer checks prove nothing).

    python scripts/benchmark/update_size.py                              # embedded model, 1e-5 and 1e-4
    python scripts/benchmark/update_size.py --model tiny --learning_rates 1e-4 --json sizes.json

Each learning rate: the single-process learner (fp32) trains `--steps` PPO steps of 1 epoch and 1 minibatch on
check_gpu's fixed rollout (one AdamW step per PPO step, linear decay: the transfer checks' schedule), then
||after - start|| / ||start|| over every parameter, and the greedy answers (HF generate, 32 tokens) to the 16 eval
questions before and after: how many differ, and the mean |logprob| gap on the tokens both chose alike.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
import check_gpu  # noqa: E402


def greedy_answers(model, prompt_ids: list[list[int]], max_tokens: int = 32) -> list[tuple[list[int], list[float]]]:
    answers = []
    for ids in prompt_ids:
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)  # fmt: skip
        tokens = out.sequences[0, len(ids) :].tolist()
        logprobs = [torch.log_softmax(score[0].float(), -1)[t].item() for score, t in zip(out.scores, tokens)]
        answers.append((tokens, logprobs))
    return answers


def measure(model: str, learning_rate: str, steps: int) -> dict:
    from open_instruct.data.embedded import resolve_model_path
    from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
    from open_instruct.learner.ppo import PPOLearner
    from open_instruct.rewards.manager import RewardManager
    from open_instruct.run.args import compute_batch_sizes, parse_args

    path = resolve_model_path(model)
    tokenizer = load_tokenizer(path)
    prompts, completions = check_gpu.fixed_rollout(tokenizer)
    args = parse_args(["--model_name_or_path", path, "--learner_compute_dtype", "float32", "--local_rollout_batch_size",
                       "4", "--number_samples_per_prompt", "2", "--per_device_train_batch_size", "8",
                       "--num_mini_batches", "1", "--num_epochs", "1", "--total_episodes", str(8 * steps),
                       "--response_length", "16", "--learning_rate", learning_rate, "--beta", "0.05", "--seed", "3"])  # fmt: skip
    torch.manual_seed(args.run.seed)
    learner = PPOLearner(args, compute_batch_sizes(args), tokenizer, path, stop_token_ids_for(tokenizer, "eos"))
    policy = learner.backend.hf_model(learner.policy)
    start = {name: p.detach().double().clone() for name, p in policy.named_parameters()}
    prompt_ids = check_gpu.eval_prompt_ids(path)
    with torch.no_grad():
        before = greedy_answers(policy, prompt_ids)
    for _ in range(steps):
        experience, _, _ = learner.make_experience(prompts, completions, RewardManager(args.reward))
        learner.train(experience)
    change = sum((p.detach().double() - start[n]).square().sum() for n, p in policy.named_parameters())
    size = sum(t.square().sum() for t in start.values())
    with torch.no_grad():
        after = greedy_answers(policy, prompt_ids)
    differ = sum(a[0] != b[0] for a, b in zip(before, after))
    gaps = []
    for (tokens, logprobs), (other, other_logprobs) in zip(after, before):
        for token, token_other, x, y in zip(tokens, other, logprobs, other_logprobs):
            if token != token_other:
                break
            gaps.append(abs(x - y))
    return {"model": model, "learning_rate": learning_rate, "ppo_steps": steps,
            "relative_update": float((change / size).sqrt()), "answers_changed": f"{differ}/{len(prompt_ids)}",
            "alike_logprob_gap": sum(gaps) / max(1, len(gaps))}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--learning_rates", nargs="+", default=["1e-5", "1e-4"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json")
    options = parser.parse_args()
    rows = []
    for learning_rate in options.learning_rates:
        rows.append(measure(options.model, learning_rate, options.steps))
        print(json.dumps(rows[-1]), flush=True)
    if options.json:
        with open(options.json, "w") as file:
            json.dump(rows, file, indent=2)


if __name__ == "__main__":
    main()
