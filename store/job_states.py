"""Job state writes (docs/design.md, Job lifecycle), one transaction each.

Every state change writes its ``job_events`` row in the same transaction, and every
release / preemption / cancel / extension its ``audit`` row (invariant 7). Writes
are guarded by the attempt (and, for the leader's writes, the fencing epoch via
``store.leadership.check_epoch``) and are idempotent: re-applying a transition that
is already done is a no-op that reports where the job stands, so a retried activity
or a duplicate signal never applies twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import asyncpg

from placement.lifecycle import TERMINAL, JobState
from store import task_reports
from store.allocations import lease_id_for, release_job
from store.audit import JobEvent, write_audit, write_audits, write_job_event, write_job_events
from store.errors import UnknownSubject
from store.leadership import check_epoch
from store.tx import Db, transaction

AVOID_NODES_KEPT = 8  # jobs.avoid_nodes: the newest nodes a job's attempts failed on


@dataclass(frozen=True)
class Outcome:
    applied: bool
    state: str
    attempt: int
    released: int = 0
    extra: Mapping[str, Any] | None = None


async def _lock(conn: asyncpg.Connection, job_id: str) -> asyncpg.Record:
    row = await conn.fetchrow(
        "SELECT job_id, team, state, attempt, started_at, max_runtime_s, extended_s, extensions,"
        " last_checkpoint, priority_class, replicas FROM jobs WHERE job_id = $1 FOR UPDATE",
        job_id,
    )
    if row is None:
        raise UnknownSubject(f"no job {job_id}")
    return row


async def mark_running(db: Db, job_id: str, attempt: int, *, actor: str, epoch: int | None = None) -> Outcome:
    """STARTING -> RUNNING once every rank has started. Anything else reports the state."""
    async with transaction(db) as conn:
        job = await _lock(conn, job_id)
        if job["attempt"] != attempt or job["state"] != JobState.STARTING:
            return Outcome(job["state"] == JobState.RUNNING and job["attempt"] == attempt, job["state"], job["attempt"])
        await conn.execute(
            "UPDATE jobs SET state = 'RUNNING', started_at = now(), front_of_class = false, updated_at = now()"
            " WHERE job_id = $1",
            job_id,
        )
        await write_job_event(
            conn,
            job_id,
            attempt,
            "running",
            JobState.STARTING,
            JobState.RUNNING,
            actor,
            "every rank started",
            {"epoch": epoch},
        )
        return Outcome(True, JobState.RUNNING, attempt)


async def mark_cancelling(db: Db, job_id: str, attempt: int, *, actor: str, reason: str) -> Outcome:
    """STARTING / RUNNING / PREEMPTING -> CANCELLING (ranks are being stopped), audited as a cancel."""
    async with transaction(db) as conn:
        job = await _lock(conn, job_id)
        if job["attempt"] != attempt or job["state"] not in (JobState.STARTING, JobState.RUNNING, JobState.PREEMPTING):
            return Outcome(False, job["state"], job["attempt"])
        await conn.execute("UPDATE jobs SET state = 'CANCELLING', updated_at = now() WHERE job_id = $1", job_id)
        await write_job_event(
            conn, job_id, attempt, "cancel_requested", job["state"], JobState.CANCELLING, actor, reason
        )
        await write_audit(conn, actor, "cancel", job_id, reason, {"attempt": attempt, "from_state": job["state"]})
        return Outcome(True, JobState.CANCELLING, attempt)


_FINISH_EVENT: dict[str, str] = {
    JobState.SUCCEEDED: "succeeded",
    JobState.FAILED: "failed",
    JobState.CANCELLED: "cancelled",
    JobState.TIMED_OUT: "timed_out",
}


async def finish_job(
    db: Db,
    job_id: str,
    attempt: int,
    to_state: str,
    *,
    actor: str,
    reason: str,
    exit_code: int | None = None,
    checkpoint_uri: str | None = None,
) -> Outcome:
    """Any non-terminal state of this attempt -> a terminal state, releasing every live
    lease of the attempt in the same transaction. A job already terminal is left alone."""
    if to_state not in TERMINAL:
        raise ValueError(f"{to_state} is not terminal")
    async with transaction(db) as conn:
        job = await _lock(conn, job_id)
        if job["state"] in TERMINAL:
            return Outcome(job["state"] == to_state, job["state"], job["attempt"])
        if job["attempt"] != attempt:
            return Outcome(False, job["state"], job["attempt"])
        return await _finish_locked(conn, job, attempt, to_state, actor, reason, exit_code, checkpoint_uri)


async def _finish_locked(
    conn: Any,
    job: Any,
    attempt: int,
    to_state: str,
    actor: str,
    reason: str,
    exit_code: int | None,
    checkpoint_uri: str | None,
) -> Outcome:
    """The terminal change itself, inside the caller's transaction with the job row locked."""
    job_id = job["job_id"]
    if to_state == JobState.CANCELLED and job["state"] != JobState.CANCELLING:
        # a cancel from QUEUED/STARTING is audited here (from CANCELLING it already was)
        await write_audit(conn, actor, "cancel", job_id, reason, {"attempt": attempt, "from_state": job["state"]})
    elif to_state == JobState.TIMED_OUT:
        await write_audit(conn, actor, "timeout", job_id, reason, {"attempt": attempt})
    released = await release_job(conn, job_id, attempt, reason=to_state.lower(), actor=actor)
    await conn.execute(
        "UPDATE jobs SET state = $2, finished_at = now(), exit_code = $3,"
        " last_checkpoint = COALESCE($4, last_checkpoint),"
        " last_checkpoint_at = CASE WHEN $4::text IS NULL THEN last_checkpoint_at ELSE now() END,"
        " queue_position = NULL, pending_reason = NULL, pending_detail = NULL, expected_start = NULL,"
        " updated_at = now() WHERE job_id = $1",
        job_id,
        to_state,
        exit_code,
        checkpoint_uri,
    )
    detail = {"exit_code": exit_code, "released": released}
    await write_job_event(conn, job_id, attempt, _FINISH_EVENT[to_state], job["state"], to_state, actor, reason, detail)
    return Outcome(True, to_state, attempt, released)


