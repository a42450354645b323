"""The run's arguments as a whole: every flag group (run/flags.py, data/dataset_args.py, rewards/config.py) parsed
from the CLI and/or a YAML file into one `Args`, and what the flags decide together.

    python -m open_instruct.ppo_vllm_thread_ray_gtrl configs/train_configs/ppo_arithmetic_cpu.yaml \
        --learning_rate 1e-6      # command-line flags override the YAML

`--algorithm grpo` (the default of `python -m open_instruct.grpo_vllm_thread_ray_gtrl`) also changes the defaults
of a few other flags (`ALGORITHM_DEFAULTS`); flags given in the YAML or on the command line win over them.

Sizes derived from them (`BatchSizes`) are computed and checked before any model loads.
"""

import copy
import math
import os
import sys
import time
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import get_type_hints

import yaml
from transformers import HfArgumentParser

from open_instruct import MayChangeOnResume
from open_instruct.data.dataset_args import DatasetArgs
from open_instruct.data.embedded import EMBEDDED_DATASETS
from open_instruct.environments.tools import absolute_names
from open_instruct.rewards.config import RewardConfig
from open_instruct.run.flags import DistributedArgs, GenerationArgs, ModelArgs, PPOArgs, RunArgs

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's choices of max_lora_rank (--lora_weight_sync)


# Yao et al. (2025) cap the truncated importance weight at 2; so do verl's and open-instruct's defaults.
DEFAULT_OFF_POLICY_CAP = 2.0


def async_steps(gen: "GenerationArgs") -> int:
    """How many policy versions the data may lag the learner: --async_steps in async mode, 0 in sync mode."""
    return gen.async_steps if gen.async_mode else 0


def tool_settings(gen: "GenerationArgs", chat_template_name: str | None = None) -> dict | None:
    """What the engine needs of --tools and its flags (a batch's params["tools"], stored in checkpoints); None without
    tools. `chat_template_name`: --chat_template_name (the native format renders tool turns with that template)."""
    if not gen.tools:
        return None
    settings = {"names": absolute_names(gen.tools), "max_calls": gen.max_tool_calls, "timeout_s": gen.tool_timeout_s,
                "output_max_tokens": gen.tool_output_max_tokens, "wrapper": gen.tool_output_wrapper,
                "workers": gen.tool_workers, "max_parallel_calls": gen.max_parallel_tool_calls,
                "reentry_steps": gen.tool_reentry_steps,
                "parser": gen.tool_call_parser, "chat_template_name": chat_template_name}  # fmt: skip
    if gen.environment_column is not None:  # each row's value is a --tools name as written: the engine's import name
        settings["environment_column"] = gen.environment_column
        settings["environment_names"] = dict(zip(gen.tools, settings["names"]))
    return settings


def needs_rows(gen: "GenerationArgs") -> bool:
    """Whether the engine gets each prompt's dataset row: an environment's `reset` (--tools) or an agent's `run`."""
    return bool(gen.tools or gen.rollout_agent)


def agent_settings(gen: "GenerationArgs", chat_template_name: str | None, served_name: str) -> dict | None:
    """What the engine needs of --rollout_agent and its flags (a batch's params["agent"]); None without an agent."""
    if not gen.rollout_agent:
        return None
    path, _, function = gen.rollout_agent.rpartition(":")  # absolute: engine actors load it in their own processes
    return {"spec": f"{os.path.abspath(path)}:{function}", "concurrency": gen.agent_concurrency, "timeout_s": gen.agent_timeout_s,
            "max_calls": gen.agent_max_calls, "failed": gen.agent_failed_rollouts, "host": gen.agent_host,
            "port": gen.agent_port, "parser": gen.tool_call_parser, "chat_template_name": chat_template_name,
            "served_name": served_name}  # fmt: skip


def batches_in_engine(gen: "GenerationArgs") -> int:
    """Batches the engine decodes together: the K in flight with --inflight_updates, else one at a time."""
    return async_steps(gen) if gen.inflight_updates and async_steps(gen) > 1 else 1


