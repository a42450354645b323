"""Fail fast: everything a run needs is checked before any model loads, with one-line errors.

`validate_flags` checks each flag's value against a table of rules; `validate_hub` the Hub settings of
`--push_to_hub` (a push that would fail after hours of training fails now instead); `validate_models` the
model folders' vocabularies and context lengths against the policy's tokens; `validate_memory` the sizes that
could never fit; `row_checker` every dataset row the run will read (ground truth present where its verifier
needs one, verifier known). Each raises `ConfigError`, whose message names the value and the fix; the CLI
prints it as `error: ...` and exits with code 2 (see `ppo_vllm_thread_ray_gtrl.cli`).
"""

import contextlib
import math
import os
from collections.abc import Iterator

from open_instruct.rl.verifiers import VERIFIERS, resolve_verifier_name
from open_instruct.run.args import Args, ConfigError

# Verifiers that compare numbers: a ground truth without one would fail mid-run at the first response scored.
NUMERIC_VERIFIERS = ("gsm8k", "arithmetic")


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


# (is the value valid, what is expected): the kinds of value a flag can hold.
AT_LEAST_1 = (lambda v: v >= 1, "an integer >= 1")
NON_NEGATIVE_INT = (lambda v: v >= 0, "an integer >= 0")
NON_NEGATIVE = (lambda v: _finite(v) and v >= 0, "a number >= 0")
POSITIVE = (lambda v: _finite(v) and v > 0, "a number > 0")
PROBABILITY = (lambda v: _finite(v) and 0 <= v <= 1, "a number in [0, 1]")
FRACTION = (lambda v: _finite(v) and 0 < v <= 1, "a fraction in (0, 1]")
FINITE = (lambda v: _finite(v), "a finite number")
NAME = (lambda v: bool(v) and "/" not in v, "a name without '/'")


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
            (lambda v: _finite(v) and (v == 0 or v >= 1), "0 (off) or a number >= 1 (a cap below 1 scales all tokens)"),
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
        ("queue_timeout_s", gen.queue_timeout_s, POSITIVE),
        ("max_vllm_logprob_diff", gen.max_vllm_logprob_diff, NON_NEGATIVE),
        ("max_prompt_token_length", data.max_prompt_token_length, AT_LEAST_1),
        ("dataset_seed", data.dataset_seed, NON_NEGATIVE_INT),
        ("seed", run.seed, NON_NEGATIVE_INT),
        ("save_freq", run.save_freq, (lambda v: v == -1 or v >= 1, "-1 (no checkpoints) or steps >= 1")),
        ("keep_last_n", run.keep_last_n, AT_LEAST_1),
        ("num_evals", run.num_evals, (lambda v: v >= 0, "an integer >= 0 (0: no evals)")),
        ("eval_samples_per_prompt", run.eval_samples_per_prompt, NON_NEGATIVE_INT),
        ("num_samples_to_log", run.num_samples_to_log, NON_NEGATIVE_INT),
        ("preemption_timeout_s", run.preemption_timeout_s, POSITIVE),
        ("exp_name", run.exp_name, NAME),
        ("run_name", run.run_name, NAME),
        ("output_dir", run.output_dir, (lambda v: bool(v) and not os.path.isfile(v), "a folder, not a file")),
        ("verification_reward", reward.verification_reward, FINITE),
        ("reward_model_multiplier", reward.reward_model_multiplier, FINITE),
        ("penalty_reward_value", reward.penalty_reward_value, FINITE),
        ("r1_style_format_reward", reward.r1_style_format_reward, FINITE),
        ("vllm_num_engines", args.dist.vllm_num_engines, NON_NEGATIVE_INT),
        ("vllm_tensor_parallel_size", args.dist.vllm_tensor_parallel_size, AT_LEAST_1),
        ("vllm_sync_bucket_mb", args.dist.vllm_sync_bucket_mb, POSITIVE),
        ("vllm_sync_timeout_s", args.dist.vllm_sync_timeout_s, POSITIVE),
        ("learner_timeout_s", args.dist.learner_timeout_s, POSITIVE),
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
    if args.ppo.truncated_importance_sampling_ratio_cap > 0 and args.ppo.old_logprobs_from == "vllm":
        raise ConfigError(
            "--truncated_importance_sampling_ratio_cap weights tokens by pi_learner_old / pi_vllm, which is 1 with "
            "--old_logprobs_from vllm; pass --old_logprobs_from learner, or "
            "--truncated_importance_sampling_ratio_cap 0."
        )
    validate_grpo_flags(args)
    if args.run.resume is not None and args.run.overwrite_output_dir:
        raise ConfigError("--resume continues the run in --output_dir and --overwrite_output_dir deletes it; pick one.")
    validate_engine_flags(args.dist)
    if args.dist.uses_ray and (args.run.save_freq > 0 or args.run.resume is not None):
        raise ConfigError(
            "resumable checkpoints (--save_freq, --resume) are not supported with Ray learners yet "
            "(--num_learners_per_node); run without them, or with one learner in this process."
        )