async def requeue_job(
    db: Db,
    job_id: str,
    attempt: int,
    *,
    cause: str,
    reason: str,
    actor: str,
    job_fault: bool = False,
    checkpoint_uri: str | None = None,
    max_failed_attempts: int = 3,
    failure_window_s: float = 86400.0,
) -> Outcome:
    """End attempt ``attempt`` without finishing the job: release its gang and queue
    attempt + 1 keeping the original submit time (a failed attempt goes to the front of
    its class), or FAILED once the job itself caused ``max_failed_attempts`` failures
    within ``failure_window_s``. Idempotent: a job already past ``attempt`` is left alone."""
    if cause not in ("preempted", "failed"):
        raise ValueError(f"unknown requeue cause {cause!r}")
    async with transaction(db) as conn:
        job = await _lock(conn, job_id)
        if job["attempt"] > attempt:
            # already re-queued (a retried activity): report it as such, whatever came since
            return Outcome(True, JobState.QUEUED, job["attempt"], extra={"resume_from": job["last_checkpoint"]})
        if job["state"] in TERMINAL or job["attempt"] != attempt:
            return Outcome(False, job["state"], job["attempt"], extra={"resume_from": job["last_checkpoint"]})
        if await task_reports.ranks_exited_ok(conn, job_id, attempt) >= job["replicas"]:
            # every rank had exited 0 by itself: the work is done, whatever the workflow was
            # ending the attempt for (its exit reports reached the store first)
            why = f"every rank had exited 0 (on record) while the attempt was being ended: {reason}"
            o = await _finish_locked(conn, job, attempt, JobState.SUCCEEDED, actor, why[:500], 0, checkpoint_uri)
            return Outcome(o.applied, o.state, o.attempt, o.released, {"resume_from": job["last_checkpoint"]})
        from_state = job["state"]
        released = await release_job(
            conn, job_id, attempt, reason="preempted" if cause == "preempted" else "attempt_failed", actor=actor
        )
        resume_from = checkpoint_uri or job["last_checkpoint"]
        avoid_node = None
        if cause == "failed":
            # the failing rank's report is on record (the workflow learned of the failure from it)
            culprit = task_reports.failing(await task_reports.rank_ends(conn, job_id, attempt))
            if culprit is not None and culprit.state != "STOPPED":  # a stop is ours, not the node's
                avoid_node = culprit.node_id
            await write_job_event(
                conn,
                job_id,
                attempt,
                "attempt_failed",
                None,
                None,
                actor,
                reason,
                {"job_fault": job_fault, "released": released}
                | ({"failed_on": avoid_node, "rank": culprit.rank} if avoid_node and culprit else {}),
            )
            faults = await job_faults_within(conn, job_id, failure_window_s)
            if job_fault and faults >= max_failed_attempts:
                # the job's exit code is the failing rank's
                await conn.execute(
                    "UPDATE jobs SET state = 'FAILED', finished_at = now(), failed_attempts = failed_attempts + 1,"
                    " last_checkpoint = $2, exit_code = $3, updated_at = now() WHERE job_id = $1",
                    job_id,
                    resume_from,
                    culprit.exit_code if culprit is not None else None,
                )
                await write_job_event(
                    conn,
                    job_id,
                    attempt,
                    "failed",
                    from_state,
                    JobState.FAILED,
                    actor,
                    f"{faults} failed attempts caused by the job within {failure_window_s:.0f}s: {reason}",
                )
                return Outcome(True, JobState.FAILED, attempt, released, {"resume_from": resume_from})
        await conn.execute(
            "UPDATE jobs SET state = 'QUEUED', attempt = attempt + 1, queued_at = now(),"
            " front_of_class = $2, failed_attempts = failed_attempts + $3::int,"
            " last_checkpoint = $4,"
            " last_checkpoint_at = CASE WHEN $5::text IS NULL THEN last_checkpoint_at ELSE now() END,"
            # the newest AVOID_NODES_KEPT nodes its attempts failed on, this one's last
            " avoid_nodes = CASE WHEN $6::text IS NULL THEN avoid_nodes ELSE"
            "  (array_remove(avoid_nodes, $6::text) || $6::text)"
            "  [greatest(1, cardinality(array_remove(avoid_nodes, $6::text)) + 2 - $7::int):] END,"
            " started_at = NULL, updated_at = now() WHERE job_id = $1",
            job_id,
            cause == "failed",
            1 if (cause == "failed" and job_fault) else 0,
            resume_from,
            checkpoint_uri,
            avoid_node,
            AVOID_NODES_KEPT,
        )
        await write_job_event(
            conn,
            job_id,
            attempt + 1,
            "requeued",
            from_state,
            JobState.QUEUED,
            actor,
            reason,
            {"cause": cause, "previous_attempt": attempt, "resume_from": resume_from, "job_fault": job_fault},
        )
        return Outcome(True, JobState.QUEUED, attempt + 1, released, {"resume_from": resume_from})


