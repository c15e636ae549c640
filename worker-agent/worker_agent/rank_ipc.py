"""A job's own System V IPC namespace on a node: its shared memory segments, semaphore sets and
message queues, seen by its ranks on the node and by no other job.

On the host's namespace every rank lists every job's SysV objects (``ipcs``) and opens any
made with a loose mode (``shmget(key, size, IPC_CREAT | 0666)`` is common; the umask does not
apply to them), and an object a killed rank never removed holds its memory until the host
reboots. With ``agent_rank_private_ipc`` (on; in the rank's own mount namespace, so under the
process runtime as root) the first rank of a job on a node starts in a new IPC namespace, which
its supervisor pins by bind-mounting its ``/proc/<pid>/ns/ipc`` onto ``<node state>/ipc/<pin>``
(named by a keyed hash of the job id: worker_agent.job_spaces); the job's later
ranks there join it. The agent unmounts it once the job's last rank on the node
has ended: the namespace goes, and every object in it with it.

    decided = JobIpc(path).claim()   # under a lock: join the pinned namespace, or make one
    Popen(..., preexec_fn=decided.enter)
    decided.pin(rank_pid)            # a new one: pinned for the job's next ranks; the lock freed
    remove(path)                     # the agent, after the job's last rank here

Standard library only (the supervisor imports it).
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass

from worker_agent import libc_calls as libc
from worker_agent.libc_calls import CLONE_NEWIPC, MNT_DETACH, MS_BIND


def pinned(path: str) -> bool:
    """Whether ``path`` is a namespace file (a bind mount of one), not the empty file under it."""
    try:
        return os.stat(path).st_dev == os.stat("/proc/self/ns/ipc").st_dev
    except OSError:
        return False


@dataclass
class Claim:
    """What one rank's start does: join ``path``'s namespace, or make a new one and pin it."""

    path: str
    join: bool
    lock_fd: int

    def enter(self) -> None:
        """In the rank's process, as root, before anything else of its own namespaces."""
        if self.join:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                libc.setns(fd, CLONE_NEWIPC, f"setns({self.path}, CLONE_NEWIPC)")
            finally:
                os.close(fd)
        else:
            libc.unshare(CLONE_NEWIPC, "unshare(CLONE_NEWIPC)")

    def pin(self, pid: int | None) -> str | None:
        """After the start (``pid``: the rank, None if it did not start): a new namespace is
        bound at ``path`` for the job's next ranks; then the lock is freed. Says why not, if
        it could not be (the rank runs on in a namespace of its own)."""
        try:
            if pid is None or self.join:
                return None
            with open(self.path, "a"):
                pass  # the mount point
            libc.mount(
                f"/proc/{pid}/ns/ipc".encode(),
                os.fsencode(self.path),
                None,
                MS_BIND,
                None,
                f"mount --bind /proc/{pid}/ns/ipc {self.path}",
            )
            return None
        except OSError as e:
            return str(e)
        finally:
            os.close(self.lock_fd)


class JobIpc:
    def __init__(self, path: str) -> None:
        self.path = path

    def claim(self) -> Claim:
        """Lock the job's namespace file (two of its ranks may start at once) and decide."""
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        fd = os.open(self.path + ".lock", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return Claim(self.path, pinned(self.path), fd)


def remove(path: str) -> None:
    """Unpin a job's namespace (it goes once no process is left in it) and delete its files."""
    if pinned(path):
        libc.umount(os.fsencode(path), MNT_DETACH, f"umount {path}")
    for name in (path, path + ".lock"):
        try:
            os.unlink(name)
        except FileNotFoundError:
            pass
