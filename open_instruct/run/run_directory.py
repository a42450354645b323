"""The output folder belongs to one run: a lock held for the run's length (released by the kernel even on kill -9),
leftovers of interrupted saves swept at start, and an earlier run never overwritten without --overwrite_output_dir.

--overwrite_output_dir moves the earlier run's files aside (`EARLIER_RUN`, inside output_dir) instead of deleting
them. They are deleted once the new run has something to put in their place (a complete checkpoint or its model),
and put back if it stops before that: a typo in a data path, a broken model folder or a crash in the first steps
loses nothing. A process killed in between leaves them aside; the next start in that folder decides the same way.
"""

import contextlib
import fcntl
import os
import shutil
import socket
import time

from open_instruct.run.args import Args, ConfigError
from open_instruct.run.checkpoint import CHECKPOINTS, COMPLETE_MARKER, checkpoint_step, complete_checkpoints
from open_instruct.run.console import say

LOCK_FILE = ".run.lock"
# Files a run writes in output_dir: their presence means the folder already holds a run.
RUN_FILES = (
    "metrics.jsonl", "samples.jsonl", "lengths.jsonl", "summary.json", "training_curves.png",
    "correct_rate_vs_time.png", "length_histograms.png", "model", CHECKPOINTS,
)  # fmt: skip
# What --overwrite_output_dir replaces: the run's files and its libraries' log.
REPLACED_BY_A_NEW_RUN = (*RUN_FILES, "logs")
EARLIER_RUN = ".earlier-run"  # an overwritten run's files, until the new run has a checkpoint or model


class RunDirectory:
    """Own `output_dir` for the length of a run: a lock, crash leftovers swept, an earlier run never overwritten.

    The lock is an `flock` on output_dir/.run.lock holding the owner's run name, pid and host; the kernel drops
    it when the process dies (kill -9 included), so a crashed run never leaves the folder locked.
    """

    def __init__(self, args: Args):
        self.args = args
        self.output_dir = args.run.output_dir
        self.earlier_run = os.path.join(self.output_dir, EARLIER_RUN)
        self._lock_file = None
        # The folders this run makes for output_dir (it and its missing parents, innermost first): a start that fails
        # before writing in them removes them again.
        self.created: list[str] = []

    def __enter__(self) -> "RunDirectory":
        path = os.path.abspath(self.output_dir)
        while not os.path.exists(path):
            self.created.append(path)
            path = os.path.dirname(path)
        lock_file = self._open_lock(path)
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

    def _open_lock(self, existing: str):
        """output_dir made (with its missing parents) and its lock file opened; a folder that cannot be written (a
        read-only disk, no permission) is a ConfigError naming it, and what this start made is removed again."""
        try:
            os.makedirs(self.output_dir, exist_ok=True)
            return open(os.path.join(self.output_dir, LOCK_FILE), "a+", encoding="utf-8")
        except OSError as error:
            for folder in self.created:  # innermost first; each is empty unless another process wrote there
                with contextlib.suppress(OSError):
                    os.rmdir(folder)
            raise ConfigError(
                f"--output_dir {self.output_dir} cannot be written ({error.strerror}: {error.filename}); give an "
                f"--output_dir on a disk this user can write to, or make {existing} writable."
            ) from error

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
        os.makedirs(self.earlier_run)
        moved = [name for name in REPLACED_BY_A_NEW_RUN if os.path.exists(os.path.join(self.output_dir, name))]
        for name in moved:
            os.rename(os.path.join(self.output_dir, name), os.path.join(self.earlier_run, name))
        say(f"[ppo] --overwrite_output_dir: moved the earlier run's {', '.join(moved)} to {self.earlier_run}; "
            "deleted once this run has a checkpoint or its model, put back if it stops before")  # fmt: skip

    def release_earlier_run(self, saved_elsewhere: str | None = None) -> None:
        """Delete the run --overwrite_output_dir moved aside, now that this run has a checkpoint or model in
        output_dir, or its model in `saved_elsewhere` (output_dir's disk had no room): this run's metrics and logs
        then replace the earlier run's, and the earlier run's space is freed for the model to be moved in."""
        if not os.path.isdir(self.earlier_run):
            return
        if saved_elsewhere is not None:
            shutil.rmtree(self.earlier_run)
            say(f"[ppo] --overwrite_output_dir: deleted the earlier run; this run's model is in {saved_elsewhere}")
        elif has_an_artifact(self.output_dir):
            say(f"[ppo] {settle_earlier_run(self.output_dir)}")

    def __exit__(self, *exc) -> None:
        if os.path.isdir(self.earlier_run) and self._lock_file is not None:
            message = settle_earlier_run(self.output_dir)
            say(f"[ppo] {message}", error=exc[0] is not None)
        if self._lock_file is None:
            return
        # A folder this run made and left holding only its lock (a start that failed on its data, say) is removed,
        # so that the user is not left with an empty run folder. The lock file goes first, while still held.
        only_the_lock = bool(self.created) and os.listdir(self.output_dir) == [LOCK_FILE]
        if only_the_lock:
            os.remove(os.path.join(self.output_dir, LOCK_FILE))
        fcntl.flock(self._lock_file, fcntl.LOCK_UN)
        self._lock_file.close()
        self._lock_file = None
        if only_the_lock:
            with contextlib.suppress(OSError):  # something else wrote in one meanwhile: it and those above it stay
                for folder in self.created:
                    os.rmdir(folder)


def has_an_artifact(output_dir: str) -> bool:
    """Whether a run in `output_dir` has saved something to go on from: a complete checkpoint or a final model."""
    return bool(complete_checkpoints(output_dir)) or os.path.isfile(os.path.join(output_dir, "model", "config.json"))


def settle_earlier_run(output_dir: str) -> str:
    """The run --overwrite_output_dir moved aside: deleted when the new run saved something in its place, else put
    back (the new run's own files removed). Returns what was done."""
    earlier_run = os.path.join(output_dir, EARLIER_RUN)
    if has_an_artifact(output_dir):
        shutil.rmtree(earlier_run)
        return "--overwrite_output_dir: deleted the earlier run; this run has a checkpoint or model in its place"
    for name in REPLACED_BY_A_NEW_RUN:
        path = os.path.join(output_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    for name in sorted(os.listdir(earlier_run)):
        os.rename(os.path.join(earlier_run, name), os.path.join(output_dir, name))
    os.rmdir(earlier_run)
    return (f"--overwrite_output_dir: the new run stopped before saving a checkpoint or model; put the earlier run "
            f"back in {output_dir}")  # fmt: skip


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
    if os.path.isdir(os.path.join(output_dir, EARLIER_RUN)):  # an overwriting run was killed
        messages.append(settle_earlier_run(output_dir))
    return messages
