"""One sandboxed run of an untrusted Python program: `Sandbox(mode, limits).run_python(source, stdin) -> RunResult`.

How it isolates (mode "isolated", needs root; CI and the training machines run as root):
- `unshare` gives the run new network, PID, mount, IPC and UTS namespaces. The network namespace holds only a loopback
  that is down: no address, 127.0.0.1 included, can be reached.
- In the new mount namespace a setup script (root, before anything untrusted runs) builds a root of its own: a tmpfs,
  read-only, holding /usr, /bin, /lib... bound read-only, /dev/null and /dev/urandom, a size-limited
  private /tmp (the only writable place, and the working directory) and /sandbox, the run's own folder (its program,
  read-only). The checkout, /root, /home, /etc, /proc and everything else of the machine are not there.
- The setup script moves itself into the run's own memory and pids cgroups (`cgroups.py`): every process of the run
  is in them, and together they may use `run_memory_mb` of memory and `max_processes` processes.
- `chroot` into it, then `setpriv` drops to an unprivileged user (a uid of its own per concurrent run, so one run's
  process limit cannot starve another's; each caller process draws its range of uids at random), clears
  supplementary groups, sets no_new_privs and drops every capability.
- `prlimit` caps processes (threads count), address space, CPU seconds, file size, and core dumps to 0.
- A seccomp filter (`seccomp.py`) denies the system calls that open the kernel's wider attack surface (io_uring,
  keyrings, bpf, perf, ptrace, new namespaces, socket families other than Unix and IP), installed before the
  program's interpreter starts.
- The caller reads stdout and stderr with a cap on their total size and a wall-clock deadline; past either, it kills
  the PID namespace's init, and the kernel kills every process in the namespace with it (forked, daemonised or
  orphaned ones included). `unshare --kill-child` and `setpriv --pdeathsig` kill the run if its parent dies.

The program is never read back into the caller's process: only its stdout/stderr text and exit code come back.
It does NOT protect against kernel exploits through the system calls it still allows (it shares the host's kernel),
CPU and memory-bandwidth contention with the trainer, or timing side channels. Where a wall cannot be built here
(no libseccomp, no cgroup the caller may create children in) the run goes on without it, and the log says once per
process which walls are active.

Mode "unsafe_no_isolation" runs the program as the caller's user with only the resource limits and the wall-clock
kill: for machines where isolation cannot start (no root), and only when asked for by that name.
"""

import itertools
import logging
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cache

from open_instruct.sandbox import cgroups, seccomp

logger = logging.getLogger(__name__)

ISOLATED = "isolated"
UNSAFE_NO_ISOLATION = "unsafe_no_isolation"
MODES = (ISOLATED, UNSAFE_NO_ISOLATION)

# Verdicts of a run.
OK = "ok"  # exited with code 0
ERROR = "error"  # exited with another code, or was killed by a signal (an exceeded limit other than wall time)
TIMEOUT = "timeout"  # past the wall-clock limit, or its CPU seconds (SIGXCPU)
OUTPUT_LIMIT = "output_limit"  # wrote more than max_output_bytes to stdout and stderr together
SANDBOX_ERROR = "sandbox_error"  # the sandbox itself could not start

TOOLS = ("setpriv", "unshare", "prlimit", "mount", "chroot")
# Unprivileged uids for the sandboxed programs: no user on a Debian/Ubuntu machine has one this high (and below 2**31,
# which some tools read as signed). Each process of the caller draws a range of UID_SLOTS at random, and concurrent
# runs cycle through it: a uid comes back every UID_SLOTS runs, so what the kernel keeps per uid (keyrings: denied by
# the seccomp filter) must not carry anything from one run to the next.
UID_BASE = 2_000_000_000
UID_SLOTS = 64
UID_RANGES = (2**31 - UID_BASE) // UID_SLOTS
# The run folders: the owner's pid in the name, so that a Sandbox made later removes those whose owner is gone.
FOLDER_PREFIX = "open_instruct_sandbox_"
STALE_FOLDER = re.compile(rf"{FOLDER_PREFIX}(\d+)_.+")
SETUP_FAILED_EXIT = 125
SETUP_FAILED_PREFIX = "sandbox setup failed:"
SANDBOX_FOLDER = "/sandbox"
# The exit code a shell reports for a program killed by SIGXCPU (the CPU-seconds limit).
CPU_LIMIT_EXIT = 128 + signal.SIGXCPU

