"""The sandbox's seccomp wall: a deny list of system calls that a test program has no use for and that are the usual
doors into the kernel (or out of the sandbox's namespaces).

The filter is built once per process by libseccomp (through `pyseccomp`, a ctypes binding with libseccomp's own
Python API) and exported as the kernel's BPF program; no filter is assembled by hand here. Inside the sandbox,
after `setpriv` has set no_new_privs and dropped root, `LOADER` (standard library only: the sandbox's Python has no
site packages) installs those bytes with `prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)` and `exec`s the program's
interpreter: the filter covers the program from its first instruction, every process it forks and every program it
`exec`s, and cannot be removed.

Denied calls fail with EPERM, as a call the kernel refuses for lack of privilege does; `clone3` fails with ENOSYS
instead, so that the C library falls back to `clone`, whose flags a filter can read (clone3 passes them in memory).
A system call of another architecture (the 32-bit `int 0x80` entry on x86-64) kills the process.
"""

import errno
import logging
import tempfile
from functools import cache

logger = logging.getLogger(__name__)

DENIED = (
    "io_uring_setup", "io_uring_enter", "io_uring_register",  # a second system-call interface, beside the filter
    "keyctl", "add_key", "request_key",  # kernel keyrings outlive a run (keyed by uid, which runs reuse)
    "bpf", "perf_event_open", "userfaultfd",  # frequent kernel-exploit primitives, no use to a test program
    "ptrace", "process_vm_readv", "process_vm_writev",  # reading or writing another process's memory
    "setns",  # joining another namespace
)  # fmt: skip
# The namespace-creating flags of clone and unshare (linux/sched.h): a new user namespace gives its creator every
# capability inside it, the door to most kernel attack surface an unprivileged user cannot otherwise reach.
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWTIME = 0x00000080  # unshare only: in clone's flags these bits hold the exit signal
CLONE_NAMESPACES = (CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET)
# The socket families a program may open (sys/socket.h): AF_UNIX, AF_INET, AF_INET6. The network namespace has no
# route anywhere; the others (netlink, vsock, packet, ...) reach kernel subsystems or the host.
AF_UNIX, AF_INET, AF_INET6 = 1, 2, 10

# Runs inside the sandbox as `python3 -I -S -c LOADER FILTER_HEX INTERPRETER ARGS...`: installs the filter, then
# becomes the program's interpreter. Failing, it exits as the setup script does, so the run is a sandbox error.
LOADER = r"""
import ctypes, os, sys
program = bytes.fromhex(sys.argv[1])
class SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
libc = ctypes.CDLL(None, use_errno=True)
# PR_SET_SECCOMP = 22, SECCOMP_MODE_FILTER = 2; no_new_privs is already set (setpriv), as the kernel requires.
if libc.prctl(22, 2, ctypes.byref(SockFprog(len(program) // 8, program)), 0, 0) != 0:
    sys.stderr.write("sandbox setup failed: seccomp filter: " + os.strerror(ctypes.get_errno()) + "\n")
    os._exit(125)
os.execv(sys.argv[2], sys.argv[2:])
"""


def build_filter():
    """(libseccomp's filter of the deny list, a `pyseccomp.SyscallFilter`; the denied calls an older libseccomp does
    not know, left out). Raises ImportError or RuntimeError (from pyseccomp's import) where pyseccomp or the
    libseccomp library is missing."""
    import pyseccomp as seccomp

    deny = seccomp.ERRNO(errno.EPERM)
    syscall_filter = seccomp.SyscallFilter(seccomp.ALLOW)
    try:
        syscall_filter.set_attr(seccomp.Attr.ACT_BADARCH, seccomp.KILL_PROCESS)
    except OSError:  # a kernel or libseccomp before KILL_PROCESS: the default kills the calling thread
        pass
    unknown = [name for name in (*DENIED, "clone3") if seccomp.resolve_syscall(seccomp.Arch.NATIVE, name) < 0]
    for name in DENIED:
        if name not in unknown:
            syscall_filter.add_rule(deny, name)
    if "clone3" not in unknown:
        syscall_filter.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    for flag in CLONE_NAMESPACES:  # one rule per flag: libseccomp ORs the rules of a call
        syscall_filter.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    for flag in (*CLONE_NAMESPACES, CLONE_NEWTIME):
        syscall_filter.add_rule(deny, "unshare", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    # Every family but the three: below AF_UNIX, between AF_INET and AF_INET6, above AF_INET6 (a rule compares an
    # argument once, so the gaps are rules of their own).
    for call in ("socket", "socketpair"):
        syscall_filter.add_rule(deny, call, seccomp.Arg(0, seccomp.LT, AF_UNIX))
        syscall_filter.add_rule(deny, call, seccomp.Arg(0, seccomp.GT, AF_INET6))
        for family in range(AF_INET + 1, AF_INET6):
            syscall_filter.add_rule(deny, call, seccomp.Arg(0, seccomp.EQ, family))
    return syscall_filter, unknown


@cache
def filter_program() -> tuple[bytes | None, str]:
    """(the deny list as the kernel's BPF program, or None where it cannot be built; what the log says of it)."""
    try:
        syscall_filter, unknown = build_filter()
        with tempfile.TemporaryFile() as file:
            syscall_filter.export_bpf(file)
            file.seek(0)
            program = file.read()
    except (ImportError, RuntimeError, OSError) as error:
        return None, (
            f"seccomp off (its filter cannot be built: {error}; install libseccomp2 and `pip install pyseccomp`)"
        )
    left_out = f"; left out, unknown to this libseccomp: {', '.join(unknown)}" if unknown else ""
    return program, (
        f"seccomp deny list ({len(DENIED) + 5 - len(unknown)} calls or argument sets; {len(program) // 8} "
        f"instructions{left_out})"
    )


def loader_command(program: bytes, interpreter: str) -> list[str]:
    """The command that installs `program` and then runs what follows it (starting with `interpreter`)."""
    return [interpreter, "-I", "-S", "-c", LOADER, program.hex()]
