"""Node-state writes of the health monitor (DESIGN.md, Health and Invariants 3 and 7).

Every write runs in one transaction with the leader's epoch check and writes its audit
row in the same transaction, and only when the state really changes (compare-and-set on
the state the caller saw, so an admin drain written meanwhile is never overwritten).

    ok = await set_node_state(pool, scope=..., epoch=7, node_id="n1", expect=("ready",),
                              to="suspect", reason="no heartbeat for 31s", actor="health:c1")
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from activities.store import _transaction, check_epoch, write_audit


@dataclass(frozen=True)
class NodeRow:
    node_id: str
    state: str
    reason: str | None
    drain_evict: bool


@dataclass(frozen=True)
class LeaseRow:
    lease_id: str
    job_id: str
    attempt: int
    rank: int
    node_id: str
    gpu_indices: tuple[int, ...]
    epoch: int
    live: bool


async def set_node_state(
    db: asyncpg.Pool | asyncpg.Connection,
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
    async with _transaction(db) as conn:
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
        await write_audit(conn, actor, "node_state", node_id, reason, {"from": old, "to": to, "epoch": epoch, **(detail or {})})
        return True


async def return_node(db: asyncpg.Pool | asyncpg.Connection, node_id: str, *, actor: str, reason: str) -> str | None:
    """An admin returns a drained node to service: it goes to burn_in (the leader runs the test
    and marks it ready when it passes). Returns the state it left, None when it was not draining
    or cordoned (nothing done)."""
    async with _transaction(db) as conn:
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


async def agent_addrs(db: asyncpg.Pool | asyncpg.Connection) -> dict[str, str | None]:
    """node_id -> the agent address recorded in nodes.agent_addr."""
    return {r["node_id"]: r["agent_addr"] for r in await db.fetch("SELECT node_id, agent_addr FROM nodes")}


async def set_agent_addr(db: asyncpg.Pool | asyncpg.Connection, *, scope: str, epoch: int, node_id: str, addr: str) -> bool:
    """Record the address a node's agent advertises in its heartbeats (where the API reads rank
    logs, and the host jobs rendezvous on), under the leader's epoch. True when it changed."""
    async with _transaction(db) as conn:
        await check_epoch(conn, scope, epoch)
        status = await conn.execute(
            "UPDATE nodes SET agent_addr = $2 WHERE node_id = $1 AND agent_addr IS DISTINCT FROM $2", node_id, addr
        )
        return status.endswith(" 1")


async def node_rows(db: asyncpg.Pool | asyncpg.Connection) -> dict[str, NodeRow]:
    rows = await db.fetch("SELECT node_id, state, reason, drain_evict FROM nodes")
    return {r["node_id"]: NodeRow(r["node_id"], r["state"], r["reason"], r["drain_evict"]) for r in rows}


async def not_ready_rows(db: asyncpg.Pool | asyncpg.Connection) -> dict[str, NodeRow]:
    """Nodes not ready (few): what the monitor re-reads each sweep to see admin drains and returns."""
    rows = await db.fetch("SELECT node_id, state, reason, drain_evict FROM nodes WHERE state <> 'ready'")
    return {r["node_id"]: NodeRow(r["node_id"], r["state"], r["reason"], r["drain_evict"]) for r in rows}


async def leases(db: asyncpg.Pool | asyncpg.Connection, lease_ids: Sequence[str]) -> dict[str, LeaseRow]:
    rows = await db.fetch(
        "SELECT lease_id, job_id, attempt, rank, node_id, gpu_indices, epoch, state FROM leases"
        " WHERE lease_id = ANY($1::text[])",
        list(lease_ids),
    )
    return {
        r["lease_id"]: LeaseRow(
            r["lease_id"], r["job_id"], r["attempt"], r["rank"], r["node_id"], tuple(r["gpu_indices"]), r["epoch"],
            r["state"] == "live",
        )
        for r in rows
    }


async def audit_wrong_gpus(db: asyncpg.Pool | asyncpg.Connection, *, node_id: str, lease_id: str, job_id: str,
                           reported: Sequence[int], held: Sequence[int], actor: str) -> None:  # fmt: skip
    async with _transaction(db) as conn:
        await write_audit(
            conn, actor, "kill_wrong_gpus", job_id, "reconciliation: a rank runs on GPUs its lease does not hold",
            {"node": node_id, "lease_id": lease_id, "reported_gpus": list(reported), "lease_gpus": list(held)},
        )


async def job_attempts(db: asyncpg.Pool | asyncpg.Connection, job_ids: Sequence[str]) -> dict[str, tuple[str, int, Any]]:
    """job_id -> (state, attempt, started_at) for the failure -> restart clock."""
    rows = await db.fetch("SELECT job_id, state, attempt, started_at FROM jobs WHERE job_id = ANY($1::text[])", list(job_ids))
    return {r["job_id"]: (r["state"], r["attempt"], r["started_at"]) for r in rows}


__all__ = [
    "LeaseRow", "NodeRow", "agent_addrs", "audit_wrong_gpus", "job_attempts", "leases", "node_rows", "not_ready_rows",
    "return_node", "set_agent_addr", "set_node_state",
]