def validate_grpo_flags(args: Args) -> None:
    """GRPO compares the responses to a prompt with each other and trains no value model: the flags that cannot
    work with that fail here rather than being ignored."""
    ppo = args.ppo
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
        "--value_learning_rate": ppo.value_learning_rate is not None,
        "--whiten_rewards": ppo.whiten_rewards,
    }
    if set_flags := [flag for flag, is_set in value_flags.items() if is_set]:
        raise ConfigError(
            f"{', '.join(set_flags)} configure PPO's value model and per-token rewards, which GRPO does not use; drop "
            "them, or run PPO."
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
    --max_token_length positions. Returns the policy's vocabulary size (for `validate_memory`)."""
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


def validate_memory(args: Args, vocab_size: int, available: int | None, where: str = "") -> None:
    """A micro-batch's fp32 logits (with their softmax and gradient: about 3 copies) must fit in the learner's free
    memory, `available` bytes as the learner's own process measured it (run.devices.free_memory_bytes; for Ray learner
    ranks, learner rank 0's report, so the driver never measures a GPU it does not compute on). None: unknown.

    A lower bound on what a step needs, not an estimate of it: it only rejects sizes that can never fit.
    """
    micro, response_length = args.ppo.per_device_train_batch_size, args.gen.response_length
    needed = 3 * 4 * micro * (response_length + 1) * vocab_size
    if available is not None and needed > available:
        raise ConfigError(
            f"--per_device_train_batch_size {micro} x --response_length {response_length} needs at least "
            f"{needed / 2**30:.1f} GiB for the logits over a {vocab_size}-token vocabulary, but "
            f"{available / 2**30:.1f} GiB is free{where}; lower --per_device_train_batch_size."
        )


def row_checker(args: Args, split: str):
    """A function (row, where) that raises ConfigError for a dataset row the run could not score.

    Training rows need a reward source: a ground truth with a known verifier (when verifiable rewards are on)
    or a reward model. Eval rows may lack a ground truth (they count for lengths), but what they hold must be
    usable. Numeric verifiers need a number in the ground truth.
    """
    reward = args.reward
    has_reward_model = reward.reward_model_multiplier != 0

    def check(row: dict, where: str) -> None:
        ground_truth, verifier = row["ground_truth"], row["dataset"]
        if reward.apply_verifiable_reward and ground_truth is not None:
            if not ground_truth.strip():
                raise ConfigError(f"{where}: the ground truth is empty; give the answer, or drop the row.")
            if verifier is None:
                raise ConfigError(
                    f"{where}: has a ground truth but no verifier name; set its `dataset`/`data_source` to one of "
                    f"{', '.join(sorted(VERIFIERS))}."
                )
            try:
                canonical = resolve_verifier_name(verifier)
                if canonical in NUMERIC_VERIFIERS:
                    VERIFIERS[canonical]("", ground_truth)  # raises for a ground truth it cannot compare
            except ValueError as error:
                raise ConfigError(f"{where}: {error}") from error
        if split == "train" and not has_reward_model and (ground_truth is None or not reward.apply_verifiable_reward):
            raise ConfigError(
                f"{where}: has no reward source (no ground truth, or --apply_verifiable_reward false, and no reward "
                "model); give it a ground truth and verifier, or pass --reward_model_path and "
                "--reward_model_multiplier."
            )

    return check
