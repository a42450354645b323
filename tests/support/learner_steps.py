"""One PPO step on a fixed rollout: the reference that every learner-equivalence test compares against (2 Ray ranks,
2 spawned DeepSpeed ranks, packing, GRPO)."""

import torch

from open_instruct.data.batches import PromptBatch
from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
from open_instruct.generation.vllm_engine import Completion
from open_instruct.learner.grpo import GRPOLearner
from open_instruct.learner.ppo import PPOLearner
from open_instruct.rewards.manager import RewardManager
from open_instruct.run.args import compute_batch_sizes, parse_args

QUESTIONS = [(1, 2), (3, 4), (2, 2), (5, 1)]
# Two responses per prompt, of different lengths, right and wrong, one cut off without a stop token.
RESPONSES = [
    ("The answer is 3.", "stop"), ("1 + 2 = 4", "stop"),
    ("3 + 4 = 7. So the answer is 7", "stop"), ("It is 8", "length"),
    ("4", "stop"), ("2 + 2 is 5, I think", "stop"),
    ("The sum of 5 and 1 is 6.", "stop"), ("6", "length"),
]  # fmt: skip
EQUIVALENCE_FLAGS = [
    "--local_rollout_batch_size", "4",
    "--number_samples_per_prompt", "2",
    "--per_device_train_batch_size", "2",
    "--num_mini_batches", "2",
    "--num_epochs", "2",
    "--learning_rate", "1e-3",  # far above a real run's, so that the step moves every weight visibly
    "--value_learning_rate", "3e-3",
    "--lr_scheduler_type", "linear",
    "--total_episodes", "16",
    "--response_length", "16",
    "--seed", "3",
    # fp32 compute: the comparison is exact to 1e-4, which bf16 autocast (chosen on CPUs with fast bf16) is not.
    "--learner_compute_dtype", "float32",
]  # fmt: skip


def fixed_rollout(tokenizer) -> tuple[PromptBatch, list[Completion]]:
    chats = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in QUESTIONS]
    token_ids = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False) for chat in chats]
    prompts = PromptBatch(
        token_ids=token_ids,
        ground_truths=[str(a + b) for a, b in QUESTIONS],
        verifier_names=["arithmetic"] * len(QUESTIONS),
        texts=[tokenizer.decode(ids) for ids in token_ids],
    )
    completions = []
    for row, (text, finish_reason) in enumerate(RESPONSES):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if finish_reason == "stop":
            ids.append(tokenizer.eos_token_id)
        completions.append(Completion(prompt_index=row // 2, token_ids=ids, text=text, finish_reason=finish_reason))
    return prompts, completions


def one_ppo_step(learner, prompts, completions, reward_manager) -> dict[str, float]:
    experience, metrics, _ = learner.make_experience(prompts, completions, reward_manager)
    metrics.update(learner.train(experience))
    metrics["lr"] = learner.lr
    return metrics


def single_process_ppo_step(tiny_model_dir, completions: list[Completion] | None = None, *flags: str):
    """The reference: today's PPOLearner in this process, one step on the fixed rollout (or these completions)."""
    args = parse_args(["--model_name_or_path", tiny_model_dir, *EQUIVALENCE_FLAGS, *flags])
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts, fixed_completions = fixed_rollout(tokenizer)
    torch.manual_seed(args.run.seed)
    learner = PPOLearner(args, compute_batch_sizes(args), tokenizer, tiny_model_dir, stop_token_ids_for(tokenizer, "eos"))
    initial = {name: p.detach().clone() for name, p in learner.backend.hf_model(learner.policy).named_parameters()}
    metrics = one_ppo_step(learner, prompts, completions or fixed_completions, RewardManager(args.reward))
    params = {name: p.detach().clone() for name, p in learner.backend.hf_model(learner.policy).named_parameters()}
    return initial, params, metrics


def recorded_gradients(learner) -> list[dict[str, torch.Tensor]]:
    """The gradients each optimizer step of `learner` receives (before clipping), one dict per model and step, in
    the order the steps run; filled while `learner.train` runs (each trainer's own step still applies them)."""
    steps = []
    for role, trainer in zip(("policy", "value"), learner.trainers):

        def recording_step(apply: bool = True, trainer=trainer, role=role, step=trainer.step) -> bool:
            steps.append({f"{role}:{name}": param.grad.clone() for name, param in trainer.model.named_parameters()
                          if param.grad is not None})  # fmt: skip
            return step(apply)

        trainer.step = recording_step
    return steps


def assert_same_gradients(got: dict, expected: dict, what: str, atol: float = 1e-6) -> None:
    assert got.keys() == expected.keys(), what
    for name, gradient in expected.items():
        where = f"{what}, {name}"
        torch.testing.assert_close(got[name], gradient, rtol=0, atol=atol, msg=lambda m, where=where: f"{where}: {m}")


# Two responses per prompt: a few tokens, or a sentence of 25-35; stopped, or cut off.
MIXED_RESPONSES = [
    ("3", "stop"),
    ("The answer is 3, because one plus two makes three, and I checked it twice by counting: one, two, three.", "stop"),
    ("7", "stop"), ("It is 8", "length"), ("4", "stop"),
    ("2 + 2 is 5, I think, but let me count again slowly to be sure of it: two and two make four, so", "length"),
    ("6", "length"), ("The sum of 5 and 1 is 6.", "stop"),
]  # fmt: skip


def mixed_length_rollout(tokenizer):
    prompts, _ = fixed_rollout(tokenizer)
    completions = []
    for row, (text, finish_reason) in enumerate(MIXED_RESPONSES):
        ids = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if finish_reason == "stop" else [])
        completions.append(Completion(prompt_index=row // 2, token_ids=ids, text=text, finish_reason=finish_reason))
    return prompts, completions


def learner_with_experience(model_dir: str, algorithm: str, *flags: str):
    """A fresh learner and its experience of the fixed mixed-length rollout; (learner, experience, its metrics)."""
    args = parse_args(["--model_name_or_path", model_dir, *EQUIVALENCE_FLAGS, "--response_length", "48", *flags],
                      algorithm=algorithm)  # fmt: skip
    tokenizer = load_tokenizer(model_dir)
    torch.manual_seed(args.run.seed)  # the value head's init: the same in every learner of a test
    cls = GRPOLearner if algorithm == "grpo" else PPOLearner
    learner = cls(args, compute_batch_sizes(args), tokenizer, model_dir, stop_token_ids_for(tokenizer, "eos"))
    prompts, completions = mixed_length_rollout(tokenizer)
    exp, experience_metrics, _ = learner.make_experience(prompts, completions, RewardManager(args.reward))
    return learner, exp, experience_metrics
