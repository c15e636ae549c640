"""One read model of the cluster for operators (``GET /v1/cluster``, ``/ui``, ``gpufleet top``
and the API's ``/metrics``): every node and each of its GPUs in one state, the queue per
priority class as the leader last published it, each team's quota and use, the idle GPUs
and their cost, and the GPUs of live leases whose use the leader marked idle.

    view = await read_cluster(pool, gpu_hour_usd=2.0, jobs_per_class=50)
    view.gpu_counts()        # {(gpu_type, state): n} for every type and every GPU state

Read in one repeatable-read, read-only transaction, so every number agrees with the map.
The store does not scope what a caller may see: the API redacts other teams' job ids and
reasons before answering.

A GPU's state (``GpuState``), first rule that applies:

* its node is ``down``: ``down``; ``cordoned``: ``cordoned``; ``burn_in``: ``burn_in``
  (an allocation still on it keeps its team and job, recovery is under way);
* it has an allocation row: ``borrowed`` or ``guaranteed`` (its row's own flag);
* its node is a published hot spare: ``hot_spare``;
* its node, or its node's block, is held by a published reservation: ``reserved``;
* its node is ``ready``: ``free``;
* otherwise (``draining``: out of placement by an admin; ``suspect``: silent) it takes no
  new work: ``cordoned`` for ``draining``, ``down`` for ``suspect``.

Idle GPUs are the unallocated GPUs of ``ready`` nodes (``free``, ``reserved`` and
``hot_spare``: paid for, doing nothing), the same count as ``store.nodes.free_gpus``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

import asyncpg

from placement.model import CLASSES_BY_RANK, NodeHealth
from store.jobs import CLASS_RANK_SQL
from store.tx import Db


class GpuState(StrEnum):
    FREE = "free"
    GUARANTEED = "guaranteed"  # allocated within its team's guarantee
    BORROWED = "borrowed"  # allocated beyond it (may be reclaimed)
    RESERVED = "reserved"  # free, but held for a waiting gang (head-of-line or preemption)
    HOT_SPARE = "hot_spare"  # free, held by the leader for a large gang's restarts
    CORDONED = "cordoned"  # out of placement by decision: cordoned or draining
    DOWN = "down"  # out of placement by silence: down or suspect
    BURN_IN = "burn_in"  # running the burn-in test


GPU_STATES: tuple[str, ...] = tuple(s.value for s in GpuState)
PRIORITY_CLASSES: tuple[str, ...] = tuple(c.value for c in CLASSES_BY_RANK)
IDLE_STATES = frozenset({GpuState.FREE, GpuState.RESERVED, GpuState.HOT_SPARE})
# a node's own state decides its GPUs' state, whatever is allocated on them
_NODE_OVERRIDES = {
    NodeHealth.DOWN: GpuState.DOWN,
    NodeHealth.CORDONED: GpuState.CORDONED,
    NodeHealth.BURN_IN: GpuState.BURN_IN,
}
# an unallocated, unheld GPU of a node that takes no new placements
_NOT_PLACEABLE = {NodeHealth.DRAINING: GpuState.CORDONED, NodeHealth.SUSPECT: GpuState.DOWN}


@dataclass(frozen=True)
class GpuCell:
    index: int
    state: GpuState
    team: str | None = None  # the allocation's team, or the team a hot spare / reservation is held for
    job_id: str | None = None  # the allocation's job, or the job it is held for


@dataclass(frozen=True)
class NodeCell:
    node_id: str
    block_id: str
    gpu_type: str
    health: str  # placement.NodeHealth
    reason: str | None
    gpus: tuple[GpuCell, ...]

    @property
    def cordoned(self) -> bool:
        return self.health == NodeHealth.CORDONED

    @property
    def drained(self) -> bool:
        return self.health == NodeHealth.DRAINING

    @property
    def burn_in(self) -> bool:
        return self.health == NodeHealth.BURN_IN


@dataclass(frozen=True)
class QueuedJob:
    job_id: str
    team: str
    name: str | None
    priority_class: str
    gpu_type: str
    gpus: int
    queue_position: int | None  # published by the leader (None until a cycle ranked it)
    pending_reason: str | None
    pending_detail: str | None
    expected_start: datetime | None
    submitted_at: datetime


@dataclass(frozen=True)
class QueueClass:
    priority_class: str
    jobs_queued: int
    gpus_queued: int
    jobs: tuple[QueuedJob, ...]  # the first ``jobs_per_class`` in queue order


@dataclass(frozen=True)
class TeamUse:
    team: str
    gpu_type: str
    guaranteed: int  # the quota's guarantee
    borrow_limit: int
    in_use: int
    borrowed: int  # of in_use, beyond the guarantee

    @property
    def guaranteed_in_use(self) -> int:
        return self.in_use - self.borrowed


@dataclass(frozen=True)
class ClusterView:
    nodes: tuple[NodeCell, ...]
    queue: tuple[QueueClass, ...]  # every priority class, highest first
    teams: tuple[TeamUse, ...]
    allocated_idle: Mapping[str, int]  # team -> GPUs of live leases whose idle_since is set
    gpu_hour_usd: float
    gpu_types: tuple[str, ...] = field(default=())

    def gpu_counts(self) -> dict[tuple[str, str], int]:
        """(gpu_type, GPU state) -> GPUs, every known type x every state (zeros included)."""
        counts: Counter[tuple[str, str]] = Counter()
        for n in self.nodes:
            for g in n.gpus:
                counts[(n.gpu_type, g.state.value)] += 1
        return {(t, s): counts[(t, s)] for t in self.gpu_types for s in GPU_STATES}

    def allocated(self) -> dict[tuple[str, str, bool], int]:
        """(gpu_type, team, borrowed) -> GPUs allocated (from the allocation rows, on any node)."""
        out: dict[tuple[str, str, bool], int] = {}
        for u in self.teams:
            if u.in_use - u.borrowed:
                out[(u.gpu_type, u.team, False)] = u.in_use - u.borrowed
            if u.borrowed:
                out[(u.gpu_type, u.team, True)] = u.borrowed
        return out

    def idle_gpus(self) -> dict[str, int]:
        """gpu_type -> unallocated GPUs of ready nodes (free, reserved, hot spare)."""
        counts = self.gpu_counts()
        return {t: sum(counts[(t, s.value)] for s in IDLE_STATES) for t in self.gpu_types}

    @property
    def idle_gpu_total(self) -> int:
        return sum(self.idle_gpus().values())

    @property
    def idle_cost_usd_per_hour(self) -> float:
        return self.idle_gpu_total * self.gpu_hour_usd

    @property
    def allocated_idle_cost_usd_per_hour(self) -> float:
        return sum(self.allocated_idle.values()) * self.gpu_hour_usd


_QUEUE_ORDER = "coalesce(queue_position, 2147483647), {rank}, submitted_at, job_id".format(
    rank=CLASS_RANK_SQL.format(col="priority_class")
)


async def read_cluster(db: Db, *, gpu_hour_usd: float, jobs_per_class: int = 50) -> ClusterView:
    """The whole picture, in one consistent read. ``jobs_per_class=0`` reads counts only."""
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn:
            return await _read(conn, gpu_hour_usd, jobs_per_class)
    return await _read(db, gpu_hour_usd, jobs_per_class)


async def _read(conn: asyncpg.Connection, gpu_hour_usd: float, jobs_per_class: int) -> ClusterView:
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        gpu_types = [r["name"] for r in await conn.fetch("SELECT name FROM gpu_types ORDER BY name")]
        nodes = await conn.fetch(
            "SELECT node_id, block_id, gpu_type, gpus, state, reason FROM nodes ORDER BY block_id, node_id"
        )
        allocs = await conn.fetch("SELECT node_id, gpu_index, job_id, team, borrowed FROM allocations")
        spares = await conn.fetch(
            "SELECT h.node_id, h.job_id, j.team FROM hot_spares h LEFT JOIN jobs j ON j.job_id = h.job_id"
        )
        reservations = await conn.fetch(
            "SELECT r.job_id, j.team, r.nodes, r.blocks FROM reservations r JOIN jobs j ON j.job_id = r.job_id"
            " ORDER BY r.expected_start NULLS LAST, r.job_id"
        )
        classes = await conn.fetch(
            "SELECT priority_class, count(*) AS jobs, coalesce(sum(replicas * gpus_per_replica), 0) AS gpus"
            " FROM jobs WHERE state = 'QUEUED' GROUP BY priority_class"
        )
        queued: list[asyncpg.Record] = []
        if jobs_per_class > 0:
            queued = await conn.fetch(
                "SELECT * FROM (SELECT job_id, team, name, priority_class, gpu_type,"
                "   replicas * gpus_per_replica AS gpus, queue_position, pending_reason, pending_detail,"
                f"  expected_start, submitted_at, row_number() OVER (PARTITION BY priority_class ORDER BY {_QUEUE_ORDER})"
                "   AS n FROM jobs WHERE state = 'QUEUED') q WHERE n <= $1 ORDER BY priority_class, n",
                jobs_per_class,
            )
        use = await conn.fetch(
            "WITH used AS (SELECT team, gpu_type, count(*) AS in_use, count(*) FILTER (WHERE borrowed) AS borrowed"
            "   FROM allocations GROUP BY team, gpu_type)"
            " SELECT coalesce(q.team, u.team) AS team, coalesce(q.gpu_type, u.gpu_type) AS gpu_type,"
            "   coalesce(q.guaranteed, 0) AS guaranteed, coalesce(q.borrow_limit, 0) AS borrow_limit,"
            "   coalesce(u.in_use, 0) AS in_use, coalesce(u.borrowed, 0) AS borrowed"
            " FROM quotas q FULL JOIN used u ON u.team = q.team AND u.gpu_type = q.gpu_type"
            " ORDER BY 1, 2"
        )
        idle = await conn.fetch(
            "SELECT j.team, sum(cardinality(l.gpu_indices)) AS gpus FROM leases l JOIN jobs j ON j.job_id = l.job_id"
            " WHERE l.state = 'live' AND l.idle_since IS NOT NULL GROUP BY j.team ORDER BY j.team"
        )
    return ClusterView(
        nodes=_cells(nodes, allocs, spares, reservations),
        queue=_queue(classes, queued),
        teams=tuple(TeamUse(**dict(r)) for r in use),
        allocated_idle={r["team"]: int(r["gpus"]) for r in idle},
        gpu_hour_usd=gpu_hour_usd,
        gpu_types=tuple(gpu_types),
    )


def _cells(
    nodes: list[asyncpg.Record],
    allocs: list[asyncpg.Record],
    spares: list[asyncpg.Record],
    reservations: list[asyncpg.Record],
) -> tuple[NodeCell, ...]:
    by_gpu = {(a["node_id"], a["gpu_index"]): a for a in allocs}
    spare_of = {s["node_id"]: (s["team"], s["job_id"]) for s in spares}
    held_node: dict[str, tuple[str, str]] = {}
    held_block: dict[str, tuple[str, str]] = {}
    for r in reservations:  # the earliest expected start wins a node two reservations name
        for n in r["nodes"]:
            held_node.setdefault(n, (r["team"], r["job_id"]))
        for b in r["blocks"]:
            held_block.setdefault(b, (r["team"], r["job_id"]))
    out = []
    for n in nodes:
        health = NodeHealth(n["state"])
        cells = []
        for i in range(n["gpus"]):
            a = by_gpu.get((n["node_id"], i))
            owner = (a["team"], a["job_id"]) if a is not None else None
            if health in _NODE_OVERRIDES:
                state = _NODE_OVERRIDES[health]
            elif a is not None:
                state = GpuState.BORROWED if a["borrowed"] else GpuState.GUARANTEED
            elif n["node_id"] in spare_of:
                state, owner = GpuState.HOT_SPARE, spare_of[n["node_id"]]
            elif n["node_id"] in held_node or n["block_id"] in held_block:
                state = GpuState.RESERVED
                owner = held_node.get(n["node_id"]) or held_block[n["block_id"]]
            elif health == NodeHealth.READY:
                state = GpuState.FREE
            else:
                state = _NOT_PLACEABLE[health]
            cells.append(GpuCell(i, state, *(owner or (None, None))))
        out.append(NodeCell(n["node_id"], n["block_id"], n["gpu_type"], health.value, n["reason"], tuple(cells)))
    return tuple(out)


def _queue(classes: list[asyncpg.Record], queued: list[asyncpg.Record]) -> tuple[QueueClass, ...]:
    counts = {r["priority_class"]: (int(r["jobs"]), int(r["gpus"])) for r in classes}
    jobs: dict[str, list[QueuedJob]] = {c: [] for c in PRIORITY_CLASSES}
    for r in queued:
        jobs[r["priority_class"]].append(QueuedJob(**{k: r[k] for k in r.keys() if k != "n"}))
    out = []
    for c in PRIORITY_CLASSES:
        n_jobs, n_gpus = counts.get(c, (0, 0))
        out.append(QueueClass(c, jobs_queued=n_jobs, gpus_queued=n_gpus, jobs=tuple(jobs[c])))
    return tuple(out)
