"""Node rows: the health monitor's state writes, the admin's drain and return, and reads.

Every state write runs in one transaction and writes its audit row in it, and only
when the state really changes (compare-and-set on the state the caller saw, so an
admin drain written meanwhile is never overwritten). The health monitor's writes
check the leader epoch.

    ok = await set_node_state(pool, scope=..., epoch=7, node_id="n1", expect=("ready",),
                              to="suspect", reason="no heartbeat for 31s", actor="health:c1")
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg

from store.audit import write_audit
from store.leadership import check_epoch
from store.tx import Db, transaction


@dataclass(frozen=True)
class NodeRow:
    node_id: str
    state: str
    reason: str | None
    drain_evict: bool


async def set_node_state(
    db: Db,
    *,
    scope: str,
    epoch: int,
    node_id: str,
    expect: Sequence[str],
    to: str,
    reason: str,
    actor: str,
    detail: dict[str, Any] | None = None,
) -> bool:
    """Move ``node_id`` from one of ``expect`` to ``to`` under ``epoch``; audit it. False when
    the node is not in an expected state any more (someone else changed it) or already ``to``."""
    async with transaction(db) as conn:
        await check_epoch(conn, scope, epoch)
        old = await conn.fetchval("SELECT state FROM nodes WHERE node_id = $1 FOR UPDATE", node_id)
        if old is None or old == to or old not in expect:
            return False
        await conn.execute(
            "UPDATE nodes SET state = $2, reason = $3, updated_at = now(),"
            " drain_evict = CASE WHEN $2 = 'draining' THEN drain_evict ELSE false END"
            " WHERE node_id = $1",
            node_id,
            to,
            reason,
        )
        await write_audit(
            conn, actor, "node_state", node_id, reason, {"from": old, "to": to, "epoch": epoch, **(detail or {})}
        )
        return True


async def return_node(db: Db, node_id: str, *, actor: str, reason: str) -> str | None:
    """An admin returns a drained node to service: it goes to burn_in (the leader runs the test
    and marks it ready when it passes). Returns the state it left, None when it was not draining
    or cordoned (nothing done)."""
    async with transaction(db) as conn:
        old = await conn.fetchval("SELECT state FROM nodes WHERE node_id = $1 FOR UPDATE", node_id)
        if old not in ("draining", "cordoned"):
            return None
        await conn.execute(
            "UPDATE nodes SET state = 'burn_in', reason = $2, drain_evict = false, updated_at = now() WHERE node_id = $1",
            node_id,
            reason,
        )
        await write_audit(conn, actor, "node_return", node_id, reason, {"from": old, "to": "burn_in"})
        return old


async def agent_addrs(db: Db) -> dict[str, str | None]:
    """node_id -> the agent address recorded in nodes.agent_addr."""
    return {r["node_id"]: r["agent_addr"] for r in await db.fetch("SELECT node_id, agent_addr FROM nodes")}


async def set_agent_addr(db: Db, *, scope: str, epoch: int, node_id: str, addr: str) -> bool:
    """Record the address a node's agent advertises in its heartbeats (where the API reads rank
    logs, and the host jobs rendezvous on), under the leader's epoch. True when it changed."""
    async with transaction(db) as conn:
        await check_epoch(conn, scope, epoch)
        status = await conn.execute(
            "UPDATE nodes SET agent_addr = $2 WHERE node_id = $1 AND agent_addr IS DISTINCT FROM $2", node_id, addr
        )
        return status.endswith(" 1")


async def node_rows(db: Db) -> dict[str, NodeRow]:
    rows = await db.fetch("SELECT node_id, state, reason, drain_evict FROM nodes")
    return {r["node_id"]: NodeRow(r["node_id"], r["state"], r["reason"], r["drain_evict"]) for r in rows}


async def node_row(db: Db, node_id: str) -> NodeRow | None:
    r = await db.fetchrow("SELECT node_id, state, reason, drain_evict FROM nodes WHERE node_id = $1", node_id)
    return NodeRow(r["node_id"], r["state"], r["reason"], r["drain_evict"]) if r is not None else None


async def not_ready_rows(db: Db) -> dict[str, NodeRow]:
    """Nodes not ready (few): what the monitor re-reads each sweep to see admin drains and returns."""
    rows = await db.fetch("SELECT node_id, state, reason, drain_evict FROM nodes WHERE state <> 'ready'")
    return {r["node_id"]: NodeRow(r["node_id"], r["state"], r["reason"], r["drain_evict"]) for r in rows}


