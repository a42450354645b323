"""The console shows the run's own lines: what runs (config, model, device, dtype and why), the progress bar, the
evals, the summary and where the files are. Everything other libraries print goes to `output_dir/logs/libraries.log`
(and to the console too with --verbose): vLLM's and transformers' logging, datasets' progress bars, DeepSpeed's and
Ray's messages, Python warnings, and what C++ code writes to the process's stdout and stderr.

The split is made at the file descriptors: while `library_output_to` is active, fds 1 and 2 point at the log file,
and `say` writes to copies of the original ones. So a library cannot reach the console by any route (a logging
handler made before the run started, `print`, C++ `std::cout`, a subprocess inheriting the fds), and our lines
need no cooperation from anyone. Without an active redirection `say` is `print` to sys.stdout (or sys.stderr).
"""

import logging
import os
import sys
import threading
from contextlib import contextmanager

from tqdm import tqdm

LOG_NAME = os.path.join("logs", "libraries.log")


class _Terminal:
    """The console's streams while library output is redirected (None otherwise)."""

    out = None
    err = None


def say(message: str, error: bool = False) -> None:
    """One line of ours on the console (stderr with `error`), above a progress bar if one is showing."""
    stream = (_Terminal.err if error else _Terminal.out) or (sys.stderr if error else sys.stdout)
    tqdm.write(message, file=stream)
    stream.flush()


class ConsoleHandler(logging.Handler):
    """Our modules log to `logging.getLogger(__name__)` (layers below `run` never import the console); this handler,
    on the "open_instruct" logger, puts those lines on the console: info on stdout, warnings and errors on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        say(self.format(record), error=record.levelno >= logging.WARNING)


def install_console_handler() -> None:
    package_logger = logging.getLogger("open_instruct")
    if not any(isinstance(handler, ConsoleHandler) for handler in package_logger.handlers):
        package_logger.addHandler(ConsoleHandler())
        package_logger.setLevel(logging.INFO)
        package_logger.propagate = False  # once is enough: not again through a library's root handler


install_console_handler()


def stream(error: bool = True):
    """The console stream for things of ours that write to a file object (the progress bar, a traceback)."""
    return (_Terminal.err if error else _Terminal.out) or (sys.stderr if error else sys.stdout)


def redirected() -> bool:
    return _Terminal.out is not None


@contextmanager
def library_output_to(log_path: str, verbose: bool = False, discard_on: type[BaseException] | None = None):
    """Send everything written to fds 1 and 2 to `log_path` (appended) for the block; with `verbose`, to the console
    as well. `say` keeps writing to the console. A block that raises `discard_on` (a run refused before it started)
    leaves no log file behind unless one was there before."""
    if redirected():  # nested (a run inside a run's process): the outer redirection holds
        yield
        return
    new_folder, new_file = not os.path.isdir(os.path.dirname(log_path)), not os.path.exists(log_path)
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    tee = None
    if verbose:
        read_fd, write_fd = os.pipe()
        tee = threading.Thread(target=_copy, args=(read_fd, (log_fd, saved_out)), name="library-output", daemon=True)
        tee.start()
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        os.close(write_fd)
    else:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
    _Terminal.out = os.fdopen(saved_out, "w", buffering=1, closefd=False)
    _Terminal.err = os.fdopen(saved_err, "w", buffering=1, closefd=False)
    try:
        yield
    except BaseException as error:
        if discard_on is not None and isinstance(error, discard_on) and new_file:
            os.remove(log_path)
            if new_folder:
                os.rmdir(os.path.dirname(log_path))
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)  # closes the pipe's last write end: the tee thread sees the end and stops
        os.dup2(saved_err, 2)
        if tee is not None:
            tee.join(timeout=5)
        _Terminal.out.flush()
        _Terminal.err.flush()
        _Terminal.out = _Terminal.err = None
        for fd in (saved_out, saved_err, log_fd):
            os.close(fd)


def _copy(read_fd: int, targets: tuple[int, ...]) -> None:
    """The --verbose tee: everything libraries write goes to the log file and to the console."""
    while chunk := os.read(read_fd, 65536):
        for fd in targets:
            try:
                os.write(fd, chunk)
            except OSError:
                pass  # a closed console must not stop the log file
    os.close(read_fd)


class _EndOfProcess:
    """Whether this process ends by `exit_without_teardown`, and what it keeps until then (`keep_until_exit`)."""

    without_teardown = False
    kept: list = []


def keep_until_exit(thing) -> None:
    """Free `thing` with the process rather than now, when the process ends without teardown: for an object whose
    freeing only frees memory, slowly (vLLM's in-process engine: its shutdown collects garbage and releases the KV
    cache, ~1 s of a 2-core machine after a tiny-model run). In a process that goes on (tests calling `main`), nothing:
    it is freed as usual."""
    if _EndOfProcess.without_teardown:
        _EndOfProcess.kept.append(thing)


def exit_without_teardown(entry) -> None:
    """Run the command line's `entry` (which ends by returning or by SystemExit), then end the process at once with
    its exit code. By then everything is on disk and the logs are closed, so the interpreter's teardown would only
    free memory, and it is slow: measured 7-8 s on 2 cores after a tiny-model run (garbage-collecting vLLM's, torch's
    and transformers' objects), against 0.5 s without it. Only for `python -m ...`: code that calls `entry` in
    process (tests) keeps its interpreter."""
    _EndOfProcess.without_teardown = True
    try:
        entry()
        code = 0
    except SystemExit as request:
        code = request.code
    if not isinstance(code, int):  # sys.exit("message") prints the message and exits 1, as Python does
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
