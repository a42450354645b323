"""Fail fast: everything a run needs is checked before any model loads, with one-line errors, in four phases that the
trainer runs in order, each before what it protects loads:

1. flags, `check_flags`: each flag's own rule (its `check=`, declared beside the flag: run/flags.py,
   data/dataset_args.py, rewards/config.py) in one pass over the argument dataclasses (`check_values`); the rules that
   tie flags together (run/flag_combinations.py); the batch sizes; the sampling that could never finish; an
   --async_steps the run's steps cannot use; the Hub settings of --push_to_hub (a push that would fail after hours of
   training fails now instead). It returns the sizes and the settings that work but not as written (the warnings).
2. data: every row the run will read, as the datasets are built (`row_checker`: ground truth present where its
   verifier needs one, verifier known), the tools' schemas (`tool_call_schemas`), then `check_data`: that code rows'
   sandbox starts and runs a program, and a token budget that holds the longest prompt's sequence.
3. models, `check_models`: the model folders' vocabularies and context lengths against the policy's tokens; then, where
   this process knows the learner's device,
4. memory, `check_memory`: the learner's memory plan, printed, and a run that cannot fit refused. Ray learner ranks are
   checked against learner rank 0's own report, before any of them loads a model.

Each raises `ConfigError`, whose message names the value and the fix; the CLI prints it as `error: ...` and exits with
code 2 (see `ppo_vllm_thread_ray_gtrl.cli`).
"""

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import fields

from open_instruct.environments.native_tools import tool_call_format
from open_instruct.environments.routing import environment_row, row_environment_problem
from open_instruct.rewards.config import CODE_VERIFIER, code_limits
from open_instruct.rewards.verifiers import GROUND_TRUTH_CHECKS, VERIFIER_ALIASES, VERIFIERS, resolve_verifier_name
from open_instruct.run.args import (
    Args,
    BatchSizes,
    ConfigError,
    GenerationArgs,
    async_steps,
    batches_in_engine,
    compute_batch_sizes,
)
from open_instruct.run.flag_combinations import validate_combinations
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


def check_values(*groups) -> None:
    """Each flag's own rule, declared beside it (`arg(..., check=...)`), in one pass over the argument dataclasses."""
    for group in groups:
        for flag in fields(group):
            check, value = flag.metadata.get("check"), getattr(group, flag.name)
            if check is not None and not check.test(value):
                raise ConfigError(f"--{flag.name} {value!r} is not valid; expected {check.describe()}.")


# ---- 1. flags --------------------------------------------------------------------------------------------------------


def check_flags(args: Args) -> tuple[BatchSizes, list[str]]:
    """Every flag value valid, their combinations, the sizes and work they make, the hub: the run's sizes and the start
    warnings, or a ConfigError for the first problem."""
    check_values(*vars(args).values())
    validate_combinations(args)
    sizes = compute_batch_sizes(args)
    validate_work(args, sizes)
    validate_async_depth(args, sizes)
    validate_hub(args)
    return sizes, start_warnings(args, sizes)


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


# ---- 2. data ---------------------------------------------------------------------------------------------------------


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


def check_data(args: Args, train_dataset, eval_dataset, longest_prompt: int) -> None:
    """The datasets as built: code rows' sandbox, and a token budget that holds the longest sequence."""
    verifier_names = list(train_dataset["dataset"]) + (list(eval_dataset["dataset"]) if eval_dataset else [])
    validate_code_sandbox(args, verifier_names)
    validate_packing(args, longest_prompt)


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


# ---- 3. models and 4. memory -----------------------------------------------------------------------------------------


def check_models(args: Args, policy_path: str, policy_tokenizer, longest_prompt: int) -> None:
    """The models against the policy's tokens, then the learner's memory where this process can know it. `args` name
    every model by a local folder (hub ids resolved: run/hub_models.py)."""
    import torch

    from open_instruct.run.devices import free_memory_bytes, learner_device

    validate_models(args, policy_path, policy_tokenizer)
    if not args.dist.uses_ray:  # this process is the learner
        device = learner_device()
        check_memory(args, longest_prompt, device.type, free_memory_bytes(device))
    elif args.dist.device_memory_gb is not None:  # the user gave the learners' memory: refuse before Ray starts
        # torch.cuda.is_available() asks NVML for a count: no CUDA context on the driver. A head node without GPUs
        # plans its learners as CPU ranks; give the memory plan's CLI --device gpu to see the GPU plan.
        check_memory(args, longest_prompt, "cuda" if torch.cuda.is_available() else "cpu", None)
    # else Ray learner ranks are checked against learner rank 0's own report, before any of them loads a model


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



def check_memory(
    args: Args, longest_prompt: int | None, device_type: str, available: int | None, whose: str = "this"
):
    """The memory plan of a learner rank (run/memory_budget.py), printed as one block, and a ConfigError naming the
    biggest item and its flag when the plan's peak is over the learner's device: --device_memory_gb when given, else
    `available` free bytes as the learner's own process measured them (run.devices.free_memory_bytes: this process
    in single-process mode, learner rank 0's report for Ray ranks, so the driver never measures a GPU it does not
    compute on, `whose` "learner rank 0's"); None: unknown, planned only. `device_type`: the learner's torch device
    type ("cuda", "cpu").
    Reads the models' configs, no weights. `longest_prompt`: the training data's, in tokens (sequences are planned at
    it + --response_length; default --max_prompt_token_length)."""
    from open_instruct.run.console import say
    from open_instruct.run.memory_budget import plan_memory
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