async def job_faults_within(db: Db, job_id: str, window_s: float) -> int:
    """Attempts the job itself failed within ``window_s``: what ``max_failed_attempts`` counts."""
    return await db.fetchval(
        "SELECT count(*) FROM job_events WHERE job_id = $1 AND event = 'attempt_failed'"
        " AND (detail->>'job_fault')::boolean AND at > now() - make_interval(secs => $2)",
        job_id,
        window_s,
    )


_END_EVENTS = ["attempt_failed", "requeued", "failed", "cancelled", "timed_out", "succeeded"]


async def last_attempt_end(db: Db, job_id: str) -> asyncpg.Record | None:
    """The newest event that ended an attempt or the job (attempt, event, reason, detail,
    actor, at): why the latest attempt stopped running."""
    return await db.fetchrow(
        "SELECT attempt, event, reason, detail, actor, at FROM job_events WHERE job_id = $1"
        " AND event = ANY($2::text[]) ORDER BY id DESC LIMIT 1",
        job_id,
        _END_EVENTS,
    )


async def extend_job(
    db: Db,
    job_id: str,
    attempt: int,
    seconds: float,
    *,
    actor: str,
    reason: str,
    running_since: datetime,
    max_extensions: int,
    max_fraction: float,
    request_id: str = "",
) -> dict[str, Any]:
    """Grant or refuse a runtime extension; either way it is audited and evented.

    Refused when: the job is not RUNNING; it already has ``max_extensions``; the
    extension exceeds ``max_fraction`` of the original max_runtime; or the new end
    would pass the expected start of a reservation on any node the job holds."""
    async with transaction(db) as conn:
        job = await _lock(conn, job_id)
        if request_id:
            done = await conn.fetchval(
                "SELECT detail FROM job_events WHERE job_id = $1 AND event IN ('extended', 'extension_refused')"
                " AND detail->>'request_id' = $2 ORDER BY id DESC LIMIT 1",
                job_id,
                request_id,
            )
            if done is not None:  # a retried request: the first answer stands
                return {
                    "granted": done["code"] == "granted",
                    "code": done["code"],
                    "message": done["message"],
                    "new_deadline": datetime.fromisoformat(done["new_deadline"]) if done.get("new_deadline") else None,
                    "extensions_used": done["extensions"],
                }
        original = job["max_runtime_s"] - job["extended_s"]
        new_runtime = job["max_runtime_s"] + seconds
        code, message = "granted", f"extended by {seconds:.0f}s"
        new_deadline = None
        if job["state"] != JobState.RUNNING or job["attempt"] != attempt:
            code, message = "not_running", f"job is {job['state']}"
        elif job["extensions"] >= max_extensions:
            code, message = "too_many", f"at most {max_extensions} extensions per job"
        elif seconds <= 0 or seconds > max_fraction * original + 1e-9:
            code, message = "too_long", f"each extension is at most {max_fraction:.0%} of {original:.0f}s"
        else:
            new_deadline = await conn.fetchval(
                "SELECT $1::timestamptz + make_interval(secs => $2)", running_since, new_runtime
            )
            blocking = await conn.fetchrow(
                "SELECT r.job_id, r.expected_start FROM reservations r"
                " WHERE r.job_id <> $1 AND r.expected_start IS NOT NULL AND r.expected_start < $2"
                "   AND (r.nodes && (SELECT coalesce(array_agg(DISTINCT l.node_id), '{}') FROM leases l"
                "                    WHERE l.job_id = $1 AND l.state = 'live')"
                "     OR r.blocks && (SELECT coalesce(array_agg(DISTINCT n.block_id), '{}') FROM leases l"
                "                     JOIN nodes n USING (node_id) WHERE l.job_id = $1 AND l.state = 'live'))"
                " ORDER BY r.expected_start LIMIT 1",
                job_id,
                new_deadline,
            )
            if blocking is not None:
                code = "delays_reservation"
                message = f"would delay the reservation of {blocking['job_id']} (expected start {blocking['expected_start'].isoformat()})"
                new_deadline = None
        granted = code == "granted"
        extensions = job["extensions"] + (1 if granted else 0)
        detail = {
            "seconds": seconds,
            "code": code,
            "message": message,
            "extensions": extensions,
            "request_id": request_id,
            "new_deadline": new_deadline.isoformat() if new_deadline else None,
        }
        if granted:
            await conn.execute(
                "UPDATE jobs SET max_runtime_s = max_runtime_s + $2, extended_s = extended_s + $2,"
                " extensions = extensions + 1, updated_at = now() WHERE job_id = $1",
                job_id,
                seconds,
            )
            detail["max_runtime_s"] = new_runtime
        await write_job_event(
            conn,
            job_id,
            job["attempt"],
            "extended" if granted else "extension_refused",
            job["state"],
            job["state"],
            actor,
            reason or message,
            detail,
        )
        await write_audit(conn, actor, "extend" if granted else "extend_refused", job_id, reason or message, detail)
        return {
            "granted": granted,
            "code": code,
            "message": message,
            "new_deadline": new_deadline,
            "extensions_used": extensions,
        }


