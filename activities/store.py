"""The one place with SQL for the invariant-bearing writes (DESIGN.md, Invariants).

Every function here takes an asyncpg pool or connection, runs one transaction,
and raises a typed error instead of leaking a database exception:

* ``commit_gang``   - all allocation rows and leases of a gang, or none; the
  leader epoch is checked in the same transaction; guaranteed usage is held
  within the guarantee; audit and job_events rows are written with the change.
* ``release_lease`` / ``release_job`` - free GPUs; keyed by lease id (and
  optionally epoch), never by GPU, so a stale "task exited" cannot free a
  newer lease on the same GPU.
* ``acquire_leadership`` / ``renew_leadership`` - the fencing row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import logging

import asyncpg

from common.settings import get_settings
from placement.lifecycle import allowed_change

log = logging.getLogger("gpufleet.store")


class StoreError(Exception):
    """Base of the typed errors the store raises."""

    code = "store_error"


class AllocationConflict(StoreError):
    """A GPU in the gang already belongs to a live lease."""

    code = "allocation_conflict"


class StaleEpoch(StoreError):
    """The caller's fencing epoch is not the current leader's."""

    code = "stale_epoch"


class QuotaExceeded(StoreError):
    """Guaranteed usage would exceed the guarantee, or borrowing its limit."""

    code = "quota_exceeded"


class JobStateConflict(StoreError):
    """The job is not in the state (or attempt) the write expects."""

    code = "job_state_conflict"


class InvalidJobTransition(StoreError):
    """A job state change that placement.lifecycle's table has no edge for."""

    code = "invalid_job_transition"


class UnknownSubject(StoreError):
    code = "unknown_subject"


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