# Runs as root in the new namespaces, before anything untrusted; arguments: root mount point, the run's folder, uid,
# /tmp size in MiB, an interpreter prefix to bind ("" when the interpreter lies under /usr), the targets of /'s
# symbolic links to recreate (bin -> usr/bin: each named after its target's last part), the top-level folders to
# bind, the run's cgroup folders to join, then the command. Few processes: each costs milliseconds, and a run pays
# for all of them. The environment loses PWD and OLDPWD (the shell sets them to the host's path of the run folder).
SETUP_SCRIPT = r"""
set -u
fail() { echo "sandbox setup failed: $*" >&2; exit 125; }
root=$1 work=$2 uid=$3 tmp_mb=$4 prefix=$5 links=$6 folders=$7 cgroups=$8
shift 8
mount -t tmpfs -o size=1m,mode=755 sandbox-root "$root" || fail "tmpfs on $root"
mkdir "$root/usr" "$root/tmp" "$root/sandbox" "$root/dev" || fail "folders in $root"
if [ -n "$links" ]; then (cd "$root" && ln -s $links .) || fail "links $links"; fi
for folder in $folders; do
  mkdir "$root/$folder" && mount --bind -o ro,nosuid,nodev "/$folder" "$root/$folder" || fail "bind /$folder"
done
mount --bind -o ro,nosuid,nodev /usr "$root/usr" || fail "bind /usr"
if [ -n "$prefix" ]; then
  mkdir -p "$root$prefix" && mount --bind -o ro,nosuid,nodev "$prefix" "$root$prefix" || fail "bind $prefix"
fi
mount -t tmpfs -o "size=${tmp_mb}m,nr_inodes=4096,mode=1777,nosuid,nodev" sandbox-tmp "$root/tmp" || fail "tmpfs /tmp"
mount --bind -o ro,nosuid,nodev "$work" "$root/sandbox" || fail "bind $work"
touch "$root/dev/null" "$root/dev/urandom" || fail "/dev in $root"
mount --bind -o nosuid,noexec /dev/null "$root/dev/null" || fail "/dev/null"
mount --bind -o nosuid,noexec /dev/urandom "$root/dev/urandom" || fail "/dev/urandom"
mount -o remount,ro "$root" || fail "read-only $root"
for cgroup in $cgroups; do echo 0 > "$cgroup/cgroup.procs" || fail "join $cgroup"; done
chroot "$root" /usr/bin/setpriv --reuid="$uid" --regid="$uid" --clear-groups --no-new-privs \
  --inh-caps=-all --bounding-set=-all -- /usr/bin/env -u PWD -u OLDPWD --chdir=/tmp "$@"
"""
# The system folders a program may need besides /usr (on merged-/usr systems, links into it).
SYSTEM_FOLDERS = ("bin", "lib", "lib32", "lib64", "libx32", "sbin")


def system_layout() -> tuple[str, str]:
    """(the targets of /'s links to recreate, the real folders to bind), as the setup script takes them: a link is
    recreated in one `ln -s TARGET... .` call, which names each link after its target's last part (bin -> usr/bin);
    a link named otherwise (rare) is bound as a folder instead."""
    links, folders = [], []
    for name in SYSTEM_FOLDERS:
        path = f"/{name}"
        if os.path.islink(path) and os.path.basename(os.readlink(path).rstrip("/")) == name:
            links.append(os.readlink(path))
        elif os.path.isdir(path):
            folders.append(name)
    return " ".join(links), " ".join(folders)


class SandboxUnavailable(RuntimeError):
    """The isolation cannot start on this machine; the message says why and what to do, in one line."""


@dataclass(frozen=True)
class Limits:
    """What one run may use."""

    wall_time_s: float = 2.0  # wall-clock seconds before the whole process tree is killed
    memory_mb: int = 512  # address space of each process (RLIMIT_AS)
    max_processes: int = 16  # processes and threads of the run's user (RLIMIT_NPROC) and of the run (pids cgroup)
    max_file_mb: int = 16  # the largest file it may write (RLIMIT_FSIZE)
    tmp_mb: int = 64  # the size of its private /tmp
    max_output_bytes: int = 1 << 20  # stdout and stderr together; past it the run is killed
    run_memory_mb: int = 0  # memory of all the run's processes together (memory cgroup); 0: run_memory_share_mb
    concurrent_runs: int = 4  # how many runs go at once (the code workers): the default run memory divides by it

    @property
    def cpu_time_s(self) -> int:
        """CPU seconds (RLIMIT_CPU): the wall time rounded up, so that a busy loop ends even if a wall kill were late."""
        return max(1, int(self.wall_time_s + 0.999))


