"""open_instruct: thread-based asynchronous PPO (RLHF / RLVR) for language models.

The package is a stack of layers; each imports only the layers below it (tests/test_layers.py keeps it so):

    ppo_vllm_thread_ray_gtrl.py   entry points: the trainer's recipe (GRPO: grpo_vllm_thread_ray_gtrl.py),
    evaluate.py                   a saved model's eval, memory_plan.py, sft_warmup.py (a supervised warm-up)
    learner/                      the training side: models, PPO/GRPO learners, one process or DeepSpeed ranks on Ray
    generation/                   the rollout side: vLLM engines, the generation thread, the weight broadcast
    run/                          configuration and bookkeeping: flags, checks, checkpoints, logs, hub
    environments/                 tools and environments, tool-call parsers, token-exact tool turns, the agent endpoint
    data/                         what a run reads: prompt datasets, tokenizer, the embedded model and tasks
    rewards/                      how a response is scored: verifiers, IFEval, code tests, the reward manager
    rl/                           the math: masked statistics, advantages, losses, logprobs, packing
    sandbox/                      isolated runs of model-written programs (code rewards, tools)
"""

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

__version__ = "0.1.0"

# ---- what a flag declares beside itself ------------------------------------------------------------------------------
# The flag dataclasses live on several floors (run/flags.py, data/dataset_args.py, rewards/config.py), so the words
# they share live here, on none.

_Flag = TypeVar("_Flag")
# The type of a flag that a `--resume` may set to another value: it changes nothing the run computes (where files go,
# logging, timeouts, how often to save). Every other flag must equal the checkpoint's (run/checkpoint.py), and
# docs/flags.md shows which is which. Declared beside the flag: `save_freq: MayChangeOnResume[int] = ...`.
# The argument parser sees the plain type (HfArgumentParser resolves hints without their extras).
MayChangeOnResume = Annotated[_Flag, "may change on resume"]


def arg(default, help: str, check: "Check | None" = None, **kwargs):
    """A flag: its default, its `--help` text, the rule its value must meet (`check`, applied before any model loads
    by run/validation.py and printed in docs/flags.md) and argparse's own options (choices, nargs, aliases)."""
    metadata = {"help": help, **kwargs, **({"check": check} if check is not None else {})}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


@dataclass(frozen=True)
class Check:
    """What a flag's value must be, as a test and in words. A bad value fails as `--flag VALUE is not valid; expected
    {expected}.`; `expected` may be a function when the words are known only at run time (a library's list)."""

    test: Callable[[object], bool]
    expected: str | Callable[[], str]

    def describe(self) -> str:
        return self.expected if isinstance(self.expected, str) else self.expected()

    def saying(self, expected: str) -> "Check":
        """The same test, other words (what 0 means for this flag)."""
        return Check(self.test, expected)

    def or_unset(self, expected: str) -> "Check":
        """The same test, and None (unset) also accepted."""
        return Check(lambda value: value is None or self.test(value), expected)


def at_least(low: int) -> Check:
    return Check(lambda value: value >= low, f"an integer >= {low}")


def one_of(choices) -> Check:
    return Check(lambda value: value in choices, "one of " + ", ".join(choices))


# The kinds of value a flag can hold.
AT_LEAST_1 = at_least(1)
NON_NEGATIVE_INT = at_least(0)
NON_NEGATIVE = Check(lambda value: finite(value) and value >= 0, "a number >= 0")
POSITIVE = Check(lambda value: finite(value) and value > 0, "a number > 0")
PROBABILITY = Check(lambda value: finite(value) and 0 <= value <= 1, "a number in [0, 1]")
FRACTION = Check(lambda value: finite(value) and 0 < value <= 1, "a fraction in (0, 1]")
FINITE = Check(finite, "a finite number")
NAME = Check(lambda value: bool(value) and "/" not in value, "a name without '/'")
FOLDER = Check(lambda value: bool(value) and not os.path.isfile(value), "a folder, not a file")
