"""All of the API's SQL: job insert, idempotency keys and the reads.

Reads come from Postgres only (what each placement cycle publishes there), so
they answer while the control plane is down. Writes take a connection that is
already inside the caller's transaction; audit and job-event rows go through
``activities.store`` so there is one writer of those tables' shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg

Db = asyncpg.Pool | asyncpg.Connection

CLASS_RANK_SQL = (
    "CASE {col} WHEN 'prod-serving' THEN 0 WHEN 'prod-batch' THEN 1 WHEN 'research' THEN 2 ELSE 3 END"
)
LIVE_STATES = ("QUEUED", "STARTING", "RUNNING", "PREEMPTING", "CANCELLING")


# --- health ---------------------------------------------------------------------


async def ping(db: Db) -> None:
    await db.fetchval("SELECT 1")


# --- idempotency keys (IETF Idempotency-Key draft) ---------------------------------


async def set_lock_timeout(conn: asyncpg.Connection, seconds: float) -> None:
    """Only for the current transaction; 0 = wait forever (the default)."""
    ms = max(0, int(seconds * 1000))
    await conn.execute(f"SET LOCAL lock_timeout = '{ms}ms'")


async def delete_expired_key(conn: asyncpg.Connection, principal: str, key: str) -> None:
    await conn.execute(
        "DELETE FROM idempotency_keys WHERE principal = $1 AND key = $2 AND expires_at < now()", principal, key
    )


async def purge_expired_keys(conn: asyncpg.Connection, limit: int = 100) -> int:
    status = await conn.execute(
        "DELETE FROM idempotency_keys WHERE ctid = ANY(ARRAY("
        " SELECT ctid FROM idempotency_keys WHERE expires_at < now() LIMIT $1 FOR UPDATE SKIP LOCKED))",
        limit,
    )
    return int(status.split()[-1])


async def claim_key(
    conn: asyncpg.Connection,
    *,
    principal: str,
    key: str,
    method: str,
    path: str,
    request_hash: str,
    ttl_s: float,
) -> bool:
    """Insert the key as in flight; False if a (committed) row already holds it.

    A concurrent claim of the same key blocks here until the first transaction
    ends (Postgres waits on the uncommitted unique key); the caller bounds that wait
    with a lock timeout and answers 409 when it runs out.
    """
    row = await conn.fetchval(
        "INSERT INTO idempotency_keys (principal, key, method, path, request_hash, status, expires_at)"
        " VALUES ($1, $2, $3, $4, $5, 'in_flight', now() + make_interval(secs => $6))"
        " ON CONFLICT (principal, key) DO NOTHING RETURNING 1",
        principal,
        key,
        method,
        path,
        request_hash,
        ttl_s,
    )
    return row is not None


async def get_key(conn: asyncpg.Connection, principal: str, key: str) -> asyncpg.Record | None:
    return await conn.fetchrow(
        "SELECT method, path, request_hash, status, response_code, response_body, expires_at"
        " FROM idempotency_keys WHERE principal = $1 AND key = $2",
        principal,
        key,
    )


async def complete_key(conn: asyncpg.Connection, principal: str, key: str, code: int, body: Any) -> None:
    await conn.execute(
        "UPDATE idempotency_keys SET status = 'done', response_code = $3, response_body = $4"
        " WHERE principal = $1 AND key = $2",
        principal,
        key,
        code,
        body,
    )


# --- admission reads ----------------------------------------------------------------


async def team_exists(db: Db, team: str) -> bool:
    return bool(await db.fetchval("SELECT 1 FROM teams WHERE name = $1", team))


async def gpu_type_exists(db: Db, gpu_type: str) -> bool:
    return bool(await db.fetchval("SELECT 1 FROM gpu_types WHERE name = $1", gpu_type))


async def node_capacity(db: Db, gpu_type: str) -> list[tuple[str, int]]:
    """(block_id, gpus) of every node of this type, whatever its state (admission asks
    whether the job could ever fit, not whether it fits now)."""
    rows = await db.fetch("SELECT block_id, gpus FROM nodes WHERE gpu_type = $1", gpu_type)
    return [(r["block_id"], r["gpus"]) for r in rows]


async def get_quota(db: Db, team: str, gpu_type: str) -> asyncpg.Record | None:
    return await db.fetchrow(
        "SELECT guaranteed, borrow_limit FROM quotas WHERE team = $1 AND gpu_type = $2", team, gpu_type
    )


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
        f"SELECT count(*) FROM (SELECT 1 FROM jobs WHERE state = 'QUEUED' AND {rank_col} <= {rank_new}"
        " LIMIT $2) t",
        priority_class,
        cap,
    )
    return int(ahead) + 1


# --- jobs ---------------------------------------------------------------------------


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


async def mark_workflow_started(db: Db, job_id: str) -> None:
    await db.execute(
        "UPDATE jobs SET workflow_started = true WHERE job_id = $1 AND NOT workflow_started", job_id
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
    sql = f"SELECT {_JOB_COLUMNS} FROM jobs"
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


async def free_gpus(db: Db, gpu_type: str) -> int:
    return await db.fetchval(
        "SELECT coalesce(sum(n.gpus), 0) - (SELECT count(*) FROM allocations a JOIN nodes m ON m.node_id = a.node_id"
        "   WHERE m.gpu_type = $1 AND m.state = 'ready')"
        " FROM nodes n WHERE n.gpu_type = $1 AND n.state = 'ready'",
        gpu_type,
    )


# --- teams: quota, usage, queue ---------------------------------------------------------


async def team_usage(db: Db, team: str) -> dict[str, dict[str, int]]:
    rows = await db.fetch(
        "SELECT q.gpu_type, q.guaranteed, q.borrow_limit,"
        "  (SELECT count(*) FROM allocations a WHERE a.team = q.team AND a.gpu_type = q.gpu_type) AS in_use,"
        "  (SELECT count(*) FROM allocations a WHERE a.team = q.team AND a.gpu_type = q.gpu_type AND a.borrowed)"
        "    AS borrowed"
        " FROM quotas q WHERE q.team = $1 ORDER BY q.gpu_type",
        team,
    )
    usage = {
        r["gpu_type"]: {
            "guaranteed": r["guaranteed"],
            "borrow_limit": r["borrow_limit"],
            "in_use": r["in_use"],
            "borrowed": r["borrowed"],
        }
        for r in rows
    }
    # allocations of a type the team has no quota row for (should not happen, but show it)
    extra = await db.fetch(
        "SELECT gpu_type, count(*) AS in_use, count(*) FILTER (WHERE borrowed) AS borrowed FROM allocations"
        " WHERE team = $1 AND gpu_type <> ALL($2::text[]) GROUP BY gpu_type",
        team,
        list(usage),
    )
    for r in extra:
        usage[r["gpu_type"]] = {"guaranteed": 0, "borrow_limit": 0, "in_use": r["in_use"], "borrowed": r["borrowed"]}
    return usage


async def team_state_counts(db: Db, team: str) -> dict[str, int]:
    rows = await db.fetch(
        "SELECT state, count(*) AS n FROM jobs WHERE team = $1 AND state = ANY($2::text[]) GROUP BY state",
        team,
        list(LIVE_STATES),
    )
    counts = {s: 0 for s in LIVE_STATES}
    counts.update({r["state"]: r["n"] for r in rows})
    return counts


async def team_queue(db: Db, team: str, *, after: tuple[int, int, datetime, str] | None, limit: int) -> list[asyncpg.Record]:
    """Queued jobs of a team in queue order: published position first (unranked last),
    then class, then submit time."""
    args: list[Any] = [team]
    where = "team = $1 AND state = 'QUEUED'"
    key = (
        "coalesce(queue_position, 2147483647), " + CLASS_RANK_SQL.format(col="priority_class") + ", submitted_at, job_id"
    )
    if after is not None:
        args.extend(after)
        where += " AND (" + key + ") > ($2, $3, $4, $5)"
    args.append(limit)
    return await db.fetch(
        "SELECT job_id, name, priority_class, gpu_type, replicas * gpus_per_replica AS gpus, state, queue_position,"
        f" pending_reason, expected_start, submitted_at, {CLASS_RANK_SQL.format(col='priority_class')} AS class_rank"
        f" FROM jobs WHERE {where} ORDER BY {key} LIMIT ${len(args)}",
        *args,
    )


# --- nodes ------------------------------------------------------------------------------


_NODE_COLUMNS = (
    "n.node_id, n.block_id, n.gpu_type, n.gpus, n.state, n.reason, n.drain_evict, n.updated_at, n.task_queue,"
    " n.agent_addr, (SELECT count(*) FROM allocations a WHERE a.node_id = n.node_id) AS gpus_allocated,"
    " (SELECT h.job_id FROM hot_spares h WHERE h.node_id = n.node_id) AS hot_spare_for,"
    " (SELECT j.team FROM hot_spares h JOIN jobs j ON j.job_id = h.job_id WHERE h.node_id = n.node_id) AS hot_spare_team"
)


def _node_filters(state: str | None, block: str | None, gpu_type: str | None) -> tuple[list[str], list[Any]]:
    where: list[str] = []
    args: list[Any] = []
    for col, val in (("n.state", state), ("n.block_id", block), ("n.gpu_type", gpu_type)):
        if val is not None:
            args.append(val)
            where.append(f"{col} = ${len(args)}")
    return where, args


async def list_nodes(
    db: Db,
    *,
    state: str | None,
    block: str | None,
    gpu_type: str | None,
    after: str | None,
    limit: int,
) -> list[asyncpg.Record]:
    where, args = _node_filters(state, block, gpu_type)
    if after is not None:
        args.append(after)
        where.append(f"n.node_id > ${len(args)}")
    args.append(limit)
    sql = f"SELECT {_NODE_COLUMNS} FROM nodes n"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += f" ORDER BY n.node_id LIMIT ${len(args)}"
    return await db.fetch(sql, *args)


async def count_hot_spares(db: Db, *, state: str | None, block: str | None, gpu_type: str | None) -> int:
    """Nodes the leader holds as hot spares (as it last published them), under the list's filters."""
    where, args = _node_filters(state, block, gpu_type)
    sql = "SELECT count(*) FROM hot_spares h JOIN nodes n ON n.node_id = h.node_id"
    if where:
        sql += " WHERE " + " AND ".join(where)
    return int(await db.fetchval(sql, *args))


