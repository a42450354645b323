"""The code sandbox against hostile programs: each attack ends with score 0 (or a verdict saying why), and the machine
is left as it was (no process of the sandbox's users, no child of this process, no zombie, no temporary folder, and
the files the attack aimed at unchanged). Runs as CI runs, as root; skipped only where isolation cannot start.

Where a program would gain something by the attack, it is graded by the code verifier: the attack's success would
score 1 (the expected output is behind a socket or in a file the program should not read).
"""

import json
import os
import re
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from open_instruct.rl.code_tests import CodeVerifier
from open_instruct.sandbox import (
    ISOLATED,
    UNSAFE_NO_ISOLATION,
    Limits,
    Sandbox,
    SandboxPool,
    SandboxUnavailable,
    isolation,
)
from open_instruct.sandbox.isolation import ERROR, OK, OUTPUT_LIMIT, TIMEOUT, UID_BASE, isolation_problem

REPO = Path(__file__).resolve().parent.parent
PROBLEM = isolation_problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"isolation impossible here: {PROBLEM}")
# Programs that end by themselves get a generous wall time (a loaded CI machine starts Python slowly); those meant
# to run into it, a short one.
FAST = Limits(wall_time_s=5.0, memory_mb=256, max_output_bytes=64 << 10)
SHORT = Limits(wall_time_s=1.0, memory_mb=256)


def processes() -> dict[int, tuple[int, str, int]]:
    """pid -> (real uid, state letter, parent pid) of every process on the machine."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        uid = int(re.search(r"^Uid:\s+(\d+)", status, re.M).group(1))
        state = re.search(r"^State:\s+(\S)", status, re.M).group(1)
        parent = int(re.search(r"^PPid:\s+(\d+)", status, re.M).group(1))
        found[int(entry)] = (uid, state, parent)
    return found


def leftovers() -> dict[str, list]:
    """What a sandboxed run of this process could leave behind: its users' processes (the uids of this process's own
    range: a pytest worker beside it runs sandboxes of its own), children of this process, zombies of either, folders
    in this module's temporary folder (private_temporary_folder)."""
    table = processes()
    first_uid = UID_BASE + (os.getpid() % isolation.PID_LIMIT) * isolation.UID_SLOTS
    ours = {pid for pid, (uid, _, _) in table.items() if first_uid <= uid < first_uid + isolation.UID_SLOTS}
    children = {pid for pid, (_, _, parent) in table.items() if parent == os.getpid()}
    return {
        "sandbox users' processes": sorted(ours),
        "children of the test": sorted(children),
        "zombies": sorted(pid for pid in ours | children if table[pid][1] == "Z"),
        "temporary folders": sorted(p.name for p in Path(tempfile.gettempdir()).glob("open_instruct_sandbox_*")),
    }


@pytest.fixture(scope="module", autouse=True)
def private_temporary_folder(tmp_path_factory):
    """The sandbox's run folders go to a temporary folder of this module's own, so that a pytest worker running
    sandboxes beside this file (tests/test_code_tests.py, test_tools.py) leaves none in the folders checked here."""
    folder = tmp_path_factory.mktemp("sandbox_tmp")
    folder.chmod(0o755)
    before, tempfile.tempdir = tempfile.tempdir, str(folder)
    yield
    tempfile.tempdir = before


@pytest.fixture(autouse=True)
def machine_left_as_it_was():
    before = leftovers()
    yield
    deadline = time.monotonic() + 5  # the kernel tears a namespace down asynchronously
    while (after := leftovers()) != before and time.monotonic() < deadline:
        time.sleep(0.05)
    for what, now in after.items():
        new = sorted(set(now) - set(before[what]))
        assert not new, f"left behind: {what} {new}"


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return Sandbox(ISOLATED, FAST)


@pytest.fixture(scope="module")
def short_sandbox() -> Sandbox:
    return Sandbox(ISOLATED, SHORT)


