"""Job rows: the API's insert and reads, the workflow's load, the leader's sweeps.

Reads come from Postgres only (what each placement cycle publishes there), so the
API answers while the control plane is down. State changes live in
``store.job_states``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg

from store.allocations import live_gang
from store.audit import write_audit
from store.tx import Db, transaction

CLASS_RANK_SQL = "CASE {col} WHEN 'prod-serving' THEN 0 WHEN 'prod-batch' THEN 1 WHEN 'research' THEN 2 ELSE 3 END"


async def lock_team_queue(conn: asyncpg.Connection, team: str) -> None:
    """Serialize submits of one team for the queued-jobs limit (transaction-scoped)."""
    await conn.execute("SELECT pg_advisory_xact_lock(hashtextextended('gpufleet:queue:' || $1, 0))", team)


async def count_queued(db: Db, team: str) -> int:
    return await db.fetchval("SELECT count(*) FROM jobs WHERE team = $1 AND state = 'QUEUED'", team)


async def estimate_queue_position(db: Db, priority_class: str, cap: int) -> int:
    """1-based position by class, then submit time, counting at most ``cap`` jobs ahead."""
    rank_col = CLASS_RANK_SQL.format(col="priority_class")
    rank_new = CLASS_RANK_SQL.format(col="$1::text")
    ahead = await db.fetchval(
        f"SELECT count(*) FROM (SELECT 1 FROM jobs WHERE state = 'QUEUED' AND {rank_col} <= {rank_new} LIMIT $2) t",
        priority_class,
        cap,
    )
    return int(ahead) + 1


async def insert_job(
    conn: asyncpg.Connection,
    *,
    job_id: str,
    team: str,
    name: str | None,
    priority_class: str,
    gpu_type: str,
    replicas: int,
    gpus_per_replica: int,
    spec: dict[str, Any],
    max_runtime_s: float,
    submitted_by: str,
) -> asyncpg.Record:
    return await conn.fetchrow(
        "INSERT INTO jobs (job_id, team, name, priority_class, gpu_type, replicas, gpus_per_replica, spec,"
        " max_runtime_s, submitted_by, state)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 'QUEUED')"
        " RETURNING job_id, state, attempt, submitted_at",
        job_id,
        team,
        name,
        priority_class,
        gpu_type,
        replicas,
        gpus_per_replica,
        spec,
        max_runtime_s,
        submitted_by,
    )


async def mark_workflow_started(db: Db, job_ids: Sequence[str]) -> None:
    """Record that these jobs' workflows were started (the leader's sweep skips them)."""
    if job_ids:
        await db.execute(
            "UPDATE jobs SET workflow_started = true WHERE job_id = ANY($1::text[]) AND NOT workflow_started",
            list(job_ids),
        )


_JOB_COLUMNS = (
    "job_id, team, name, priority_class, gpu_type, replicas, gpus_per_replica, spec, state, attempt,"
    " submitted_at, queued_at, started_at, finished_at, max_runtime_s, extensions, last_checkpoint,"
    " last_checkpoint_at, preemptions, exit_code, submitted_by, workflow_started, queue_position,"
    " pending_reason, pending_detail, expected_start"
)


async def get_job(db: Db, job_id: str) -> asyncpg.Record | None:
    return await db.fetchrow(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE job_id = $1", job_id)


async def job_ranks(db: Db, job_id: str, attempt: int) -> list[asyncpg.Record]:
    """Live leases of one attempt, with the block of each node."""
    return await db.fetch(
        "SELECT l.lease_id, l.rank, l.node_id, n.block_id, l.gpu_indices FROM leases l"
        " JOIN nodes n ON n.node_id = l.node_id"
        " WHERE l.job_id = $1 AND l.attempt = $2 AND l.state = 'live' ORDER BY l.rank",
        job_id,
        attempt,
    )


async def list_jobs(
    db: Db,
    *,
    team: str | None,
    state: str | None,
    after: tuple[datetime, str] | None,
    limit: int,
) -> list[asyncpg.Record]:
    """Newest first; ``after`` is the (submitted_at, job_id) of the last row of the previous page."""
    where: list[str] = []
    args: list[Any] = []
    if team is not None:
        args.append(team)
        where.append(f"team = ${len(args)}")
    if state is not None:
        args.append(state)
        where.append(f"state = ${len(args)}")
    if after is not None:
        args.extend(after)
        where.append(f"(submitted_at, job_id) < (${len(args) - 1}, ${len(args)})")
    args.append(limit)
    # the live attempt's nodes, for the list's nodes column
    nodes = (
        "(SELECT array_agg(DISTINCT l.node_id ORDER BY l.node_id) FROM leases l"
        " WHERE l.job_id = jobs.job_id AND l.attempt = jobs.attempt AND l.state = 'live') AS nodes"
    )
    sql = f"SELECT {_JOB_COLUMNS}, {nodes} FROM jobs"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += f" ORDER BY submitted_at DESC, job_id DESC LIMIT ${len(args)}"
    return await db.fetch(sql, *args)


async def list_events(db: Db, job_id: str, *, after_id: int, limit: int) -> list[asyncpg.Record]:
    return await db.fetch(
        "SELECT id, attempt, event, from_state, to_state, reason, detail, actor, at FROM job_events"
        " WHERE job_id = $1 AND id > $2 ORDER BY id LIMIT $3",
        job_id,
        after_id,
        limit,
    )


async def find_rank_lease(db: Db, job_id: str, rank: int, attempt: int | None) -> asyncpg.Record | None:
    """The lease that ran (or runs) ``rank`` of ``attempt`` (default: the newest attempt
    that has one), with the agent address of its node."""
    return await db.fetchrow(
        "SELECT l.lease_id, l.attempt, l.state, l.node_id, n.agent_addr FROM leases l"
        " JOIN nodes n ON n.node_id = l.node_id"
        " WHERE l.job_id = $1 AND l.rank = $2 AND ($3::int IS NULL OR l.attempt = $3)"
        " ORDER BY l.attempt DESC LIMIT 1",
        job_id,
        rank,
        attempt,
    )


async def load_job(db: Db, job_id: str) -> tuple[asyncpg.Record | None, list[asyncpg.Record]]:
    """The job row (with ``job_rank_id`` and its team's ``team_rank_id``, the numbers its
    ranks' user and group are made from) and the live leases of its current attempt (with each node's task queue)."""
    async with transaction(db) as conn:
        job = await conn.fetchrow(
            "SELECT j.*, j.rank_id AS job_rank_id, t.rank_id AS team_rank_id FROM jobs j"
            " JOIN teams t ON t.name = j.team WHERE j.job_id = $1",
            job_id,
        )
        if job is None:
            return None, []
        return job, await live_gang(conn, job_id, job["attempt"])


async def job_attempts(db: Db, job_ids: Sequence[str]) -> dict[str, tuple[str, int, Any]]:
    """job_id -> (state, attempt, started_at) for the failure -> restart clock."""
    rows = await db.fetch(
        "SELECT job_id, state, attempt, started_at FROM jobs WHERE job_id = ANY($1::text[])", list(job_ids)
    )
    return {r["job_id"]: (r["state"], r["attempt"], r["started_at"]) for r in rows}


async def active_jobs(db: Db, *, unchanged_for_s: float, limit: int = 100_000) -> list[asyncpg.Record]:
    """Jobs not in a final state whose row has not changed for ``unchanged_for_s`` (a job
    that just moved may not show in Temporal's visibility yet): job_id, state, attempt."""
    return await db.fetch(
        "SELECT job_id, state, attempt FROM jobs"
        " WHERE state NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'TIMED_OUT')"
        " AND updated_at < now() - make_interval(secs => $1) ORDER BY submitted_at LIMIT $2",
        unchanged_for_s,
        limit,
    )


async def audit_workflow_restarted(db: Db, job_id: str, *, actor: str, state: str, reason: str) -> None:
    """Who started a job's missing workflow, and why (invariant 7)."""
    async with transaction(db) as conn:
        await write_audit(conn, actor, "workflow_started", job_id, reason, {"state": state})
