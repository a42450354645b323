"""PPO for language models with a vLLM generation thread (Cleanba-style asynchronous actor/learner).

    python -m open_instruct.ppo_vllm_thread_ray_gtrl                       # embedded default, offline
    python -m open_instruct.ppo_vllm_thread_ray_gtrl configs/train_configs/ppo_arithmetic_cpu.yaml

The learner runs in this (main) thread; a vLLM engine runs in a generation thread fed through queues of size 1
(generation/generation_thread.py). With --async_mode (the default) the learner sends the next prompts with its
current policy *before* training on a batch an older policy generated, so generation and training overlap and the
data is up to --async_steps policy versions old (1: Cleanba's off-by-one; --inflight_updates loads each new policy
into the engine between two decode steps); without it, the same code waits for the batch of the current policy.

The learner is this process's PPOLearner, or, with more than one learner (--num_learners_per_node), a --ray_address
or a --deepspeed_stage, learner ranks as Ray actors on DeepSpeed behind the same methods (learner/ray_group.py;
docs/distributed.md); each seam the loop calls is declared once: learner/seams.py (the learner), generation/seams.py
(the engine, and what it needs from a learner). GRPO (grpo_vllm_thread_ray_gtrl.py) only picks another learner
class. The loop is the same.

The recipe, in order: parse args -> data -> models -> generation thread -> loop {send weights and prompts, receive
rollout, score + advantages, PPO epochs, log, eval, save} -> final eval, save, push. `main` and `train` show it;
`train_step` is the loop's body; what the loop writes (evals, checkpoints, the final model, the push) is in
trainer_outputs.py, and how a step's batch is collected (--async_steps, GRPO's dynamic sampling) in
generation/step_batch.py.
"""

import os
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field

from open_instruct.run.command_line import debug_requested, exit_for_config_error, exit_on_bad_command_line

if __name__ == "__main__":  # --help or a mistyped flag: answered in ~2 s, before the imports below (~8 s on 2 cores)
    exit_on_bad_command_line(sys.argv[1:], "ppo")

import torch
from tqdm import tqdm

from open_instruct.data.batches import PromptBatch, ShufflingIterator, prompt_batch
from open_instruct.data.prompt_dataset import build_prompt_datasets
from open_instruct.data.tokenizer import load_tokenizer, stop_token_ids_for
from open_instruct.environments.routing import environment_rows
from open_instruct.generation.eval_metrics import sample_rows
from open_instruct.generation.generation_thread import GenerationSettings, GenerationThread, WaitAbandoned
from open_instruct.generation.rollout_requests import RolloutRequests, broadcast_metrics
from open_instruct.generation.step_batch import BatchCollector
from open_instruct.generation.vllm_engine import EngineConfig
from open_instruct.learner.algorithms import learner_class
from open_instruct.learner.experience import check_engine_matches_learner
from open_instruct.learner.seams import Learner
from open_instruct.rewards.failures import RewardFailures
from open_instruct.rewards.manager import RewardManager
from open_instruct.run import checkpoint, console, disk_space, summary
from open_instruct.run.args import (
    Args,
    BatchSizes,
    ConfigError,
    agent_settings,
    async_steps,
    batches_in_engine,
    needs_rows,
    parse_args,
    tool_settings,
)
from open_instruct.run.console import say
from open_instruct.run.devices import (
    learner_compute_dtype,
    learner_device,
    pin_this_thread,
    split_cpu_cores,
)
from open_instruct.run.divergence import DivergedError, check_divergence
from open_instruct.run.hub_models import describe_pins, with_local_models
from open_instruct.run.preemption import Preempted, StopRequest
from open_instruct.run.run_directory import RunDirectory
from open_instruct.run.tracking import MetricsLogger, format_progress, repair_jsonl
from open_instruct.run.validation import (
    as_config_errors,
    check_data,
    check_flags,
    check_memory,
    check_models,
    one_line,
    row_checker,
    tool_call_schemas,
)
from open_instruct.trainer_outputs import (
    checkpoint_space_problem,
    evaluate_final_policy,
    final_model_space_problem,
    finish,
    log_eval,
    save_checkpoint,
    save_model_snapshot,
)

