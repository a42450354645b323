"""The reward flags (`RewardConfig`, the --reward_function, --code_* and penalty flags) and the code verifier's
sandbox limits: what the flag parser needs of the rewards, without torch (rewards.py scores with it)."""

from dataclasses import dataclass

from open_instruct import (
    AT_LEAST_1,
    FINITE,
    FRACTION,
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    POSITIVE,
    MayChangeOnResume,
    arg,
    at_least,
    one_of,
)
from open_instruct.rewards.code_tests import DEFAULT_MAX_TESTS
from open_instruct.sandbox import ISOLATED, MODES, UNSAFE_NO_ISOLATION, Limits

CODE_VERIFIER = "code"


@dataclass
class RewardConfig:
    apply_verifiable_reward: bool = arg(True, "Score responses with each row's verifier against its ground truth.")
    reward_function: str | None = arg(
        None, "path/to/file.py:fn, a verifier of your own, fn(response, ground_truth) -> float in [0, 1], that "
        "replaces the rows' verifiers for every row; its correct rate is logged as objective/<fn>_correct_rate "
        "(docs/extending.md)."
    )
    reward_timeout_s: float = arg(
        10.0, "Wall-clock seconds one response's verifier (all but code's, whose programs --code_timeout_s bounds) or "
        "--reward_function may take; past it the process scoring it is killed, and the response scores 0, counted "
        "in reward/timeouts/<verifier>.",
        check=POSITIVE,
    )
    reward_max_consecutive_failures: MayChangeOnResume[int] = arg(
        50, "Stop the run when one verifier or the --reward_function fails on this many responses in a row (raises, "
        "returns something not in [0, 1], or times out; each such response scores 0). 0: never stop.",
        check=NON_NEGATIVE_INT.saying("an integer >= 0 (0: never stop)"),
    )
    verification_reward: float = arg(1.0, "Reward for a correct answer (times the verifier's score in [0, 1]).",
                                     check=FINITE)  # fmt: skip
    reward_model_multiplier: float = arg(0.0, "Weight of the reward model's score; 0 turns the reward model off.",
                                         check=FINITE)  # fmt: skip
    add_r1_style_format_reward: bool = arg(False, "Reward `<think>...</think><answer>...</answer>` responses.")
    r1_style_format_reward: float = arg(1.0, "Reward for a correctly formatted response, when that is on.",
                                        check=FINITE)  # fmt: skip
    non_stop_penalty: bool = arg(False, "Replace the score of a response that never produced a stop token.")
    penalty_reward_value: float = arg(-1.0, "The score of a non-stopping response under --non_stop_penalty.",
                                      check=FINITE)  # fmt: skip
    overlong_buffer_length: int = arg(
        0, "DAPO's soft overlong punishment: a response longer than --response_length minus this many tokens loses "
        "up to --overlong_penalty_factor, linearly, reaching all of it at --response_length. 0: off.",
        check=NON_NEGATIVE_INT,
    )
    overlong_penalty_factor: float = arg(1.0, "The most a response loses to the overlong penalty.", check=NON_NEGATIVE)
    code_sandbox: str = arg(
        ISOLATED, f"How code rows' programs run: {ISOLATED!r} (namespaces, read-only root, unprivileged user, "
        f"limits; needs root) or {UNSAFE_NO_ISOLATION!r} (as this process's user, with only the resource limits: "
        "the model's code can read and write what the trainer can; for a machine you do not mind losing).",
        check=one_of(MODES),
    )
    code_workers: MayChangeOnResume[int] = arg(
        4, "Sandboxed programs run at once when scoring code rows (a thread each, beside the learner).", check=AT_LEAST_1
    )
    code_max_tests: int = arg(
        DEFAULT_MAX_TESTS, "A code row's score counts its first this many tests (0: all of them).",
        check=NON_NEGATIVE_INT.saying("an integer >= 0 (0: every test of a row)"),
    )
    code_pass_threshold: float | None = arg(
        None, "Score a code row 1 when at least this fraction of its tests pass, else 0; unset: the fraction itself.",
        check=FRACTION.or_unset("a fraction in (0, 1] (or unset: the fraction passed)"),
    )
    code_timeout_s: float = arg(2.0, "Wall-clock seconds one code test may run (CPU seconds: this, rounded up).",
                                check=POSITIVE)  # fmt: skip
    code_memory_mb: int = arg(512, "Address space, in MiB, of each process of a code test.",
                              check=at_least(64).saying("an integer >= 64 (Python itself needs ~30)"))  # fmt: skip

def code_limits(config: RewardConfig) -> Limits:
    """The sandbox limits of one code test, from the --code_* flags."""
    return Limits(wall_time_s=config.code_timeout_s, memory_mb=config.code_memory_mb,
                  concurrent_runs=config.code_workers)  # fmt: skip
