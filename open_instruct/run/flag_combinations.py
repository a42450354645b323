"""The rules that tie flags together: combinations that cannot work (--tools flags without --tools, GRPO with a value
model, async lag with the engine's old logprobs, engine actors without Ray, ...), checked once each flag's own value is
valid (its `check=`: run/flags.py). `validate_combinations` runs them all, as the first phase of run/validation.py's
checks; each raises `ConfigError`, whose message names the flags and the fix.
"""

import dataclasses

from open_instruct.environments.routing import routing_problem
from open_instruct.environments.tool_parsers import AUTO, TAGS, vllm_parser_names
from open_instruct.rewards.reward_function import load_reward_function
from open_instruct.run.args import (
    VLLM_LORA_RANKS,
    Args,
    ConfigError,
    GenerationArgs,
    async_steps,
    batches_in_engine,
    needs_off_policy_correction,
)


def validate_combinations(args: Args) -> None:
    """The combinations a run needs, once each flag's own value is valid; raises ConfigError for the first problem."""
    if args.reward.reward_model_multiplier != 0 and args.model.reward_model_path is None:
        raise ConfigError(
            f"--reward_model_multiplier {args.reward.reward_model_multiplier} needs a reward model; pass "
            "--reward_model_path, or set --reward_model_multiplier 0."
        )
    if not args.reward.apply_verifiable_reward and args.reward.reward_model_multiplier == 0:
        raise ConfigError(
            "No reward is enabled (--apply_verifiable_reward false and --reward_model_multiplier 0); pass "
            "--apply_verifiable_reward true or a non-zero --reward_model_multiplier with --reward_model_path."
        )
    validate_reward_function(args)
    validate_async_flags(args)
    validate_tool_flags(args.gen)
    validate_agent_flags(args)
    if (args.ppo.truncated_importance_sampling_ratio_cap or 0) > 0 and args.ppo.old_logprobs_from == "vllm":
        raise ConfigError(
            "--truncated_importance_sampling_ratio_cap weights tokens by pi_learner_old / pi_vllm, which is 1 with "
            "--old_logprobs_from vllm; pass --old_logprobs_from learner, or "
            "--truncated_importance_sampling_ratio_cap 0."
        )
    validate_grpo_flags(args)
    if args.run.resume is not None and args.run.overwrite_output_dir:
        raise ConfigError("--resume continues the run in --output_dir and --overwrite_output_dir deletes it; pick one.")
    validate_engine_flags(args.dist)
    validate_deepspeed_flags(args.dist)
    validate_lora_flags(args)


def validate_lora_flags(args: Args) -> None:
    """LoRA runs in every learner mode (one process, Ray ranks at ZeRO-0/2/3, engine actors; PPO and GRPO)."""
    model = args.model
    if model.lora_rank == 0 and model.lora_target_modules:
        raise ConfigError(
            f"--lora_target_modules {' '.join(model.lora_target_modules)} names the layers of LoRA adapters, and "
            "--lora_rank is 0 (full fine-tuning); pass --lora_rank R (e.g. 16), or drop it."
        )
    default_alpha = next(f.default for f in dataclasses.fields(model) if f.name == "lora_alpha")
    if model.lora_rank == 0 and model.lora_alpha != default_alpha:
        raise ConfigError(
            f"--lora_alpha {model.lora_alpha:g} scales LoRA adapters, and --lora_rank is 0 (full fine-tuning, no "
            "adapters); pass --lora_rank R (e.g. 16), or drop --lora_alpha."
        )
    if model.lora_weight_sync == "adapter":
        if model.lora_rank == 0:
            raise ConfigError("--lora_weight_sync adapter sends LoRA adapters, and --lora_rank is 0 (full fine-tuning); "
                              "pass --lora_rank R (e.g. 16), or drop --lora_weight_sync.")  # fmt: skip
        if model.lora_rank > VLLM_LORA_RANKS[-1]:
            raise ConfigError(f"--lora_weight_sync adapter: vLLM serves adapters of rank <= {VLLM_LORA_RANKS[-1]}, "
                              f"and --lora_rank is {model.lora_rank}; use --lora_weight_sync merged.")  # fmt: skip
        if args.dist.uses_ray:
            raise ConfigError(
                "--lora_weight_sync adapter runs with one learner process and its in-process engine; Ray learners and "
                "engine actors send merged weights: drop --lora_weight_sync adapter (or the Ray flags: "
                "--num_learners_per_node, --deepspeed_stage, --vllm_num_engines, --ray_address)."
            )


