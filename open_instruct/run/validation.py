"""Fail fast: everything a run needs is checked before any model loads, with one-line errors.

`validate_flags` checks each flag's value against a table of rules; `validate_hub` the Hub settings of
`--push_to_hub` (a push that would fail after hours of training fails now instead); `validate_models` the
model folders' vocabularies and context lengths against the policy's tokens; `validate_memory` prints the learner's
memory plan and refuses a run that cannot fit; `validate_work` the sampling that could never finish;
`validate_async_depth` an --async_steps the run's steps cannot use; `validate_packing` a token budget below one
sequence; `row_checker` every dataset row the run will read (ground truth present where its verifier needs one,
verifier known); `validate_code_sandbox` that code rows' sandbox starts and runs a program. Each raises
`ConfigError`, whose message names the value and the fix; the CLI prints it as `error: ...` and exits with code 2
(see `ppo_vllm_thread_ray_gtrl.cli`). `start_warnings` names settings that work but not as a user would expect.
"""

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterable, Iterator

from open_instruct.environments.native_tools import tool_call_format
from open_instruct.environments.routing import environment_row, routing_problem, row_environment_problem
from open_instruct.environments.tool_parsers import AUTO, TAGS, vllm_parser_names
from open_instruct.rewards.config import CODE_VERIFIER, code_limits
from open_instruct.rewards.reward_function import load_reward_function
from open_instruct.rewards.verifiers import GROUND_TRUTH_CHECKS, VERIFIER_ALIASES, VERIFIERS, resolve_verifier_name
from open_instruct.run.args import (
    VLLM_LORA_RANKS,
    Args,
    BatchSizes,
    ConfigError,
    GenerationArgs,
    async_steps,
    batches_in_engine,
    needs_off_policy_correction,
)
from open_instruct.sandbox import MODES as SANDBOX_MODES
from open_instruct.sandbox import Sandbox, SandboxUnavailable


def one_line(error: BaseException) -> str:
    """An error's message on one line (some libraries' messages span several)."""
    return " ".join(str(error).split()) or type(error).__name__


