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

With ``agent_rank_private_tmp`` (on) the namespace also gives the rank its own ``/tmp`` and
``/var/tmp``: one dir in its work dir (``tmp``) is bound over both. What the rank writes there
counts against its disk share (worker_agent.rank_disk measures the work dir), so it cannot fill
the host's root disk past its share through them, and no other job sees or plants a file
there: a shared ``/tmp`` lets one job pre-create a path another job's program writes to or
loads from without asking ``TMPDIR``. Paths the rank needs that lie under them (its work dir,
its checkpoint dir, the GPU device dir, as on a test host) are bound back in at the same
paths; the rest of the host's ``/tmp`` is out of its sight.

With ``agent_rank_private_shm`` (on) the rank's ``/dev/shm`` (POSIX shared memory and
semaphores: NCCL's, PyTorch's, multiprocessing's) is its job's own tmpfs of its memory
share, mounted under ``/dev/shm/gpufleet/<node>.<state dir hash>/`` (worker_agent.job_spaces),
shared by the job's ranks on the node (NCCL joins ranks of one job there) and by no other
job. The agent unmounts it once the job's last rank on the node has ended: segments a killed
rank never unlinked would otherwise hold the host's memory until it reboots.

Since Linux 5.8 every procfs mount is an instance with its own options; before it the
options belonged to the one instance of the pid namespace, so mounting with ``hidepid``
here would change the host's ``/proc`` too. ``problem`` refuses such kernels, and checks
the steps in a child process at the agent's start.

Standard library only (the supervisor imports it)."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from worker_agent import libc_calls as libc
from worker_agent.libc_calls import CLONE_NEWNS, MS_BIND, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_REC, MS_SLAVE
from worker_agent.proc_visibility import this_host_hides_pids

MIN_KERNEL = (5, 8)  # per-mount procfs options
TMP_DIRS = ("/tmp", "/var/tmp")  # what a rank's own tmp dir is bound over
SHM_DIR = "/dev/shm"  # the host's POSIX shared memory, where its job's own dir is bound over


def kernel_release_ok(release: str) -> bool:
    """Whether a kernel release (``uname -r``) keeps procfs options per mount."""
    m = re.match(r"(\d+)\.(\d+)", release)
    return m is not None and (int(m.group(1)), int(m.group(2))) >= MIN_KERNEL