TOOL_CALL_FLAGS = ("max_tool_calls", "tool_timeout_s", "tool_output_max_tokens", "tool_output_wrapper",
                   "environment_column", "tool_workers", "max_parallel_tool_calls", "tool_call_parser",
                   "tool_reentry_steps")


def validate_tool_flags(gen: GenerationArgs) -> None:
    """--tools and the flags that shape a call (the trainer's, and `open_instruct.evaluate`'s): known names, each
    environment's routing, a known parser. Without --tools, a call-shaping flag set away from its default would change
    nothing: refused, as a forgotten --tools is the likelier mistake."""
    if not gen.tools:
        defaults = {f.name: f.default for f in dataclasses.fields(gen)}
        for flag in TOOL_CALL_FLAGS:
            if flag == "tool_call_parser" and gen.rollout_agent:  # how the endpoint reads an agent's tool calls
                continue
            if getattr(gen, flag) != defaults[flag]:
                raise ConfigError(
                    f"--{flag} {getattr(gen, flag)!r} shapes tool calls, and --tools is not set (no tool is called); "
                    f"pass --tools NAME (e.g. calculator), or drop --{flag}."
                )
        return
    problem = routing_problem(gen.tools, gen.environment_column)
    if problem is not None:
        raise ConfigError(f"{problem}.")
    validate_tool_call_parser(gen)


AGENT_FLAGS = ("agent_concurrency", "agent_timeout_s", "agent_max_calls", "agent_failed_rollouts", "agent_host",
               "agent_port")


def validate_agent_flags(args: Args) -> None:
    """--rollout_agent: a function that can take (row, client), loaded before any model (one line otherwise), ports
    that exist, and the modes it runs in. Without it, an agent flag set away from its default is refused."""
    gen = args.gen
    if not gen.rollout_agent:
        defaults = {f.name: f.default for f in dataclasses.fields(gen)}
        for flag in AGENT_FLAGS:
            if getattr(gen, flag) != defaults[flag]:
                raise ConfigError(f"--{flag} {getattr(gen, flag)!r} shapes agent rollouts, and --rollout_agent is not "
                                  f"set; pass --rollout_agent path/to/agent.py:run, or drop --{flag}.")  # fmt: skip
        return
    from open_instruct.environments.agent_runner import agent_problem

    problem = agent_problem(gen.rollout_agent)
    if problem is not None:
        raise ConfigError(f"{problem}.")
    last_port = gen.agent_port + max(0, args.dist.vllm_num_engines - 1)  # engine actor i serves on --agent_port + i
    if gen.agent_port and last_port > 65535:
        raise ConfigError(f"--agent_port {gen.agent_port}: with {args.dist.vllm_num_engines} engines the endpoints "
                          f"would need ports up to {last_port}; pass a port of at most "
                          f"{65536 - args.dist.vllm_num_engines}, or 0 (free ports).")  # fmt: skip
    # The agent brings its own tools and reward.
    refused = [("--tools", bool(gen.tools), "the agent runs its own tools: drop --tools"),
               ("--reward_model_path", bool(args.model.reward_model_path), "the agent returns the reward: drop it"),
               ("--filter_zero_std_groups", args.ppo.filter_zero_std_groups, "not yet with agents: drop it")]  # fmt: skip
    for flag, is_set, why in refused:
        if is_set:
            raise ConfigError(f"{flag} with --rollout_agent: {why}.")


def validate_tool_call_parser(gen: GenerationArgs) -> None:
    """--tool_call_parser names a parser (tags, auto, or one of vLLM's: importing vLLM, a few seconds, only then): the
    check that needs no tokenizer (`tool_call_schemas` does the rest: the schemas, environments that take native
    calls)."""
    parser = gen.tool_call_parser
    if parser in (TAGS, AUTO):
        return
    known = vllm_parser_names()
    if parser not in known:
        raise ConfigError(f"--tool_call_parser {parser} is not a known parser; pass auto, tags or one of vLLM's "
                          f"({', '.join(sorted(known)[:12])}, ...).")  # fmt: skip


def validate_reward_function(args: Args) -> None:
    """--reward_function: the file and the function are there and take (response, ground_truth), before any model
    loads (importing the user's file is the only way to know)."""
    spec = args.reward.reward_function
    if spec is None:
        return
    if not args.reward.apply_verifiable_reward:
        raise ConfigError(
            f"--reward_function {spec} replaces the rows' verifiers, and --apply_verifiable_reward is false; pass "
            "--apply_verifiable_reward true, or drop --reward_function."
        )
    try:
        load_reward_function(spec)
    except ValueError as error:
        raise ConfigError(str(error)) from error


