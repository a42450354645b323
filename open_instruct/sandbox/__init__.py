"""sandbox: runs untrusted programs (model-written code) isolated from the machine, for the code verifiers' tests and
the tools that run Python.

`Sandbox.run_python(source, stdin)` runs one program and returns a `RunResult` (stdout, stderr, exit code, verdict,
wall time); `SandboxPool` runs many at once on N threads, each waiting on its own sandboxed process. The isolation
(`isolation.py`): new network, PID, mount, IPC and UTS namespaces, a read-only root holding only the system's programs
and libraries, a private /tmp, an unprivileged user with no capabilities, a seccomp deny list (`seccomp.py`), memory
and pids cgroups per run (`cgroups.py`), limits on processes, memory, CPU time, file and output size, and a wall-clock
kill of the whole process tree.

May import: the standard library, and `pyseccomp` (to build the seccomp filter; optional: without it that wall is
off and the log says so); nothing else of open_instruct (the bottom layer: rewards/ and environments/ build on it, through the names
exported here only).
"""

from open_instruct.sandbox.isolation import (  # noqa: F401
    ISOLATED,
    MODES,
    OUTPUT_LIMIT,
    SANDBOX_ERROR,
    TIMEOUT,
    UNSAFE_NO_ISOLATION,
    Limits,
    RunResult,
    Sandbox,
    SandboxUnavailable,
    isolation_problem,
)
from open_instruct.sandbox.pool import SandboxPool  # noqa: F401
