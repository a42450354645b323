"""What the trainer's loop writes: evals (logged, one console line each), checkpoints, model snapshots
(--save_model_freq), the final model (in output_dir, or --fallback_save_dir when its disk is full), the plots and
summary, and the push to the hub. `run` is the trainer's `Run` (ppo_vllm_thread_ray_gtrl.py).
"""

import os
import shutil
import sys
import time

import torch

from open_instruct.data.embedded import resolve_model_path
from open_instruct.generation.eval_metrics import eval_metrics
from open_instruct.run import checkpoint, disk_space, hub, hub_models, summary
from open_instruct.run.args import Args, batches_in_engine
from open_instruct.run.console import say


def log_eval(run, eval_rollout, step: int) -> dict:
    """The eval's metrics (and one line on the console); its completions go to samples.jsonl."""
    metrics, samples = eval_metrics(eval_rollout, run.data.eval_prompts, run.reward_manager)
    run.batches.note_cut_outputs(metrics.get("eval/tool_outputs_cut", 0.0), "the eval")
    run.logger.log_samples(samples, step, name="eval_completions")
    say(describe_eval(metrics, len(run.data.eval_prompts.token_ids), round(metrics["eval/samples_per_prompt"]), step))
    return metrics


def save_checkpoint(run, step: int, wait_s: float | None = None) -> checkpoint.SavedCheckpoint:
    """checkpoints/step_{step}: the learner's state (Ray learner ranks write theirs in parallel), the trainer's (with
    the rollouts in flight, waited for at most `wait_s`) and every flag."""
    trainer_state = {
        "step": step,
        "episode": step * run.sizes.rollout_batch_size,
        "policy_version": step,
        "run_id": run.args.run.run_name,
        "wandb_run_id": run.logger.wandb_run_id,
        "time_from_scratch": time.time() - run.start_time,
        # The commit each hub model id resolved to at the start: a resume loads these, not the branches' newest.
        "hub_commits": hub_models.resolved_commits(run.args, run.data.local_args),
        # engine actors: the run's count goes on (an in-process engine is never restarted)
        "engine_restarts": run.generator.engine.restarts if run.generator.engine is not None else 0,
        **run.rollouts.state_dict(learner_version=step, wait_s=wait_s,
                                  inflight_updates=batches_in_engine(run.args.gen) > 1,
                                  steps_left=run.sizes.num_training_steps - step),
    }
    saved = checkpoint.save_checkpoint(
        run.args.run.output_dir, step, run.learner, trainer_state, run.args, run.args.run.keep_last_n
    )
    say(f"[ppo] checkpoint {os.path.relpath(saved.path, run.args.run.output_dir)}: {saved.bytes / 1e9:.2f} GB in "
        f"{saved.seconds:.1f}s")  # fmt: skip
    run.run_dir.release_earlier_run()
    run.checkpointed = (step, saved.path)
    return saved


def save_model_snapshot(run, step: int) -> None:
    """--save_model_freq: the current policy as a loadable HF folder, output_dir/model_step_{step} (fp32 masters by
    default, in --save_dtype), so a long run leaves a usable model before its end; only the newest --keep_last_n stay.
    A snapshot that does not fit on the disk is skipped with a warning: the run goes on."""
    args = run.args
    folder = os.path.join(args.run.output_dir, f"model_step_{step}")
    started = time.time()
    needed = final_model_size(args, run.data)
    try:
        if needed is not None:
            disk_space.require_space(args.run.output_dir, needed, f"model_step_{step} not written")
        with disk_space.out_of_space_as_error(args.run.output_dir, needed, f"model_step_{step} not written"):
            saved = run.learner.save(folder, extra_files={"open_instruct_args.json": args.as_flat_dict()})
    except disk_space.DiskFullError as error:
        say(f"[ppo] warning: {error}; the run goes on", error=True)
        return
    say(f"[ppo] model snapshot {os.path.basename(folder)} ({saved.dtype}, weights_sha256 {saved.weights_sha256[:12]}) "
        f"in {time.time() - started:.1f}s")  # fmt: skip
    for old in model_snapshots(args.run.output_dir)[: -args.run.keep_last_n]:
        shutil.rmtree(old, ignore_errors=True)