def validate_async_flags(args: Args) -> None:
    """--async_steps, --inflight_updates and --vllm_cpu_cores: what they combine with."""
    gen, ppo, dist = args.gen, args.ppo, args.dist
    if gen.vllm_cpu_cores > 0:
        import torch

        from open_instruct.run.devices import split_cpu_cores

        if dist.uses_ray or torch.cuda.is_available():
            raise ConfigError(
                f"--vllm_cpu_cores {gen.vllm_cpu_cores} splits a CPU machine's cores between the learner and the engine in "
                "this process; engine actors and GPUs have their own devices: drop it."
            )
        try:
            split_cpu_cores(gen.vllm_cpu_cores)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    if not gen.async_mode and (gen.async_steps != 1 or gen.inflight_updates):
        flag = "--inflight_updates true" if gen.inflight_updates else f"--async_steps {gen.async_steps}"
        raise ConfigError(f"{flag} needs async mode, and --async_mode is false; drop {flag.split()[0]} or pass "
                          "--async_mode true.")  # fmt: skip
    if needs_off_policy_correction(gen) and ppo.old_logprobs_from == "vllm":
        if ppo.truncated_importance_sampling_ratio_cap is None:
            lag = f"--async_steps {gen.async_steps}" + (" with --inflight_updates" if gen.inflight_updates else "")
            raise ConfigError(
                f"{lag} trains on data up to {gen.async_steps} policy versions old, and --old_logprobs_from vllm would "
                "take PPO's ratio against that stale policy (most tokens clipped at once); pass --old_logprobs_from "
                "learner (decoupled PPO with a truncated importance weight, the default correction), or "
                "--truncated_importance_sampling_ratio_cap 0 to train without a correction."
            )
    if batches_in_engine(gen) > 1:
        if dist.max_engine_restarts > 0:
            raise ConfigError(
                f"--max_engine_restarts {dist.max_engine_restarts} with --inflight_updates: a dead engine's half "
                "generated batches cannot be regenerated as they were; pass --max_engine_restarts 0 (resume from a "
                "checkpoint instead), or drop --inflight_updates."
            )
    elif async_steps(gen) > 1 and dist.uses_ray:
        raise ConfigError(
            f"--async_steps {gen.async_steps} without --inflight_updates with Ray learners: learner rank 0 sends each "
            "policy straight into the engines, which can take it only between batches, so the learner would wait for "
            "the batches ahead of it; pass --inflight_updates true (the engines take it between two decode steps)."
        )


def validate_grpo_flags(args: Args) -> None:
    """GRPO compares the responses to a prompt with each other and trains no value model: the flags that cannot
    work with that fail here rather than being ignored."""
    ppo = args.ppo
    if args.reward.overlong_buffer_length >= args.gen.response_length:
        raise ConfigError(
            f"--overlong_buffer_length {args.reward.overlong_buffer_length} is not below --response_length "
            f"{args.gen.response_length}: every response would be penalised; pass a buffer shorter than the responses "
            "(DAPO: a fifth of them), or 0 to turn it off."
        )
    if ppo.filter_metric != "correct" and not ppo.filter_zero_std_groups:
        raise ConfigError(
            f"--filter_metric {ppo.filter_metric} says what the groups of --filter_zero_std_groups must differ in, and "
            "that filter is off; pass --filter_zero_std_groups true, or drop --filter_metric."
        )
    if ppo.filter_zero_std_groups:
        if ppo.algorithm != "grpo":
            raise ConfigError(
                "--filter_zero_std_groups drops groups whose scores are all equal because GRPO gives them no advantage; "
                "PPO's value model gives them one. Pass --algorithm grpo (or grpo_vllm_thread_ray_gtrl), or drop it."
            )
        if args.reward.reward_model_multiplier != 0:
            raise ConfigError(
                "--filter_zero_std_groups scores each batch before the learner runs, with the verifiers alone; a reward "
                "model's score comes from the learner's forward pass. Drop the filter, or --reward_model_multiplier 0."
            )
    if ppo.algorithm != "grpo":
        return
    if ppo.number_samples_per_prompt < 2:
        raise ConfigError(
            f"--number_samples_per_prompt {ppo.number_samples_per_prompt} is too few for GRPO, whose advantages "
            "compare the responses to the same prompt with each other; pass --number_samples_per_prompt 2 or more "
            "(e.g. 8)."
        )
    if ppo.beta != 0 and not ppo.kl_in_loss:
        raise ConfigError(
            f"GRPO takes its advantages from the scores alone, so --beta {ppo.beta:g} with --kl_in_loss false (a KL "
            "penalty in the reward) would be ignored; pass --kl_in_loss true (the KL as a k3 loss term), or --beta 0."
        )
    value_flags = {
        "--value_model_path": args.model.value_model_path is not None,
        "--value_model_revision": args.model.value_model_revision is not None,
        "--value_model_num_layers": args.model.value_model_num_layers != 0,
        "--value_learning_rate": ppo.value_learning_rate is not None,
        "--whiten_rewards": ppo.whiten_rewards,
    }
    if set_flags := [flag for flag, is_set in value_flags.items() if is_set]:
        raise ConfigError(
            f"{', '.join(set_flags)} configure PPO's value model and per-token rewards, which GRPO does not use; drop "
            "them, or run PPO."
        )


