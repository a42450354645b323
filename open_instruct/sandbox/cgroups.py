"""The sandbox's cgroup wall: each run gets a memory and a process-count cgroup of its own that holds all of its
processes, so that a run of many processes cannot take more than its share (RLIMIT_AS caps one process's address
space and RLIMIT_NPROC counts a uid's processes; neither bounds a run's processes together).

Cgroup v1 (a hierarchy per controller, /sys/fs/cgroup/memory, /sys/fs/cgroup/pids) and v2 (one hierarchy,
memory.max and pids.max) are both handled. A run's cgroup is made under the caller's own cgroup
(`open_instruct_sandbox_<caller pid>_<n>`), the run's first process moves itself into it (the setup script, as root,
before anything untrusted starts: every process the program forks inherits it), and it is removed after the run.
Those a killed caller left behind are swept when a Sandbox is made. Under v2 a cgroup that holds processes cannot
hand controllers to child cgroups (the kernel's no-internal-processes rule): there the caller's cgroup's processes
move to a leaf child of it first (`open_instruct_processes`), as container runtimes nested in a container do; the
caller's cgroup and its limits still contain them.
"""

import errno
import os
import re
import time
from dataclasses import dataclass

PREFIX = "open_instruct_sandbox_"
STALE = re.compile(rf"{PREFIX}(\d+)_\d+")
LEAF = "open_instruct_processes"
CONTROLLERS = ("memory", "pids")
SWAP_FILES = ("memory.memsw.limit_in_bytes", "memory.swap.max")


@dataclass(frozen=True)
class Hierarchy:
    """Where the runs' cgroups of one hierarchy go, and which limit files they get."""

    version: int  # 1 or 2
    parent: str  # the caller's own cgroup folder (the runs' cgroups are its children)
    controllers: tuple[str, ...]


def mounts(mountinfo: str) -> list[tuple[str, str, str, set[str]]]:
    """(fs type, mount point, the mounted cgroup's root, super options) of each cgroup mount in /proc/self/mountinfo."""
    found = []
    for line in mountinfo.splitlines():
        before, _, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            found.append((tail[0], fields[4], fields[3], set(tail[2].split(","))))
    return found


def own_cgroups(proc_cgroup: str) -> dict[str, str]:
    """controller ("" for v2's one hierarchy) -> this process's cgroup path, from /proc/self/cgroup."""
    paths = {}
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            paths[controller] = path
    return paths


def under_mount(mount_point: str, mount_root: str, path: str) -> str | None:
    """The folder of cgroup `path` in a mount of the hierarchy's `mount_root` at `mount_point` (None: not visible)."""
    if mount_root != "/" and not (path == mount_root or path.startswith(mount_root + "/")):
        return None
    relative = path[len(mount_root):] if mount_root != "/" else path  # fmt: skip
    return os.path.join(mount_point, relative.lstrip("/")).rstrip("/") or "/"


def find_hierarchies(mountinfo: str, proc_cgroup: str) -> list[Hierarchy]:
    """Where memory and pids cgroups can be made for this process: v1's per-controller hierarchies where those are
    mounted, else v2's one hierarchy (where it offers them)."""
    paths = own_cgroups(proc_cgroup)
    found, missing = [], list(CONTROLLERS)
    for fs_type, point, root, options in mounts(mountinfo):
        for controller in [c for c in missing if fs_type == "cgroup" and c in options and c in paths]:
            folder = under_mount(point, root, paths[controller])
            if folder and os.path.isdir(folder):
                found.append(Hierarchy(1, folder, (controller,)))
                missing.remove(controller)
    if missing and "" in paths:
        for fs_type, point, root, _ in mounts(mountinfo):
            folder = under_mount(point, root, paths[""]) if fs_type == "cgroup2" else None
            if folder and os.path.isdir(folder):
                offered = read(os.path.join(folder, "cgroup.controllers")).split()
                if all(controller in offered for controller in missing):
                    found.append(Hierarchy(2, folder, tuple(missing)))
                    break
    return found


