"""PPO for language models with a vLLM generation thread (Cleanba-style asynchronous actor/learner).

    python -m open_instruct.ppo_vllm_thread_ray_gtrl                       # embedded default, offline
    python -m open_instruct.ppo_vllm_thread_ray_gtrl configs/train_configs/ppo_arithmetic_debug.yaml

The learner runs in this (main) thread; a vLLM engine runs in a generation thread fed through
queues of size 1 (see generation_thread.py). With --async_mode (the default) the learner sends the
next prompts with policy k *before* training on the batch policy k-1 generated, so generation and
training overlap and the data is one policy version old; without it, the same code waits for
the batch of the current policy.

The learner is this process's PPOLearner, or, with more than one learner (--num_learners_per_node), a
--ray_address or a --deepspeed_stage, learner ranks as Ray actors on DeepSpeed behind the same methods
(learner_group.py; docs/distributed.md). The loop below is the same for both.

The recipe, in order: parse args -> data -> models -> generation thread -> loop {send weights and
prompts, receive rollout, score + advantages, PPO epochs, log, eval, save} -> final eval, save, push.
"""

import os
import sys
import time
from collections import deque
from dataclasses import dataclass

import torch
from tqdm import tqdm

from open_instruct import hub_utils
from open_instruct.dataset_transformation import ShufflingIterator, build_prompt_datasets
from open_instruct.embedded_model import resolve_model_path
from open_instruct.generation_thread import GenerationRequest, GenerationSettings, GenerationThread, Rollout
from open_instruct.ground_truth_utils import RewardManager
from open_instruct.model_utils import load_tokenizer
from open_instruct.ppo_args import Args, BatchSizes, compute_batch_sizes, parse_args
from open_instruct.ppo_learner import PPOLearner, PromptBatch
from open_instruct.tracking import MetricsLogger, format_progress, plot_training_curves, read_metrics
from open_instruct.vllm_utils import EngineConfig

PROGRESS_KEYS = ["objective/verifiable_correct_rate", "objective/scores", "objective/kl", "time/step"]


@dataclass
class InFlight:
    """A rollout request the learner sent and has not received yet."""

    prompts: PromptBatch
    policy_version: int
    run_eval: bool


def stop_token_ids_for(tokenizer, stop_token: str | None) -> list[int]:
    if stop_token is None:
        return []
    if stop_token == "eos":
        return [tokenizer.eos_token_id]
    period_ids = tokenizer.encode(".", add_special_tokens=False)
    return period_ids[-1:]  # "period": stop after the first sentence (the seed 001 TL;DR setting)


def prompt_batch(dataset, indices: list[int], tokenizer) -> PromptBatch:
    rows = dataset[indices]
    return PromptBatch(
        token_ids=rows["input_ids_prompt"],
        ground_truths=rows["ground_truth"],
        verifier_names=rows["dataset"],
        texts=[tokenizer.decode(ids) for ids in rows["input_ids_prompt"]],
    )


def start_generation_thread(
    args: Args, policy_path: str, stop_token_ids: list[int], eval_prompts: PromptBatch | None
) -> GenerationThread:
    settings = GenerationSettings(
        engine=EngineConfig(
            policy_path,
            max_model_len=args.gen.max_token_length,
            seed=args.run.seed,
            dtype=args.gen.vllm_dtype,
            gpu_memory_utilization=args.gen.vllm_gpu_memory_utilization,
            enforce_eager=args.gen.vllm_enforce_eager,
        ),
        samples_per_prompt=args.ppo.number_samples_per_prompt,
        temperature=args.gen.temperature,
        response_length=args.gen.response_length,
        stop_token_ids=stop_token_ids,
        stop_strings=args.gen.stop_strings,
        eval_prompt_token_ids=eval_prompts.token_ids if eval_prompts is not None else None,
        eval_samples_per_prompt=args.run.eval_samples_per_prompt,
    )
    thread = GenerationThread(settings, timeout_s=args.gen.queue_timeout_s)
    thread.start()
    return thread


def verifiable_correct_rate(completions, prompts: PromptBatch, reward_manager: RewardManager) -> float | None:
    verifiable = [c for c in completions if prompts.ground_truths[c.prompt_index] is not None]
    if not verifiable or not reward_manager.config.apply_verifiable_reward:
        return None
    _, metrics = reward_manager.score(
        [c.text for c in verifiable],
        [prompts.ground_truths[c.prompt_index] for c in verifiable],
        [prompts.verifier_names[c.prompt_index] for c in verifiable],
        [c.finish_reason == "stop" for c in verifiable],
    )
    return metrics["objective/verifiable_correct_rate"]