def validate_deepspeed_flags(dist) -> None:
    if dist.deepspeed_weights_dtype == "bfloat16" and dist.deepspeed_stage == 0:
        raise ConfigError(
            "--deepspeed_weights_dtype bfloat16 needs ZeRO stage 2 or 3 (DeepSpeed cannot sum a bf16 engine's "
            "gradients in fp32 at stage 0); pass --deepspeed_stage 2 or 3, or --deepspeed_weights_dtype float32."
        )
    if dist.deepspeed_weights_dtype != "auto" and not dist.uses_ray:
        raise ConfigError(
            "--deepspeed_weights_dtype applies to DeepSpeed learner ranks; pass --deepspeed_stage 2 or 3 (or more "
            "than one learner), or drop it: the single-process learner keeps fp32 weights."
        )


def validate_engine_flags(dist) -> None:
    """Engine actors and the weight transfer: the combinations that cannot work together, before Ray starts.

    What depends on the devices (NCCL needs every member on a GPU, IPC a GPU shared with a learner) is decided later
    from the devices' own reports (generation/weight_transfer.py); only a local run, whose Ray cluster is this very
    machine, is checked here against this machine's CUDA (a count, which creates no CUDA context).
    """
    import torch

    has_cuda = torch.cuda.is_available()
    if dist.vllm_num_engines == 0 and (dist.vllm_tensor_parallel_size > 1 or dist.single_gpu_mode):
        raise ConfigError(
            "--vllm_tensor_parallel_size and --single_gpu_mode apply to engine actors; pass --vllm_num_engines N "
            "(N >= 1), or drop them."
        )
    if not dist.uses_ray and dist.vllm_sync_backend != "auto":
        raise ConfigError(
            "--vllm_sync_backend sets how Ray learner ranks send weights to the engines; the single-process learner "
            "hands its tensors to its engine directly. Drop it, or use Ray learners (--num_learners_per_node, "
            "--vllm_num_engines)."
        )
    if dist.max_engine_restarts > 0 and dist.vllm_num_engines < 2:
        raise ConfigError(
            f"--max_engine_restarts {dist.max_engine_restarts} needs --vllm_num_engines 2 or more (got "
            f"{dist.vllm_num_engines}): a surviving engine generates a dead one's prompts while its replacement loads; "
            "pass --vllm_num_engines 2 or more, or drop --max_engine_restarts."
        )
    if dist.single_gpu_mode and (dist.vllm_num_engines != dist.num_learners or dist.vllm_tensor_parallel_size != 1):
        raise ConfigError(
            f"--single_gpu_mode puts one engine beside each learner rank on its GPU: pass --vllm_num_engines "
            f"{dist.num_learners} (one per learner) and --vllm_tensor_parallel_size 1."
        )
    if dist.single_gpu_mode and dist.vllm_sync_backend == "nccl":
        raise ConfigError(
            "--single_gpu_mode puts learner rank 0 and engine 0 on one GPU, and NCCL refuses two ranks of a group on "
            "one GPU ('Duplicate GPU detected'); use --vllm_sync_backend auto (CUDA IPC on GPUs) or gloo."
        )
    if dist.vllm_sync_backend == "ipc" and not dist.single_gpu_mode:
        raise ConfigError(
            "--vllm_sync_backend ipc shares GPU memory between a learner rank and the engine on its GPU; it needs "
            "--single_gpu_mode (else use auto, nccl or gloo)."
        )
    if dist.vllm_tensor_parallel_size > 1 and not has_cuda and dist.ray_address is None:
        raise ConfigError("--vllm_tensor_parallel_size > 1 needs GPUs (this machine has none); use 1 on CPUs.")
    if dist.vllm_sync_backend in ("nccl", "ipc") and not has_cuda and dist.ray_address is None:
        raise ConfigError(f"--vllm_sync_backend {dist.vllm_sync_backend} needs GPUs (this machine has none); use gloo or auto.")

