"""The output folder belongs to one run: a lock held for the run's length (released by the kernel even on kill -9),
leftovers of interrupted saves swept at start, and an earlier run never overwritten without --overwrite_output_dir.
"""

import fcntl
import os
import shutil
import socket
import time

from open_instruct.run.args import Args, ConfigError
from open_instruct.run.checkpoint import CHECKPOINTS, COMPLETE_MARKER, checkpoint_step
from open_instruct.run.console import say

LOCK_FILE = ".run.lock"
# Files a run writes in output_dir: their presence means the folder already holds a run.
RUN_FILES = (
    "metrics.jsonl", "samples.jsonl", "lengths.jsonl", "summary.json", "training_curves.png", "model", CHECKPOINTS,
)  # fmt: skip


class RunDirectory:
    """Own `output_dir` for the length of a run: a lock, crash leftovers swept, an earlier run never overwritten.

    The lock is an `flock` on output_dir/.run.lock holding the owner's run name, pid and host; the kernel drops
    it when the process dies (kill -9 included), so a crashed run never leaves the folder locked.
    """

    def __init__(self, args: Args):
        self.args = args
        self.output_dir = args.run.output_dir
        self._lock_file = None

    def __enter__(self) -> "RunDirectory":
        os.makedirs(self.output_dir, exist_ok=True)
        lock_path = os.path.join(self.output_dir, LOCK_FILE)
        lock_file = open(lock_path, "a+", encoding="utf-8")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            owner = lock_file.read().strip() or "another process"
            lock_file.close()
            raise ConfigError(
                f"--output_dir {self.output_dir} is in use by {owner}; wait for that run to end, or pick another "
                "--output_dir."
            ) from None
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(f"run {self.args.run.run_name} (pid {os.getpid()} on {socket.gethostname()}, since "
                        f"{time.strftime('%Y-%m-%d %H:%M:%S')})")  # fmt: skip
        lock_file.flush()
        self._lock_file = lock_file
        try:
            for message in sweep_leftovers(self.output_dir):
                say(f"[ppo] {message}")
            self._claim()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _claim(self) -> None:
        """A fresh run needs an output_dir without an earlier run in it (or --overwrite_output_dir)."""
        if self.args.run.resume is not None:
            return
        earlier = [name for name in RUN_FILES if os.path.exists(os.path.join(self.output_dir, name))]
        if not earlier:
            return
        if not self.args.run.overwrite_output_dir:
            raise ConfigError(
                f"--output_dir {self.output_dir} already holds a run ({', '.join(earlier)}); pass --resume to continue "
                "it, --overwrite_output_dir true to delete it and start over, or another --output_dir."
            )
        for name in earlier:
            path = os.path.join(self.output_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
        say(f"[ppo] --overwrite_output_dir: deleted the earlier run's {', '.join(earlier)}")

    def __exit__(self, *exc) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None


def sweep_leftovers(output_dir: str) -> list[str]:
    """Remove what an interrupted save left behind; put back a final model a crash left between two renames."""
    messages = []
    model_dir = os.path.join(output_dir, "model")
    for name in sorted(os.listdir(output_dir)):
        path = os.path.join(output_dir, name)
        if name.startswith(".model-old-"):
            previous = os.path.join(path, "previous")
            if not os.path.exists(model_dir) and os.path.isdir(previous):
                os.rename(previous, model_dir)
                messages.append(f"recovered {model_dir} from an interrupted save")
            shutil.rmtree(path, ignore_errors=True)
            messages.append(f"removed the leftover {path} of an interrupted save")
        elif name.startswith(".model-saving-") or (name.startswith(".") and name.endswith(".tmp")):
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            messages.append(f"removed the leftover {path} of an interrupted save")
    root = os.path.join(output_dir, CHECKPOINTS)
    if os.path.isdir(root):
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            if name.startswith(".step_") or (
                checkpoint_step(name) is not None and not os.path.isfile(os.path.join(path, COMPLETE_MARKER))
            ):
                shutil.rmtree(path, ignore_errors=True)
                messages.append(f"removed the incomplete checkpoint {path}")
    return messages
