"""One response that cannot be scored is that response's failure, never the step's.

A verifier or --reward_function that raises on a response (a deeply nested or huge value from a code row, an IFEval
check on a degenerate text), returns something that is not a number in [0, 1] (NaN, 5.0, None), or runs past
--reward_timeout_s, scores that response 0 (its verifier's "wrong"). Each step counts them per verifier in
`reward/errors/<verifier>` and `reward/timeouts/<verifier>`; the first of each kind is said on the console with its
cause. A verifier that fails on --reward_max_consecutive_failures responses in a row stops the run (RewardFailures,
one line naming it and its last error): one that fails on everything is broken, and a run trained on zeros learns
nothing while looking healthy.
"""

import logging
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

from open_instruct.rewards.worker import SHOWN_CHARS, RewardError, RewardTimeout

log = logging.getLogger(__name__)
ERRORS, TIMEOUTS = "errors", "timeouts"  # the kinds of failure, as the metrics name them


@dataclass(frozen=True)
class Outcome:
    """One response's verifier score in [0, 1], or 0 and why it could not be computed."""

    score: float
    failure: str | None = None  # ERRORS or TIMEOUTS
    cause: str = ""  # one line


def outcome_of(call: Callable[[], object]) -> Outcome:
    """`call()`'s score, or the failure it ended in."""
    try:
        value = call()
    except RewardTimeout as error:
        return Outcome(0.0, TIMEOUTS, str(error))
    except RewardError as error:
        return Outcome(0.0, ERRORS, str(error))
    except Exception as error:  # noqa: BLE001 - whatever one response makes a verifier raise is that response's failure
        return Outcome(0.0, ERRORS, one_line(f"{type(error).__name__}: {error}"))
    if isinstance(value, numbers.Real) and math.isfinite(value) and 0 <= value <= 1:
        return Outcome(float(value))
    return Outcome(0.0, ERRORS, one_line(f"returned {value!r}, not a number in [0, 1]"))


def one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


class RewardFailures(RuntimeError):
    """A verifier failed on --reward_max_consecutive_failures responses in a row; the message is one line."""


class FailureTally:
    """The failures of each verifier: this step's counts (`metrics`), the failures in a row, the warnings said."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row  # 0: never stop
        self.in_a_row: dict[str, int] = {}
        self.warned: set[tuple[str, str]] = set()

    def count(self, verifier: str, described: str, outcome: Outcome, counts: dict[str, float]) -> None:
        """Add one response's `outcome` of `verifier` (its metrics' name; `described`: how the console names it, e.g.
        "the math verifier") to this step's `counts`; RewardFailures at the limit of failures in a row."""
        for kind in (ERRORS, TIMEOUTS):
            counts.setdefault(f"reward/{kind}/{verifier}", 0.0)
        if outcome.failure is None:
            self.in_a_row[verifier] = 0
            return
        counts[f"reward/{outcome.failure}/{verifier}"] += 1
        in_a_row = self.in_a_row[verifier] = self.in_a_row.get(verifier, 0) + 1
        if self.max_in_a_row and in_a_row >= self.max_in_a_row:
            raise RewardFailures(
                f"{described} failed on {in_a_row} responses in a row, the last: {outcome.cause}; fix it, or raise "
                "--reward_max_consecutive_failures (0: never stop)"
                + ("" if outcome.failure == ERRORS else " or --reward_timeout_s")
            )
        if (verifier, outcome.failure) not in self.warned:
            self.warned.add((verifier, outcome.failure))
            log.warning(
                f"[reward] warning: {described} failed on a response ({outcome.cause}): it scores 0, counted in "
                f"reward/{outcome.failure}/{verifier} (said once; {self.max_in_a_row or 'no number of'} failures in a "
                "row stop the run: --reward_max_consecutive_failures)"
            )