PROGRESS_KEYS = ["objective/verifiable_correct_rate", "objective/scores", "objective/kl", "time/step"]


# ---- the recipe ------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None, algorithm: str = "ppo") -> dict:
    """One run; `algorithm` is the default of --algorithm (the GRPO entry point passes "grpo")."""
    with as_config_errors():  # everything below up to the models: a one-line error and exit code 2 (see cli)
        args = parse_args(argv, algorithm)
        sizes, warnings = check_flags(args)  # values, combinations, batch sizes, the hub: before anything loads
    say(f"[ppo] run {args.run.run_name}: {describe_run(args, sizes)}")
    for warning in warnings:
        say(f"[ppo] warning: {warning}")
    stop = StopRequest(args.run.output_dir, args.run.preemption_timeout_s)
    with RunDirectory(args) as run_dir:  # one run per output_dir: locked, leftovers swept, an earlier run kept
        with as_config_errors():
            resume = checkpoint.load_checkpoint(args) if args.run.resume is not None else None
        if resume is not None:
            say(f"[ppo] resuming run {args.run.run_name} from {resume.path} (step {resume.step})")
        library_log = os.path.join(args.run.output_dir, console.LOG_NAME)
        say(f"[ppo] writing to {args.run.output_dir}; other libraries' logs go to {library_log}"
            f"{'' if args.run.verbose else ' (--verbose shows them here too)'}")  # fmt: skip
        stop.install()
        try:
            with console.library_output_to(library_log, verbose=args.run.verbose, discard_on=ConfigError):
                result = train(args, sizes, resume, stop, run_dir)
        finally:
            stop.uninstall()
    say("[ppo] summary: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    say(f"[ppo] saved in {args.run.output_dir}: {', '.join(outputs_of(args.run.output_dir))}")
    return result


def train(
    args: Args, sizes: BatchSizes, resume: checkpoint.Checkpoint | None, stop: StopRequest, run_dir: RunDirectory
) -> dict:
    """Data, then models and the generation thread, then the loop, then the final eval, save and push."""
    torch.manual_seed(args.run.seed)
    start_time = time.time() - (resume.trainer_state["time_from_scratch"] if resume else 0.0)
    # Every row checked, and the models' vocabularies and sizes, before any model loads; a resumed run's hub models at
    # the commits its checkpoint recorded, not where their branches point now.
    data = load_data(args, resume.trainer_state.get("hub_commits") if resume else None)
    say(describe_models(args, data))
    if (problem := final_model_space_problem(args, data)) is not None:
        say(f"[ppo] warning: {problem}; free space there, or the final model will go to "
            f"{os.path.join(args.run.fallback_save_dir, args.run.run_name, 'model')}", error=True)  # fmt: skip
    if (problem := checkpoint_space_problem(args, sizes, data)) is not None:
        say(f"[ppo] warning: {problem}", error=True)
    logger = open_logger(args, sizes, resume, data)
    last_step = resume.step if resume else 0
    # An exit without a new checkpoint (the preemption's deadline, a second signal) says so in summary.json too; the
    # closure reads `last_step` as the loop advances it.
    stop.last_words = lambda line: summary.record_exit_without_checkpoint(args.run.output_dir, logger, line, last_step)
    try:
        with start_workers(args, sizes, data, resume, stop) as (generator, learner, rollouts):
            reward_manager = RewardManager(args.reward, args.gen.response_length)
            run = Run(args, sizes, data, logger, reward_manager, generator, learner, rollouts, stop, start_time, run_dir)
            steps = range(last_step + 1, sizes.num_training_steps + 1)
            run.progress = tqdm(steps, desc=args.ppo.algorithm, dynamic_ncols=True, initial=last_step,
                                total=sizes.num_training_steps, file=console.stream(error=False))  # fmt: skip
            for step in run.progress:
                train_step(run, step)
                last_step = step
            final_eval = evaluate_final_policy(run)
        result = finish(run, final_eval)
    except BaseException as error:
        stop.last_words = None  # this ending is recorded here
        try:
            summary.record_failure(args.run.output_dir, logger, error, last_step)
        except OSError as failure:  # a full disk: the error line matters more than summary.json
            say(f"[ppo] warning: could not record the failure in summary.json: {one_line(failure)}", error=True)
        raise
    finally:
        stop.last_words = None  # summary.json says how the run ended
        if args.dist.uses_ray:  # this job's actors go now, while Ray's last worker logs still go to the library log
            from open_instruct.run.cluster import stop_ray

            stop_ray()
    result["time/from_scratch"] = time.time() - start_time
    return result


def train_step(run: "Run", step: int) -> None:
    """One step: top up the requests in flight, receive a rollout, score it and compute advantages, run the PPO epochs,
    log, eval, save. Async mode keeps --async_steps requests in flight beyond the batch the learner waits for, so the
    engine generates with policy k while the learner trains on an older batch; sync mode only that one."""
    args, sizes, learner = run.args, run.sizes, run.learner
    if run.stop.requested:  # SIGTERM/SIGINT: stop between steps, with a checkpoint of the last one
        stop_with_checkpoint(run, step - 1)
    step_start = time.time()
    learner_version = step - 1  # the policy's updates so far
    try:
        # After SIGTERM/SIGINT the wait for this step's rollout is given up at preemption.WAIT_SHARE of the budget:
        # nothing of the step is done yet, so the previous step's state is complete and is what gets checkpointed.
        with run.generator.abandoning_waits_when(run.stop.out_of_patience):
            batch = run.batches.collect(learner_version, steps_left=sizes.num_training_steps - step + 1)
    except WaitAbandoned:
        say(f"[ppo] step {step} waited {time.time() - step_start:.0f}s for its rollout, "
            f"{time.monotonic() - run.stop.received_at:.0f}s of them after {run.stop.name}: giving up step {step}, "
            f"checkpointing step {step - 1}", error=True)  # fmt: skip
        stop_with_checkpoint(run, step - 1)
    learner_wait = time.time() - step_start

    scoring_start = time.time()
    experience, metrics, samples = learner.make_experience(batch.prompts, batch.rollout.completions, batch.scorer)
    check_engine_matches_learner(metrics, args.gen.max_vllm_logprob_diff, step)
    training_start = time.time()
    metrics.update(learner.train(experience))
    training_time = time.time() - training_start
    for request in batch.requests:
        if request.run_eval:
            metrics.update(log_eval(run, request.receive_eval(run.generator), step))
    rollout = batch.rollout
    step_time = time.time() - step_start
    metrics.update({
        "episode": step * sizes.rollout_batch_size,
        "epoch": run.rollouts.prompts_received / run.data.num_train_prompts,  # GRPO's filter draws more than a step
        "lr": learner.lr,
        "policy_version/learner": learner_version,
        "policy_version/rollout": rollout.policy_version,
        **batch.metrics,
        "time/generation": rollout.timings.get("generation", 0.0),
        "time/weight_sync": rollout.timings.get("weight_sync", 0.0),
        **engine_idle_metrics(rollout),
        **broadcast_metrics(batch.requests[0].weights_sent),
        # The tensors handed to an in-process engine (the broadcast's are weight_broadcast/megabytes).
        **({"weight_sync/megabytes": rollout.timings["weight_sync_bytes"] / 2**20}
           if "weight_sync_bytes" in rollout.timings else {}),  # fmt: skip
        **rollout.engine_metrics,  # engine actors: engine/restarts, time/engine_restart
        **run.rollouts.take_resume_metrics(),  # the first step after a resume that continues differently
        "time/learner_wait": learner_wait,
        "perf/learner_idle_fraction": learner_wait / step_time,
        "time/scoring": training_start - scoring_start,
        "time/training": training_time,
        "time/step": step_time,
        "time/from_scratch": time.time() - run.start_time,
    })  # fmt: skip
    run.logger.log(metrics, step)
    run.logger.log_samples(sample_rows(batch.prompts, rollout, samples["score"], args.run.num_samples_to_log), step)
    run.logger.log_histograms({"lengths/response_tokens": samples["response_length"]}, step)
    run.progress.set_postfix_str(format_progress(metrics, PROGRESS_KEYS))
    check_divergence(metrics, step, args.ppo.learning_rate)  # after logging (metrics.jsonl shows it), before saving
    if sizes.save_freq > 0 and step % sizes.save_freq == 0:
        save_checkpoint(run, step)
    if args.run.save_model_freq > 0 and step % args.run.save_model_freq == 0 and step < sizes.num_training_steps:
        save_model_snapshot(run, step)


def stop_with_checkpoint(run: "Run", step: int) -> None:
    """Write the checkpoint of `step` (unless --save_freq just did) and raise Preempted. Half of what is left of
    --preemption_timeout_s may go to waiting for the rollouts in flight of older policies; the rest is the write's.
    A rollout not stored is generated again on resume: one of the checkpoint's own policy is then the same batch
    (the same weights and sampling seed), one of an older policy is generated by the checkpoint's, with a warning."""
    if run.checkpointed is None or run.checkpointed[0] != step:
        save_checkpoint(run, step, wait_s=run.stop.seconds_left() / 2)
    raise Preempted(run.stop.signum, step, run.checkpointed[1])


def engine_idle_metrics(rollout) -> dict:
    """The engine's idle share since the rollout before this one (waiting for the learner's requests, or for the
    learner to take a rollout): `perf/engine_idle_fraction`."""
    idle, busy = rollout.timings.get("engine_idle"), rollout.timings.get("engine_busy")
    if idle is None or busy is None or idle + busy <= 0:
        return {}
    return {"time/engine_idle": idle, "perf/engine_idle_fraction": idle / (idle + busy)}


# ---- setup -----------------------------------------------------------------------------------------------------------


@dataclass
class RunData:
    """What the run reads, loaded and checked before any model: the policy's path and tokenizer, the prompts."""

    policy_path: str  # a local folder: a hub id's snapshot (hub_models.py)
    tokenizer: object
    stop_token_ids: list[int]
    train_dataset: object  # datasets.Dataset of tokenised prompts
    eval_prompts: PromptBatch | None
    local_args: Args  # the run's args with every model a local folder: what the learners load
    longest_prompt: int | None = None  # in tokens: the memory plan of Ray learner ranks, checked where they run
    eval_rows: list[dict] | None = None  # with --tools: the eval prompts' dataset rows, for their environments

    @property
    def num_train_prompts(self) -> int:
        return len(self.train_dataset)


@dataclass
class Run:
    """The parts of one run the loop works with, in the order `train` builds them."""

    args: Args
    sizes: BatchSizes
    data: RunData
    logger: MetricsLogger
    reward_manager: RewardManager
    generator: GenerationThread
    learner: Learner  # PPOLearner / GRPOLearner in this process, or ray_group.LearnerGroup: learner/seams.py
    rollouts: RolloutRequests
    stop: StopRequest
    start_time: float
    run_dir: RunDirectory  # the output_dir; holds an overwritten run until this one has a checkpoint or model
    progress: tqdm | None = None
    checkpointed: tuple[int, str] | None = None  # the step and folder of the newest checkpoint this process wrote
    batches: BatchCollector = field(init=False)  # each step's batch, from `rollouts`

    def __post_init__(self):
        ppo = self.args.ppo
        self.batches = BatchCollector(self.rollouts, self.reward_manager, async_steps(self.args.gen),
                                      self.sizes.prompts_per_step, ppo.filter_zero_std_groups,
                                      ppo.filter_max_extra_batches, self.data.stop_token_ids,
                                      ppo.filter_metric, with_tools=bool(self.args.gen.tools),
                                      with_agent=bool(self.args.gen.rollout_agent),
                                      compares_groups=ppo.algorithm == "grpo")  # fmt: skip


def load_data(args: Args, pinned_commits: dict | None = None) -> RunData:
    """The policy's tokenizer, the prompts (every row checked), and the models' vocabularies and sizes: a problem with
    any of them is a one-line error here, before any model loads. `pinned_commits`: a resumed run's hub models."""
    with as_config_errors():
        # Hub ids become snapshot folders at their revisions, here, before Ray starts: ZeRO-3 ranks read safetensors
        # from a folder, and a missing repo, revision or download is one line now, not an error after the engines load.
        local_args = with_local_models(args, pinned_commits)
        if pinned_commits:
            say(f"[ppo] resumed with the hub models' commits of the checkpoint: {describe_pins(pinned_commits)}")
        policy_path = local_args.model.model_name_or_path
        tokenizer = load_tokenizer(policy_path)
        train_dataset, eval_dataset = build_prompt_datasets(
            args.data, tokenizer, row_checker(args, "train"), row_checker(args, "eval"),
            keep_extra_columns=needs_rows(args.gen),  # each row's other columns, for its environment or agent
            # A native tool-call format (--tool_call_parser): the tools' schemas rendered into the prompts (tools=).
            tool_schemas=tool_call_schemas(args.gen, tokenizer, args.data.chat_template_name),
        )
        longest_prompt = max(len(ids) for ids in train_dataset["input_ids_prompt"])
        check_data(args, train_dataset, eval_dataset, longest_prompt)  # code rows' sandbox, the token budget
        check_models(local_args, policy_path, tokenizer, longest_prompt)  # vocabularies, context, memory (one process)
    # The eval split is small and fixed: read it from the dataset once, not row by row at every eval.
    eval_prompts = eval_rows = None
    if eval_dataset is not None:
        eval_prompts = prompt_batch(eval_dataset, list(range(len(eval_dataset))), tokenizer)
        eval_rows = environment_rows(eval_dataset, list(range(len(eval_dataset)))) if needs_rows(args.gen) else None
    return RunData(policy_path, tokenizer, stop_token_ids_for(tokenizer, args.gen.stop_token), train_dataset,
                   eval_prompts, local_args, longest_prompt, eval_rows)  # fmt: skip


def open_logger(args: Args, sizes: BatchSizes, resume: checkpoint.Checkpoint | None, data: RunData) -> MetricsLogger:
    """metrics.jsonl, samples.jsonl, lengths.jsonl and summary.json (continued on resume), and wandb when tracking."""
    if resume is not None:  # steps after the checkpoint are logged again
        for name in ("metrics.jsonl", "samples.jsonl", "lengths.jsonl"):
            for warning in repair_jsonl(os.path.join(args.run.output_dir, name), keep_through_step=resume.step):
                say(f"[ppo] warning: {warning}")
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
    if resume is None:  # the dataset's prompt lengths (wandb histogram + length_histograms.png)
        prompt_lengths = [len(ids) for ids in data.train_dataset["input_ids_prompt"]]
        logger.log_histograms({"lengths/prompt_tokens": prompt_lengths}, 0)
    logger.set_summary("status", "running")  # last: from here on, every ending says how it ended (`train`)
    return logger


@contextmanager
def start_workers(args: Args, sizes: BatchSizes, data: RunData, resume: checkpoint.Checkpoint | None,
                  stop: StopRequest):  # fmt: skip
    """The generation thread (its engine loads while the learner does), the learner, and the rollout requests between
    them, restored from `resume`; the generation side is stopped on the way out, and the learner too on an error."""
    placement = learner = None
    if args.dist.uses_ray:  # reserve the learners' bundles first: engine actors placed before could take them
        from open_instruct.run.placement import reserve_placement

        placement = reserve_placement(args.dist)  # starts Ray, or joins --ray_address
        stop.install()  # ray.init replaced our SIGTERM handler with its own (sys.exit): a preemption must checkpoint
    compute_dtype, engine_cores = None, None
    if args.gen.vllm_cpu_cores > 0:  # the learner (this thread) and the engine's thread each on their own cores
        learner_cores, engine_cores = split_cpu_cores(args.gen.vllm_cpu_cores)
        pin_this_thread(learner_cores)
        say(f"[ppo] CPU cores: the learner on {learner_cores}, the vLLM engine's thread on {engine_cores}")
    if not args.dist.uses_ray:  # the dtype probe times matmuls: run it before the engine loads on the same cores
        compute_dtype = learner_compute_dtype(args.model.learner_compute_dtype, learner_device())
    generator = start_generation_thread(args, data, sizes, placement, engine_cores)
    try:
        # vLLM sizes its KV cache from the GPU memory it finds free, so on a GPU a learner may share it measures
        # before any learner allocates: where the engines are (Ray's GPUs; this process's own for its engine).
        if (placement.uses_gpus if placement is not None else torch.cuda.is_available()):
            generator.wait_until_ready()
        # The learners load local folders; the driver's args keep the hub ids (the config logged, the model card).
        learner = build_learner(data.local_args, sizes, data, placement, compute_dtype)
        if args.dist.uses_ray:  # learner rank 0 sends every policy version to the engines (actors or in-process)
            from open_instruct.generation.weight_transfer import connect_engines

            generator.wait_until_ready()
            connect_engines(learner, generator.weight_receivers, args.dist)
        prompt_order = ShufflingIterator(len(data.train_dataset), sizes.prompts_per_step, args.run.seed)
        rollouts = RolloutRequests(generator, learner, data.train_dataset, data.tokenizer, prompt_order,
                                   data.eval_prompts, sizes.eval_freq, args.run.seed, args.dist.vllm_sync_timeout_s,
                                   broadcast=args.dist.uses_ray, async_steps=async_steps(args.gen),
                                   with_rows=needs_rows(args.gen))  # fmt: skip
        if resume is not None:
            learner.read_checkpoint(resume.path)
            rollouts.load_state_dict(resume.trainer_state)
            if generator.engine is not None:  # engine actors: --max_engine_restarts counts over the whole run
                generator.engine.restarts = resume.trainer_state.get("engine_restarts", 0)
            for warning in rollouts.send_unfinished(learner_version=resume.step).warnings(resume.path, resume.step):
                say(f"[ppo] warning: {warning}", error=True)
        yield generator, learner, rollouts
    except BaseException:
        if learner is not None:  # Ray learner ranks are stopped now, not at exit (after a run that ends well they
            learner.shutdown()  # still save the final model, then stop at exit); one process: nothing to stop
        raise
    finally:
        generator.shutdown()
        if generator.engine is not None:
            generator.engine.shutdown()


def adapter_serving(model) -> dict:
    """EngineConfig's LoRA fields: with --lora_weight_sync adapter the engine serves the adapters (vllm_engine)."""
    if model.lora_rank and model.lora_weight_sync == "adapter":
        return {"lora_rank": model.lora_rank, "lora_alpha": model.lora_alpha}
    return {}


def start_generation_thread(args: Args, data: RunData, sizes: BatchSizes, placement=None,
                            cpu_cores: list[int] | None = None) -> GenerationThread:  # fmt: skip
    """The generation thread, with an engine in this process (on `cpu_cores`, or all) or, with --vllm_num_engines,
    engine actors on Ray (with --single_gpu_mode in the learners' bundles of `placement`)."""
    engine_config = EngineConfig(
        data.policy_path,
        max_model_len=args.gen.max_token_length,
        seed=args.run.seed,
        dtype=args.gen.vllm_dtype,
        gpu_memory_utilization=args.gen.vllm_gpu_memory_utilization,
        enforce_eager=args.gen.vllm_enforce_eager,
        max_num_seqs=args.gen.vllm_max_num_seqs,
        kv_cache_memory_gb=args.gen.vllm_kv_cache_memory_gb,
        weight_sync=args.dist.vllm_sync_backend if args.dist.uses_ray else None,  # fed by Ray learners
        cpu_weight_layout=args.gen.vllm_cpu_weight_layout,
        **adapter_serving(args.model),
    )
    engines = None
    if args.dist.vllm_num_engines > 0:
        from open_instruct.generation.engine_actors import (
            start_engine_actors,  # imports ray; the in-process path never does
        )

        engines = start_engine_actors(args, engine_config, placement)
    settings = GenerationSettings(
        engine=engine_config,
        samples_per_prompt=args.ppo.number_samples_per_prompt,
        temperature=args.gen.temperature,
        response_length=args.gen.response_length,
        stop_token_ids=data.stop_token_ids,
        stop_strings=args.gen.stop_strings,
        eval_prompt_token_ids=data.eval_prompts.token_ids if data.eval_prompts is not None else None,
        eval_samples_per_prompt=args.run.eval_samples_per_prompt,
        mid_run_eval_samples_per_prompt=args.run.mid_run_eval_samples_per_prompt,
        final_policy_version=sizes.num_training_steps,
        batches_in_engine=batches_in_engine(args.gen),
        cpu_cores=cpu_cores,
        tools=tool_settings(args.gen, args.data.chat_template_name),
        eval_rows=data.eval_rows,
        agent=agent_settings(args.gen, args.data.chat_template_name, args.model.model_name_or_path),
    )
    thread = GenerationThread(settings, timeout_s=args.gen.queue_timeout_s, engine=engines)
    thread.start()
    return thread


def build_learner(args: Args, sizes: BatchSizes, data: RunData, placement=None, compute_dtype: tuple | None = None
                  ) -> Learner:  # fmt: skip
    """This process's learner (PPOLearner, or GRPOLearner with --algorithm grpo), or learner ranks of that class on
    Ray + DeepSpeed behind the same methods; `args` name every model by a local folder (`RunData.local_args`).
    `compute_dtype`: this process's (dtype, why), chosen before the engine started; Ray ranks choose on their own
    nodes."""
    if not args.dist.uses_ray:
        return learner_class(args.ppo.algorithm)(args, sizes, data.tokenizer, data.policy_path, data.stop_token_ids,
                                                 compute_dtype=compute_dtype)  # fmt: skip
    from open_instruct.learner.ray_group import LearnerGroup  # imports ray; the single-process path never does

    def check_devices(reports: list[dict]) -> None:  # learner rank 0's own measure, before any rank loads a model
        if args.dist.device_memory_gb is None:  # else checked against it before Ray started
            rank0 = reports[0]
            check_memory(args, data.longest_prompt, rank0["device_type"], rank0["free_memory_bytes"],
                         "learner rank 0's")  # fmt: skip

    return LearnerGroup(args, sizes, data.policy_path, data.stop_token_ids, placement, check_devices)


# ---- what the console says -------------------------------------------------------------------------------------------


def describe_run(args: Args, sizes: BatchSizes) -> str:
    ppo = args.ppo
    learners = f"{sizes.num_learners} learner ranks on Ray" if args.dist.uses_ray else "the learner in this process"
    return (
        f"{ppo.algorithm.upper()} in {'async' if args.gen.async_mode else 'sync'} mode, {sizes.num_training_steps} steps "
        f"of {sizes.rollout_batch_size} responses ({sizes.prompts_per_step} prompts x {ppo.number_samples_per_prompt}), "
        f"{ppo.num_epochs} epoch(s) of {ppo.num_mini_batches} minibatch(es), micro-batch {ppo.per_device_train_batch_size}, "
        f"{learners}"
    )


def describe_models(args: Args, data: RunData) -> str:
    model = args.model
    value = "none (GRPO)" if args.ppo.algorithm == "grpo" else (
        model.value_model_path or model.reward_model_path or "the policy with a new score head")  # fmt: skip
    if model.value_model_num_layers and args.ppo.algorithm != "grpo":
        value += f", its first {model.value_model_num_layers} layers (all, if it has fewer)"
    reference = "none (--beta 0)" if args.ppo.beta == 0 else "the initial policy"
    if model.lora_rank and args.ppo.beta != 0:
        reference = "the policy with its LoRA adapters disabled (the base)"
    lora = f"; LoRA rank {model.lora_rank}, alpha {model.lora_alpha:g}" if model.lora_rank else ""
    verifiers = f"reward function {args.reward.reward_function}" if args.reward.reward_function else "verifiers"
    rewards = [name for name, on in ((verifiers, args.reward.apply_verifiable_reward),
                                     (f"reward model {model.reward_model_path}", args.reward.reward_model_multiplier != 0)) if on]  # fmt: skip
    if args.gen.rollout_agent:  # the agent returns each rollout's reward
        rewards = [f"the agent {args.gen.rollout_agent}"]
    evals = f"{len(data.eval_prompts.token_ids)} eval prompts" if data.eval_prompts is not None else "no eval set"
    return (f"[ppo] policy {model.model_name_or_path} ({data.policy_path}){lora}; value model: {value}; "
            f"reference: {reference}; "
            f"reward: {' + '.join(rewards)}; {data.num_train_prompts} train prompts, {evals}")  # fmt: skip


def outputs_of(output_dir: str) -> list[str]:
    names = ["model/", "metrics.jsonl", "samples.jsonl", "training_curves.png", "correct_rate_vs_time.png",
             "length_histograms.png", "summary.json", "checkpoints/", console.LOG_NAME]  # fmt: skip
    return [name for name in names if os.path.exists(os.path.join(output_dir, name))]


# ---- the command line ------------------------------------------------------------------------------------------------


def cli(argv: list[str] | None = None, algorithm: str = "ppo") -> None:
    """Run `main`; errors end the process with one line on stderr (`error: ...`) and an exit code:

    2: the configuration (flags, files, data rows, output_dir) cannot work; nothing was trained. The traceback
       only with --debug or OPEN_INSTRUCT_DEBUG=1.
    128 + signal: stopped by SIGTERM/SIGINT after writing a checkpoint (the line says how to resume).
    1: the run failed while training (the traceback comes first, except for non-finite values, a diverged policy,
       a verifier failing on --reward_max_consecutive_failures responses in a row and a full disk), or its final
       model went to --fallback_save_dir (the line says where).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    try:
        main(argv, algorithm)
    except ConfigError as error:
        exit_for_config_error(error, debug)
    except Preempted as error:
        say(f"error: {error}", error=True)
        sys.stdout.flush()
        # Everything is on disk (fsynced) and the logs are closed; skip the interpreter's teardown of the in-process
        # vLLM engine (measured: ~9 s on 2 cores), because the scheduler's grace period is running.
        os._exit(128 + error.signum)
    except (checkpoint.NonFiniteError, DivergedError, RewardFailures) as error:
        if debug:
            traceback.print_exc(file=console.stream())
        say(f"error: stopped: {one_line(error)}; {resume_hint(argv, algorithm)}", error=True)
        sys.exit(1)
    except disk_space.DiskFullError as error:  # said in full: what did not fit, where, and what was kept
        if debug:
            traceback.print_exc(file=console.stream())
        hint = "" if error.rescued_to else f"; {resume_hint(argv, algorithm)}"
        say(f"error: {one_line(error)}{hint}", error=True)
        sys.exit(1)
    except Exception as error:  # noqa: BLE001 - a failure while training: its traceback, then one line
        if disk_space.is_out_of_space(error):  # a small write (a log line) on a full disk: the cause is the disk
            say(f"error: stopped: no space left on the disk: {one_line(error)}; {resume_hint(argv, algorithm)}",
                error=True)  # fmt: skip
            sys.exit(1)
        traceback.print_exc(file=console.stream())
        say(f"error: the run failed: {type(error).__name__}: {one_line(error)}; {resume_hint(argv, algorithm)}",
            error=True)  # fmt: skip
        sys.exit(1)


def resume_hint(argv: list[str], algorithm: str = "ppo") -> str:
    try:
        output_dir = parse_args(argv, algorithm).run.output_dir
    except ValueError:
        return "see the message above"
    checkpoints = checkpoint.complete_checkpoints(output_dir)
    if not checkpoints:
        return f"no checkpoint to resume from in {output_dir}"
    return f"the newest checkpoint is {checkpoints[-1]} (resume with --resume)"


if __name__ == "__main__":
    console.exit_without_teardown(cli)
