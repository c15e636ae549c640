"""Agents' reports about ranks, durable until their job's workflow has them (docs/design.md, Reports).

    fresh = await store(pool, report)                 # a TaskStatus as JSON, before the agent is acknowledged
    rows = await undelivered(pool, skip_jobs=..., limit=500)
    await mark(pool, [row.id ...], "delivered")       # or "job_finished"
    await exits_for(pool, lease_ids)                 # leases whose end is on record
    await rank_ends(pool, job_id)                    # each rank's end in the newest attempt that has one
    await succeeded_attempt(conn, job_id, before=2, replicas=4)   # an earlier attempt whose every rank exited 0
    await succeeded_attempts(pool, [(job_id, 2, 4), ...])         # the same for many jobs, one query
    failing(ends)                                    # the rank whose end failed the attempt

A report stored twice (the agent sent it again) is one row: unique on (lease, epoch, state,
checkpoint). An exit 0 is stored under a share lock on its job's row, so it serializes with
the writes that lock that row to start or re-queue an attempt
(``store.allocations.commit_gang``, ``store.job_states.requeue_job``): each either sees the
exit or commits before it is on record. A terminal report carries the rank's cause (signal,
stderr tail: migration 0013); the newest attempt's ends that were not exit 0 are kept after
delivery, so a failed job says why long after its node is gone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from store.tx import Db, transaction

# the states that end a rank (common.contracts.TaskState's, spelled out: the store imports no Temporal)
TERMINAL_REPORTS = ("EXITED", "STOPPED", "FENCED", "LOST", "REJECTED")
TAIL_BYTES = 4096  # the agent's bound (worker_agent.exit_cause); enforced again here


@dataclass(frozen=True)
class RankEnd:
    """How one rank of an attempt ended, as its agent (or control, for LOST) reported it."""

    rank: int
    attempt: int
    lease_id: str
    node_id: str
    state: str  # EXITED | STOPPED | FENCED | LOST | REJECTED
    exit_code: int | None
    signal: int | None
    stderr_tail: str
    reason: str
    at: str | None  # when the agent saw it (ISO 8601, the agent's clock)
    received_at: datetime


@dataclass(frozen=True)
class StoredReport:
    id: int
    job_id: str
    report: dict[str, Any]  # the TaskStatus as received (control.report_delivery decodes it)


async def store(db: Db, report: dict[str, Any]) -> bool:
    """Record a report (committed when this returns); False when it was already on record.
    ``report``: a TaskStatus as JSON (lease_id, job_id, attempt, epoch, rank, node_id,
    state, exit_code, checkpoint_uri, ...)."""
    report = dict(report)
    tail = _bounded_tail(report.pop("stderr_tail", None))  # its own column, not twice
    sig = report.get("signal")
    if report["state"] == "EXITED" and report.get("exit_code") == 0:
        async with transaction(db) as conn:
            # a finished rank: serialize with a start or re-queue of the job (module docstring)
            await conn.execute("SELECT 1 FROM jobs WHERE job_id = $1 FOR SHARE", report["job_id"])
            return await _insert(conn, report, sig, tail)
    return await _insert(db, report, sig, tail)


async def _insert(db: Db, report: dict[str, Any], sig: Any, tail: str | None) -> bool:
    # received_at: when the row was written (under the lock, for an exit 0), not when its transaction began
    row_id = await db.fetchval(
        "INSERT INTO task_reports (lease_id, job_id, attempt, epoch, rank, node_id, state, exit_code,"
        " checkpoint_uri, report, signal, stderr_tail, received_at)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, clock_timestamp())"
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
        sig if isinstance(sig, int) else None,
        tail,
    )
    return row_id is not None


def _bounded_tail(tail: Any) -> str | None:
    """At most TAIL_BYTES of the end of the text, no NUL (Postgres text cannot hold one)."""
    if not isinstance(tail, str) or not tail:
        return None
    tail = tail.replace("\x00", "\ufffd")
    raw = tail.encode("utf-8", errors="replace")
    if len(raw) > TAIL_BYTES:
        tail = raw[-TAIL_BYTES:].decode("utf-8", errors="ignore")
    return tail


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
    """Forget delivered reports older than ``older_than_s``, except how each job's newest
    attempt that did not end well ended (the cause a user reads); returns how many."""
    status = await db.execute(
        "DELETE FROM task_reports t WHERE t.delivered_at IS NOT NULL"
        " AND t.delivered_at < now() - make_interval(secs => $1)"
        " AND NOT (t.state = ANY($2::text[]) AND (t.state <> 'EXITED' OR coalesce(t.exit_code, -1) <> 0)"
        "  AND t.attempt = (SELECT max(x.attempt) FROM task_reports x WHERE x.job_id = t.job_id"
        "   AND x.state = ANY($2::text[]) AND (x.state <> 'EXITED' OR coalesce(x.exit_code, -1) <> 0)))",
        older_than_s,
        list(TERMINAL_REPORTS),
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


async def succeeded_attempt(db: Db, job_id: str, *, before: int, replicas: int) -> int | None:
    """The newest attempt earlier than ``before`` whose every one of ``replicas`` ranks
    exited 0 (on record), or None: the job's work is done, whatever attempt it is on."""
    return (await succeeded_attempts(db, [(job_id, before, replicas)])).get(job_id)