def needs_off_policy_correction(gen: "GenerationArgs") -> bool:
    """More than one policy version of lag, or tokens of several versions in one response."""
    return async_steps(gen) > 1 or batches_in_engine(gen) > 1


def truncated_importance_cap(args: "Args", engine_differs: bool = False) -> float:
    """--truncated_importance_sampling_ratio_cap, or when unset its default: on (2) where the data is off-policy by more
    than one version, or where `engine_differs` (--old_logprobs_from auto chose the learner's logprobs because the
    engine's differ from them), else off."""
    cap = args.ppo.truncated_importance_sampling_ratio_cap
    if cap is not None:
        return cap
    return DEFAULT_OFF_POLICY_CAP if needs_off_policy_correction(args.gen) or engine_differs else 0.0


def old_logprobs_source(args: "Args", learner_dtype: str, engine_dtype: str, device_type: str
                        ) -> tuple[str, float, str]:  # fmt: skip
    """--old_logprobs_from resolved for this learner: (source, truncated-importance cap, why). `auto` takes the engine's
    logprobs only where they are the learner's within ~1e-5 (docs/ppo_details.md): a CPU engine and learner both in
    fp32, and data at most one policy version old. Anywhere else (a bf16 side, a GPU's kernels, async lag) it runs
    the learner's own forward, and weights each token by its truncated ratio to the engine's (docs/speed.md,
    "Learner dtype": a bf16 learner against the fp32 engine's logprobs collapsed in 2 runs of 3)."""
    requested = args.ppo.old_logprobs_from
    if requested != "auto":
        return requested, truncated_importance_cap(args), f"--old_logprobs_from {requested}"
    if needs_off_policy_correction(args.gen):
        return "learner", truncated_importance_cap(args), "the learner's: the data is more than one version old"
    if (args.ppo.truncated_importance_sampling_ratio_cap or 0) > 0:
        return "learner", truncated_importance_cap(args), "the learner's: a truncated importance weight was asked for"
    if device_type == "cpu" and learner_dtype == engine_dtype == "float32":
        return "vllm", truncated_importance_cap(args), "the engine's: engine and learner both compute in float32"
    where = "on a GPU" if device_type != "cpu" else f"the learner computes in {learner_dtype}, the engine in {engine_dtype}"
    cap = truncated_importance_cap(args, engine_differs=True)
    return "learner", cap, f"the learner's ({where}), the engine's in a truncated importance weight (cap {cap:g})"


ARG_GROUPS = (ModelArgs, DatasetArgs, RewardConfig, PPOArgs, GenerationArgs, RunArgs, DistributedArgs)


def flags_that_may_change_on_resume() -> frozenset[str]:
    """The flags declared `MayChangeOnResume[...]`: a resumed run may pass other values for them."""
    marker = MayChangeOnResume.__metadata__
    return frozenset(
        name
        for group in ARG_GROUPS
        for name, hint in get_type_hints(group, include_extras=True).items()
        if getattr(hint, "__metadata__", ()) == marker
    )

# The defaults `--algorithm` changes. GRPO: the KL to the reference is a k3 loss term (its advantages come from the
# scores alone, so a KL in the reward would be ignored), one pass over each rollout (DeepSeekMath, TRL and
# open-instruct's GRPO take one), and no batch whitening on top of the per-group normalisation.
ALGORITHM_DEFAULTS = {
    "ppo": {},
    "grpo": {
        "exp_name": "grpo",
        "output_dir": "output/grpo",
        "kl_in_loss": True,
        "kl_estimator": "k3",
        "num_epochs": 1,
        "whiten_advantages": False,
    },
}