@contextlib.contextmanager
def as_config_errors() -> Iterator[None]:
    """Errors raised while the run is being set up (flags, files, data rows) become ConfigError: the run's inputs
    cannot work, nothing was trained, and the CLI reports them in one line with exit code 2."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, OSError) as error:
        raise ConfigError(one_line(error)) from error
    except Exception as error:  # noqa: BLE001 - e.g. a hub dataset lookup's own error types
        raise ConfigError(f"{type(error).__name__}: {one_line(error)}") from error


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


# --queue_timeout_s bounds every wait on generation, the first batch's (the engine still loading) included: below a
# minute a healthy run times out.
MIN_QUEUE_TIMEOUT_S = 60

# (is the value valid, what is expected): the kinds of value a flag can hold.
AT_LEAST_1 = (lambda v: v >= 1, "an integer >= 1")
NON_NEGATIVE_INT = (lambda v: v >= 0, "an integer >= 0")
NON_NEGATIVE = (lambda v: _finite(v) and v >= 0, "a number >= 0")
POSITIVE = (lambda v: _finite(v) and v > 0, "a number > 0")
PROBABILITY = (lambda v: _finite(v) and 0 <= v <= 1, "a number in [0, 1]")
FRACTION = (lambda v: _finite(v) and 0 < v <= 1, "a fraction in (0, 1]")
FINITE = (lambda v: _finite(v), "a finite number")
NAME = (lambda v: bool(v) and "/" not in v, "a name without '/'")
FOLDER = (lambda v: bool(v) and not os.path.isfile(v), "a folder, not a file")


def _flag_rules(args: Args) -> list[tuple[str, object, tuple]]:
    """(flag, value, (is_valid, what is expected)) for every flag with a constrained value."""
    ppo, gen, run, data, reward = args.ppo, args.gen, args.run, args.data, args.reward
    return [
        ("learning_rate", ppo.learning_rate, NON_NEGATIVE),
        (
            "value_learning_rate",
            ppo.value_learning_rate,
            (lambda v: v is None or NON_NEGATIVE[0](v), "a number >= 0 (or unset: --learning_rate)"),
        ),
        ("lr_scheduler_type", ppo.lr_scheduler_type, (lambda v: v in _scheduler_names(), _scheduler_list())),
        ("warmup_ratio", ppo.warmup_ratio, (lambda v: _finite(v) and 0 <= v < 1, "a number in [0, 1)")),
        ("weight_decay", ppo.weight_decay, NON_NEGATIVE),
        ("max_grad_norm", ppo.max_grad_norm, POSITIVE),
        ("total_episodes", ppo.total_episodes, AT_LEAST_1),
        ("num_epochs", ppo.num_epochs, AT_LEAST_1),
        ("num_mini_batches", ppo.num_mini_batches, AT_LEAST_1),
        ("per_device_train_batch_size", ppo.per_device_train_batch_size, AT_LEAST_1),
        ("local_rollout_batch_size", ppo.local_rollout_batch_size, AT_LEAST_1),
        ("number_samples_per_prompt", ppo.number_samples_per_prompt, AT_LEAST_1),
        ("beta", ppo.beta, NON_NEGATIVE),
        ("cliprange", ppo.cliprange, POSITIVE),
        ("cliprange_value", ppo.cliprange_value, POSITIVE),
        ("vf_coef", ppo.vf_coef, NON_NEGATIVE),
        (
            "truncated_importance_sampling_ratio_cap",
            ppo.truncated_importance_sampling_ratio_cap,
            (lambda v: v is None or (_finite(v) and (v == 0 or v >= 1)),
             "0 (off) or a number >= 1 (a cap below 1 scales all tokens), or unset (on in async with lag above 1)"),
        ),
        ("gamma", ppo.gamma, PROBABILITY),
        ("lam", ppo.lam, PROBABILITY),
        ("response_length", gen.response_length, AT_LEAST_1),
        ("max_token_length", gen.max_token_length, (lambda v: v >= 2, "an integer >= 2")),
        ("temperature", gen.temperature, (POSITIVE[0], "a number > 0: PPO samples at it and divides logits by it")),
        ("vllm_gpu_memory_utilization", gen.vllm_gpu_memory_utilization, FRACTION),
        ("vllm_max_num_seqs", gen.vllm_max_num_seqs, AT_LEAST_1),
        (
            "vllm_kv_cache_memory_gb",
            gen.vllm_kv_cache_memory_gb,
            (lambda v: v is None or POSITIVE[0](v), "a number of GiB > 0 (or unset: vLLM's default)"),
        ),
        ("queue_timeout_s", gen.queue_timeout_s,
         (lambda v: _finite(v) and v >= MIN_QUEUE_TIMEOUT_S, f"seconds >= {MIN_QUEUE_TIMEOUT_S} (the longest wait for "
          "a rollout, loading the engine and generating a batch; default 1800)")),
        ("max_vllm_logprob_diff", gen.max_vllm_logprob_diff, NON_NEGATIVE),
        ("max_prompt_token_length", data.max_prompt_token_length, AT_LEAST_1),
        ("dataset_seed", data.dataset_seed, NON_NEGATIVE_INT),
        ("seed", run.seed, NON_NEGATIVE_INT),
        ("save_freq", run.save_freq, (lambda v: v == -1 or v >= 1, "-1 (no checkpoints) or steps >= 1")),
        ("save_model_freq", run.save_model_freq, (lambda v: v == -1 or v >= 1, "-1 (final model only) or steps >= 1")),
        ("keep_last_n", run.keep_last_n, AT_LEAST_1),
        ("fallback_save_dir", run.fallback_save_dir, FOLDER),
        ("num_evals", run.num_evals, (lambda v: v >= 0, "an integer >= 0 (0: no evals)")),
        ("eval_samples_per_prompt", run.eval_samples_per_prompt, NON_NEGATIVE_INT),
        ("mid_run_eval_samples_per_prompt", run.mid_run_eval_samples_per_prompt,
         (lambda v: v is None or (isinstance(v, int) and v >= 0), "an integer >= 0 (0: greedy only), or unset")),
        ("num_samples_to_log", run.num_samples_to_log, NON_NEGATIVE_INT),
        ("preemption_timeout_s", run.preemption_timeout_s, POSITIVE),
        ("exp_name", run.exp_name, NAME),
        ("run_name", run.run_name, NAME),
        ("output_dir", run.output_dir, FOLDER),
        ("verification_reward", reward.verification_reward, FINITE),
        ("reward_model_multiplier", reward.reward_model_multiplier, FINITE),
        ("penalty_reward_value", reward.penalty_reward_value, FINITE),
        ("r1_style_format_reward", reward.r1_style_format_reward, FINITE),
        ("vllm_num_engines", args.dist.vllm_num_engines, NON_NEGATIVE_INT),
        ("vllm_tensor_parallel_size", args.dist.vllm_tensor_parallel_size, AT_LEAST_1),
        ("vllm_sync_bucket_mb", args.dist.vllm_sync_bucket_mb, POSITIVE),
        ("vllm_sync_timeout_s", args.dist.vllm_sync_timeout_s, POSITIVE),
        ("max_engine_restarts", args.dist.max_engine_restarts, NON_NEGATIVE_INT),
        ("learner_timeout_s", args.dist.learner_timeout_s, POSITIVE),
        ("logprob_chunk_size", args.ppo.logprob_chunk_size, (lambda v: v >= 0, "an integer >= 0 (0: all positions at once)")),
        ("filter_max_extra_batches", args.ppo.filter_max_extra_batches, NON_NEGATIVE_INT),
        ("overlong_buffer_length", reward.overlong_buffer_length, NON_NEGATIVE_INT),
        ("overlong_penalty_factor", reward.overlong_penalty_factor, NON_NEGATIVE),
        ("code_sandbox", reward.code_sandbox, (lambda v: v in SANDBOX_MODES, "one of " + ", ".join(SANDBOX_MODES))),
        ("code_workers", reward.code_workers, AT_LEAST_1),
        ("code_max_tests", reward.code_max_tests, (lambda v: v >= 0, "an integer >= 0 (0: every test of a row)")),
        ("code_pass_threshold", reward.code_pass_threshold,
         (lambda v: v is None or (_finite(v) and 0 < v <= 1), "a fraction in (0, 1] (or unset: the fraction passed)")),
        ("code_timeout_s", reward.code_timeout_s, POSITIVE),
        ("reward_timeout_s", reward.reward_timeout_s, POSITIVE),
        ("reward_max_consecutive_failures", reward.reward_max_consecutive_failures,
         (lambda v: v >= 0, "an integer >= 0 (0: never stop)")),
        ("code_memory_mb", reward.code_memory_mb, (lambda v: v >= 64, "an integer >= 64 (Python itself needs ~30)")),
        ("async_steps", args.gen.async_steps, AT_LEAST_1),
        ("vllm_cpu_cores", args.gen.vllm_cpu_cores, NON_NEGATIVE_INT),
        ("max_tokens_per_micro_batch", args.ppo.max_tokens_per_micro_batch,
         (lambda v: v >= 0, "an integer >= 0 (0: micro-batches of --per_device_train_batch_size padded rows)")),
        ("device_memory_gb", args.dist.device_memory_gb, (lambda v: v is None or POSITIVE[0](v), "a number of GB > 0")),
        ("lora_rank", args.model.lora_rank, (lambda v: v >= 0, "an integer >= 0 (0: full fine-tuning)")),
        ("value_model_num_layers", args.model.value_model_num_layers,
         (lambda v: v >= 0, "an integer >= 0 (0: all the layers of the value model's init)")),
        ("lora_alpha", args.model.lora_alpha, POSITIVE),
        ("lora_dropout", args.model.lora_dropout,
         (lambda v: v == 0, "0: the engine samples with the merged weights and no dropout, so dropout in the adapters "
          "would make the learner's logprobs differ from the rollout's (rollout and training must compute the same "
          "function)")),
    ]  # fmt: skip


def _scheduler_names() -> set[str]:
    from transformers import SchedulerType

    return {scheduler.value for scheduler in SchedulerType}


def _scheduler_list() -> str:
    return "one of " + ", ".join(sorted(_scheduler_names()))


def validate_flags(args: Args) -> None:
    """Every flag value in range, and the combinations a run needs; raises ConfigError for the first problem."""
    for flag, value, (is_valid, expected) in _flag_rules(args):
        if not is_valid(value):
            raise ConfigError(f"--{flag} {value!r} is not valid; expected {expected}.")
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
    """--tools and the flags that shape a call: known names, limits that can be met, a wrapper that holds the output
    (the trainer's, and `open_instruct.evaluate`'s). Without --tools, a call-shaping flag set away from its default
    would change nothing: refused, as a forgotten --tools is the likelier mistake."""
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
    rules = [
        ("max_tool_calls", gen.max_tool_calls, AT_LEAST_1),
        ("tool_timeout_s", gen.tool_timeout_s, POSITIVE),
        ("tool_output_max_tokens", gen.tool_output_max_tokens, AT_LEAST_1),
        ("tool_workers", gen.tool_workers, AT_LEAST_1),
        ("max_parallel_tool_calls", gen.max_parallel_tool_calls, AT_LEAST_1),
        ("tool_reentry_steps", gen.tool_reentry_steps, NON_NEGATIVE_INT),
    ]
    for flag, value, (is_valid, expected) in rules:
        if not is_valid(value):
            raise ConfigError(f"--{flag} {value!r} is not valid; expected {expected}.")
    wrapper = gen.tool_output_wrapper
    try:
        wraps = wrapper.count("{output}") == 1 and wrapper.format(output="") is not None
    except (KeyError, IndexError, ValueError):
        wraps = False
    if not wraps:
        raise ConfigError(
            f"--tool_output_wrapper {wrapper!r} is not valid; expected a text holding {{output}} once and no other "
            "braces (write a literal brace as {{ or }})."
        )


AGENT_FLAGS = ("agent_concurrency", "agent_timeout_s", "agent_max_calls", "agent_failed_rollouts", "agent_host",
               "agent_port")


def validate_agent_flags(args: Args) -> None:
    """--rollout_agent: a function that can take (row, client), loaded before any model (one line otherwise), limits
    that can be met, and the modes it runs in. Without it, an agent flag set away from its default is refused."""
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
    for flag, value, (is_valid, expected) in [("agent_concurrency", gen.agent_concurrency, AT_LEAST_1),
                                              ("agent_timeout_s", gen.agent_timeout_s, POSITIVE),
                                              ("agent_max_calls", gen.agent_max_calls, AT_LEAST_1),
                                              ("agent_port", gen.agent_port, NON_NEGATIVE_INT)]:  # fmt: skip
        if not is_valid(value):
            raise ConfigError(f"--{flag} {value!r} is not valid; expected {expected}.")
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


def tool_call_schemas(gen: GenerationArgs, tokenizer, chat_template_name: str | None) -> list[dict]:
    """The tools' schemas the prompts are rendered with (`tools=`): empty with the tags protocol. The parser that
    --tool_call_parser stands for with this template, the schemas (valid JSON Schema) and a template that renders
    tools are checked here, before any model loads: ConfigError in one line otherwise."""
    if not gen.tools:
        return []
    try:
        return tool_call_format(gen.tools, gen.tool_call_parser, tokenizer, chat_template_name).schemas
    except ValueError as error:
        raise ConfigError(f"{one_line(error)}.") from None


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


# Sampling that could not finish even at a generous rate is a typo (4000000 samples per prompt for 4), not a plan.
# Generous, per device: the CPU engine measured ~120 tokens/s per core here (docs/speed.md, "Generation": 242 tokens/s
# on 2 cores, SmolLM2-135M in fp32), so a CPU machine gets 1,000 tokens/s per core, however many engines share the
# cores; a GPU engine with a small model and large batches does thousands to ~100k, so 200k per engine. The bounds are
# far past any run we know of (Tulu 3 8B PPO samples ~0.5 M response tokens a step, ~0.2 G in all), so they refuse
# only what would never end.
GENEROUS_TOKENS_PER_S_PER_CPU_CORE = 1_000
GENEROUS_TOKENS_PER_S_PER_GPU_ENGINE = 200_000
MAX_STEP_S = 24 * 3600  # one step's sampling
MAX_RUN_S = 365 * 24 * 3600  # the whole run's


def generous_sampling_rate(on_gpus: bool, num_engines: int, cpu_cores: int) -> tuple[int, str]:
    """Response tokens per second no setup of these devices beats, and how it was counted."""
    if on_gpus:
        engines = max(1, num_engines)
        return GENEROUS_TOKENS_PER_S_PER_GPU_ENGINE * engines, f"{engines} GPU engine(s)"
    return GENEROUS_TOKENS_PER_S_PER_CPU_CORE * cpu_cores, f"{cpu_cores} CPU core(s)"


def validate_work(args: Args, sizes: BatchSizes) -> None:
    """A step's (and the run's) response tokens must be sampleable within a day (a year) at a generous rate."""
    import torch

    ppo, response_length = args.ppo, args.gen.response_length
    on_gpus = torch.cuda.is_available() or args.dist.ray_address is not None  # a cluster's engines may have GPUs
    rate, devices = generous_sampling_rate(on_gpus, args.dist.vllm_num_engines, len(os.sched_getaffinity(0)))
    step_tokens = sizes.rollout_batch_size * response_length
    run_tokens = sizes.num_training_steps * step_tokens
    sizes_named = (
        f"--local_rollout_batch_size {ppo.local_rollout_batch_size} x --number_samples_per_prompt "
        f"{ppo.number_samples_per_prompt} x --response_length {response_length}"
    )
    if step_tokens / rate > MAX_STEP_S:
        raise ConfigError(
            f"one step samples up to {step_tokens:,} response tokens ({sizes_named}), more than a day's work even at "
            f"{rate:,} tokens/s ({devices}); lower --number_samples_per_prompt, --local_rollout_batch_size or "
            "--response_length."
        )
    if run_tokens / rate > MAX_RUN_S:
        raise ConfigError(
            f"the run samples up to {run_tokens:,} response tokens ({sizes.num_training_steps:,} steps of "
            f"{sizes_named}), more than a year's work even at {rate:,} tokens/s ({devices}); lower --total_episodes."
        )


def validate_async_depth(args: Args, sizes: BatchSizes) -> None:
    """--async_steps K above 1 turns the off-policy correction on (decoupled PPO, the truncated importance weight):
    with K or fewer steps no batch can be more than steps - 1 versions old, so that K would change the loss for
    nothing."""
    lag, steps = async_steps(args.gen), sizes.num_training_steps
    if lag > 1 and lag >= steps:
        most = max(1, steps - 1)
        raise ConfigError(
            f"--async_steps {lag} lets data lag {lag} policy versions, but the run's {steps} step(s) can lag at most "
            f"{steps - 1}, and above 1 it turns the off-policy correction on; pass --async_steps {most}, or more "
            "--total_episodes."
        )


def start_warnings(args: Args, sizes: BatchSizes) -> list[str]:
    """Settings that work but not as written: episodes a step cannot hold, checkpoints that never come."""
    warnings = []
    total, step = args.ppo.total_episodes, sizes.rollout_batch_size
    trained = sizes.num_training_steps * step
    if trained != total:
        warnings.append(
            f"--total_episodes {total} is not a multiple of a step's {step} responses: the run trains "
            f"{sizes.num_training_steps} steps ({trained} episodes) and drops the last {total - trained}; pass "
            f"--total_episodes {trained} or {trained + step}."
        )
    if args.gen.inflight_updates and batches_in_engine(args.gen) == 1:
        warnings.append(
            f"--inflight_updates does nothing at --async_steps {args.gen.async_steps}: the engine holds one batch at a "
            "time and takes each policy between batches; pass --async_steps 2 or more for it, or drop it."
        )
    if args.run.save_freq > sizes.num_training_steps:
        warnings.append(
            f"--save_freq {args.run.save_freq} is more than the run's {sizes.num_training_steps} steps: no checkpoint "
            f"will be written (only the final model, and one on SIGTERM/SIGINT); pass --save_freq "
            f"{sizes.num_training_steps} or less for one."
        )
    return warnings


def validate_hub(args: Args) -> None:
    """With --push_to_hub: the repo and branch names, a token, and the Hub in reach, before training starts."""
    run = args.run
    if not run.push_to_hub:
        return
    from huggingface_hub import constants, get_token

    from open_instruct.run.hub import resolve_hub_repo

    if constants.HF_HUB_OFFLINE:
        raise ConfigError("--push_to_hub is set but HF_HUB_OFFLINE is on; unset HF_HUB_OFFLINE, or drop --push_to_hub.")
    if get_token() is None:
        raise ConfigError("--push_to_hub needs a Hub token with write access; run `hf auth login` or set HF_TOKEN.")
    try:
        resolve_hub_repo(
            run.hf_entity, run.hf_repo_id, run.exp_name, run.hf_repo_revision, run.run_name, endpoint=run.hf_endpoint
        )
    except ValueError as error:
        raise ConfigError(str(error)) from error
    except Exception as error:  # whoami failed: no network, bad token, unknown endpoint
        cause = " ".join(str(error).split())[:200]
        raise ConfigError(
            "--push_to_hub without --hf_entity asks the Hub who is logged in, and that failed "
            f"({type(error).__name__}: {cause}); pass --hf_entity, or check the token and --hf_endpoint."
        ) from error


def _model_config(path: str, role: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"the {role} {path!r} has no readable config.json ({' '.join(str(error).split())[:160]}); give an HF "
            "model folder or hub id."
        ) from error


def validate_models(args: Args, policy_path: str, policy_tokenizer) -> int:
    """Every model reads the policy's token ids: same vocabulary, an embedding that covers every id, and room for
    --max_token_length positions. Returns the policy's vocabulary size."""
    from open_instruct.data.embedded import resolve_model_path
    from open_instruct.data.tokenizer import check_same_vocab, load_tokenizer

    model = args.model
    roles = {"policy": policy_path}
    if model.reward_model_path is not None:
        roles["reward model (--reward_model_path)"] = resolve_model_path(model.reward_model_path)
    if model.value_model_path is not None:
        roles["value model (--value_model_path)"] = resolve_model_path(model.value_model_path)
    num_tokens = len(policy_tokenizer)
    policy_vocab_size = num_tokens
    for role, path in roles.items():
        if path != policy_path:
            try:
                check_same_vocab(policy_tokenizer, load_tokenizer(path), policy_path, path)
            except ValueError as error:
                raise ConfigError(str(error).replace("The reward model", f"The {role}")) from error
        config = _model_config(path, role)
        vocab_size = getattr(config, "vocab_size", None)
        if vocab_size is not None and vocab_size < num_tokens:
            raise ConfigError(
                f"the {role} {path!r} embeds {vocab_size} token ids but the policy's tokenizer has {num_tokens}; use a "
                "model built on the policy's tokenizer."
            )
        max_positions = getattr(config, "max_position_embeddings", None)
        if max_positions is not None and args.gen.max_token_length > max_positions:
            raise ConfigError(
                f"--max_token_length {args.gen.max_token_length} exceeds the {role}'s {max_positions} positions "
                f"({path!r}); lower it to at most {max_positions}."
            )
        if role == "policy" and vocab_size is not None:
            policy_vocab_size = vocab_size
    return policy_vocab_size