class RankMounts:
    """The steps, taken in the rank's child (libc's calls are looked up at import,
    worker_agent.libc_calls)."""

    def enter(
        self,
        mask_file: str | None = None,
        masked: list[str] | None = None,
        tmp: str | None = None,
        keep: list[str] | None = None,
        cwd: str | None = None,
        shm: str | None = None,
    ) -> None:
        """In the rank's process, as root, before it drops to its user: its own namespace and
        /proc, ``mask_file`` bound over each of ``masked``, ``shm`` over /dev/shm, ``tmp``
        bound over /tmp and /var/tmp with each of ``keep`` under them bound back in, then
        into ``cwd`` again (Popen entered it before these mounts, by a path they may have
        hidden)."""
        libc.unshare(CLONE_NEWNS, "unshare(CLONE_NEWNS)")
        libc.mount(None, b"/", None, MS_REC | MS_SLAVE, None, "mount --make-rslave /")
        libc.mount(
            b"proc",
            b"/proc",
            b"proc",
            MS_NOSUID | MS_NODEV | MS_NOEXEC,
            b"hidepid=2",
            "mount -t proc -o hidepid=2 proc /proc",
        )
        for path in masked or ():
            libc.mount(
                os.fsencode(mask_file or "/dev/null"),
                os.fsencode(path),
                None,
                MS_BIND,
                None,
                f"mount --bind {mask_file} {path}",
            )
        if shm is not None:
            libc.mount(os.fsencode(shm), os.fsencode(SHM_DIR), None, MS_BIND, None, f"mount --bind {shm} {SHM_DIR}")
        if tmp is not None:
            # held open: once /tmp is covered, a path under it no longer leads to the dir
            own = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                for top in TMP_DIRS:
                    if os.path.islink(top) or not os.path.isdir(top):
                        continue  # a link to /tmp is covered with it
                    for path in keep or ():
                        rel = under(path, top)
                        if rel is not None:
                            self._bind_into(path, own, rel)
                    libc.mount(
                        f"/proc/self/fd/{own}".encode(),
                        os.fsencode(top),
                        None,
                        MS_BIND | MS_REC,
                        None,
                        f"mount --rbind {tmp} {top}",
                    )
            finally:
                os.close(own)
        if cwd is not None:
            os.chdir(cwd)

    def _bind_into(self, path: str, base: int, rel: str) -> None:
        """Bind ``path`` at ``rel`` under the dir ``base`` is open on (the rank's own), making
        the dirs on the way as root without following a link; mounted through the last dir's
        descriptor."""
        fd = os.dup(base)
        try:
            for part in rel.split("/"):
                made = True
                try:
                    os.mkdir(part, 0o700, dir_fd=fd)
                except FileExistsError:
                    made = False
                inner = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                os.close(fd)
                fd = inner
                if made:  # passed through, not listed, as on the host (the dirs above a checkpoint dir)
                    os.fchmod(fd, 0o711)
            libc.mount(
                os.fsencode(path),
                f"/proc/self/fd/{fd}".encode(),
                None,
                MS_BIND | MS_REC,
                None,
                f"mount --rbind {path} <its own tmp>/{rel}",
            )
        finally:
            os.close(fd)


def under(path: str, top: str) -> str | None:
    """``path`` relative to ``top`` when it lies under it (both real paths), else None."""
    if not path.startswith(top.rstrip("/") + "/"):
        return None
    rel = path[len(top.rstrip("/")) + 1 :].strip("/")
    return rel or None


@functools.cache
def problem() -> str | None:
    """Why ranks cannot get their own ``/proc`` and ``/tmp`` here, or None (asked once per
    agent process, as root: the steps are taken in a child process, and the agent's own
    ``/proc`` must be as it was)."""
    if os.geteuid() != 0:
        return "the agent is not root"
    release = os.uname().release
    if not kernel_release_ok(release):
        return f"Linux {release} shares procfs options between mounts (5.8 or later keeps them apart)"
    before = this_host_hides_pids()
    pkg_root = str(Path(__file__).resolve().parent.parent)
    with tempfile.TemporaryDirectory(prefix="gpufleet-mounts-probe-") as base:
        try:
            r = subprocess.run(
                [sys.executable, "-m", "worker_agent.rank_mounts", os.path.realpath(base)],
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


def _probe(base: str) -> int:
    """Take the steps in this process (``base/own`` as its tmp dir, ``base/kept`` bound back
    in), then check that its /proc and /tmp are the new ones and the kept dir is reachable."""
    own, kept = os.path.join(base, "own"), os.path.join(base, "kept")
    os.mkdir(own, 0o700)
    os.mkdir(kept, 0o700)
    Path(kept, "marker").touch()
    try:
        RankMounts().enter(tmp=own, keep=[kept], cwd=kept)
    except OSError as e:
        sys.stderr.write(f"{e.strerror}\n")
        return 1
    if this_host_hides_pids() is not True:
        sys.stderr.write("the new /proc does not hide other users' processes\n")
        return 1
    if not os.path.exists(os.path.join(kept, "marker")) or os.getcwd() != kept:
        sys.stderr.write(f"{kept}, under /tmp, is not reachable through the rank's own /tmp\n")
        return 1
    top = under(base, "/tmp")
    if top is not None and os.listdir("/tmp") != [top.split("/")[0]]:
        sys.stderr.write("the rank's own /tmp shows the host's\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_probe(sys.argv[1]))
