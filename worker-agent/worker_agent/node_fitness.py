"""Whether a node can host new ranks, as its agent finds it: every dir a rank's start writes
(the node's state dir, its ranks' work dir) takes a small file written, fsynced and removed,
and keeps at least ``agent_min_free_disk_bytes`` free; under the container runtime, its
engine answers. A full disk, one the kernel remounted read-only after an I/O error, or a
container daemon that is down fails every rank there while the node's GPUs still look
healthy: without this the leader would place job after job on it, each failing (and, where
the rank itself exits non-zero, counted against the job) and placed there again.

What it finds goes out in every heartbeat (``node_faults``); the leader takes a node that
reports any out of new placements (event ``unfit``: cordoned, its running ranks left alone)
until none is reported and the node passes burn-in. Checked every
``agent_node_fitness_check_s``, and again at the next heartbeat after a start that could not
prepare its dirs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

log = logging.getLogger("gpufleet.agent")

PROBE = ".fitness-probe"


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check(dirs: Iterable[Path], min_free_bytes: int) -> list[str]:
    """One line per dir that cannot take a rank's files now (none: fit)."""
    faults: list[str] = []
    for d in dict.fromkeys(Path(p) for p in dirs):  # in order, once each
        try:  # the agent made them at its start: one gone is a fault too
            free = shutil.disk_usage(d).free
        except OSError as e:
            faults.append(f"disk {d}: {e.strerror or e}")
            continue
        if free < min_free_bytes:
            faults.append(f"disk {d}: {_size(free)} free, below {_size(min_free_bytes)} (agent_min_free_disk_bytes)")
            continue
        probe = d / PROBE
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, b"ok\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(probe)
        except OSError as e:
            faults.append(f"disk {d}: cannot write: {e.strerror or e}")
    return faults


def _what(faults: list[str]) -> set[str]:
    """What each fault is about (``disk <dir>``, ``container engine <name>``)."""
    return {f.split(": ", 1)[0] for f in faults}


class NodeFitness:
    """The node's faults as of the latest check, checked again once ``every_s`` has passed
    (or at once after ``recheck``); a change is logged. ``probes`` say what else keeps the
    node from starting ranks (the container engine's), or None."""

    def __init__(
        self,
        node_id: str,
        dirs: list[Path],
        min_free_bytes: int,
        every_s: float,
        probes: Sequence[Callable[[], str | None]] = (),
    ) -> None:
        self.node_id = node_id
        self.dirs = dirs
        self.min_free_bytes = min_free_bytes
        self.every_s = every_s
        self.probes = list(probes)
        self.latest: list[str] = []
        self._at = -1e18  # monotonic, of the latest check

    def recheck(self) -> None:
        """A start could not prepare its dirs: check again at the next heartbeat, not later."""
        self._at = -1e18

    async def faults(self) -> list[str]:
        if time.monotonic() - self._at >= self.every_s:
            self._at = time.monotonic()
            found = await asyncio.to_thread(self._check)
            if _what(found) != _what(self.latest):  # not each new free-space figure
                if found:
                    log.warning("%s: cannot host new ranks: %s", self.node_id, "; ".join(found))
                else:
                    log.info("%s: can host new ranks again (%s)", self.node_id, "; ".join(self.latest))
            self.latest = found
        return self.latest

    def _check(self) -> list[str]:
        return check(self.dirs, self.min_free_bytes) + [p for p in (probe() for probe in self.probes) if p]
