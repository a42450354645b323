"""Preemption: SIGTERM or SIGINT asks the training loop to stop between steps, write a checkpoint and exit with
128 + signal; a deadline (--preemption_timeout_s) or a second signal exits at once, naming the newest checkpoint.
Signals that come within `SAME_REQUEST_WINDOW_S` of the first are one request, not a second one.

A step whose rollout is still being generated is given `WAIT_SHARE` of the budget to get it; if it does not come,
the step is given up and the checkpoint is the previous step's: that state is complete (the learner has not
touched the new batch), and the rollouts in flight are stored as they are or generated again on resume.
"""

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from open_instruct.run.checkpoint import complete_checkpoints
from open_instruct.run.console import say

# One preemption often delivers its signal twice within milliseconds: GNU `timeout` signals its child and then the
# whole process group, SLURM signals every process of the step, and a terminal's Ctrl-C reaches the group. A signal
# this soon after the first is that same request; only a later one (a person or scheduler insisting) stops at once.
SAME_REQUEST_WINDOW_S = 3.0
# The share of --preemption_timeout_s a step may wait for its rollout after the signal; the rest is the checkpoint's.
WAIT_SHARE = 0.5
# At most this long for the last words of an exit without a checkpoint (summary.json): the exit must not wait on them.
LAST_WORDS_S = 5.0


@dataclass
class StopRequest:
    """SIGTERM/SIGINT set a flag that the training loop reads between steps: it then writes a checkpoint and stops.

    The step in progress finishes first (a half-done update cannot be saved), unless it is still waiting for its
    rollout when `WAIT_SHARE` of `timeout_s` has passed (`out_of_patience`): then it is given up and the previous
    step is checkpointed. If the checkpoint is not written within `timeout_s`, or a second signal comes more than
    `SAME_REQUEST_WINDOW_S` after the first, the process exits at once, naming the newest complete checkpoint (the
    kernel releases the output_dir lock), after `last_words` (the trainer's: summary.json) had `LAST_WORDS_S`.
    """

    output_dir: str
    timeout_s: float
    signum: int | None = None
    received_at: float | None = None
    last_words: Callable[[str], None] | None = None  # given the line an exit without a checkpoint ends with
    _previous: dict = field(default_factory=dict)
    _deadline: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def seconds_left(self) -> float | None:
        """Of the preemption's budget (None: no stop requested)."""
        if not self.requested:
            return None
        return max(0.0, self.timeout_s - (time.monotonic() - self.received_at))

    def out_of_patience(self) -> bool:
        """Whether a wait for generation should be given up: a stop was requested `WAIT_SHARE` of the budget ago."""
        return self.requested and time.monotonic() - self.received_at >= WAIT_SHARE * self.timeout_s

    def install(self) -> None:
        """Set the handlers; again after `ray.init`, which sets its own SIGTERM handler (sys.exit) in the driver."""
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (e.g. when called from a test's thread)
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)  # uninstall restores what was there before the first install

    def uninstall(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.requested:
            since_first = time.monotonic() - self.received_at
            if since_first < SAME_REQUEST_WINDOW_S:
                return  # the same preemption delivered twice (e.g. to the process and to its group)
            self._exit_now(f"a second {signal.Signals(signum).name} came {since_first:.0f}s after the first")
        self.signum, self.received_at = signum, time.monotonic()
        say(
            f"[ppo] {self.name} received: finishing this step (or, if its rollout has not come within "
            f"{WAIT_SHARE * self.timeout_s:.0f}s, giving it up), writing a checkpoint, then stopping (at most "
            f"{self.timeout_s:.0f}s; a second signal, {SAME_REQUEST_WINDOW_S:.0f}s or more after this one, stops "
            "at once)",
            error=True,
        )
        too_late = f"no checkpoint within {self.timeout_s:.0f}s of {self.name} (--preemption_timeout_s)"
        self._deadline = threading.Timer(self.timeout_s, self._exit_now, args=(too_late,))
        self._deadline.daemon = True
        self._deadline.start()

    def _exit_now(self, why: str) -> None:
        found = complete_checkpoints(self.output_dir)
        where = f"the newest complete checkpoint is {found[-1]}" if found else "there is no complete checkpoint"
        line = f"{why}: stopped without a new checkpoint; {where} (resume with --resume)"
        if self.last_words is not None:
            # In a thread of its own, joined for a bounded time: this may run in a signal handler that interrupted
            # the main thread while it held the lock the last words need, and the exit must come regardless.
            writer = threading.Thread(target=self.last_words, args=(line,), name="last-words", daemon=True)
            writer.start()
            writer.join(LAST_WORDS_S)
        say(f"error: {line}", error=True)
        os._exit(128 + (self.signum or signal.SIGTERM))


class Preempted(Exception):
    """The run stopped on SIGTERM/SIGINT after writing a checkpoint."""

    def __init__(self, signum: int, step: int, checkpoint_path: str):
        self.signum, self.step, self.checkpoint_path = signum, step, checkpoint_path
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint saved in {checkpoint_path}; "
            "resume with the same command plus --resume"
        )