def validate_packing(args: Args, longest_prompt: int) -> None:
    """--max_tokens_per_micro_batch T must hold the longest sequence the run can make, the longest prompt plus
    --response_length: a longer one would run alone in a micro-batch over the budget the memory plan was made for."""
    budget, longest = args.ppo.max_tokens_per_micro_batch, longest_prompt + args.gen.response_length
    if 0 < budget < longest:
        raise ConfigError(
            f"--max_tokens_per_micro_batch {budget} is below one sequence: the longest prompt ({longest_prompt} tokens) "
            f"plus --response_length {args.gen.response_length} make {longest}; pass --max_tokens_per_micro_batch "
            f"{longest} or more (a few sequences' worth packs them), or 0 for padded micro-batches."
        )


def validate_memory(
    args: Args, longest_prompt: int | None, device_type: str, available: int | None, whose: str = "this"
):
    """The memory plan of a learner rank (run/memory_plan.py), printed as one block, and a ConfigError naming the
    biggest item and its flag when the plan's peak is over the learner's device: --device_memory_gb when given, else
    `available` free bytes as the learner's own process measured them (run.devices.free_memory_bytes: this process
    in single-process mode, learner rank 0's report for Ray ranks, so the driver never measures a GPU it does not
    compute on, `whose` "learner rank 0's"); None: unknown, planned only. `device_type`: the learner's torch device
    type ("cuda", "cpu").
    Reads the models' configs, no weights. `longest_prompt`: the training data's, in tokens (sequences are planned at
    it + --response_length; default --max_prompt_token_length)."""
    from open_instruct.run.console import say
    from open_instruct.run.memory_plan import plan_memory
    from open_instruct.run.model_shapes import run_model_shapes

    capacity = available
    where = f"{whose} GPU (free memory)" if device_type == "cuda" else f"{whose} machine (MemAvailable)"
    if args.dist.device_memory_gb is not None:
        capacity, where = args.dist.device_memory_gb * 1e9, f"--device_memory_gb {args.dist.device_memory_gb:g}"
    plan = plan_memory(args, run_model_shapes(args), "gpu" if device_type == "cuda" else "cpu", capacity, longest_prompt)
    say("\n".join(plan.lines()))
    if capacity is not None:
        plan.check(capacity, where)
    return plan