async def write_audit(
    conn: asyncpg.Connection,
    actor: str,
    action: str,
    subject: str,
    reason: str | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    await conn.execute(
        "INSERT INTO audit (actor, action, subject, reason, detail) VALUES ($1, $2, $3, $4, $5)",
        actor,
        action,
        subject,
        reason,
        detail or {},
    )


async def write_job_event(
    conn: asyncpg.Connection,
    job_id: str,
    attempt: int,
    event: str,
    from_state: str | None,
    to_state: str | None,
    actor: str,
    reason: str | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    if from_state and to_state and from_state != to_state and not allowed_change(from_state, to_state):
        # every state change writes its job event: this is where the lifecycle table is checked
        msg = f"job {job_id}: {from_state} -> {to_state} ({event}) is not in placement.lifecycle.TRANSITIONS"
        if get_settings().strict_job_transitions:
            raise InvalidJobTransition(msg)
        log.error(msg)
    await conn.execute(
        "INSERT INTO job_events (job_id, attempt, event, from_state, to_state, reason, detail, actor)"
        " VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
        job_id,
        attempt,
        event,
        from_state,
        to_state,
        reason,
        detail or {},
        actor,
    )


async def check_epoch(conn: asyncpg.Connection, scope: str, epoch: int) -> None:
    """Invariant 3: raise StaleEpoch unless ``epoch`` is the leader's, and hold the
    row (FOR SHARE) so no takeover can commit until this transaction ends."""
    current = await conn.fetchval("SELECT epoch FROM leader WHERE scope = $1 FOR SHARE", scope)
    if current is None or current != epoch:
        raise StaleEpoch(f"epoch {epoch} is not the current leader epoch ({current}) for scope {scope!r}")


async def commit_gang(
    db: asyncpg.Pool | asyncpg.Connection,
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
    QuotaExceeded or JobStateConflict, and then nothing is written.
    """
    if not placements:
        raise ValueError("a gang has at least one placement")
    ranks = sorted(p.rank for p in placements)
    if ranks != list(range(len(placements))):
        raise ValueError(f"ranks must be 0..{len(placements) - 1}, got {ranks}")
    async with _transaction(db) as conn:
        await check_epoch(conn, scope, epoch)
        job = await conn.fetchrow(
            "SELECT team, gpu_type, state, attempt FROM jobs WHERE job_id = $1 FOR UPDATE", job_id
        )
        if job is None:
            raise UnknownSubject(f"no job {job_id}")
        if job["state"] != "QUEUED" or job["attempt"] != attempt:
            raise JobStateConflict(
                f"job {job_id} is {job['state']} attempt {job['attempt']}, expected QUEUED attempt {attempt}"
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
    db: asyncpg.Pool | asyncpg.Connection,
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
    async with _transaction(db) as conn:
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
    db: asyncpg.Pool | asyncpg.Connection,
    job_id: str,
    attempt: int,
    *,
    reason: str,
    actor: str,
) -> int:
    """Release every live lease of one attempt of a job; return how many."""
    async with _transaction(db) as conn:
        rows = await conn.fetch(
            "UPDATE leases SET state = 'released', released_at = now(), release_reason = $3"
            " WHERE job_id = $1 AND attempt = $2 AND state = 'live' RETURNING lease_id, node_id, gpu_indices",
            job_id,
            attempt,
            reason,
        )
        if not rows:
            return 0
        await conn.execute(
            "DELETE FROM allocations WHERE lease_id = ANY($1::text[])", [r["lease_id"] for r in rows]
        )
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


async def acquire_leadership(
    db: asyncpg.Pool | asyncpg.Connection,
    *,
    scope: str,
    holder: str,
    task_queue: str,
    grpc_addr: str,
    ttl_s: float,
) -> int | None:
    """Take the leader row when it is free or expired; return the new epoch (strictly
    increasing), or None while another holder's lease is live."""
    async with _transaction(db) as conn:
        return await conn.fetchval(
            "INSERT INTO leader (scope, epoch, holder, expires_at, task_queue, grpc_addr)"
            " VALUES ($1, 1, $2, now() + make_interval(secs => $3), $4, $5)"
            " ON CONFLICT (scope) DO UPDATE SET epoch = leader.epoch + 1, holder = EXCLUDED.holder,"
            "   expires_at = EXCLUDED.expires_at, task_queue = EXCLUDED.task_queue,"
            "   grpc_addr = EXCLUDED.grpc_addr, acquired_at = now()"
            " WHERE leader.expires_at < now()"
            " RETURNING epoch",
            scope,
            holder,
            ttl_s,
            task_queue,
            grpc_addr,
        )


async def renew_leadership(
    db: asyncpg.Pool | asyncpg.Connection, *, scope: str, holder: str, epoch: int, ttl_s: float
) -> bool:
    """Extend our lease; False means we are no longer the leader (expired or deposed)."""
    async with _transaction(db) as conn:
        status = await conn.execute(
            "UPDATE leader SET expires_at = now() + make_interval(secs => $4)"
            " WHERE scope = $1 AND holder = $2 AND epoch = $3 AND expires_at > now()",
            scope,
            holder,
            epoch,
            ttl_s,
        )
        return status.endswith(" 1")


async def resign_leadership(db: asyncpg.Pool | asyncpg.Connection, *, scope: str, holder: str, epoch: int) -> None:
    """Give the lease up on a clean shutdown so a successor need not wait for expiry."""
    async with _transaction(db) as conn:
        await conn.execute(
            "UPDATE leader SET expires_at = now() - interval '1 second' WHERE scope = $1 AND holder = $2 AND epoch = $3",
            scope,
            holder,
            epoch,
        )


class _transaction:
    """``async with _transaction(pool_or_conn) as conn``: one transaction on a pooled or given connection."""

    def __init__(self, db: asyncpg.Pool | asyncpg.Connection) -> None:
        self._db = db
        self._conn: asyncpg.Connection | None = None
        self._acquired = False
        self._tx: Any = None

    async def __aenter__(self) -> asyncpg.Connection:
        if isinstance(self._db, asyncpg.Pool):
            self._conn = await self._db.acquire()
            self._acquired = True
        else:
            self._conn = self._db
        self._tx = self._conn.transaction()
        await self._tx.start()
        return self._conn

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self._conn is not None
        try:
            if exc_type is None:
                await self._tx.commit()
            else:
                await self._tx.rollback()
        finally:
            if self._acquired and isinstance(self._db, asyncpg.Pool):
                await self._db.release(self._conn)
