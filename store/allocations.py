"""Allocations and leases: the invariant-bearing writes (invariants 1, 2, 4 and 7).

* ``commit_gang`` - every allocation row and lease of a gang in one transaction, or
  none; the leader epoch is checked in it; guaranteed usage is held within the
  guarantee; audit and job_events rows are written with the change; an attempt is never
  started when an earlier one had finished (every rank's exit 0 on record).
* ``release_lease`` / ``release_job`` - free GPUs, keyed by lease id (and optionally
  epoch), never by GPU, so a stale "task exited" cannot free a newer lease on the
  same GPU.
* ``relabel_jobs`` - the leader re-marks running jobs borrowed or guaranteed, a cycle's
  relabels in one transaction.
* reads of live leases: the gang of one attempt (``live_gang``), which of a set of
  leases are still live (``live_lease_ids``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from store import task_reports
from store.audit import write_audit, write_audits, write_job_event
from store.errors import (
    AllocationConflict,
    EarlierAttemptSucceeded,
    JobStateConflict,
    QuotaExceeded,
    UnknownSubject,
)
from store.leadership import check_epoch
from store.tx import Db, transaction


@dataclass(frozen=True)
class GangPlacement:
    """One replica of a gang: its rank, node, GPUs and whether they are borrowed."""

    rank: int
    node_id: str
    gpu_indices: tuple[int, ...]
    borrowed: bool


def lease_id_for(job_id: str, attempt: int, rank: int) -> str:
    """Lease ids are derived, not random: a retried commit names the same lease."""
    return f"{job_id}.a{attempt}.r{rank}"


async def commit_gang(
    db: Db,
    *,
    scope: str,
    epoch: int,
    job_id: str,
    attempt: int,
    placements: Sequence[GangPlacement],
    actor: str = "placement",
    reason: str = "scheduled",
) -> list[str]:
    """Commit a whole gang in one transaction; return its lease ids.

    Moves the job QUEUED -> STARTING. Raises AllocationConflict, StaleEpoch,
    QuotaExceeded, JobStateConflict or EarlierAttemptSucceeded, and then nothing is written.
    """
    if not placements:
        raise ValueError("a gang has at least one placement")
    ranks = sorted(p.rank for p in placements)
    if ranks != list(range(len(placements))):
        raise ValueError(f"ranks must be 0..{len(placements) - 1}, got {ranks}")
    async with transaction(db) as conn:
        await check_epoch(conn, scope, epoch)
        job = await conn.fetchrow(
            "SELECT team, gpu_type, state, attempt, replicas FROM jobs WHERE job_id = $1 FOR UPDATE", job_id
        )
        if job is None:
            raise UnknownSubject(f"no job {job_id}")
        if job["state"] != "QUEUED" or job["attempt"] != attempt:
            raise JobStateConflict(
                f"job {job_id} is {job['state']} attempt {job['attempt']}, expected QUEUED attempt {attempt}"
            )
        # the row lock above orders this read after any exit 0 already being stored (task_reports.store)
        done = await task_reports.succeeded_attempt(conn, job_id, before=attempt, replicas=job["replicas"])
        if done is not None:
            # its exits came after it was re-queued: the job's workflow is told so by report delivery
            raise EarlierAttemptSucceeded(
                f"job {job_id} attempt {done} had exited 0 on every rank: not starting {attempt}"
            )
        team, gpu_type = job["team"], job["gpu_type"]
        # Lock the quota row first: concurrent commits for one team serialize here,
        # so the usage sum below cannot be raced.
        quota = await conn.fetchrow(
            "SELECT guaranteed, borrow_limit FROM quotas WHERE team = $1 AND gpu_type = $2 FOR UPDATE",
            team,
            gpu_type,
        )
        if quota is None:
            raise QuotaExceeded(f"team {team} has no {gpu_type} quota")
        lease_ids: list[str] = []
        try:
            for p in sorted(placements, key=lambda p: p.rank):
                lease_id = lease_id_for(job_id, attempt, p.rank)
                await conn.execute(
                    "INSERT INTO leases (lease_id, job_id, attempt, rank, node_id, gpu_indices, epoch)"
                    " VALUES ($1, $2, $3, $4, $5, $6, $7)",
                    lease_id,
                    job_id,
                    attempt,
                    p.rank,
                    p.node_id,
                    list(p.gpu_indices),
                    epoch,
                )
                await conn.executemany(
                    "INSERT INTO allocations (node_id, gpu_index, lease_id, job_id, team, gpu_type, borrowed)"
                    " VALUES ($1, $2, $3, $4, $5, $6, $7)",
                    [(p.node_id, g, lease_id, job_id, team, gpu_type, p.borrowed) for g in p.gpu_indices],
                )
                lease_ids.append(lease_id)
        except asyncpg.UniqueViolationError as e:
            raise AllocationConflict(f"gang for {job_id} attempt {attempt} conflicts: {e.detail or e}") from e
        except asyncpg.ForeignKeyViolationError as e:
            raise UnknownSubject(f"gang for {job_id} names an unknown node: {e.detail or e}") from e
        usage = await conn.fetchrow(
            "SELECT count(*) FILTER (WHERE NOT borrowed) AS guaranteed,"
            "       count(*) FILTER (WHERE borrowed) AS borrowed"
            " FROM allocations WHERE team = $1 AND gpu_type = $2",
            team,
            gpu_type,
        )
        if usage["guaranteed"] > quota["guaranteed"]:
            raise QuotaExceeded(
                f"team {team} would use {usage['guaranteed']} guaranteed {gpu_type} GPUs"
                f" (guarantee {quota['guaranteed']})"
            )
        if usage["borrowed"] > quota["borrow_limit"]:
            raise QuotaExceeded(
                f"team {team} would borrow {usage['borrowed']} {gpu_type} GPUs (limit {quota['borrow_limit']})"
            )
        await conn.execute(
            "UPDATE jobs SET state = 'STARTING', queue_position = NULL, pending_reason = NULL,"
            " pending_detail = NULL, expected_start = NULL, updated_at = now() WHERE job_id = $1",
            job_id,
        )
        detail = {
            "attempt": attempt,
            "epoch": epoch,
            "placements": [
                {"rank": p.rank, "node": p.node_id, "gpus": list(p.gpu_indices), "borrowed": p.borrowed}
                for p in placements
            ],
        }
        await write_job_event(conn, job_id, attempt, "allocated", "QUEUED", "STARTING", actor, reason, detail)
        await write_audit(conn, actor, "allocate", job_id, reason, detail)
        return lease_ids


async def release_lease(
    db: Db,
    lease_id: str,
    *,
    reason: str,
    actor: str,
    epoch: int | None = None,
) -> bool:
    """Release one lease and its GPUs. Returns False if it was not live (idempotent).

    With ``epoch``, only a lease of that epoch is released: a stale report can
    never free a newer lease that reuses the same GPUs.
    """
    async with transaction(db) as conn:
        row = await conn.fetchrow(
            "UPDATE leases SET state = 'released', released_at = now(), release_reason = $2"
            " WHERE lease_id = $1 AND state = 'live' AND ($3::bigint IS NULL OR epoch = $3)"
            " RETURNING job_id, node_id, gpu_indices, attempt",
            lease_id,
            reason,
            epoch,
        )
        if row is None:
            return False
        await conn.execute("DELETE FROM allocations WHERE lease_id = $1", lease_id)
        await write_audit(
            conn,
            actor,
            "release",
            row["job_id"],
            reason,
            {"lease_id": lease_id, "node": row["node_id"], "gpus": list(row["gpu_indices"]), "attempt": row["attempt"]},
        )
        return True


async def release_job(
    db: Db,
    job_id: str,
    attempt: int,
    *,
    reason: str,
    actor: str,
) -> int:
    """Release every live lease of one attempt of a job; return how many."""
    async with transaction(db) as conn:
        rows = await conn.fetch(
            "UPDATE leases SET state = 'released', released_at = now(), release_reason = $3"
            " WHERE job_id = $1 AND attempt = $2 AND state = 'live' RETURNING lease_id, node_id, gpu_indices",
            job_id,
            attempt,
            reason,
        )
        if not rows:
            return 0
        await conn.execute("DELETE FROM allocations WHERE lease_id = ANY($1::text[])", [r["lease_id"] for r in rows])
        await write_audit(
            conn,
            actor,
            "release",
            job_id,
            reason,
            {
                "attempt": attempt,
                "leases": [
                    {"lease_id": r["lease_id"], "node": r["node_id"], "gpus": list(r["gpu_indices"])} for r in rows
                ],
            },
        )
        return len(rows)


async def relabel_jobs(
    db: Db, *, scope: str, epoch: int, relabels: Sequence[tuple[str, bool]], actor: str = "placement"
) -> list[int]:
    """Invariant 4: re-mark running jobs' allocations borrowed (or guaranteed), each relabel
    (job, borrowed), in one transaction under the leader's epoch: one statement re-marks
    every job's rows, one round trip writes an audit row per job that changed. Returns the
    rows changed per relabel, in order (a job named twice: the last one applies, the first
    reports 0)."""
    if not relabels:
        return []
    last = {job_id: i for i, (job_id, _) in enumerate(relabels)}
    applied = [(job_id, b) for i, (job_id, b) in enumerate(relabels) if last[job_id] == i]
    async with transaction(db) as conn:
        await check_epoch(conn, scope, epoch)
        rows = await conn.fetch(
            "UPDATE allocations a SET borrowed = u.borrowed"
            " FROM unnest($1::text[], $2::bool[]) AS u(job_id, borrowed)"
            " WHERE a.job_id = u.job_id AND a.borrowed <> u.borrowed"
            " RETURNING a.job_id",
            [j for j, _ in applied],
            [b for _, b in applied],
        )
        changed: dict[str, int] = {}
        for r in rows:
            changed[r["job_id"]] = changed.get(r["job_id"], 0) + 1
        await write_audits(
            conn,
            [
                (actor, "relabel", j, "quota re-check", {"borrowed": b, "gpus": changed[j], "epoch": epoch})
                for j, b in applied
                if j in changed
            ],
        )
    return [changed.get(j, 0) if last[j] == i else 0 for i, (j, _) in enumerate(relabels)]


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


async def lease_rows(db: Db, lease_ids: Sequence[str]) -> dict[str, LeaseRow]:
    """The rows of these leases, live or not (unknown ids are left out)."""
    rows = await db.fetch(
        "SELECT lease_id, job_id, attempt, rank, node_id, gpu_indices, epoch, state FROM leases"
        " WHERE lease_id = ANY($1::text[])",
        list(lease_ids),
    )
    return {
        r["lease_id"]: LeaseRow(
            r["lease_id"],
            r["job_id"],
            r["attempt"],
            r["rank"],
            r["node_id"],
            tuple(r["gpu_indices"]),
            r["epoch"],
            r["state"] == "live",
        )
        for r in rows
    }


async def live_gang(db: Db, job_id: str, attempt: int) -> list[asyncpg.Record]:
    """The live leases of one attempt in rank order, each with its node's task queue and
    agent address (what a StartTask needs)."""
    return list(
        await db.fetch(
            "SELECT l.lease_id, l.rank, l.node_id, l.gpu_indices, l.epoch, n.task_queue, n.agent_addr"
            " FROM leases l JOIN nodes n USING (node_id)"
            " WHERE l.job_id = $1 AND l.attempt = $2 AND l.state = 'live' ORDER BY l.rank",
            job_id,
            attempt,
        )
    )


async def live_lease_nodes(db: Db, lease_ids: Sequence[str]) -> dict[str, str]:
    """The live ones of ``lease_ids``, each with the node that holds it."""
    rows = await db.fetch(
        "SELECT lease_id, node_id FROM leases WHERE lease_id = ANY($1::text[]) AND state = 'live'", list(lease_ids)
    )
    return {r["lease_id"]: r["node_id"] for r in rows}