async def restart_replica(
    db: Db,
    job_id: str,
    attempt: int,
    rank: int,
    failed_lease_id: str,
    *,
    actor: str,
    reason: str,
) -> asyncpg.Record | None:
    """prod-serving: hand a failed replica's GPUs to a fresh lease of the same rank, in one
    transaction (its allocation rows move; no moment where the GPUs are free). Returns the
    new lease row, or None when the job/attempt/rank no longer holds a live lease.
    Idempotent: when the rank's live lease is no longer ``failed_lease_id`` it was already
    replaced (a retried activity), and that lease is returned."""
    async with transaction(db) as conn:
        job = await _lock(conn, job_id)
        if job["attempt"] != attempt or job["state"] not in (JobState.STARTING, JobState.RUNNING):
            return None
        old = await conn.fetchrow(
            "SELECT * FROM leases WHERE job_id = $1 AND attempt = $2 AND rank = $3 AND state = 'live' FOR UPDATE",
            job_id,
            attempt,
            rank,
        )
        if old is None:
            return None
        if old["lease_id"] != failed_lease_id:
            return await conn.fetchrow(  # already replaced (a retried activity)
                "SELECT l.*, n.task_queue FROM leases l JOIN nodes n USING (node_id) WHERE l.lease_id = $1",
                old["lease_id"],
            )
        generation = await conn.fetchval(
            "SELECT count(*) FROM leases WHERE job_id = $1 AND attempt = $2 AND rank = $3", job_id, attempt, rank
        )
        new_id = f"{lease_id_for(job_id, attempt, rank)}.g{generation}"
        rows = await conn.fetch(
            "DELETE FROM allocations WHERE lease_id = $1 RETURNING node_id, gpu_index, team, gpu_type, borrowed",
            old["lease_id"],
        )
        await conn.execute(
            "UPDATE leases SET state = 'released', released_at = now(), release_reason = 'replica restart'"
            " WHERE lease_id = $1",
            old["lease_id"],
        )
        await conn.execute(
            "INSERT INTO leases (lease_id, job_id, attempt, rank, node_id, gpu_indices, epoch)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7)",
            new_id,
            job_id,
            attempt,
            rank,
            old["node_id"],
            old["gpu_indices"],
            old["epoch"],
        )
        await conn.executemany(
            "INSERT INTO allocations (node_id, gpu_index, lease_id, job_id, team, gpu_type, borrowed)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7)",
            [(r["node_id"], r["gpu_index"], new_id, job_id, r["team"], r["gpu_type"], r["borrowed"]) for r in rows],
        )
        await write_audit(
            conn,
            actor,
            "restart_replica",
            job_id,
            reason,
            {
                "attempt": attempt,
                "rank": rank,
                "old_lease": old["lease_id"],
                "new_lease": new_id,
                "node": old["node_id"],
                "gpus": list(old["gpu_indices"]),
            },
        )
        return await conn.fetchrow(
            "SELECT l.*, n.task_queue FROM leases l JOIN nodes n USING (node_id) WHERE l.lease_id = $1", new_id
        )


