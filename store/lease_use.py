"""What a lease's GPUs are doing (db/migrations/0012_lease_gpu_use.sql): written by the leader
from the agents' heartbeats, read by the API (a job's status and explain, the cluster map)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from store.tx import Db


@dataclass(frozen=True)
class LeaseUse:
    lease_id: str
    gpu_util: float  # mean SM use % over the lease's GPUs
    at: float  # unix seconds of the reading
    idle_since: float | None  # below the idle threshold since (None: in use, or not long enough)


def _dt(t: float | None) -> datetime | None:
    return None if t is None else datetime.fromtimestamp(t, UTC)


async def write_lease_use(db: Db, rows: Sequence[LeaseUse]) -> int:
    """Record readings of live leases in one statement; a released lease keeps its last one."""
    if not rows:
        return 0
    status = await db.execute(
        "UPDATE leases l SET gpu_util = u.util, gpu_util_at = u.at, idle_since = u.idle_since"
        " FROM unnest($1::text[], $2::real[], $3::timestamptz[], $4::timestamptz[]) AS u(lease_id, util, at, idle_since)"
        " WHERE l.lease_id = u.lease_id AND l.state = 'live'",
        [r.lease_id for r in rows],
        [r.gpu_util for r in rows],
        [_dt(r.at) for r in rows],
        [_dt(r.idle_since) for r in rows],
    )
    return int(status.split()[-1])


@dataclass(frozen=True)
class JobGpuUse:
    gpu_util: float | None  # mean over the live leases that reported
    idle_since: datetime | None  # every live lease idle: since the latest of them went idle
    idle_gpus: int  # GPUs of its live leases that are idle
    gpus: int  # GPUs of its live leases


async def job_gpu_use(db: Db, job_id: str) -> JobGpuUse | None:
    """The live attempt's GPU use, or None when the job holds no live lease."""
    rows = await db.fetch(
        "SELECT gpu_util, idle_since, cardinality(gpu_indices) AS gpus FROM leases"
        " WHERE job_id = $1 AND state = 'live'",
        job_id,
    )
    if not rows:
        return None
    read = [r["gpu_util"] for r in rows if r["gpu_util"] is not None]
    idle = [r for r in rows if r["idle_since"] is not None]
    return JobGpuUse(
        gpu_util=round(sum(read) / len(read), 1) if read else None,
        idle_since=max(r["idle_since"] for r in idle) if idle and len(idle) == len(rows) else None,
        idle_gpus=sum(r["gpus"] for r in idle),
        gpus=sum(r["gpus"] for r in rows),
    )