def eval_metrics(rollout: Rollout, eval_prompts: PromptBatch, reward_manager: RewardManager) -> tuple[dict, list[dict]]:
    """Eval: greedy and sampled correct rates on the eval rows that have a ground truth, greedy length.

    Rows without a ground truth (reward-model-only data) count for the length only: the reward model
    belongs to the learner, and an eval that waited for it would stall the generation thread.
    """
    completions = rollout.completions
    result = {
        "eval/sequence_lengths": sum(len(c.token_ids) for c in completions) / len(completions),
        "eval/policy_version": rollout.policy_version,
        "time/eval_generation": rollout.timings.get("eval_generation", 0.0),
    }
    by_key = {"eval/correct_rate": completions, "eval/sampled_correct_rate": rollout.sampled_completions}
    for key, eval_completions in by_key.items():
        correct_rate = verifiable_correct_rate(eval_completions, eval_prompts, reward_manager)
        if correct_rate is not None:
            result[key] = correct_rate
    samples = [
        {
            "policy_version": rollout.policy_version,
            "prompt": eval_prompts.texts[c.prompt_index],
            "ground_truth": eval_prompts.ground_truths[c.prompt_index],
            "response": c.text,
            "token_ids": c.token_ids,
        }
        for c in completions
    ]
    return result, samples


def log_eval(generator, eval_prompts: PromptBatch, reward_manager, logger: MetricsLogger, step: int) -> dict:
    metrics, samples = eval_metrics(generator.receive_eval(), eval_prompts, reward_manager)
    logger.log_samples(samples, step, name="eval_completions")
    return metrics


def sample_rows(prompts: PromptBatch, rollout: Rollout, scores: list[float], how_many: int) -> list[dict]:
    return [
        {
            "prompt": prompts.texts[c.prompt_index],
            "response": c.text,
            "ground_truth": prompts.ground_truths[c.prompt_index],
            "score": score,
            "finish_reason": c.finish_reason,
        }
        for c, score in list(zip(rollout.completions, scores))[:how_many]
    ]


def expected_rollout_version(step: int, async_mode: bool) -> int:
    """Learner is at version step-1: sync trains on its own data, async on the previous version's."""
    return max(0, step - 2) if async_mode else step - 1


def build_learner(args: Args, sizes: BatchSizes, tokenizer, policy_path: str, stop_token_ids: list[int]):
    """This process's PPOLearner, or learner ranks on Ray + DeepSpeed behind the same methods."""
    if not args.dist.uses_ray:
        return PPOLearner(args, sizes, tokenizer, policy_path, stop_token_ids)
    from open_instruct.learner_group import LearnerGroup  # imports ray; the single-process path never does

    return LearnerGroup(args, sizes, policy_path, stop_token_ids)


def train(args: Args, sizes: BatchSizes) -> dict:
    torch.manual_seed(args.run.seed)
    start_time = time.time()

    # ---- data ----
    policy_path = resolve_model_path(args.model.model_name_or_path)
    tokenizer = load_tokenizer(policy_path, args.model.model_revision)
    train_dataset, eval_dataset = build_prompt_datasets(args.data, tokenizer)
    # The eval split is small and fixed: read it from the dataset once, not row by row at every eval.
    eval_prompts = None
    if eval_dataset is not None:
        eval_prompts = prompt_batch(eval_dataset, list(range(len(eval_dataset))), tokenizer)
    reward_manager = RewardManager(args.reward)
    reward_manager.validate(list(train_dataset["dataset"]) + (eval_prompts.verifier_names if eval_prompts else []))
    prompt_order = ShufflingIterator(len(train_dataset), sizes.prompts_per_step, args.run.seed)
    stop_token_ids = stop_token_ids_for(tokenizer, args.gen.stop_token)

    # ---- models and the generation thread (the engine starts while the learner loads) ----
    generator = start_generation_thread(args, policy_path, stop_token_ids, eval_prompts)
    if torch.cuda.is_available():
        generator.wait_until_ready()  # vLLM sizes its KV cache from free GPU memory: let it measure first
    learner = build_learner(args, sizes, tokenizer, policy_path, stop_token_ids)
    logger = MetricsLogger(
        args.run.output_dir,
        with_tracking=args.run.with_tracking,
        wandb_project=args.run.wandb_project_name,
        wandb_entity=args.run.wandb_entity,
        run_name=args.run.run_name,
        config={**args.as_flat_dict(), **vars(sizes)},
    )
    in_flight: deque[InFlight] = deque()
    evaluated_versions: set[int] = set()

    def request_rollout(version: int) -> None:
        prompts = prompt_batch(train_dataset, next(prompt_order), tokenizer)
        run_eval = (
            eval_prompts is not None
            and sizes.eval_freq > 0
            and version % sizes.eval_freq == 0
            and version not in evaluated_versions  # async sends version 0 twice
        )
        if run_eval:
            evaluated_versions.add(version)
        weights = None if version == 0 else learner.weights_for_engine()  # the engine starts at version 0
        generator.send(GenerationRequest(version, weights, prompts.token_ids, run_eval))
        in_flight.append(InFlight(prompts, version, run_eval))

    # ---- the loop ----
    try:
        request_rollout(version=0)
        progress = tqdm(range(1, sizes.num_training_steps + 1), desc="ppo", dynamic_ncols=True)
        for step in progress:
            step_start = time.time()
            if args.gen.async_mode and step < sizes.num_training_steps:
                request_rollout(version=step - 1)  # policy k generates the next batch while we train on k-1's
            rollout, request = generator.receive(), in_flight.popleft()
            learner_wait = time.time() - step_start
            if rollout.policy_version != expected_rollout_version(step, args.gen.async_mode):
                raise RuntimeError(f"step {step} got a rollout of policy version {rollout.policy_version}")

            scoring_start = time.time()
            experience, metrics, samples = learner.make_experience(request.prompts, rollout.completions, reward_manager)
            training_start = time.time()
            metrics.update(learner.train(experience))
            training_time = time.time() - training_start
            if not args.gen.async_mode and step < sizes.num_training_steps:
                request_rollout(version=step)  # sync: the next batch comes from the policy just trained
            if request.run_eval:
                metrics.update(log_eval(generator, eval_prompts, reward_manager, logger, step))

            episode = step * sizes.rollout_batch_size
            metrics.update({
                "episode": episode,
                "epoch": step * sizes.prompts_per_step / len(train_dataset),
                "lr": learner.lr,
                "policy_version/learner": step - 1,
                "policy_version/rollout": rollout.policy_version,
                "time/generation": rollout.timings.get("generation", 0.0),
                "time/weight_sync": rollout.timings.get("weight_sync", 0.0),
                "time/learner_wait": learner_wait,
                "time/scoring": training_start - scoring_start,
                "time/training": training_time,
                "time/step": time.time() - step_start,
                "time/from_scratch": time.time() - start_time,
            })
            logger.log(metrics, step)
            logger.log_samples(sample_rows(request.prompts, rollout, samples["score"], args.run.num_samples_to_log), step)
            progress.set_postfix_str(format_progress(metrics, PROGRESS_KEYS))
            if sizes.save_freq > 0 and step % sizes.save_freq == 0:
                learner.save(os.path.join(args.run.output_dir, "checkpoints", f"step_{step}"))

        # ---- finish: evaluate the final policy (this also syncs its weights into vLLM), save, push ----
        final_step = sizes.num_training_steps
        final_eval = {}
        if eval_prompts is not None:
            generator.send(GenerationRequest(final_step, learner.weights_for_engine(), [], run_eval=True))
            final_eval = log_eval(generator, eval_prompts, reward_manager, logger, final_step)
            logger.log({**final_eval, "episode": final_step * sizes.rollout_batch_size}, final_step)
    finally:
        generator.shutdown()
    summary = finish(args, learner, logger, final_eval)
    summary["time/from_scratch"] = time.time() - start_time
    return summary