def read(path: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return ""


def write(path: str, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)


def delegate(hierarchy: Hierarchy) -> None:
    """v2: let the caller's cgroup hand its controllers to child cgroups. A cgroup holding processes cannot: move
    them into a leaf child first (again while new ones keep arriving). Raises OSError where it cannot."""
    control = os.path.join(hierarchy.parent, "cgroup.subtree_control")
    wanted = [c for c in hierarchy.controllers if c not in read(control).split()]
    if not wanted:
        return
    leaf = os.path.join(hierarchy.parent, LEAF)
    for _ in range(10):
        try:
            write(control, " ".join(f"+{c}" for c in wanted))
            return
        except OSError as error:
            if error.errno != errno.EBUSY:
                raise
        os.makedirs(leaf, exist_ok=True)
        for pid in read(os.path.join(hierarchy.parent, "cgroup.procs")).split():
            try:
                write(os.path.join(leaf, "cgroup.procs"), pid)
            except OSError:  # it exited meanwhile
                pass
    write(control, " ".join(f"+{c}" for c in wanted))


def limit_files(hierarchy: Hierarchy, memory_bytes: int, max_processes: int) -> list[tuple[str, int]]:
    """(file, value) of a run's cgroup, in the order they must be written (v1's memory+swap limit after the memory
    limit: it may not be below it). No swap: a run over its memory is killed, not swapped out."""
    files = []
    if "memory" in hierarchy.controllers:
        files += ([("memory.limit_in_bytes", memory_bytes), ("memory.memsw.limit_in_bytes", memory_bytes)]
                  if hierarchy.version == 1 else [("memory.max", memory_bytes), ("memory.swap.max", 0)])  # fmt: skip
    if "pids" in hierarchy.controllers:
        files.append(("pids.max", max_processes))
    return files


def create(hierarchies: list[Hierarchy], name: str, memory_bytes: int, max_processes: int) -> list[str]:
    """The run's cgroup folders (one per hierarchy), made and limited; none is left where one fails (OSError)."""
    made = []
    try:
        for hierarchy in hierarchies:
            folder = os.path.join(hierarchy.parent, name)
            os.mkdir(folder)
            made.append(folder)
            for file, value in limit_files(hierarchy, memory_bytes, max_processes):
                path = os.path.join(folder, file)
                if file in SWAP_FILES and not os.path.exists(path):  # only where swap is accounted
                    continue
                write(path, str(value))
    except OSError:
        remove(made, wait_s=0)
        raise
    return made


def remove(folders: list[str], wait_s: float = 2.0) -> list[str]:
    """Remove the run's cgroups; a cgroup is busy until its last process is reaped (the kernel tears a PID namespace
    down asynchronously), so retry for up to `wait_s`. Returns those still there (the next sweep removes them)."""
    deadline = time.monotonic() + wait_s
    left = list(folders)
    delay = 0.002
    while left:
        for folder in list(left):
            try:
                os.rmdir(folder)
                left.remove(folder)
            except FileNotFoundError:
                left.remove(folder)
            except OSError:
                pass
        if not left or time.monotonic() > deadline:
            break
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    return left


def owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(hierarchies: list[Hierarchy]) -> None:
    """Remove the runs' cgroups whose owner process is gone (a caller killed with SIGKILL leaves them)."""
    for hierarchy in hierarchies:
        try:
            names = os.listdir(hierarchy.parent)
        except OSError:
            continue
        stale = [name for name in names if (match := STALE.fullmatch(name)) and not owner_alive(int(match[1]))]
        remove([os.path.join(hierarchy.parent, name) for name in stale], wait_s=0)


def memory_mb() -> int:
    """The memory this process may use, in MiB: the machine's, or its cgroup's limit where that is lower."""
    total = int(re.search(r"^MemTotal:\s+(\d+) kB", read("/proc/meminfo") or "MemTotal: 0 kB", re.M)[1]) >> 10
    hierarchies = find_hierarchies(read("/proc/self/mountinfo"), read("/proc/self/cgroup"))
    for hierarchy in hierarchies:
        if "memory" in hierarchy.controllers:
            name = "memory.limit_in_bytes" if hierarchy.version == 1 else "memory.max"
            limit = read(os.path.join(hierarchy.parent, name)).strip()
            if limit.isdigit():
                total = min(total, int(limit) >> 20) if total else int(limit) >> 20
    return total