def row_checker(args: Args, split: str):
    """A function (row, where) that raises ConfigError for a dataset row the run could not score.

    Training rows need a reward source: a ground truth with a known verifier (when verifiable rewards are on; any
    verifier name with --reward_function, which replaces them) or a reward model (an environment's rewards add to
    the score, they do not replace it). Eval rows may lack a ground truth (they count for lengths), but what they hold must be
    usable. Each verifier's GROUND_TRUTH_CHECKS entry says whether it can grade the row's ground truth. With
    --environment_column, the environment a row names must be one of --tools.
    """
    reward, column, tools = args.reward, args.gen.environment_column, args.gen.tools
    has_reward_model = reward.reward_model_multiplier != 0

    def check(row: dict, where: str) -> None:
        ground_truth, verifier = row["ground_truth"], row["dataset"]
        if tools and column is not None:  # the environment it names is one of --tools
            problem = row_environment_problem(environment_row(row), column, args.gen.tools)
            if problem is not None:
                raise ConfigError(f"{where}: {problem}.")
        if reward.apply_verifiable_reward and ground_truth is not None:
            if not ground_truth.strip():
                raise ConfigError(f"{where}: the ground truth is empty; give the answer, or drop the row.")
            if reward.reward_function is None:  # else it replaces the row's verifier: `dataset` is not read
                check_verifier(verifier, ground_truth, where)
        if split == "train" and not has_reward_model and (ground_truth is None or not reward.apply_verifiable_reward):
            raise ConfigError(
                f"{where}: has no reward source (no ground truth, or --apply_verifiable_reward false, and no reward "
                "model); give it a ground truth and verifier, or pass --reward_model_path and "
                "--reward_model_multiplier."
            )

    return check