@dataclass
class Args:
    model: ModelArgs
    data: DatasetArgs
    reward: RewardConfig
    ppo: PPOArgs
    gen: GenerationArgs
    run: RunArgs
    dist: DistributedArgs

    def as_flat_dict(self) -> dict:
        return {f.name: getattr(group, f.name) for group in vars(self).values() for f in fields(group)}


def yaml_to_cli(path: str) -> list[str]:
    with open(path) as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a mapping of flag: value, not a {type(config).__name__}.")
    argv = []
    for key, value in config.items():
        values = value if isinstance(value, list) else [value]
        argv += [f"--{key}"] + [str(v) for v in values]
    return argv


def mixer_eval_list(args: "Args") -> list:
    return args.data.dataset_mixer_eval_list or []


class ConfigError(ValueError):
    """A flag, file or setting the run cannot use; the message names it and the fix (printed as one line)."""


class FlagParser(HfArgumentParser):
    """The parser of every flag dataclass: full flag names only (`--learn` is not `--learning_rate`), errors raised,
    not printed with the usage, and each flag's `check=` kept from argparse."""

    def __init__(self, groups):
        super().__init__(groups, allow_abbrev=False)

    def _parse_dataclass_field(self, parser, field):
        """argparse takes the field's metadata as add_argument's options: all but the flag's rule (`check`)."""
        if "check" in field.metadata:
            field = copy.copy(field)
            field.metadata = MappingProxyType({k: v for k, v in field.metadata.items() if k != "check"})
        HfArgumentParser._parse_dataclass_field(parser, field)

    def error(self, message: str):
        raise ConfigError(f"{message}; run with --help for the list of flags.")


