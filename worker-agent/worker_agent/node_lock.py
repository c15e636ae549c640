"""One agent per node state dir: an exclusive ``flock`` on ``<node dir>/agent.lock``, held
from the node's start until it closes, and by the kernel until the agent's process is gone
(a SIGKILLed agent frees it). A second agent serving the same node (a deploy that started a
new one before the old stopped, two units naming one node) would adopt the same ranks,
watch and report them, and heartbeat its own view of what runs on the node beside the
first's. It refuses to start instead, naming the holder.

The lock's descriptor is not inheritable (Python's default) and every child is started with
``close_fds``, so no rank or supervisor holds it after the agent is gone.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "agent.lock"


class NodeLockHeld(RuntimeError):
    """Another agent serves this node's state dir."""


class NodeLock:
    def __init__(self, node_dir: Path) -> None:
        self.path = Path(node_dir) / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, node_id: str) -> None:
        """Take the lock, or raise ``NodeLockHeld`` saying which process holds it."""
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise NodeLockHeld(
                f"node {node_id}: another agent serves its state dir {self.path.parent} (pid {holder});"
                " stop it first, or give this agent another state dir"
            ) from None
        except OSError:
            os.close(fd)
            raise
        # who holds it, for the next one's message (the lock, not this text, is what counts)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        os.close(fd)  # closing the only descriptor of the open file drops the flock