async def get_node(db: Db, node_id: str, *, for_update: bool = False) -> asyncpg.Record | None:
    sql = f"SELECT {_NODE_COLUMNS} FROM nodes n WHERE n.node_id = $1"
    if for_update:
        sql += " FOR UPDATE OF n"
    return await db.fetchrow(sql, node_id)


async def node_leases(db: Db, node_id: str) -> list[asyncpg.Record]:
    return await db.fetch(
        "SELECT l.lease_id, l.job_id, j.team, l.attempt, l.rank, l.gpu_indices, l.epoch FROM leases l"
        " JOIN jobs j ON j.job_id = l.job_id WHERE l.node_id = $1 AND l.state = 'live' ORDER BY l.lease_id",
        node_id,
    )


async def node_allocations(db: Db, node_id: str) -> list[asyncpg.Record]:
    return await db.fetch(
        "SELECT gpu_index, job_id, team, borrowed FROM allocations WHERE node_id = $1 ORDER BY gpu_index", node_id
    )


async def set_node_draining(conn: asyncpg.Connection, node_id: str, reason: str, evict: bool) -> None:
    await conn.execute(
        "UPDATE nodes SET state = 'draining', reason = $2, drain_evict = $3, updated_at = now() WHERE node_id = $1",
        node_id,
        reason,
        evict,
    )


def records(rows: Sequence[asyncpg.Record]) -> list[dict[str, Any]]:
    return [dict(r) for r in rows]
