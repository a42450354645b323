"""A small disk for a test: a command run in a private mount namespace (`unshare -m`) with a tmpfs of a given size
mounted on a folder, so a write past its size fails with ENOSPC exactly as on a full disk. The mount is gone when the
command ends; files written elsewhere (a fallback folder outside the mount point) stay. Needs root (the machines and
CI run as root); `small_disk_unavailable()` says why not otherwise, for a skip.
"""

import shlex
import shutil
import subprocess


def small_disk_unavailable() -> str | None:
    """None when a tmpfs can be mounted in a private mount namespace here, else why not."""
    if shutil.which("unshare") is None:
        return "no `unshare` command"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True,
                           text=True)  # fmt: skip
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a private mount namespace (`unshare -m`): {probe.stderr.strip()[:200]}"
    return None


def on_small_disk(mount_point: str, size_mb: float, command: list[str], copy_to: str | None = None) -> list[str]:
    """`command`, run with a tmpfs of `size_mb` MiB mounted on `mount_point` (which must exist); its exit code is the
    command's. With `copy_to`, what the tmpfs holds at the end is copied there (the mount goes with the namespace)."""
    mount = f"mount -t tmpfs -o size={int(size_mb * 1024)}k tmpfs {shlex.quote(mount_point)}"
    copy = f"cp -a {shlex.quote(mount_point)}/. {shlex.quote(copy_to)}/; " if copy_to else ""
    script = f"{mount} || exit 99; {shlex.join(command)}; code=$?; {copy}exit $code"
    return ["unshare", "-m", "bash", "-c", script]