@dataclass
class RunResult:
    """What came back from one run: its output as text (undecodable bytes replaced), never an object."""

    verdict: str  # OK, ERROR, TIMEOUT, OUTPUT_LIMIT or SANDBOX_ERROR
    exit_code: int | None  # None when it was killed (wall time, output size)
    stdout: str
    stderr: str
    wall_s: float

    @property
    def ok(self) -> bool:
        return self.verdict == OK


def missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


def isolation_problem() -> str | None:
    """Why mode "isolated" cannot run here (one line), or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"the code sandbox isolates with Linux namespaces and this is {sys.platform}"
    if os.geteuid() != 0:
        return (
            "the code sandbox needs root to build its namespaces and switch to an unprivileged user (this process "
            f"runs as uid {os.geteuid()}); run as root (as CI and the training containers do)"
        )
    missing = missing_tools()
    if missing:
        return f"the code sandbox needs util-linux's {', '.join(missing)} on PATH (apt-get install util-linux mount)"
    return None


def python_interpreter() -> tuple[str, str]:
    """(the interpreter the programs run with, a folder to bind read-only into the sandbox or "" when it lies under
    /usr): the system's python3 when there is one (under /usr, already bound), else this process's base interpreter
    (not a virtual environment's: its packages are not the program's)."""
    if os.access("/usr/bin/python3", os.X_OK):
        return "/usr/bin/python3", ""
    executable = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    prefix = os.path.realpath(sys.base_prefix)
    return executable, "" if prefix.startswith("/usr/") else prefix


_run_numbers = itertools.count()
_first_uids: dict[int, int] = {}


def first_uid() -> int:
    """The first uid of this process's range, drawn at random (again in a forked child: its pid differs)."""
    pid = os.getpid()
    if pid not in _first_uids:  # setdefault: of two threads drawing at once, both keep the first draw
        _first_uids.setdefault(pid, UID_BASE + secrets.randbelow(UID_RANGES) * UID_SLOTS)
    return _first_uids[pid]


def next_uid() -> int:
    """A uid for the next run: this process's own range, cycling through UID_SLOTS (more than any pool's workers)."""
    return first_uid() + next(_run_numbers) % UID_SLOTS


def run_memory_share_mb(limits: Limits) -> int:
    """The default memory of one run's processes together: a quarter of what this process may use (the machine's
    memory, or its cgroup's limit) shared by the concurrent runs, at least 256 MiB and at most what its processes'
    address spaces add up to."""
    share = cgroups.memory_mb() // (4 * max(1, limits.concurrent_runs))
    return max(256, min(share, limits.max_processes * limits.memory_mb))


@cache
def cgroup_hierarchies() -> tuple[tuple[cgroups.Hierarchy, ...], str]:
    """(where this process's runs get their memory and pids cgroups, what the log says of it): tried once per process
    by making and removing a child cgroup."""
    found = cgroups.find_hierarchies(cgroups.read("/proc/self/mountinfo"), cgroups.read("/proc/self/cgroup"))
    missing = [c for c in cgroups.CONTROLLERS if not any(c in h.controllers for h in found)]
    if missing:
        return (), f"cgroup off (no {' or '.join(missing)} controller this process can use)"
    probe = f"{cgroups.PREFIX}{os.getpid()}_{next(_run_numbers)}"  # named as a run's: a sweep removes it if left
    try:
        for hierarchy in found:
            if hierarchy.version == 2:
                cgroups.delegate(hierarchy)
            if any(char.isspace() for char in hierarchy.parent):
                raise OSError(f"a space in {hierarchy.parent}")
        cgroups.remove(cgroups.create(found, probe, 1 << 30, 1), wait_s=0)
    except OSError as error:
        return (), f"cgroup off (cannot make a child cgroup: {error})"
    versions = " and ".join(sorted({f"v{h.version}" for h in found}))
    return tuple(found), f"cgroup {versions} memory and pids per run"


