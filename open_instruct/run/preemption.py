"""Preemption: SIGTERM or SIGINT asks the training loop to stop between steps, write a checkpoint and exit with
128 + signal; a deadline (--preemption_timeout_s) or a second signal exits at once, naming the newest checkpoint.
Signals that come within `SAME_REQUEST_WINDOW_S` of the first are one request, not a second one.
"""

import os
import signal
import threading
import time
from dataclasses import dataclass, field

from open_instruct.run.checkpoint import complete_checkpoints
from open_instruct.run.console import say

# One preemption often delivers its signal twice within milliseconds: GNU `timeout` signals its child and then the
# whole process group, SLURM signals every process of the step, and a terminal's Ctrl-C reaches the group. A signal
# this soon after the first is that same request; only a later one (a person or scheduler insisting) stops at once.
SAME_REQUEST_WINDOW_S = 3.0


@dataclass
class StopRequest:
    """SIGTERM/SIGINT set a flag that the training loop reads between steps: it then writes a checkpoint and stops.

    The step in progress finishes first (a half-done update cannot be saved). If that and the checkpoint take
    longer than `timeout_s`, or a second signal comes more than `SAME_REQUEST_WINDOW_S` after the first, the
    process exits at once, naming the newest complete checkpoint (the kernel releases the output_dir lock).
    """

    output_dir: str
    timeout_s: float
    signum: int | None = None
    received_at: float | None = None
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
            f"[ppo] {self.name} received: finishing this step, writing a checkpoint, then stopping "
            f"(at most {self.timeout_s:.0f}s; a second signal, {SAME_REQUEST_WINDOW_S:.0f}s or more after this "
            "one, stops at once)",
            error=True,
        )
        too_late = f"no checkpoint within {self.timeout_s:.0f}s of {self.name} (--preemption_timeout_s)"
        self._deadline = threading.Timer(self.timeout_s, self._exit_now, args=(too_late,))
        self._deadline.daemon = True
        self._deadline.start()

    def _exit_now(self, why: str) -> None:
        found = complete_checkpoints(self.output_dir)
        where = f"the newest complete checkpoint is {found[-1]}" if found else "there is no complete checkpoint"
        say(f"error: {why}: stopped without a new checkpoint; {where} (resume with --resume)", error=True)
        os._exit(128 + (self.signum or signal.SIGTERM))


class Preempted(Exception):
    """The run stopped on SIGTERM/SIGINT after writing a checkpoint."""

    def __init__(self, signum: int, step: int, checkpoint_path: str):
        self.signum, self.step, self.checkpoint_path = signum, step, checkpoint_path
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step}; checkpoint saved in {checkpoint_path}; "
            "resume with the same command plus --resume"
        )