def check_verifier(verifier: str | None, ground_truth: str, where: str) -> None:
    """The row's verifier is known and can grade its ground truth."""
    if verifier is None:
        raise ConfigError(
            f"{where}: has a ground truth but no verifier name; set its `dataset`/`data_source` to one of "
            f"{', '.join(sorted(VERIFIERS))}."
        )
    try:
        canonical = resolve_verifier_name(verifier)
        check_ground_truth = GROUND_TRUTH_CHECKS.get(canonical)
        if check_ground_truth is not None:  # a ground truth it cannot grade would fail mid-run, at the first score
            check_ground_truth(ground_truth)
    except ValueError as error:
        raise ConfigError(f"{where}: {error}") from error


def validate_code_sandbox(args: Args, verifier_names: Iterable[str | None]) -> None:
    """When some row is graded by running its tests: the sandbox (--code_sandbox) starts here and runs a trivial
    program, so that a machine where it cannot isolate, or a broken util-linux, is one line before any model loads."""
    reward = args.reward
    if not reward.apply_verifiable_reward or reward.reward_function is not None:
        return
    if not any(VERIFIER_ALIASES.get(str(name).strip().lower()) == CODE_VERIFIER for name in set(verifier_names)):
        return
    try:
        sandbox = Sandbox(reward.code_sandbox, code_limits(reward))
    except SandboxUnavailable as error:
        raise ConfigError(f"the data has code rows, whose tests run in a sandbox, but {error}.") from error
    run = sandbox.run_python('print("sandbox ok")')
    if run.stdout.strip() != "sandbox ok":
        detail = (run.stderr.strip().splitlines() or [run.verdict])[-1]
        raise ConfigError(
            f"--code_sandbox {reward.code_sandbox}: a trivial program did not run in the code sandbox ({run.verdict}: "
            f"{detail}); check that util-linux's unshare, setpriv and prlimit work here, or drop the code rows."
        )
