"""Teams and quotas: the admin's quota writes (audited, invariant 4) and the API's reads."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from placement.lifecycle import TERMINAL, JobState
from store.audit import write_audit
from store.jobs import CLASS_RANK_SQL
from store.tx import Db


@dataclass(frozen=True)
class TeamQuota:
    team: str
    gpu_type: str
    guaranteed: int
    borrow_limit: int


async def set_quota(conn: asyncpg.Connection, quota: TeamQuota, *, actor: str, reason: str) -> None:
    """Create the team if needed and set its quota for one GPU type, audited."""
    async with conn.transaction():
        await conn.execute("INSERT INTO teams (name) VALUES ($1) ON CONFLICT DO NOTHING", quota.team)
        await conn.execute("INSERT INTO gpu_types (name) VALUES ($1) ON CONFLICT DO NOTHING", quota.gpu_type)
        old = await conn.fetchrow(
            "SELECT guaranteed, borrow_limit FROM quotas WHERE team = $1 AND gpu_type = $2 FOR UPDATE",
            quota.team,
            quota.gpu_type,
        )
        await conn.execute(
            "INSERT INTO quotas (team, gpu_type, guaranteed, borrow_limit) VALUES ($1, $2, $3, $4)"
            " ON CONFLICT (team, gpu_type) DO UPDATE SET guaranteed = EXCLUDED.guaranteed,"
            " borrow_limit = EXCLUDED.borrow_limit, updated_at = now()",
            quota.team,
            quota.gpu_type,
            quota.guaranteed,
            quota.borrow_limit,
        )
        # Invariant 4: lowering a guarantee re-marks the team's newest allocations as borrowed.
        await conn.execute(
            "WITH ranked AS ("
            "  SELECT node_id, gpu_index, row_number() OVER (ORDER BY allocated_at, node_id, gpu_index) AS n"
            "  FROM allocations WHERE team = $1 AND gpu_type = $2)"
            " UPDATE allocations a SET borrowed = (r.n > $3) FROM ranked r"
            " WHERE a.node_id = r.node_id AND a.gpu_index = r.gpu_index AND a.borrowed <> (r.n > $3)",
            quota.team,
            quota.gpu_type,
            quota.guaranteed,
        )
        await write_audit(
            conn,
            actor,
            "quota_change",
            f"{quota.team}/{quota.gpu_type}",
            reason,
            {
                "old": dict(old) if old else None,
                "new": {"guaranteed": quota.guaranteed, "borrow_limit": quota.borrow_limit},
            },
        )


async def set_quotas(conn: asyncpg.Connection, changes: list[tuple[TeamQuota, str]], *, actor: str) -> None:
    """Several quotas (each with its reason) in one transaction: all or none, one audit row each."""
    async with conn.transaction():
        for quota, reason in changes:
            await set_quota(conn, quota, actor=actor, reason=reason)


@dataclass(frozen=True)
class Entitlement:
    """What a team may submit: ``priority_classes`` in class order, None for every class."""

    priority_classes: tuple[str, ...] | None


async def entitlement(db: Db, team: str) -> Entitlement | None:
    """The team's entitlement; None: no such team (one read serves both checks at submit)."""
    row = await db.fetchrow("SELECT priority_classes FROM teams WHERE name = $1", team)
    if row is None:
        return None
    classes = row["priority_classes"]
    return Entitlement(None if classes is None else tuple(classes))


async def set_priority_classes(
    conn: asyncpg.Connection, team: str, classes: tuple[str, ...] | None, *, actor: str, reason: str
) -> bool:
    """Set the classes an existing team may submit in (None: every class), audited with the
    old and new sets; False: no such team. Jobs already queued keep their class; admission
    checks new submissions."""
    async with conn.transaction():
        old = await conn.fetchrow("SELECT priority_classes FROM teams WHERE name = $1 FOR UPDATE", team)
        if old is None:
            return False
        await conn.execute("UPDATE teams SET priority_classes = $2 WHERE name = $1", team, classes)
        await write_audit(
            conn,
            actor,
            "priority_classes_change",
            team,
            reason,
            {
                "old": None if old["priority_classes"] is None else list(old["priority_classes"]),
                "new": None if classes is None else list(classes),
            },
        )
    return True


# the states a team's jobs are counted in (every state that is not terminal)
LIVE_STATES = tuple(s.value for s in JobState if s not in TERMINAL)


async def team_exists(db: Db, team: str) -> bool:
    return bool(await db.fetchval("SELECT 1 FROM teams WHERE name = $1", team))


async def get_quota(db: Db, team: str, gpu_type: str) -> asyncpg.Record | None:
    return await db.fetchrow(
        "SELECT guaranteed, borrow_limit FROM quotas WHERE team = $1 AND gpu_type = $2", team, gpu_type
    )


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


async def team_queue(
    db: Db, team: str, *, after: tuple[int, int, datetime, str] | None, limit: int
) -> list[asyncpg.Record]:
    """Queued jobs of a team in queue order: published position first (unranked last),
    then class, then submit time."""
    args: list[Any] = [team]
    where = "team = $1 AND state = 'QUEUED'"
    key = (
        "coalesce(queue_position, 2147483647), "
        + CLASS_RANK_SQL.format(col="priority_class")
        + ", submitted_at, job_id"
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
