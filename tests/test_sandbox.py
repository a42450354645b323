"""The code sandbox against hostile programs: each attack ends with score 0 (or a verdict saying why), and the machine
is left as it was (no process of the sandbox's users, no child of this process, no zombie, no temporary folder, and
the files the attack aimed at unchanged). Runs as CI runs, as root; skipped only where isolation cannot start.

Where a program would gain something by the attack, it is graded by the code verifier: the attack's success would
score 1 (the expected output is behind a socket or in a file the program should not read).
"""

import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from open_instruct.rewards.code_tests import CodeVerifier
from open_instruct.rewards.config import RewardConfig, code_limits
from open_instruct.sandbox import (
    ISOLATED,
    UNSAFE_NO_ISOLATION,
    Limits,
    Sandbox,
    SandboxPool,
    SandboxUnavailable,
    cgroups,
    isolation,
    seccomp,
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
    first_uid = isolation.first_uid()
    ours = {pid for pid, (uid, _, _) in table.items() if first_uid <= uid < first_uid + isolation.UID_SLOTS}
    children = {pid for pid, (_, _, parent) in table.items() if parent == os.getpid()}
    return {
        "sandbox users' processes": sorted(ours),
        "children of the test": sorted(children),
        "zombies": sorted(pid for pid in ours | children if table[pid][1] == "Z"),
        "temporary folders": sorted(p.name for p in Path(tempfile.gettempdir()).glob("open_instruct_sandbox_*")),
        "run cgroups": sorted(run_cgroups()),
    }


def run_cgroups() -> list[str]:
    """The run cgroups of this process that exist now (one folder per hierarchy and run)."""
    hierarchies, _ = isolation.cgroup_hierarchies()
    prefix = f"{cgroups.PREFIX}{os.getpid()}_"
    return [str(Path(h.parent) / name) for h in hierarchies for name in os.listdir(h.parent) if name.startswith(prefix)]


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


# The seccomp deny list. Each call is made with arguments for which the kernel's own answer, without the filter, is
# something other than EPERM here (a new file descriptor, a key, EINVAL from flags no namespace check is reached
# with, ...): a call that got through the filter would not print "Operation not permitted".
SYSCALL_PRELUDE = """import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
buffer = ctypes.create_string_buffer(4096)
def call(number, *args):
    result = libc.syscall(ctypes.c_long(number), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    print(result if result >= 0 else os.strerror(ctypes.get_errno()))
"""
CLONE_THREAD = 0x00010000  # without CLONE_SIGHAND: EINVAL before any namespace is looked at
DENIED_CALLS = {  # x86-64 system call numbers
    "io_uring_setup": "call(425, 1, buffer)",
    "io_uring_enter": "call(426, 0, 0, 0, 0, 0, 0)",
    "io_uring_register": "call(427, 0, 0, 0, 0)",
    "add_key": "call(248, b'user', b'name', b'secret', 6, -4)",  # -4: the user keyring
    "keyctl": "call(250, 0, -4, 0)",  # KEYCTL_GET_KEYRING_ID of the user keyring
    "request_key": "call(249, b'user', b'name', 0, 0)",
    "bpf": "call(321, 0, buffer, 72)",
    "perf_event_open": "call(298, buffer, 0, -1, -1, 0)",
    "userfaultfd": "call(323, 1)",  # UFFD_USER_MODE_ONLY: allowed to an unprivileged user
    "ptrace": "call(101, 0, 0, 0, 0)",  # PTRACE_TRACEME
    "process_vm_readv": "call(310, os.getpid(), 0, 0, 0, 0, 0)",
    "process_vm_writev": "call(311, os.getpid(), 0, 0, 0, 0, 0)",
    "setns": "call(308, 0, 0)",
    **{f"clone {name}": f"call(56, {flag} | {CLONE_THREAD} | 17, 0, 0, 0, 0)"
       for name, flag in (("CLONE_NEWUSER", seccomp.CLONE_NEWUSER), ("CLONE_NEWNS", seccomp.CLONE_NEWNS),
                          ("CLONE_NEWNET", seccomp.CLONE_NEWNET), ("CLONE_NEWPID", seccomp.CLONE_NEWPID),
                          ("CLONE_NEWIPC", seccomp.CLONE_NEWIPC), ("CLONE_NEWUTS", seccomp.CLONE_NEWUTS),
                          ("CLONE_NEWCGROUP", seccomp.CLONE_NEWCGROUP))},
    **{f"unshare {name}": f"call(272, {flag} | 1)"  # bit 0 is no unshare flag: EINVAL first
       for name, flag in (("CLONE_NEWUSER", seccomp.CLONE_NEWUSER), ("CLONE_NEWNS", seccomp.CLONE_NEWNS),
                          ("CLONE_NEWNET", seccomp.CLONE_NEWNET), ("CLONE_NEWTIME", seccomp.CLONE_NEWTIME))},
    **{f"socket family {family}": f"socket.socket({family}, socket.SOCK_DGRAM, 0); print('opened')"
       for family in (16, 40, 38, 0, 3)},  # netlink, vsock, alg, unspec, ax25 (a gap between AF_INET and AF_INET6)
}  # fmt: skip


@pytest.mark.parametrize("name", DENIED_CALLS)
def test_a_denied_system_call_fails_with_eperm(sandbox, name):
    program = (
        SYSCALL_PRELUDE
        + f"try:\n    {DENIED_CALLS[name]}\nexcept OSError as error:\n    print(os.strerror(error.errno))\n"
    )
    run = sandbox.run_python(program)
    assert (run.verdict, run.stdout) == (OK, "Operation not permitted\n"), run.stderr


def test_clone3_is_not_implemented_so_threads_and_forks_fall_back_to_clone(sandbox):
    """clone3 passes its flags in memory, where a filter cannot read them: it answers ENOSYS, and the C library
    then starts threads and processes with clone (whose flags it can read), Unix and IP sockets still open."""
    program = SYSCALL_PRELUDE + (
        "call(435, buffer, 88)\n"
        "import threading\nthread = threading.Thread(target=print, args=('thread',))\nthread.start()\nthread.join()\n"
        "pid = os.fork()\nif pid == 0:\n    os._exit(7)\nprint(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
        "left, right = socket.socketpair()\nleft.sendall(b'unix')\nprint(right.recv(4).decode())\n"
        "print(socket.socket(socket.AF_INET).family.name, socket.socket(socket.AF_INET6).family.name)\n"
    )
    run = sandbox.run_python(program)
    assert run.stdout.split("\n") == ["Function not implemented", "thread", "7", "unix", "AF_INET AF_INET6", ""], (
        run.stderr
    )


def test_a_key_added_in_one_run_cannot_be_read_in_the_next_with_the_same_uid(sandbox, monkeypatch):
    """A uid comes back every UID_SLOTS runs, and the kernel keeps a user keyring per uid: without the filter, a key
    added by one run is found by the next run of that uid."""
    uid = isolation.next_uid()
    monkeypatch.setattr(isolation, "next_uid", lambda: uid)
    add = sandbox.run_python(SYSCALL_PRELUDE + "call(248, b'user', b'carried', b'secret', 6, -4)\n")
    read = sandbox.run_python(SYSCALL_PRELUDE + (
        "key = libc.syscall(ctypes.c_long(250), ctypes.c_long(10), ctypes.c_long(-4), b'user', b'carried', 0)\n"
        "print(key if key < 0 else libc.syscall(ctypes.c_long(250), ctypes.c_long(11), ctypes.c_long(key), "
        "buffer, ctypes.c_long(64)), buffer.value)\n"
    ))  # fmt: skip  # KEYCTL_SEARCH, then KEYCTL_READ
    assert add.stdout == "Operation not permitted\n", add.stderr
    assert read.stdout == "-1 b''\n", read.stderr


def test_each_process_draws_its_uid_range_at_random():
    """Two processes' first uids differ and do not follow from their pids (a program could otherwise predict the uid
    of another process's runs)."""
    program = "import os\nfrom open_instruct.sandbox import isolation\nprint(os.getpid(), isolation.first_uid())"
    firsts = []
    for _ in range(2):
        pid, first = map(int, subprocess.check_output([sys.executable, "-c", program], text=True).split())
        assert (first - UID_BASE) % isolation.UID_SLOTS == 0 and first + isolation.UID_SLOTS <= 2**31
        firsts.append((pid, first))
    assert firsts[0][1] != firsts[1][1]
    assert not all(first == UID_BASE + pid * isolation.UID_SLOTS for pid, first in firsts)


def test_the_environment_holds_no_host_path(sandbox):
    run = sandbox.run_python("import json, os\nprint(json.dumps(dict(os.environ)))")
    environment = json.loads(run.stdout)
    assert set(environment) == {"PATH", "LANG", "HOME"} and environment["HOME"] == "/tmp", environment


CGROUPS, CGROUP_WALL = isolation.cgroup_hierarchies()
needs_cgroups = pytest.mark.skipif(not CGROUPS, reason=CGROUP_WALL)


@needs_cgroups
def test_a_runs_processes_together_are_killed_past_its_memory_cgroup():
    """Four processes of 150 MiB each, every one under its 256 MiB address space: together over the run's 300 MiB,
    so the kernel kills some of them (without the cgroup all four finish)."""
    sandbox = Sandbox(ISOLATED, Limits(wall_time_s=20.0, memory_mb=256, run_memory_mb=300))
    program = (
        "import os, time\nchildren = []\n"
        "for _ in range(4):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = bytearray(b'x') * (150 << 20)\n"  # written, so resident
        "        time.sleep(1.0)\n"
        "        os._exit(0)\n"
        "    children.append(pid)\n"
        "print([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children])\n"
    )
    run = sandbox.run_python(program)
    codes = json.loads(run.stdout) if run.verdict == OK else None
    assert codes is None or -9 in codes, (run.verdict, run.stdout, run.stderr)
    assert sandbox.run_python("print('after')").stdout == "after\n"


@needs_cgroups
def test_a_run_sits_in_memory_and_pids_cgroups_of_its_own_removed_after_it(sandbox):
    """While a run of three children sleeps, its cgroups hold its processes (the namespace's init, the program, its
    children) under the run's limits; after it, they are gone (the fixture checks)."""
    seen = {}

    def look():
        deadline = time.monotonic() + 4.0
        while time.monotonic() < deadline and not seen:
            for folder in map(Path, run_cgroups()):
                procs = (folder / "cgroup.procs").read_text().split()
                if len(procs) == 5:
                    limits = [(folder / name).read_text().strip() for name in
                              ("memory.limit_in_bytes", "memory.max", "pids.max") if (folder / name).exists()]  # fmt: skip
                    seen.setdefault("limits", []).extend(limits)
            time.sleep(0.05)

    thread = threading.Thread(target=look)
    thread.start()
    run = Sandbox(ISOLATED, Limits(wall_time_s=3.0, run_memory_mb=320)).run_python(
        "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        time.sleep(60)\ntime.sleep(60)\n"
    )
    thread.join()
    assert run.verdict == TIMEOUT
    assert sorted(seen.get("limits", [])) == sorted([str(320 << 20), str(FAST.max_processes + 1)]), seen


@needs_cgroups
def test_folders_and_cgroups_left_by_a_killed_caller_are_swept_by_the_next_sandbox():
    """A caller killed with SIGKILL leaves its run folder and cgroups: the next Sandbox removes those whose owner
    (the pid in their name) is gone, and keeps a live owner's."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    temporary = Path(tempfile.gettempdir())
    stale = temporary / f"open_instruct_sandbox_{gone.pid}_abc"
    live = temporary / f"open_instruct_sandbox_{os.getpid()}_live"
    (stale / "work").mkdir(parents=True)
    (stale / "work" / "main.py").write_text("print('left')")
    live.mkdir()
    stale_cgroups = [Path(h.parent) / f"{cgroups.PREFIX}{gone.pid}_3" for h in CGROUPS]
    try:
        for folder in stale_cgroups:
            folder.mkdir()
        Sandbox(ISOLATED, FAST)
        assert not stale.exists() and live.exists()
        assert not any(folder.exists() for folder in stale_cgroups)
    finally:
        live.rmdir()


def test_the_log_says_which_walls_are_active_and_a_run_works_without_libseccomp(monkeypatch):
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    level = isolation.logger.level
    isolation.logger.addHandler(handler)
    isolation.logger.setLevel(logging.INFO)
    monkeypatch.setattr(isolation, "_walls_said", set())
    try:
        Sandbox(ISOLATED, FAST)
        Sandbox(ISOLATED, FAST)  # once per process
        monkeypatch.setitem(sys.modules, "pyseccomp", None)  # as where pyseccomp is not installed
        seccomp.filter_program.cache_clear()
        without = Sandbox(ISOLATED, FAST)
        run = without.run_python(SYSCALL_PRELUDE + "call(248, b'user', b'name', b'secret', 6, -4)\n")
    finally:
        isolation.logger.removeHandler(handler)
        isolation.logger.setLevel(level)
        seccomp.filter_program.cache_clear()
    assert len(lines) == 2, lines
    assert "namespaces" in lines[0] and "seccomp deny list" in lines[0] and "rlimits" in lines[0]
    assert ("cgroup v1 memory and pids per run" in lines[0]) == bool(CGROUPS), lines[0]
    assert "seccomp off (its filter cannot be built" in lines[1]
    assert run.verdict == OK and run.stdout != "Operation not permitted\n"


def test_cgroup_v2_is_found_where_it_offers_memory_and_pids(tmp_path):
    """Where no v1 memory or pids hierarchy is mounted, the caller's v2 cgroup is used (this machine has v1, so the
    v2 layout is made here as files)."""
    own = tmp_path / "user.slice" / "trainer.scope"
    own.mkdir(parents=True)
    (own / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    mountinfo = f"31 23 0:28 / {tmp_path} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    found = cgroups.find_hierarchies(mountinfo, "0::/user.slice/trainer.scope\n")
    assert found == [cgroups.Hierarchy(2, str(own), ("memory", "pids"))]
    assert cgroups.limit_files(found[0], 300 << 20, 17) == [("memory.max", 300 << 20), ("memory.swap.max", 0),
                                                            ("pids.max", 17)]  # fmt: skip
    (own / "cgroup.controllers").write_text("cpu io\n")
    assert cgroups.find_hierarchies(mountinfo, "0::/user.slice/trainer.scope\n") == []


def test_the_default_run_memory_is_a_share_of_the_machine_per_concurrent_run():
    """A quarter of the memory this process may use, divided by the runs that go at once (--code_workers), within
    [256 MiB, its processes' address spaces added up]."""
    quarter = cgroups.memory_mb() // 4
    for workers in (1, 4, 64):
        limits = Limits(memory_mb=512, max_processes=16, concurrent_runs=workers)
        assert isolation.run_memory_share_mb(limits) == max(256, min(quarter // workers, 16 * 512))
    assert Sandbox(ISOLATED, Limits(run_memory_mb=300)).run_memory_mb == 300
    assert code_limits(RewardConfig(code_workers=8)).concurrent_runs == 8