async def succeeded_attempts(db: Db, asks: Sequence[tuple[str, int, int]]) -> dict[str, int]:
    """``succeeded_attempt`` for many jobs in one query, each ask (job, before, replicas):
    the jobs that have such an attempt, with the newest."""
    if not asks:
        return {}
    rows = await db.fetch(
        "SELECT q.job_id, done.attempt FROM unnest($1::text[], $2::int[], $3::int[]) AS q(job_id, before, replicas)"
        " CROSS JOIN LATERAL (SELECT attempt FROM task_reports t WHERE t.job_id = q.job_id AND t.attempt < q.before"
        "  AND t.state = 'EXITED' AND t.exit_code = 0 GROUP BY attempt HAVING count(DISTINCT rank) >= q.replicas"
        "  ORDER BY attempt DESC LIMIT 1) AS done",
        [a[0] for a in asks],
        [a[1] for a in asks],
        [a[2] for a in asks],
    )
    return {r["job_id"]: r["attempt"] for r in rows}


async def rank_ends(db: Db, job_id: str, attempt: int | None = None) -> list[RankEnd]:
    """Each rank's latest end in ``attempt`` (default: the newest attempt with any end on
    record), by rank."""
    rows = await db.fetch(
        "SELECT DISTINCT ON (rank) rank, attempt, lease_id, node_id, state, exit_code, signal, stderr_tail,"
        " report->>'reason' AS reason, report->>'at' AS at, received_at FROM task_reports"
        " WHERE job_id = $1 AND state = ANY($2::text[]) AND attempt = coalesce($3::int,"
        "  (SELECT max(attempt) FROM task_reports WHERE job_id = $1 AND state = ANY($2::text[])))"
        " ORDER BY rank, epoch DESC, id DESC",
        job_id,
        list(TERMINAL_REPORTS),
        attempt,
    )
    return [
        RankEnd(
            rank=r["rank"],
            attempt=r["attempt"],
            lease_id=r["lease_id"],
            node_id=r["node_id"],
            state=r["state"],
            exit_code=r["exit_code"],
            signal=r["signal"],
            stderr_tail=r["stderr_tail"] or "",
            reason=r["reason"] or "",
            at=r["at"],
            received_at=r["received_at"],
        )
        for r in rows
    ]


def failing(ends: Sequence[RankEnd]) -> RankEnd | None:
    """The rank whose end failed its attempt: the first (by the agents' clocks, then rank) to
    exit non-zero by itself; else the first lost, fenced or refused; else the first stopped
    (a cancel, a preemption). None when every rank exited 0."""

    def first(kind: Sequence[RankEnd]) -> RankEnd | None:
        return min(kind, key=lambda e: (e.at or "~", e.rank), default=None)

    return (
        first([e for e in ends if e.state == "EXITED" and e.exit_code != 0])
        or first([e for e in ends if e.state in ("LOST", "FENCED", "REJECTED")])
        or first([e for e in ends if e.state == "STOPPED"])
    )
