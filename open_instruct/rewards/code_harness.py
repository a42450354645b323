"""Runs inside the code sandbox as its main program (the package never imports it): one function-call test of the
program in solution.py beside it. Standard library only; run with `python -I -S`.

Standard input is one JSON object {"nonce", "fn_name", "args", "kwargs"}. The harness and the program run in two
processes, so that the program can neither read the nonce nor write the report:
- this process makes itself undumpable (`prctl(PR_SET_DUMPABLE, 0)`): another process of the sandbox's user can then
  neither ptrace it nor read its memory (the sandbox has no /proc, and its seccomp filter denies ptrace as well);
- it reads the request, then starts code_runner.py in a new interpreter (posix_spawn: a fresh image, no copy of this
  process's memory) with the request less the nonce on its stdin, its stdout thrown away, its stderr shared (for the
  log) and one pipe for the value: the program never holds this process's stdout, nor the nonce, in any frame or in
  memory;
- when the runner exits 0, the report is one line on stdout: the nonce and the runner's text, cut at MAX_VALUE_BYTES.
The text is not decoded here: the verifier decodes it outside the sandbox with caps on its size and nesting and
compares the value with the expected one there (code_tests). What the program writes on the value pipe is only ever
a value it could have returned, so a forged pipe line gains nothing.
"""

import ctypes
import json
import os
import sys

PR_SET_DUMPABLE = 4
MAX_VALUE_BYTES = 1 << 20  # the verifier refuses a longer value anyway; reading stops here
VALUE_FD = 3  # the runner's end of the value pipe


def make_undumpable() -> None:
    """Fail closed: a harness whose memory the program could read must not report at all."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        sys.stderr.write(f"harness: prctl(PR_SET_DUMPABLE) failed (errno {ctypes.get_errno()}); no report\n")
        sys.exit(3)


def read_all(fd: int, limit: int) -> bytes:
    """What `fd` gives until it closes, at most `limit` + 1 bytes (one more says "too long")."""
    chunks, total = [], 0
    while total <= limit:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    os.close(fd)
    return b"".join(chunks)[: limit + 1]


def start_runner(request: bytes) -> tuple[int, int]:
    """(pid, the read end of its value pipe) of code_runner.py in a new interpreter: the request on its stdin, its
    stdout thrown away, its stderr this one's, the value pipe on VALUE_FD. posix_spawn, not subprocess: one import
    less per test. Python's own pipes are close-on-exec, so the runner gets no other descriptor of this process."""
    request_read, request_write = os.pipe()
    value_read, value_write = os.pipe()
    runner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "code_runner.py")
    pid = os.posix_spawn(sys.executable, [sys.executable, "-I", "-S", runner, str(VALUE_FD)], {}, file_actions=[
        (os.POSIX_SPAWN_DUP2, request_read, 0),
        (os.POSIX_SPAWN_OPEN, 1, "/dev/null", os.O_WRONLY, 0),
        (os.POSIX_SPAWN_DUP2, value_write, VALUE_FD),
    ])  # fmt: skip
    os.close(request_read)
    os.close(value_write)
    try:
        os.write(request_write, request)  # small: fits the pipe's buffer
    except BrokenPipeError:
        pass  # the runner died already: it reports no value
    os.close(request_write)
    return pid, value_read


def main() -> None:
    make_undumpable()
    request = json.loads(sys.stdin.read())
    nonce = request.pop("nonce")
    pid, value_read = start_runner(json.dumps(request).encode())
    value = read_all(value_read, MAX_VALUE_BYTES)
    exit_code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if exit_code != 0 or not value or len(value) > MAX_VALUE_BYTES:  # an exit before the value: none
        sys.exit(1)
    sys.stdout.write("\n" + nonce + " " + value.decode("utf-8", errors="replace").replace("\n", " ") + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
