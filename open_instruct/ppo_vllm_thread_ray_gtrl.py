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

GRPO runs this same loop (grpo_vllm_thread_ray_gtrl.py passes `algorithm="grpo"`): only the learner's class
differs (`ppo_learner.learner_class`), here and on Ray learner ranks.
"""

import os
import sys
import time
import traceback

import torch
from tqdm import tqdm

from open_instruct import checkpoint as ckpt
from open_instruct import hub_utils
from open_instruct.dataset_transformation import ShufflingIterator, build_prompt_datasets
from open_instruct.embedded_model import resolve_model_path
from open_instruct.generation_thread import GenerationSettings, GenerationThread, Rollout
from open_instruct.rollout_requests import RolloutRequests, broadcast_metrics, prompt_batch
from open_instruct.ground_truth_utils import RewardManager
from open_instruct.model_utils import learner_compute_dtype, learner_device, load_tokenizer
from open_instruct.ppo_args import Args, BatchSizes, ConfigError, compute_batch_sizes, parse_args
from open_instruct.ppo_learner import PromptBatch, SavedModel, check_engine_matches_learner, learner_class
from open_instruct.tracking import (
    CORRECT_RATE_KEYS,
    MetricsLogger,
    format_progress,
    plot_length_histograms,
    plot_training_curves,
    read_metrics,
    repair_jsonl,
)
from open_instruct.validation import (
    as_config_errors,
    one_line,
    row_checker,
    validate_flags,
    validate_hub,
    validate_memory,
    validate_models,
)
from open_instruct.vllm_utils import EngineConfig

PROGRESS_KEYS = ["objective/verifiable_correct_rate", "objective/scores", "objective/kl", "time/step"]


def stop_token_ids_for(tokenizer, stop_token: str | None) -> list[int]:
    if stop_token is None:
        return []
    if stop_token == "eos":
        return [tokenizer.eos_token_id]
    period_ids = tokenizer.encode(".", add_special_tokens=False)
    return period_ids[-1:]  # "period": stop after the first sentence (the seed 001 TL;DR setting)


def start_generation_thread(
    args: Args, policy_path: str, stop_token_ids: list[int], eval_prompts: PromptBatch | None
) -> GenerationThread:
    """The generation thread, with an engine in this process or, with --vllm_num_engines, engine actors on Ray."""
    engine_config = EngineConfig(
        policy_path,
        max_model_len=args.gen.max_token_length,
        seed=args.run.seed,
        dtype=args.gen.vllm_dtype,
        gpu_memory_utilization=args.gen.vllm_gpu_memory_utilization,
        enforce_eager=args.gen.vllm_enforce_eager,
        cpu_weight_layout=args.gen.vllm_cpu_weight_layout,
    )
    engines = None
    if args.dist.vllm_num_engines > 0:
        from open_instruct.engine_group import start_engine_actors  # imports ray; the in-process path never does

        engines = start_engine_actors(args, engine_config)
    settings = GenerationSettings(
        engine=engine_config,
        samples_per_prompt=args.ppo.number_samples_per_prompt,
        temperature=args.gen.temperature,
        response_length=args.gen.response_length,
        stop_token_ids=stop_token_ids,
        stop_strings=args.gen.stop_strings,
        eval_prompt_token_ids=eval_prompts.token_ids if eval_prompts is not None else None,
        eval_samples_per_prompt=args.run.eval_samples_per_prompt,
    )
    thread = GenerationThread(settings, timeout_s=args.gen.queue_timeout_s, engine=engines)
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


def log_eval(eval_rollout: Rollout, eval_prompts: PromptBatch, reward_manager, logger: MetricsLogger, step: int):
    metrics, samples = eval_metrics(eval_rollout, eval_prompts, reward_manager)
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


def build_learner(args: Args, sizes: BatchSizes, tokenizer, policy_path: str, stop_token_ids: list[int], placement=None,
                  compute_dtype: tuple | None = None):  # fmt: skip
    """This process's learner (PPOLearner, or GRPOLearner with --algorithm grpo), or learner ranks of that class on
    Ray + DeepSpeed behind the same methods. `compute_dtype`: this process's (dtype, why), chosen before the engine
    started; Ray ranks choose on their own nodes."""
    if not args.dist.uses_ray:
        return learner_class(args.ppo.algorithm)(args, sizes, tokenizer, policy_path, stop_token_ids,
                                                 compute_dtype=compute_dtype)  # fmt: skip
    from open_instruct.learner_group import LearnerGroup  # imports ray; the single-process path never does

    return LearnerGroup(args, sizes, policy_path, stop_token_ids, placement)


def train(args: Args, sizes: BatchSizes, resume: ckpt.Checkpoint | None, stop: ckpt.StopRequest) -> dict:
    torch.manual_seed(args.run.seed)
    start_time = time.time() - (resume.trainer_state["time_from_scratch"] if resume else 0.0)

    # ---- data (every row checked) and the models' vocabularies and sizes, before any model loads ----
    with as_config_errors():
        policy_path = resolve_model_path(args.model.model_name_or_path)
        tokenizer = load_tokenizer(policy_path, args.model.model_revision)
        train_dataset, eval_dataset = build_prompt_datasets(
            args.data, tokenizer, row_checker(args, "train"), row_checker(args, "eval")
        )
        validate_memory(args, validate_models(args, policy_path, tokenizer))
    # The eval split is small and fixed: read it from the dataset once, not row by row at every eval.
    eval_prompts = None
    if eval_dataset is not None:
        eval_prompts = prompt_batch(eval_dataset, list(range(len(eval_dataset))), tokenizer)
    reward_manager = RewardManager(args.reward)
    stop_token_ids = stop_token_ids_for(tokenizer, args.gen.stop_token)
    if resume is not None:  # steps after the checkpoint are logged again
        for name in ("metrics.jsonl", "samples.jsonl", "lengths.jsonl"):
            for warning in repair_jsonl(os.path.join(args.run.output_dir, name), keep_through_step=resume.step):
                print(f"[ppo] warning: {warning}", flush=True)
    logger = MetricsLogger(
        args.run.output_dir,
        with_tracking=args.run.with_tracking,
        wandb_project=args.run.wandb_project_name,
        wandb_entity=args.run.wandb_entity,
        run_name=args.run.run_name,
        config={**args.as_flat_dict(), **vars(sizes)},
        run_id=args.run.run_name,
        wandb_run_id=resume.trainer_state.get("wandb_run_id") if resume else None,
    )
    logger.set_summary("status", "running")
    if resume is None:  # the dataset's prompt lengths (wandb histogram + length_histograms.png)
        logger.log_histograms({"lengths/prompt_tokens": [len(ids) for ids in train_dataset["input_ids_prompt"]]}, 0)
    last_step = resume.step if resume else 0
    try:
        # ---- models and the generation thread (the engine starts while the learner loads) ----
        learner_placement = None
        if args.dist.uses_ray:  # reserve the learners' nodes first: engine actors placed before could take them
            from open_instruct.learner_group import reserve_learner_placement

            learner_placement = reserve_learner_placement(args.dist)
        compute_dtype = None
        if not args.dist.uses_ray:  # the dtype probe times matmuls: run it before the engine loads on the same cores
            compute_dtype = learner_compute_dtype(args.model.learner_compute_dtype, learner_device())
        generator = start_generation_thread(args, policy_path, stop_token_ids, eval_prompts)
        try:
            if torch.cuda.is_available():
                generator.wait_until_ready()  # vLLM sizes its KV cache from free GPU memory: let it measure first
            learner = build_learner(
                args, sizes, tokenizer, policy_path, stop_token_ids, learner_placement, compute_dtype
            )
            if generator.engine is not None:  # engine actors: learner rank 0 will broadcast weights to them
                from open_instruct.engine_group import connect_engines

                connect_engines(learner, generator.engine, args.dist)
            prompt_order = ShufflingIterator(len(train_dataset), sizes.prompts_per_step, args.run.seed)
            rollouts = RolloutRequests(generator, learner, train_dataset, tokenizer, prompt_order, eval_prompts,
                                       sizes.eval_freq, args.run.seed, args.dist.vllm_sync_timeout_s)  # fmt: skip
            if resume is not None:
                learner.load_state_dict(resume.learner_state)
                rollouts.load_state_dict(resume.trainer_state)

            def save_checkpoint(step: int) -> str:
                trainer_state = {
                    "step": step,
                    "episode": step * sizes.rollout_batch_size,
                    "policy_version": step,
                    "run_id": args.run.run_name,
                    "wandb_run_id": logger.wandb_run_id,
                    "time_from_scratch": time.time() - start_time,
                    **rollouts.state_dict(),
                }
                return ckpt.save_checkpoint(
                    args.run.output_dir, step, learner.state_dict(), trainer_state, args, args.run.keep_last_n
                )

            # ---- the loop ----
            if not rollouts.in_flight:
                rollouts.send(version=0)  # the engine starts with the initial weights
            first_step = last_step + 1
            progress = tqdm(range(first_step, sizes.num_training_steps + 1), desc=args.ppo.algorithm, dynamic_ncols=True,
                            initial=first_step - 1, total=sizes.num_training_steps)  # fmt: skip
            for step in progress:
                if stop.requested:  # SIGTERM/SIGINT: stop between steps, with a checkpoint of the last one
                    raise ckpt.Preempted(stop.signum, step - 1, save_checkpoint(step - 1))
                step_start = time.time()
                if args.gen.async_mode and step < sizes.num_training_steps:
                    rollouts.send(version=step - 1)  # policy k generates the next batch while we train on k-1's
                request, rollout = rollouts.receive()
                learner_wait = time.time() - step_start
                if rollout.policy_version != expected_rollout_version(step, args.gen.async_mode):
                    raise RuntimeError(f"step {step} got a rollout of policy version {rollout.policy_version}")

                scoring_start = time.time()
                experience, metrics, samples = learner.make_experience(
                    request.prompts, rollout.completions, reward_manager
                )
                check_engine_matches_learner(metrics, args.gen.max_vllm_logprob_diff, step)
                training_start = time.time()
                metrics.update(learner.train(experience))
                training_time = time.time() - training_start
                if not args.gen.async_mode and step < sizes.num_training_steps:
                    rollouts.send(version=step)  # sync: the next batch comes from the policy just trained
                if request.run_eval:
                    eval_rollout = request.receive_eval(generator)
                    metrics.update(log_eval(eval_rollout, eval_prompts, reward_manager, logger, step))

                episode = step * sizes.rollout_batch_size
                metrics.update({
                    "episode": episode,
                    "epoch": step * sizes.prompts_per_step / len(train_dataset),
                    "lr": learner.lr,
                    "policy_version/learner": step - 1,
                    "policy_version/rollout": rollout.policy_version,
                    "time/generation": rollout.timings.get("generation", 0.0),
                    "time/weight_sync": rollout.timings.get("weight_sync", 0.0),
                    **broadcast_metrics(request.weights_sent),
                    "time/learner_wait": learner_wait,
                    "time/scoring": training_start - scoring_start,
                    "time/training": training_time,
                    "time/step": time.time() - step_start,
                    "time/from_scratch": time.time() - start_time,
                })
                logger.log(metrics, step)
                logger.log_samples(
                    sample_rows(request.prompts, rollout, samples["score"], args.run.num_samples_to_log), step
                )
                logger.log_histograms({"lengths/response_tokens": samples["response_length"]}, step)
                progress.set_postfix_str(format_progress(metrics, PROGRESS_KEYS))
                last_step = step
                if sizes.save_freq > 0 and step % sizes.save_freq == 0:
                    save_checkpoint(step)

            # ---- finish: evaluate the final policy (this also syncs its weights into vLLM), save, push ----
            final_step = sizes.num_training_steps
            final_eval = {}
            if eval_prompts is not None:
                final_eval = log_eval(rollouts.send_final_eval(final_step), eval_prompts, reward_manager, logger, final_step)
                logger.log({**final_eval, "episode": final_step * sizes.rollout_batch_size}, final_step)
        finally:
            generator.shutdown()
            if generator.engine is not None:
                generator.engine.shutdown()
        summary = finish(args, learner, logger, final_eval)
    except BaseException as error:
        record_failure(args, logger, error, last_step)
        raise
    summary["time/from_scratch"] = time.time() - start_time
    return summary


def record_failure(args: Args, logger: MetricsLogger, error: BaseException, last_step: int) -> None:
    """summary.json and the plot describe this run even when it stops early: how, where, what to resume from."""
    preempted = isinstance(error, ckpt.Preempted)
    checkpoints = ckpt.complete_checkpoints(args.run.output_dir)
    logger.set_summary("status", "preempted" if preempted else "failed")
    logger.set_summary("error", one_line(error))
    logger.set_summary("last_step", error.step if preempted else last_step)
    logger.set_summary("last_checkpoint", checkpoints[-1] if checkpoints else None)
    metrics_path = os.path.join(args.run.output_dir, "metrics.jsonl")
    try:
        plot_training_curves(metrics_path, os.path.join(args.run.output_dir, "training_curves.png"))
    except (FileNotFoundError, ValueError):
        pass  # nothing logged yet: no plot
    logger.finish()


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


def report_save_rounding(saved: SavedModel) -> dict:
    """Summary entries for a save in lower precision than training, with a warning when it lost most updates."""
    if saved.rounding is None:
        return {}
    fraction = saved.rounding["fraction_rounded_away"]
    if fraction > 0.5:
        print(
            f"[ppo] WARNING: saving in {saved.dtype} rounded {fraction:.0%} of the changed weights back to their "
            f"initial value: {saved.path} holds little of the training. Save with --save_dtype float32.",
            file=sys.stderr,
        )
    return {"save/fraction_of_changed_weights_rounded_away": fraction}


def finish(args: Args, learner, logger: MetricsLogger, final_eval: dict) -> dict:
    saved = learner.save(
        os.path.join(args.run.output_dir, "model"), extra_files={"open_instruct_args.json": args.as_flat_dict()}
    )
    model_dir = saved.path
    metrics_path = os.path.join(args.run.output_dir, "metrics.jsonl")
    plot_path = plot_training_curves(metrics_path, os.path.join(args.run.output_dir, "training_curves.png"))
    try:  # correct rates against wall-clock seconds; a run without verifiable rewards has none
        plot_training_curves(metrics_path, os.path.join(args.run.output_dir, "correct_rate_vs_time.png"),
                             keys=list(CORRECT_RATE_KEYS), x_key="time/from_scratch")  # fmt: skip
    except ValueError:
        pass
    plot_length_histograms(os.path.join(args.run.output_dir, "lengths.jsonl"),
                           os.path.join(args.run.output_dir, "length_histograms.png"))  # fmt: skip
    summary = {
        "status": "completed",
        **summarize(metrics_path),
        "model_dir": model_dir,
        "save_dtype": saved.dtype,
        "weights_sha256": saved.weights_sha256,
        **report_save_rounding(saved),
        "plot": plot_path,
    }
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
            weights_dtype=saved.dtype,
            command=" ".join([f"python -m open_instruct.{args.ppo.algorithm}_vllm_thread_ray_gtrl", *sys.argv[1:]]),
            algorithm=args.ppo.algorithm,
        )
        summary["hub_url"] = hub_utils.push_folder_to_hub(
            model_dir, repo_id, revision, endpoint=args.run.hf_endpoint
        )
    for key, value in summary.items():
        logger.set_summary(key, value)
    logger.finish()
    return summary


def main(argv: list[str] | None = None, algorithm: str = "ppo") -> dict:
    """One run; `algorithm` is the default of --algorithm (the GRPO entry point passes "grpo")."""
    with as_config_errors():  # everything below up to the models: a one-line error and exit code 2 (see cli)
        args = parse_args(argv, algorithm)
        validate_flags(args)
        sizes = compute_batch_sizes(args)  # inconsistent sizes fail here, before any model loads
        validate_hub(args)
    print(f"[ppo] run {args.run.run_name}: {sizes.describe()}")
    stop = ckpt.StopRequest(args.run.output_dir, args.run.preemption_timeout_s)
    with ckpt.RunDirectory(args):  # one run per output_dir: locked, leftovers swept, an earlier run kept
        with as_config_errors():
            resume = ckpt.load_checkpoint(args) if args.run.resume is not None else None
        if resume is not None:
            print(f"[ppo] resuming run {args.run.run_name} from {resume.path} (step {resume.step})")
        stop.install()
        try:
            summary = train(args, sizes, resume, stop)
        finally:
            stop.uninstall()
    print("[ppo] summary: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    return summary


def cli(argv: list[str] | None = None, algorithm: str = "ppo") -> None:
    """Run `main`; errors end the process with one line on stderr (`error: ...`) and an exit code:

    2: the configuration (flags, files, data rows, output_dir) cannot work; nothing was trained. The traceback
       only with --debug or OPEN_INSTRUCT_DEBUG=1.
    128 + signal: stopped by SIGTERM/SIGINT after writing a checkpoint (the line says how to resume).
    1: the run failed while training (the traceback comes first, except for non-finite values).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("OPEN_INSTRUCT_DEBUG", "") not in ("", "0")
    try:
        main(argv, algorithm)
    except ConfigError as error:
        if debug:
            traceback.print_exc()
        print(f"error: {one_line(error)}", file=sys.stderr, flush=True)
        sys.exit(2)
    except ckpt.Preempted as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Everything is on disk (fsynced) and the logs are closed; skip the interpreter's teardown of the in-process
        # vLLM engine (measured: ~9 s on 2 cores), because the scheduler's grace period is running.
        os._exit(128 + error.signum)
    except ckpt.NonFiniteError as error:
        if debug:
            traceback.print_exc()
        print(f"error: stopped: {one_line(error)}; {resume_hint(argv, algorithm)}", file=sys.stderr, flush=True)
        sys.exit(1)
    except Exception as error:  # noqa: BLE001 - a failure while training: its traceback, then one line
        traceback.print_exc()
        print(f"error: the run failed: {type(error).__name__}: {one_line(error)}; {resume_hint(argv, algorithm)}",
              file=sys.stderr, flush=True)  # fmt: skip
        sys.exit(1)


def resume_hint(argv: list[str], algorithm: str = "ppo") -> str:
    try:
        output_dir = parse_args(argv, algorithm).run.output_dir
    except ValueError:
        return "see the message above"
    checkpoints = ckpt.complete_checkpoints(output_dir)
    if not checkpoints:
        return f"no checkpoint to resume from in {output_dir}"
    return f"the newest checkpoint is {checkpoints[-1]} (resume with --resume)"


if __name__ == "__main__":
    cli()