def stdio_tests(inputs: list[str], outputs: list[str]) -> str:
    return json.dumps({"inputs": inputs, "outputs": outputs})


def test_an_honest_program_runs_and_sees_only_the_sandbox(sandbox):
    run = sandbox.run_python(
        "import json, os\nprint(input()[::-1], os.getuid(), os.getcwd(), json.dumps(os.listdir('/')))", "abc\n"
    )
    assert run.verdict == OK, run.stderr
    reversed_text, uid, cwd, listing = run.stdout.split(" ", 3)
    assert reversed_text == "cba" and int(uid) >= UID_BASE and cwd == "/tmp"
    assert set(json.loads(listing)) <= {*isolation.SYSTEM_FOLDERS, "usr", "tmp", "dev", "sandbox"}


def test_infinite_loop_is_killed_at_the_wall_clock_limit(short_sandbox):
    run = short_sandbox.run_python("while True:\n    pass\n")
    assert run.verdict == TIMEOUT and run.exit_code is None
    assert run.wall_s < SHORT.wall_time_s + 1.0


def test_fork_bomb_is_capped_and_killed_whole(sandbox, short_sandbox):
    run = short_sandbox.run_python(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    assert run.verdict == TIMEOUT
    assert sandbox.run_python("print('after')").stdout == "after\n"  # the next run starts: nothing was exhausted


def test_memory_hog_gets_a_memory_error(sandbox):
    run = sandbox.run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))\n")
    assert run.verdict == ERROR and "MemoryError" in run.stderr


def test_endless_printing_is_cut_at_the_output_cap(sandbox):
    run = sandbox.run_python("while True:\n    print('x' * 1000)\n")
    assert run.verdict == OUTPUT_LIMIT and len(run.stdout) <= FAST.max_output_bytes
    assert run.wall_s < FAST.wall_time_s / 2  # cut when the cap is passed, not at the deadline


def test_a_program_that_closes_its_output_and_loops_is_killed(sandbox, short_sandbox):
    run = short_sandbox.run_python("import os\nos.close(1)\nos.close(2)\nwhile True:\n    pass\n")
    assert run.verdict == TIMEOUT
    silent = CodeVerifier(sandbox).score("import os\nos.close(1)\n", stdio_tests(["1\n"], ["1\n"]))
    assert silent == 0.0


def test_writes_to_etc_the_checkout_and_the_root_fail(sandbox):
    target = REPO / "sandbox_escape.txt"
    passwd = Path("/etc/passwd").read_bytes()
    for path in ("/etc/passwd", "/etc/sandbox_escape", str(target), "/sandbox_escape", "/sandbox/main.py", "/usr/x"):
        run = sandbox.run_python(f"open({path!r}, 'a').write('escaped')\n")
        assert run.verdict == ERROR and re.search("Read-only file system|No such file|Permission denied", run.stderr), (
            path
        )
    assert not target.exists() and Path("/etc/passwd").read_bytes() == passwd
    assert (
        sandbox.run_python("open('/tmp/scratch', 'w').write('ok')\nprint(open('/tmp/scratch').read())").stdout == "ok\n"
    )


def test_a_big_file_is_stopped_by_the_file_size_limit(sandbox):
    run = sandbox.run_python("open('/tmp/big', 'wb').write(b'0' * (64 << 20))\n")
    assert run.verdict == ERROR


def test_files_outside_the_sandbox_cannot_be_read(sandbox, tmp_path):
    """The expected output sits in a file of the checkout, in /root and in a temporary folder: a program that could
    read any of them would pass."""
    secret = "the answer 4242"
    files = [REPO / ".sandbox_secret_for_test", Path("/root/.sandbox_secret_for_test"), tmp_path / "secret"]
    try:
        for path in files:
            path.write_text(secret)
        verifier = CodeVerifier(sandbox)
        for path in files:
            program = f"print(open({str(path)!r}).read())"
            assert verifier.score(program, stdio_tests([""], [secret])) == 0.0, path
        run = sandbox.run_python(
            "import os\nprint(os.path.exists('/root'), os.path.exists('/work'), os.path.exists('/etc'))"
        )
        assert run.stdout == "False False False\n"
    finally:
        for path in files:
            path.unlink(missing_ok=True)