def parse_args(argv: list[str] | None = None, algorithm: str = "ppo") -> Args:
    """Flags from `argv` (a YAML config first, then flags that override it); `algorithm` is the entry point's
    default of --algorithm, whose ALGORITHM_DEFAULTS apply to every flag the config and the command line leave out."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].endswith((".yaml", ".yml")):
        if not os.path.isfile(argv[0]):
            raise ConfigError(f"config file {argv[0]} does not exist; check the path (relative to {os.getcwd()}).")
        argv = yaml_to_cli(argv[0]) + argv[1:]
    parser = FlagParser(ARG_GROUPS)
    parser.set_defaults(algorithm=algorithm)
    chosen, _ = parser.parse_known_args(argv)  # the algorithm first (a YAML or flag may name it), then its defaults
    parser.set_defaults(**ALGORITHM_DEFAULTS[chosen.algorithm])
    *groups, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        raise ConfigError(f"Unknown arguments {unknown}; flags take their full names, run with --help for the list.")
    args = Args(*groups)
    if args.gen.stop_token == "none":
        args.gen.stop_token = None
    if not args.data.dataset_mixer_list:
        from open_instruct.data.embedded import arithmetic_data_path

        data_dir = arithmetic_data_path()
        args.data.dataset_mixer_list = [data_dir, "1.0"]
        args.data.dataset_mixer_eval_list = args.data.dataset_mixer_eval_list or [data_dir, "1.0"]
    if any(name in EMBEDDED_DATASETS for name in args.data.dataset_mixer_list + mixer_eval_list(args)):
        from open_instruct.data.embedded import resolve_dataset_name

        for mixer in (args.data.dataset_mixer_list, mixer_eval_list(args)):
            mixer[::2] = [resolve_dataset_name(name) for name in mixer[::2]]  # [name, fraction, name, fraction, ...]
    if args.data.dataset_cache_dir is None or args.run.fallback_save_dir is None:
        from open_instruct.data.embedded import cache_dir

        if args.data.dataset_cache_dir is None:  # tokenise once per data/tokenizer/template, reuse afterwards
            args.data.dataset_cache_dir = os.path.join(cache_dir(), "tokenized_prompts")
        if args.run.fallback_save_dir is None:
            args.run.fallback_save_dir = os.path.join(cache_dir(), "rescued")
    # Learner rank 0 writes the model on its own node: a relative path would resolve against its working directory.
    args.run.output_dir = os.path.abspath(args.run.output_dir)
    if args.run.run_name is None:
        args.run.run_name = f"{args.run.exp_name}__{args.run.seed}__{int(time.time())}"
    return args


@dataclass
class BatchSizes:
    prompts_per_step: int
    rollout_batch_size: int  # responses per step
    mini_batch_size: int
    gradient_accumulation_steps: int  # micro-batches per optimizer step on each learner rank
    num_learners: int
    num_training_steps: int
    eval_freq: int
    save_freq: int

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in vars(self).items())


SIZE_FLAGS = ("local_rollout_batch_size", "number_samples_per_prompt", "num_mini_batches",
              "per_device_train_batch_size", "total_episodes")  # fmt: skip


def compute_batch_sizes(args: Args) -> BatchSizes:
    """Derive the step sizes; any inconsistency is an error here, before a model loads."""
    ppo, gen = args.ppo, args.gen
    # The command line's early check (run/command_line.py) calls this before each flag's own check (run/validation.py):
    # a size below 1 must be named by its own flag here, not surface as a division by zero or another flag's complaint.
    for flag in SIZE_FLAGS:
        if getattr(ppo, flag) < 1:
            raise ValueError(f"--{flag} {getattr(ppo, flag)!r} is not valid; expected an integer >= 1.")
    rollout = ppo.local_rollout_batch_size * ppo.number_samples_per_prompt
    if rollout % ppo.num_mini_batches:
        raise ValueError(
            f"--num_mini_batches {ppo.num_mini_batches} does not divide the rollout batch of {rollout} responses "
            f"(local_rollout_batch_size {ppo.local_rollout_batch_size} x number_samples_per_prompt "
            f"{ppo.number_samples_per_prompt}); pick a divisor of {rollout}."
        )
    mini = rollout // ppo.num_mini_batches
    if mini % ppo.per_device_train_batch_size:
        raise ValueError(
            f"--per_device_train_batch_size {ppo.per_device_train_batch_size} does not divide the minibatch of "
            f"{mini} responses; pick a divisor of {mini}."
        )
    learners = args.dist.num_learners
    if min(args.dist.num_learners_per_node) < 1:
        raise ValueError(
            f"--num_learners_per_node {args.dist.num_learners_per_node} has an entry below 1; give one positive "
            f"count per node."
        )
    if mini % (ppo.per_device_train_batch_size * learners):
        raise ValueError(
            f"The minibatch of {mini} responses does not split into --per_device_train_batch_size "
            f"{ppo.per_device_train_batch_size} micro-batches evenly over {learners} learners; make the minibatch a "
            f"multiple of {ppo.per_device_train_batch_size * learners}."
        )
    steps = ppo.total_episodes // rollout
    if steps < 1:
        raise ValueError(
            f"--total_episodes {ppo.total_episodes} is less than one step of {rollout} responses; raise it."
        )
    if gen.response_length >= gen.max_token_length:
        raise ValueError(
            f"--response_length {gen.response_length} leaves no room for a prompt in --max_token_length "
            f"{gen.max_token_length}; raise --max_token_length."
        )
    if args.data.max_prompt_token_length + gen.response_length > gen.max_token_length:
        raise ValueError(
            f"--max_prompt_token_length {args.data.max_prompt_token_length} + --response_length "
            f"{gen.response_length} exceeds --max_token_length {gen.max_token_length}; lower one or raise the last."
        )
    eval_freq = max(1, math.ceil(steps / args.run.num_evals)) if args.run.num_evals > 0 else 0
    return BatchSizes(
        prompts_per_step=ppo.local_rollout_batch_size,
        rollout_batch_size=rollout,
        mini_batch_size=mini,
        gradient_accumulation_steps=mini // (ppo.per_device_train_batch_size * learners),
        num_learners=learners,
        num_training_steps=steps,
        eval_freq=eval_freq,
        save_freq=args.run.save_freq,
    )
