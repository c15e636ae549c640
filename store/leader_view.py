"""The leader's reads (docs/design.md, Leadership and Placement): the whole snapshot it
rebuilds its in-memory state from on takeover, and the rows a refresh re-reads when the
change feed names them. A cycle never scans the whole store.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from placement.lifecycle import TERMINAL
from store.change_feed import ChangeFeed
from store.tx import Db

JOB_COLUMNS = (
    "job_id, team, priority_class, gpu_type, replicas, gpus_per_replica, spec, state, attempt, submitted_at,"
    " started_at, max_runtime_s, last_checkpoint_at, preempted_at, front_of_class, avoid_nodes"
)
NODE_COLUMNS = "node_id, block_id, gpu_type, gpus, state, task_queue, agent_addr"
_LIVE_LEASES = (
    "SELECT l.lease_id, l.job_id, l.rank, l.node_id, l.gpu_indices, l.attempt, bool_or(a.borrowed) AS borrowed"
    " FROM leases l LEFT JOIN allocations a ON a.lease_id = l.lease_id"
)


@dataclass(frozen=True)
class Snapshot:
    """Everything the leader keeps in memory, read in one repeatable-read transaction, and
    a change feed positioned at that snapshot (nothing between is missed)."""

    feed: ChangeFeed
    nodes: list[asyncpg.Record]
    quotas: list[asyncpg.Record]
    jobs: list[asyncpg.Record]  # every job that is not terminal
    leases: list[asyncpg.Record]  # every live lease, with whether its GPUs are borrowed
    usage: list[asyncpg.Record]  # (team, gpu_type, gpu_h): decayed GPU-hours over 7 days


async def snapshot(pool: asyncpg.Pool, *, half_life_s: float) -> Snapshot:
    async with pool.acquire() as conn:
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            feed = await ChangeFeed.start(conn)
            nodes = await conn.fetch(f"SELECT {NODE_COLUMNS} FROM nodes ORDER BY node_id")
            quotas = await conn.fetch("SELECT team, gpu_type, guaranteed, borrow_limit FROM quotas")
            jobs = await conn.fetch(
                f"SELECT {JOB_COLUMNS} FROM jobs WHERE NOT (state = ANY($1::text[]))", sorted(s.value for s in TERMINAL)
            )
            leases = await conn.fetch(
                f"{_LIVE_LEASES} WHERE l.state = 'live' GROUP BY l.lease_id ORDER BY l.job_id, l.rank"
            )
            usage = await conn.fetch(
                "SELECT j.team, j.gpu_type,"
                " sum(cardinality(l.gpu_indices) * extract(epoch FROM coalesce(l.released_at, now()) - l.created_at)"
                "     / 3600.0 * power(0.5, extract(epoch FROM now() - coalesce(l.released_at, now())) / $1)) AS gpu_h"
                " FROM leases l JOIN jobs j USING (job_id)"
                " WHERE coalesce(l.released_at, now()) > now() - interval '7 days'"
                " GROUP BY j.team, j.gpu_type",
                half_life_s,
            )
    return Snapshot(feed, list(nodes), list(quotas), list(jobs), list(leases), list(usage))


async def nodes_by_id(db: Db, node_ids: Sequence[str]) -> list[asyncpg.Record]:
    return list(await db.fetch(f"SELECT {NODE_COLUMNS} FROM nodes WHERE node_id = ANY($1::text[])", list(node_ids)))


async def quotas_by_key(db: Db, keys: Sequence[str]) -> list[asyncpg.Record]:
    """Quota rows named ``team/gpu_type`` (the change feed's subject for a quota)."""
    return list(
        await db.fetch(
            "SELECT team, gpu_type, guaranteed, borrow_limit FROM quotas WHERE team || '/' || gpu_type = ANY($1::text[])",
            list(keys),
        )
    )


async def jobs_by_id(db: Db, job_ids: Sequence[str]) -> list[asyncpg.Record]:
    return list(await db.fetch(f"SELECT {JOB_COLUMNS} FROM jobs WHERE job_id = ANY($1::text[])", list(job_ids)))


async def live_leases_of_jobs(db: Db, job_ids: Sequence[str]) -> list[asyncpg.Record]:
    return list(
        await db.fetch(
            f"{_LIVE_LEASES} WHERE l.state = 'live' AND l.job_id = ANY($1::text[])"
            " GROUP BY l.lease_id ORDER BY l.job_id, l.rank",
            list(job_ids),
        )
    )


async def live_leases_on_nodes(db: Db, node_ids: Sequence[str]) -> dict[str, set[str]]:
    """node -> ids of its live leases (every node asked for is in the answer)."""
    out: dict[str, set[str]] = {n: set() for n in node_ids}
    for r in await db.fetch(
        "SELECT node_id, lease_id FROM leases WHERE state = 'live' AND node_id = ANY($1::text[])", list(node_ids)
    ):
        out[r["node_id"]].add(r["lease_id"])
    return out