def test_no_network_not_even_loopback(sandbox):
    """A server on this machine's loopback hands out the expected output: the program cannot reach it, nor an outside
    address (the connection never leaves the sandbox's empty network namespace)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    served, stop = [], threading.Event()

    def serve():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                connection, _ = server.accept()
            except OSError:  # the timeout: look at `stop` again
                continue
            served.append(True)
            connection.sendall(b"42\n")
            connection.close()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        program = ("import socket\nconnection = socket.create_connection(('127.0.0.1', %d), timeout=0.5)\n"
                   "print(connection.recv(10).decode().strip())\n") % port  # fmt: skip
        assert CodeVerifier(sandbox).score(program, stdio_tests([""], ["42"])) == 0.0
        outside = sandbox.run_python("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=0.5)\n")
        assert outside.verdict == ERROR and "Network is unreachable" in outside.stderr
    finally:
        stop.set()
        thread.join()
        server.close()
    assert not served


def test_kill_everything_kills_only_the_program(sandbox):
    """os.kill(-1, 9) in the sandbox reaches only its own PID namespace: a run beside it and a process of this
    machine survive."""
    bystander = subprocess.Popen(["sleep", "5"])
    beside = []
    thread = threading.Thread(
        target=lambda: beside.append(sandbox.run_python("import time\ntime.sleep(0.5)\nprint('alive')"))
    )
    thread.start()
    try:
        run = sandbox.run_python("import os\nos.kill(-1, 9)\nprint('still here')\n")
        thread.join()
        assert run.verdict == ERROR and "still here" not in run.stdout
        assert beside[0].stdout == "alive\n"
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_killing_the_parent_or_the_caller_is_refused(sandbox):
    program = (
        "import os, signal\n"
        "for pid in (os.getppid(), 1, %d):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "        print('killed', pid)\n"
        "    except OSError as error:\n"
        "        print(type(error).__name__)\n"
        "try:\n"
        "    os.setuid(0)\n"
        "except OSError as error:\n"
        "    print(type(error).__name__)\n"
    ) % os.getpid()
    run = sandbox.run_python(program)
    assert run.verdict == OK, run.stderr
    lines = run.stdout.split()
    assert "killed" not in lines and lines[-1] == "PermissionError"


def test_fifty_timeouts_with_forked_and_orphaned_children_leave_nothing():
    """Each run forks a child, double-forks an orphan in a new session, and loops until killed: after 50 of them,
    nothing of theirs is left (the fixture counts processes, zombies and folders before and after)."""
    sandbox = Sandbox(ISOLATED, Limits(wall_time_s=0.3, memory_mb=256))
    program = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    time.sleep(100)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(100)\n"
        "    os._exit(0)\n"
        "while True:\n"
        "    pass\n"
    )
    pool = SandboxPool(4)
    try:
        runs = pool.map(lambda _: sandbox.run_python(program), range(50))
    finally:
        pool.close()
    assert [run.verdict for run in runs] == [TIMEOUT] * 50


def test_refused_without_root_unless_asked_for_by_the_unsafe_name(monkeypatch):
    monkeypatch.setattr(isolation.os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailable, match=r"needs root .* pass --code_sandbox unsafe_no_isolation"):
        Sandbox(ISOLATED)
    unsafe = Sandbox(UNSAFE_NO_ISOLATION, Limits(wall_time_s=0.5))
    assert unsafe.run_python("print(input() * 2)", "ab\n").stdout == "abab\n"
    assert unsafe.run_python("while True:\n    pass\n").verdict == TIMEOUT