def summarize(metrics_path: str) -> dict:
    """Start vs end: eval correct rates (greedy, sampled), and the training batches' sampled correct rate
    (mean of the first / last 3 steps)."""
    records = read_metrics(metrics_path)
    sampled = [r["objective/verifiable_correct_rate"] for r in records if r.get("objective/verifiable_correct_rate") is not None]
    summary = {}
    for key in ("eval/correct_rate", "eval/sampled_correct_rate"):
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            name = key.removeprefix("eval/")
            summary[f"eval_{name}_start"], summary[f"eval_{name}_end"] = values[0], values[-1]
    if sampled:
        window = min(3, len(sampled))
        summary["sampled_correct_rate_start"] = sum(sampled[:window]) / window
        summary["sampled_correct_rate_end"] = sum(sampled[-window:]) / window
    return summary


def finish(args: Args, learner, logger: MetricsLogger, final_eval: dict) -> dict:
    model_dir = learner.save(
        os.path.join(args.run.output_dir, "model"), extra_files={"open_instruct_args.json": args.as_flat_dict()}
    )
    metrics_path = os.path.join(args.run.output_dir, "metrics.jsonl")
    plot_path = plot_training_curves(metrics_path, os.path.join(args.run.output_dir, "training_curves.png"))
    summary = {**summarize(metrics_path), "model_dir": model_dir, "plot": plot_path}
    if args.run.push_to_hub:
        repo_id, revision = hub_utils.resolve_hub_repo(
            args.run.hf_entity, args.run.hf_repo_id, args.run.exp_name, args.run.hf_repo_revision, args.run.run_name,
            endpoint=args.run.hf_endpoint,
        )
        hub_utils.write_model_card(
            model_dir,
            repo_id=repo_id,
            base_model=args.model.model_name_or_path,
            dataset_names=args.data.dataset_mixer_list[::2],
            wandb_url=logger.wandb_url,
            training_args=args.as_flat_dict(),
            metrics={**final_eval, **summary},
            command=" ".join(["python -m open_instruct.ppo_vllm_thread_ray_gtrl", *sys.argv[1:]]),
        )
        summary["hub_url"] = hub_utils.push_folder_to_hub(
            model_dir, repo_id, revision, endpoint=args.run.hf_endpoint
        )
    for key, value in summary.items():
        logger.set_summary(key, value)
    logger.finish()
    return summary


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    sizes = compute_batch_sizes(args)  # inconsistent sizes fail here, before any model loads
    print(f"[ppo] run {args.run.run_name}: {sizes.describe()}")
    summary = train(args, sizes)
    print("[ppo] summary: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    return summary


if __name__ == "__main__":
    main()
