"""Allocated-but-idle GPUs (docs/design.md, Observability): the leader reads each running
lease's GPU use from its node's latest heartbeat, marks a lease idle once its mean SM use
stayed below ``idle_gpu_util_pct`` for ``idle_gpu_after_s``, writes the readings and marks to
Postgres every ``gpu_use_flush_s`` (for a job's status and explain), counts idle GPUs per
team for /metrics, and, under ``Policy.idle_victims_first``, tells the placement state which
jobs are wholly idle (the cheapest victims).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.settings import Settings
from control.leader.metrics import ControlMetrics
from control.leader.state import LeaderState
from store.lease_use import LeaseUse, write_lease_use
from store.tx import Pool

log = logging.getLogger("gpufleet.control.gpu_use")

REWRITE_AFTER_S = 300.0  # an unchanged reading is written again this often (its time moves on)
UTIL_STEP = 1.0  # a reading this far from the written one is written at the next flush


def job_of(lease_id: str) -> str:
    """``{job}.a{attempt}.r{rank}`` (store.allocations.lease_id_for) -> the job id."""
    return lease_id.rsplit(".", 2)[0]


@dataclass
class _Lease:
    util: float
    at: float
    gpus: int
    low_from: float | None = None  # wall time its use first read below the threshold, this spell
    written: tuple[float, float | None, float] | None = None  # (util, idle_since, at) last written

    def idle_since(self, after_s: float) -> float | None:
        if self.low_from is not None and self.at - self.low_from >= after_s:
            return self.low_from
        return None


class GpuUse:
    def __init__(
        self,
        pool: Pool,
        settings: Settings,
        state: LeaderState,
        table: Callable[[], Any],
        *,
        metrics: ControlMetrics | None = None,
        idle_victims_first: bool = True,
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.state = state
        self._table = table
        self.metrics = metrics
        self.idle_victims_first = idle_victims_first
        self.leases: dict[str, _Lease] = {}
        self._idle_jobs: set[str] = set()  # what the placement state was told
        self._told: Any = None  # the ClusterState told (a rebuild makes a new one, told afresh)
        self._next = 0.0

    def drop(self) -> None:
        self.leases.clear()
        self._idle_jobs.clear()
        self._next = 0.0
        if self.metrics is not None:
            self.metrics.allocated_idle_leases = {}

    def read(self, took_over_at: float) -> None:
        """Take every live lease's latest reading from the heartbeat table."""
        table = self._table()
        if table is None:
            return
        threshold = self.settings.idle_gpu_util_pct
        live: set[str] = set()
        for node_id, lease_ids in self.state.node_leases.items():
            entry = table.get(node_id)
            if entry is None or entry.received_at < took_over_at:
                continue
            for r in entry.message.running:
                if r.lease_id not in lease_ids or not r.HasField("gpu_util"):
                    continue
                live.add(r.lease_id)
                at = entry.received_wall
                cur = self.leases.get(r.lease_id)
                if cur is None:
                    cur = self.leases[r.lease_id] = _Lease(r.gpu_util, at, len(r.gpu_indices))
                elif at <= cur.at:
                    continue  # the same heartbeat as last time
                cur.util, cur.at, cur.gpus = float(r.gpu_util), at, len(r.gpu_indices)
                if cur.util < threshold:
                    cur.low_from = cur.low_from if cur.low_from is not None else at
                else:
                    cur.low_from = None
        live_now = {lid for ids in self.state.node_leases.values() for lid in ids}
        for lid in [lid for lid in self.leases if lid not in live_now]:
            del self.leases[lid]

    def idle(self) -> dict[str, tuple[str, int]]:
        """Allocated-but-idle leases: lease -> (team, GPUs)."""
        after = self.settings.idle_gpu_after_s
        out: dict[str, tuple[str, int]] = {}
        for lid, u in self.leases.items():
            if u.idle_since(after) is None:
                continue
            job = self.state.jobs.get(job_of(lid))
            if job is not None:
                out[lid] = (job.spec.team, u.gpus)
        return out

    async def pass_(self, took_over_at: float) -> None:
        """Read, mark, and every ``gpu_use_flush_s`` write (the health monitor calls this each pass)."""
        mono = time.monotonic()
        if mono < self._next:
            return
        self._next = mono + self.settings.gpu_use_flush_s
        self.read(took_over_at)
        idle = self.idle()
        if self.metrics is not None:
            self.metrics.allocated_idle_leases = idle
        await self._tell_placement(idle)
        await self.flush()

    async def flush(self) -> int:
        after = self.settings.idle_gpu_after_s
        rows: list[LeaseUse] = []
        for lid, u in self.leases.items():
            since = u.idle_since(after)
            w = u.written
            if w is None or abs(w[0] - u.util) >= UTIL_STEP or w[1] != since or (u.at - w[2] >= REWRITE_AFTER_S):
                rows.append(LeaseUse(lid, u.util, u.at, since))
        if not rows:
            return 0
        n = await write_lease_use(self.pool, rows)
        for r in rows:
            kept = self.leases.get(r.lease_id)
            if kept is not None:
                kept.written = (r.gpu_util, r.idle_since, r.at)
        return n

    async def _tell_placement(self, idle: dict[str, tuple[str, int]]) -> None:
        if not self.idle_victims_first:
            return
        by_job: dict[str, list[bool]] = {}
        for lid in self.leases:
            by_job.setdefault(job_of(lid), []).append(lid in idle)
        wholly = {j for j, flags in by_job.items() if all(flags)}
        state = self.state
        if wholly == self._idle_jobs and state.cluster is self._told:
            return
        async with state.lock:
            cluster = state.cluster
            if cluster is None:
                return
            changed = wholly ^ self._idle_jobs if cluster is self._told else wholly | self._idle_jobs
            for j in changed:
                if cluster.get_running(j) is not None:
                    cluster.set_idle(j, j in wholly)
            self._told = cluster
        self._idle_jobs = wholly