def sweep_folders(folder: str) -> None:
    """Remove the run folders in `folder` whose owner process is gone (a caller killed with SIGKILL leaves them)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        match = STALE_FOLDER.fullmatch(name)
        if match and not cgroups.owner_alive(int(match[1])):
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


_walls_said: set[str] = set()


def say_walls(line: str) -> None:
    """Log which walls a sandbox has, once per process for each different set."""
    if line not in _walls_said:
        _walls_said.add(line)
        logger.info(line)


class Sandbox:
    """Runs untrusted Python programs, one `run_python` call per program; thread-safe (no state between runs)."""

    def __init__(self, mode: str = ISOLATED, limits: Limits | None = None):
        if mode not in MODES:
            raise ValueError(f"sandbox mode {mode!r} is not one of {', '.join(MODES)}")
        if mode == ISOLATED:
            problem = isolation_problem()
            if problem is not None:
                raise SandboxUnavailable(
                    f"{problem}; or, only on a machine you do not mind the model's code running on unconfined, pass "
                    f"--code_sandbox {UNSAFE_NO_ISOLATION}"
                )
        self.mode = mode
        self.limits = limits or Limits()
        self.interpreter, self.interpreter_prefix = python_interpreter()
        self.links, self.folders = system_layout()
        sweep_folders(tempfile.gettempdir())
        self.run_memory_mb = self.limits.run_memory_mb or run_memory_share_mb(self.limits)
        if mode == ISOLATED:
            self.cgroups, cgroup_wall = cgroup_hierarchies()
            cgroups.sweep(list(self.cgroups))
            self.seccomp_program, seccomp_wall = seccomp.filter_program()
            if self.cgroups:
                cgroup_wall += f" ({self.run_memory_mb} MiB, {self.limits.max_processes} processes)"
            say_walls(f"code sandbox walls: namespaces (network, PID, mount, IPC, UTS), read-only root, unprivileged uid; "
                      f"{seccomp_wall}; {cgroup_wall}; rlimits ({self.rlimits_text()})")  # fmt: skip
        else:
            self.cgroups, self.seccomp_program = (), None
            say_walls(f"code sandbox walls ({UNSAFE_NO_ISOLATION}): rlimits only ({self.rlimits_text()})")

    def rlimits_text(self) -> str:
        limits = self.limits
        return (f"{limits.memory_mb} MiB address space and {limits.max_processes} processes, {limits.cpu_time_s} CPU s, "
                f"{limits.max_file_mb} MiB files")  # fmt: skip

    def run_python(self, source: str, stdin: str = "", files: dict[str, str] | None = None,
                   argv: tuple[str, ...] = ()) -> RunResult:  # fmt: skip
        """Run `source` as a Python script (`python -I -S main.py *argv`: no site packages, no user environment) with
        `stdin` as its standard input and `files` (name -> text) beside it in its folder, read-only."""
        files = {"main.py": source, **(files or {})}
        for name in files:
            if not name or "/" in name or name.startswith("."):
                raise ValueError(f"sandbox file name {name!r} must be a plain file name (no '/', not hidden)")
        folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}_")
        run_cgroups = []
        try:
            work = os.path.join(folder, "work")
            os.mkdir(work, 0o755)
            os.chmod(work, 0o755)  # mkdir's mode passes through the umask; the sandbox's user must read it
            for name, text in files.items():
                path = os.path.join(work, name)
                with open(path, "w", encoding="utf-8") as file:
                    file.write(text)
                os.chmod(path, 0o644)
            stdin_path = os.path.join(folder, "stdin")
            with open(stdin_path, "w", encoding="utf-8") as file:
                file.write(stdin)
            os.mkdir(os.path.join(folder, "root"))
            if self.mode == ISOLATED:
                try:
                    run_cgroups = self.make_cgroups()
                except OSError as error:
                    return RunResult(SANDBOX_ERROR, None, "", f"{SETUP_FAILED_PREFIX} run cgroup: {error}", 0.0)
                command = self.isolated_command(folder, argv, run_cgroups)
                cwd = folder
            else:
                command = self.unconfined_command(os.path.join(work, "main.py"), argv)
                cwd = work
            with open(stdin_path, "rb") as stdin_file:
                return self.execute(command, stdin_file, cwd)
        finally:
            cgroups.remove(run_cgroups)
            shutil.rmtree(folder, ignore_errors=True)

    def make_cgroups(self) -> list[str]:
        name = f"{cgroups.PREFIX}{os.getpid()}_{next(_run_numbers)}"
        # One process more than the program's: the setup shell stays in the cgroup as the PID namespace's init.
        return cgroups.create(list(self.cgroups), name, self.run_memory_mb << 20, self.limits.max_processes + 1)

    def resource_limits(self) -> list[str]:
        limits = self.limits
        return [
            f"--as={limits.memory_mb << 20}",
            f"--cpu={limits.cpu_time_s}",
            f"--fsize={limits.max_file_mb << 20}",
            "--core=0",
        ]

    def isolated_command(self, folder: str, argv: tuple[str, ...], run_cgroups: list[str]) -> list[str]:
        limits = self.limits
        loader = [] if self.seccomp_program is None else seccomp.loader_command(self.seccomp_program, self.interpreter)
        return [
            "setpriv", "--pdeathsig", "KILL", "--",  # the caller dies: so does the run
            "unshare", "--net", "--pid", "--mount", "--ipc", "--uts", "--fork", "--kill-child",
            "--propagation", "private", "--",
            "/bin/sh", "-c", SETUP_SCRIPT, "sandbox-setup",
            os.path.join(folder, "root"), os.path.join(folder, "work"), str(next_uid()), str(limits.tmp_mb),
            self.interpreter_prefix, self.links, self.folders, " ".join(run_cgroups),
            "/usr/bin/prlimit", f"--nproc={limits.max_processes}", *self.resource_limits(), "--",
            *loader, self.interpreter, "-I", "-S", f"{SANDBOX_FOLDER}/main.py", *argv,
        ]  # fmt: skip

    def unconfined_command(self, main_path: str, argv: tuple[str, ...]) -> list[str]:
        # No process limit: it counts every process of the caller's user, and the caller may well be root.
        return ["setpriv", "--pdeathsig", "KILL", "--", "prlimit", *self.resource_limits(), "--",
                sys.executable, "-I", "-S", main_path, *argv]  # fmt: skip

    def execute(self, command: list[str], stdin_file, cwd: str) -> RunResult:
        limits = self.limits
        started = time.monotonic()
        deadline = started + limits.wall_time_s
        environment = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8", "HOME": "/tmp"}
        process = subprocess.Popen(command, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   cwd=cwd, env=environment, start_new_session=True)  # fmt: skip
        try:
            stdout, stderr, verdict = read_capped(process, deadline, limits.max_output_bytes)
            if verdict is None:
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:  # it closed its output and kept running
                    verdict = TIMEOUT
        finally:
            if process.poll() is None:
                self.kill(process)
            process.stdout.close()
            process.stderr.close()
        wall_s = time.monotonic() - started
        stdout_text = stdout.decode("utf-8", errors="replace")
        stderr_text = stderr.decode("utf-8", errors="replace")
        if verdict is not None:
            return RunResult(verdict, None, stdout_text, stderr_text, wall_s)
        code = process.returncode
        if code == SETUP_FAILED_EXIT and SETUP_FAILED_PREFIX in stderr_text:
            verdict = SANDBOX_ERROR
        elif code in (CPU_LIMIT_EXIT, -signal.SIGXCPU):
            verdict = TIMEOUT
        else:
            verdict = OK if code == 0 else ERROR
        return RunResult(verdict, code, stdout_text, stderr_text, wall_s)

    def kill(self, process: subprocess.Popen) -> None:
        """Kill the run's whole process tree and reap it. Isolated: kill the PID namespace's init (unshare's child),
        so that the kernel kills everything in the namespace and unshare, still alive, reaps it and exits."""
        if self.mode == ISOLATED:
            for child in children_of(process.pid):
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                process.wait(timeout=5)
                return
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as file:
            return [int(child) for child in file.read().split()]
    except OSError:
        return []


def read_capped(process: subprocess.Popen, deadline: float, max_bytes: int) -> tuple[bytes, bytes, str | None]:
    """(stdout, stderr, verdict) read until both close; verdict TIMEOUT past `deadline`, OUTPUT_LIMIT past `max_bytes`
    in total (what was read so far is kept, up to the cap), None when both closed in time."""
    chunks = {process.stdout.fileno(): [], process.stderr.fileno(): []}
    total = 0
    verdict = None
    with selectors.DefaultSelector() as selector:
        for fd in chunks:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and verdict is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                verdict = TIMEOUT
                break
            for key, _ in selector.select(remaining):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    selector.unregister(key.fd)
                    continue
                chunks[key.fd].append(data)
                total += len(data)
                if total > max_bytes:
                    verdict = OUTPUT_LIMIT
                    break
    stdout, stderr = (b"".join(chunks[stream.fileno()])[:max_bytes] for stream in (process.stdout, process.stderr))
    return stdout, stderr, verdict