async def audit_wrong_gpus(db: Db, *, node_id: str, lease_id: str, job_id: str,
                           reported: Sequence[int], held: Sequence[int], actor: str) -> None:  # fmt: skip
    async with transaction(db) as conn:
        await write_audit(
            conn,
            actor,
            "kill_wrong_gpus",
            job_id,
            "reconciliation: a rank runs on GPUs its lease does not hold",
            {"node": node_id, "lease_id": lease_id, "reported_gpus": list(reported), "lease_gpus": list(held)},
        )


async def gpu_type_exists(db: Db, gpu_type: str) -> bool:
    return bool(await db.fetchval("SELECT 1 FROM gpu_types WHERE name = $1", gpu_type))


async def node_capacity(db: Db, gpu_type: str) -> list[tuple[str, int]]:
    """(block_id, gpus) of every node of this type, whatever its state (admission asks
    whether the job could ever fit, not whether it fits now)."""
    rows = await db.fetch("SELECT block_id, gpus FROM nodes WHERE gpu_type = $1", gpu_type)
    return [(r["block_id"], r["gpus"]) for r in rows]


async def free_gpus(db: Db, gpu_type: str) -> int:
    return await db.fetchval(
        "SELECT coalesce(sum(n.gpus), 0) - (SELECT count(*) FROM allocations a JOIN nodes m ON m.node_id = a.node_id"
        "   WHERE m.gpu_type = $1 AND m.state = 'ready')"
        " FROM nodes n WHERE n.gpu_type = $1 AND n.state = 'ready'",
        gpu_type,
    )


def _n(count: int, what: str) -> str:
    return f"{count} {what}{'' if count == 1 else 's'}"


def node_waits_for(
    state: str,
    *,
    live_ranks: int,
    live_jobs: int,
    drain_evict: bool,
    since: datetime,
    now: datetime,
    suspect_after_s: float,
    down_after_s: float,
) -> str | None:
    """What a node in ``state`` waits for before it moves on (docs/design.md, Health), from what
    Postgres knows: its live leases (one per rank not yet confirmed gone), the jobs they belong
    to, and when it entered the state. None for a ready node. E.g. ``waiting for 1 rank to exit``."""
    ranks, jobs = _n(live_ranks, "rank"), _n(live_jobs, "job")
    at = since.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    if state == "ready":
        return None
    if state == "suspect":
        silent = suspect_after_s + max(0.0, (now - since).total_seconds())
        return f"no heartbeat for {silent:.0f} s: down at {down_after_s:.0f} s, ready when heard from"
    if state == "down":
        if live_ranks:
            return f"since {at}: {ranks} of {jobs} being recovered elsewhere"
        return f"since {at}: burn-in once its agent reports again with no rank left"
    if state == "cordoned":
        if live_ranks:
            return f"since {at}: waiting for {ranks} of {jobs} to stop, then burn-in once the fault clears"
        return f"since {at}: burn-in once the fault clears (and after a back-off if a burn-in failed)"
    if state == "draining":
        if live_jobs:
            return f"{jobs} being evicted" if drain_evict else f"{jobs} to finish or be evicted"
        return "drained: waiting for an admin return"
    if state == "burn_in":
        if live_ranks:
            return f"waiting for {ranks} to exit"
        return "the burn-in test runs (or starts at the next heartbeat): ready when it passes"
    return None


_NODE_COLUMNS = (
    "n.node_id, n.block_id, n.gpu_type, n.gpus, n.state, n.reason, n.drain_evict, n.updated_at, n.task_queue,"
    " n.agent_addr, (SELECT count(*) FROM allocations a WHERE a.node_id = n.node_id) AS gpus_allocated,"
    " (SELECT count(*) FROM leases l WHERE l.node_id = n.node_id AND l.state = 'live') AS live_ranks,"
    " (SELECT count(DISTINCT l.job_id) FROM leases l WHERE l.node_id = n.node_id AND l.state = 'live') AS live_jobs,"
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


async def drain_node(
    conn: asyncpg.Connection, node_id: str, *, from_state: str, reason: str, evict: bool, actor: str
) -> None:
    """An admin drain: no new placements (with ``evict`` the leader also preempts the node's
    jobs), audited in the caller's transaction (which holds the node row, ``get_node(...,
    for_update=True)``)."""
    await conn.execute(
        "UPDATE nodes SET state = 'draining', reason = $2, drain_evict = $3, updated_at = now() WHERE node_id = $1",
        node_id,
        reason,
        evict,
    )
    await write_audit(conn, actor, "drain", node_id, reason, {"from_state": from_state, "evict": evict})
