"""A rank's own mount namespace: a ``/proc`` showing only its own user's processes, and the
GPU nodes beside its own masked where no cgroup denies them.

On a shared node every process's command line is readable by every user unless ``/proc``
is mounted with ``hidepid`` (worker_agent.proc_visibility), so a rank of one job reads the
commands, and any token passed as an argument, of the ranks beside it and of the host's
daemons. Under the process runtime the supervisor starts each rank, while it is still
root, in its own mount namespace with a fresh procfs mounted on ``/proc`` with
``hidepid=2``: the rank then sees its own user's processes (its job's) and nothing else,
whatever the host's ``/proc`` shows. The namespace's mounts follow the host's (``/`` is made
a slave, so a file system the host mounts later still reaches the rank) and none of the
rank's reach the host.

Under the process runtime without a cgroup GPU fence (``agent_rank_cgroups`` off, or a host
where it cannot work: worker_agent.rank_cgroup), the same namespace also masks each GPU
device node the rank was not granted with an empty root-owned file of mode 0 (a bind
mount), so opening it is refused. Weaker than the cgroup fence, which denies the device
whatever path reaches it; the mask covers the nodes in ``agent_gpu_device_dir``, and a rank
cannot make another (mknod needs a capability it does not hold) nor unmount the mask.

Since Linux 5.8 every procfs mount is an instance with its own options; before it the
options belonged to the one instance of the pid namespace, so mounting with ``hidepid``
here would change the host's ``/proc`` too. ``problem`` refuses such kernels, and checks
the steps in a child process at the agent's start.

Standard library only (the supervisor imports it)."""

from __future__ import annotations

import ctypes
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

from worker_agent.proc_visibility import this_host_hides_pids

CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8
MS_BIND, MS_REC, MS_SLAVE = 0x1000, 0x4000, 1 << 19
MIN_KERNEL = (5, 8)  # per-mount procfs options


def kernel_release_ok(release: str) -> bool:
    """Whether a kernel release (``uname -r``) keeps procfs options per mount."""
    m = re.match(r"(\d+)\.(\d+)", release)
    return m is not None and (int(m.group(1)), int(m.group(2))) >= MIN_KERNEL


class RankMounts:
    """The libc calls, looked up before the fork (the child only calls them)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._unshare = libc.unshare
        self._mount = libc.mount
        self._mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    def enter(self, mask_file: str | None = None, masked: list[str] | None = None) -> None:
        """In the rank's process, as root, before it drops to its user: its own namespace and
        /proc, and ``mask_file`` bound over each of ``masked``."""
        self._check(self._unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        self._check(self._mount(None, b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")
        self._check(
            self._mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, b"hidepid=2"),
            "mount -t proc -o hidepid=2 proc /proc",
        )
        for path in masked or ():
            self._check(
                self._mount(os.fsencode(mask_file or "/dev/null"), os.fsencode(path), None, MS_BIND, None),
                f"mount --bind {mask_file} {path}",
            )


@functools.cache
def problem() -> str | None:
    """Why ranks cannot get their own ``/proc`` here, or None (asked once per agent process,
    as root: the steps are taken in a child process, and the agent's own ``/proc`` must be
    as it was)."""
    if os.geteuid() != 0:
        return "the agent is not root"
    release = os.uname().release
    if not kernel_release_ok(release):
        return f"Linux {release} shares procfs options between mounts (5.8 or later keeps them apart)"
    before = this_host_hides_pids()
    pkg_root = str(Path(__file__).resolve().parent.parent)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "worker_agent.rank_mounts"],
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": pkg_root},
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot run the probe: {e}"
    if r.returncode != 0:
        return (r.stderr.strip() or f"the probe exited {r.returncode}").splitlines()[-1]
    if this_host_hides_pids() != before:
        return "mounting a procfs in a rank's namespace changed the host's /proc"
    return None


def _probe() -> int:
    """Take the steps in this process, then check that its /proc is the new one."""

    try:
        RankMounts().enter()
    except OSError as e:
        sys.stderr.write(f"{e.strerror}\n")
        return 1
    if this_host_hides_pids() is not True:
        sys.stderr.write("the new /proc does not hide other users' processes\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_probe())