def model_snapshots(output_dir: str) -> list[str]:
    """The model_step_N folders of `output_dir` that a save completed, oldest first."""
    found = []
    for name in os.listdir(output_dir):
        prefix, _, number = name.rpartition("_")
        if prefix == "model_step" and number.isdigit() and os.path.isfile(os.path.join(output_dir, name, "config.json")):
            found.append((int(number), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def evaluate_final_policy(run) -> dict:
    """The eval of the final policy (this also syncs its weights into the engine), logged at the last step."""
    if run.data.eval_prompts is None:
        return {}
    final_step = run.sizes.num_training_steps
    final_eval = log_eval(run, run.rollouts.send_final_eval(final_step), final_step)
    run.logger.log({**final_eval, "episode": final_step * run.sizes.rollout_batch_size}, final_step)
    return final_eval


def final_model_size(args: Args, data) -> int | None:
    """Bytes the final model folder needs (with headroom), from the policy folder's weights; None if unknown."""
    size = disk_space.model_folder_bytes(data.policy_path, getattr(torch, args.run.save_dtype))
    return disk_space.with_headroom(size) if size is not None else None


def final_model_space_problem(args: Args, data) -> str | None:
    """Why output_dir's disk cannot hold the final model now (said at start, long before the save), or None."""
    needed = final_model_size(args, data)
    free = disk_space.free_bytes(args.run.output_dir)
    if needed is None or free is None or free >= needed:
        return None
    return (f"{args.run.output_dir} has {disk_space.gigabytes(free)} GB free, less than the ~"
            f"{disk_space.gigabytes(needed)} GB the final model needs")  # fmt: skip


# A checkpoint holds each trained model's fp32 weights and AdamW's two fp32 moments: 12 bytes a parameter (the tiny
# PPO run's policy and value model, 6.6 M parameters each, write 0.16 GB).
CHECKPOINT_BYTES_PER_PARAMETER = 12


def checkpoint_size(args: Args, data) -> int | None:
    """Bytes one checkpoint needs (with headroom), from the trained models' folders; None if a size is unknown."""
    trained = [data.policy_path]
    if args.ppo.algorithm == "ppo":  # the value model starts as --value_model_path, else the reward model, else the policy
        init = args.model.value_model_path or args.model.reward_model_path
        trained.append(resolve_model_path(init) if init is not None else data.policy_path)
    counts = [disk_space.weights_numel(path) for path in trained]
    if None in counts:
        return None
    return disk_space.with_headroom(sum(counts) * CHECKPOINT_BYTES_PER_PARAMETER)


def checkpoint_space_problem(args: Args, sizes, data) -> str | None:
    """Why output_dir's disk cannot hold the run's next checkpoint now (said at start, not at the first --save_freq
    step, where the run would stop), or None; the checkpoints that save may delete first count as free."""
    if sizes.save_freq <= 0 or sizes.save_freq > sizes.num_training_steps:
        return None
    needed = checkpoint_size(args, data)
    free = disk_space.free_bytes(args.run.output_dir)
    if needed is None or free is None:
        return None
    free += sum(disk_space.folder_bytes(path)
                for path in checkpoint.doomed_checkpoints(args.run.output_dir, args.run.keep_last_n))  # fmt: skip
    if free >= needed:
        return None
    return (f"{args.run.output_dir} has {disk_space.gigabytes(free)} GB free, less than the ~"
            f"{disk_space.gigabytes(needed)} GB a checkpoint needs: the run would stop at its first checkpoint "
            f"(--save_freq {sizes.save_freq}); free space there, or pass --save_freq -1 (no checkpoints)")  # fmt: skip


def save_final_model(run):
    """The policy in output_dir/model; when that disk has no room for it, in --fallback_save_dir/<run_name>/model,
    then DiskFullError naming where it went. The trained weights are only in memory until this returns, so a full
    disk must not lose them: every folder is tried, and the checkpoints already written are never touched."""
    args = run.args
    needed = final_model_size(args, run.data)
    folders = [os.path.join(args.run.output_dir, "model"),
               os.path.join(args.run.fallback_save_dir, args.run.run_name, "model")]  # fmt: skip
    problems = []
    for folder in folders:
        what = f"the final model did not fit in {folder}"
        try:
            if needed is not None:
                disk_space.require_space(os.path.dirname(folder), needed, what)
            with disk_space.out_of_space_as_error(os.path.dirname(folder), needed, what):
                saved = run.learner.save(folder, extra_files={"open_instruct_args.json": args.as_flat_dict()})
        except disk_space.DiskFullError as error:
            problems.append(str(error))
            say(f"[ppo] warning: {error}", error=True)
            continue
        if problems:  # saved, but not where the run was told to
            run.run_dir.release_earlier_run(saved_elsewhere=saved.path)
            raise disk_space.DiskFullError(
                f"{problems[0]}; saved it in {saved.path} instead (weights_sha256 {saved.weights_sha256}); move it "
                f"to {folders[0]} once there is room",
                rescued_to=saved.path,
            )
        run.run_dir.release_earlier_run()
        return saved
    raise disk_space.DiskFullError(f"{'; '.join(problems)}: the trained weights were not saved")


def finish(run, final_eval: dict) -> dict:
    """Save the final policy, draw the plots, write the summary, push to the hub when asked; returns the summary."""
    args, logger = run.args, run.logger
    saved = save_final_model(run)
    result = {
        "status": "completed",
        "reason": f"trained all {run.sizes.num_training_steps} steps",
        **summary.summarize(os.path.join(args.run.output_dir, "metrics.jsonl")),
        "model_dir": saved.path,
        "save_dtype": saved.dtype,
        "weights_sha256": saved.weights_sha256,
        **summary.report_save_rounding(saved),
        "plot": summary.write_plots(args.run.output_dir),
    }
    if args.run.push_to_hub:
        result["hub_url"] = push_to_hub(args, saved.path, saved.dtype, logger.wandb_url, {**final_eval, **result})
    logger.update_summary(result)
    logger.finish()
    return result


def push_to_hub(args: Args, model_dir: str, weights_dtype: str, wandb_url: str | None, metrics: dict) -> str:
    """Upload the saved folder with a model card to --hf_entity/--hf_repo_id at revision --hf_repo_revision."""
    run = args.run
    repo_id, revision = hub.resolve_hub_repo(run.hf_entity, run.hf_repo_id, run.exp_name, run.hf_repo_revision,
                                             run.run_name, endpoint=run.hf_endpoint)  # fmt: skip
    hub.write_model_card(
        model_dir,
        repo_id=repo_id,
        base_model=args.model.model_name_or_path,
        dataset_names=args.data.dataset_mixer_list[::2],
        wandb_url=wandb_url,
        training_args=args.as_flat_dict(),
        metrics=metrics,
        weights_dtype=weights_dtype,
        command=" ".join([f"python -m open_instruct.{args.ppo.algorithm}_vllm_thread_ray_gtrl", *sys.argv[1:]]),
        algorithm=args.ppo.algorithm,
    )
    return hub.push_folder_to_hub(model_dir, repo_id, revision, endpoint=run.hf_endpoint)


def describe_eval(metrics: dict, num_prompts: int, samples_per_prompt: int, step: int) -> str:
    version = metrics["eval/policy_version"]
    parts = []
    if "eval/correct_rate" in metrics:
        parts.append(f"greedy {metrics['eval/correct_rate']:.3f}")
    if "eval/sampled_correct_rate" in metrics:
        parts.append(f"sampled {metrics['eval/sampled_correct_rate']:.3f} ({samples_per_prompt} per prompt)")
    if "eval/tool_call_rate" in metrics:  # a run with --tools
        parts.append(f"greedy tool-call rate {metrics['eval/tool_call_rate']:.3f}")
    if "eval/agent/calls_per_rollout" in metrics:  # --rollout_agent: the rewards are the agent's
        parts.append(f"agent reward, {metrics['eval/agent/calls_per_rollout']:.2f} calls per greedy rollout")
    parts.append(f"{num_prompts} prompts, mean length {metrics['eval/sequence_lengths']:.1f} tokens")
    when = "before training" if version == 0 else f"after step {version}"
    return f"[eval] {when}: " + ", ".join(parts)
