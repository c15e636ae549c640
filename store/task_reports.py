"""Agents' reports about ranks, durable until their job's workflow has them (docs/design.md, Reports).

    fresh = await store(pool, report)                 # a TaskStatus as JSON, before the agent is acknowledged
    rows = await undelivered(pool, skip_jobs=..., limit=500)
    await mark(pool, [row.id ...], "delivered")       # or "job_finished"
    await exits_for(pool, lease_ids)                 # leases whose end is on record

A report stored twice (the agent sent it again) is one row: unique on (lease, epoch, state,
checkpoint).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from store.tx import Db

# the states that end a rank (common.contracts.TaskState's, spelled out: the store imports no Temporal)
TERMINAL_REPORTS = ("EXITED", "STOPPED", "FENCED", "LOST", "REJECTED")


@dataclass(frozen=True)
class StoredReport:
    id: int
    job_id: str
    report: dict[str, Any]  # the TaskStatus as received (control.report_delivery decodes it)


async def store(db: Db, report: dict[str, Any]) -> bool:
    """Record a report (one statement, so it is durable when this returns); False when it
    was already on record. ``report``: a TaskStatus as JSON (lease_id, job_id, attempt,
    epoch, rank, node_id, state, exit_code, checkpoint_uri, ...)."""
    row_id = await db.fetchval(
        "INSERT INTO task_reports (lease_id, job_id, attempt, epoch, rank, node_id, state, exit_code,"
        " checkpoint_uri, report) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)"
        " ON CONFLICT (lease_id, epoch, state, coalesce(checkpoint_uri, '')) DO NOTHING RETURNING id",
        report["lease_id"],
        report["job_id"],
        report["attempt"],
        report["epoch"],
        report["rank"],
        report["node_id"],
        report["state"],
        report.get("exit_code"),
        report.get("checkpoint_uri"),
        report,
    )
    return row_id is not None


async def undelivered(db: Db, *, skip_jobs: Sequence[str] = (), limit: int = 1000) -> list[StoredReport]:
    """The oldest reports not yet delivered, in the order they arrived, leaving out ``skip_jobs``."""
    rows = await db.fetch(
        "SELECT id, report FROM task_reports WHERE delivered_at IS NULL AND NOT (job_id = ANY($1::text[]))"
        " ORDER BY id LIMIT $2",
        list(skip_jobs),
        limit,
    )
    return [StoredReport(r["id"], r["report"]["job_id"], r["report"]) for r in rows]


async def mark(db: Db, ids: Sequence[int], outcome: str) -> None:
    """``delivered``: in the workflow's history; ``job_finished``: the job ended, nobody needs it."""
    await db.execute(
        "UPDATE task_reports SET delivered_at = now(), outcome = $2 WHERE id = ANY($1::bigint[])"
        " AND delivered_at IS NULL",
        list(ids),
        outcome,
    )


async def exits_for(db: Db, lease_ids: Sequence[str]) -> set[str]:
    """The leases among ``lease_ids`` whose rank's end (exit, stop, fence, loss) is on record."""
    rows = await db.fetch(
        "SELECT DISTINCT lease_id FROM task_reports WHERE lease_id = ANY($1::text[]) AND state = ANY($2::text[])",
        list(lease_ids),
        list(TERMINAL_REPORTS),
    )
    return {r["lease_id"] for r in rows}


async def prune(db: Db, *, older_than_s: float) -> int:
    """Forget delivered reports older than ``older_than_s``; returns how many."""
    status = await db.execute(
        "DELETE FROM task_reports WHERE delivered_at IS NOT NULL AND delivered_at < now() - make_interval(secs => $1)",
        older_than_s,
    )
    return int(status.split()[-1])


async def ranks_exited_ok(db: Db, job_id: str, attempt: int) -> int:
    """How many ranks of the attempt reported an exit 0."""
    return await db.fetchval(
        "SELECT count(DISTINCT rank) FROM task_reports WHERE job_id = $1 AND attempt = $2"
        " AND state = 'EXITED' AND exit_code = 0",
        job_id,
        attempt,
    )
