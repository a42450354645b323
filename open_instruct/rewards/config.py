"""The reward flags (`RewardConfig`, the --reward_function, --code_* and penalty flags) and the code verifier's
sandbox limits: what the flag parser needs of the rewards, without torch (rewards.py scores with it)."""

from dataclasses import dataclass, field

from open_instruct import MayChangeOnResume
from open_instruct.rewards.code_tests import DEFAULT_MAX_TESTS
from open_instruct.sandbox import ISOLATED, UNSAFE_NO_ISOLATION, Limits

CODE_VERIFIER = "code"


def _option(default, help: str):
    """A dataclass field whose help text `--help` shows (HfArgumentParser reads `metadata["help"]`)."""
    return field(default=default, metadata={"help": help})


@dataclass
class RewardConfig:
    apply_verifiable_reward: bool = _option(True, "Score responses with each row's verifier against its ground truth.")
    reward_function: str | None = _option(
        None, "path/to/file.py:fn, a verifier of your own, fn(response, ground_truth) -> float in [0, 1], that "
        "replaces the rows' verifiers for every row; its correct rate is logged as objective/<fn>_correct_rate "
        "(docs/extending.md)."
    )
    reward_timeout_s: float = _option(
        10.0, "Wall-clock seconds one response's verifier (all but code's, whose programs --code_timeout_s bounds) or "
        "--reward_function may take; past it the process scoring it is killed, and the response scores 0, counted "
        "in reward/timeouts/<verifier>."
    )
    reward_max_consecutive_failures: MayChangeOnResume[int] = _option(
        50, "Stop the run when one verifier or the --reward_function fails on this many responses in a row (raises, "
        "returns something not in [0, 1], or times out; each such response scores 0). 0: never stop."
    )
    verification_reward: float = _option(1.0, "Reward for a correct answer (times the verifier's score in [0, 1]).")
    reward_model_multiplier: float = _option(0.0, "Weight of the reward model's score; 0 turns the reward model off.")
    add_r1_style_format_reward: bool = _option(False, "Reward `<think>...</think><answer>...</answer>` responses.")
    r1_style_format_reward: float = _option(1.0, "Reward for a correctly formatted response, when that is on.")
    non_stop_penalty: bool = _option(False, "Replace the score of a response that never produced a stop token.")
    penalty_reward_value: float = _option(-1.0, "The score of a non-stopping response under --non_stop_penalty.")
    overlong_buffer_length: int = _option(
        0, "DAPO's soft overlong punishment: a response longer than --response_length minus this many tokens loses "
        "up to --overlong_penalty_factor, linearly, reaching all of it at --response_length. 0: off."
    )
    overlong_penalty_factor: float = _option(1.0, "The most a response loses to the overlong penalty.")
    code_sandbox: str = _option(
        ISOLATED, f"How code rows' programs run: {ISOLATED!r} (namespaces, read-only root, unprivileged user, "
        f"limits; needs root) or {UNSAFE_NO_ISOLATION!r} (as this process's user, with only the resource limits: "
        "the model's code can read and write what the trainer can; for a machine you do not mind losing)."
    )
    code_workers: MayChangeOnResume[int] = _option(
        4, "Sandboxed programs run at once when scoring code rows (a thread each, beside the learner)."
    )
    code_max_tests: int = _option(
        DEFAULT_MAX_TESTS, "A code row's score counts its first this many tests (0: all of them)."
    )
    code_pass_threshold: float | None = _option(
        None, "Score a code row 1 when at least this fraction of its tests pass, else 0; unset: the fraction itself."
    )
    code_timeout_s: float = _option(2.0, "Wall-clock seconds one code test may run (CPU seconds: this, rounded up).")
    code_memory_mb: int = _option(512, "Address space, in MiB, of each process of a code test.")


def code_limits(config: RewardConfig) -> Limits:
    """The sandbox limits of one code test, from the --code_* flags."""
    return Limits(wall_time_s=config.code_timeout_s, memory_mb=config.code_memory_mb,
                  concurrent_runs=config.code_workers)  # fmt: skip