@dataclass(frozen=True, slots=True)
class PreemptMark:
    """One victim for ``mark_preempting_many``: its attempt, why, and for which job."""

    job_id: str
    attempt: int
    reason: str
    by_job: str | None


async def mark_preempting_many(
    db: Db, *, scope: str, epoch: int, marks: Sequence[PreemptMark], actor: str = "placement"
) -> list[Outcome]:
    """STARTING / RUNNING -> PREEMPTING under the leader's epoch, audited as a preemption, for
    a cycle's victims in one transaction (one outcome per mark, in order). Already PREEMPTING
    for the attempt: a no-op (applied=True so the caller re-signals). The rows are locked in
    id order by one statement, each mark decided as it would be alone, and the changes, job
    events and audit rows written in one round trip each, so a cycle that stops a hundred jobs
    waits on a handful of round trips, not a hundred transactions. A stale epoch writes
    nothing; an unknown job raises ``UnknownSubject`` and writes nothing."""
    if not marks:
        return []
    async with transaction(db) as conn:
        await check_epoch(conn, scope, epoch)
        rows = await conn.fetch(
            "SELECT job_id, state, attempt FROM jobs WHERE job_id = ANY($1::text[]) ORDER BY job_id FOR UPDATE",
            sorted({mk.job_id for mk in marks}),
        )
        now = {r["job_id"]: (r["state"], r["attempt"]) for r in rows}
        out: list[Outcome] = []
        events: list[JobEvent] = []
        audits: list[tuple[str, str, str, str | None, dict[str, Any] | None]] = []
        for mk in marks:
            got = now.get(mk.job_id)
            if got is None:
                raise UnknownSubject(f"no job {mk.job_id}")
            state, attempt = got
            if attempt != mk.attempt:
                out.append(Outcome(False, state, attempt))
            elif state == JobState.PREEMPTING:
                out.append(Outcome(True, JobState.PREEMPTING, attempt))  # (a mark repeated: a no-op)
            elif state not in (JobState.STARTING, JobState.RUNNING):
                out.append(Outcome(False, state, attempt))
            else:
                now[mk.job_id] = (JobState.PREEMPTING, attempt)
                detail = {"attempt": attempt, "epoch": epoch, "by_job": mk.by_job}
                events.append(
                    JobEvent(mk.job_id, attempt, "preempting", state, JobState.PREEMPTING, actor, mk.reason, detail)
                )
                audits.append((actor, "preempt", mk.job_id, mk.reason, detail))
                out.append(Outcome(True, JobState.PREEMPTING, attempt))
        if events:
            await conn.execute(
                "UPDATE jobs SET state = 'PREEMPTING', preemptions = preemptions + 1,"
                " preempted_at = preempted_at || now(), updated_at = now() WHERE job_id = ANY($1::text[])",
                [e.job_id for e in events],
            )
            await write_job_events(conn, events)
            await write_audits(conn, audits)
        return out
