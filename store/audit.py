"""Audit and job-event rows (invariant 7): written in the transaction of the change they record.

``write_job_event`` (and ``write_job_events``, many in one round trip) is where every job
state change is checked against ``placement.lifecycle``'s table: an edge that is not in it
is logged, or refused with ``InvalidJobTransition`` when ``strict_job_transitions`` is set
(the tests).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import asyncpg

from common.settings import get_settings
from placement.lifecycle import allowed_change
from store.errors import InvalidJobTransition

log = logging.getLogger("gpufleet.store")

_JOB_EVENT_SQL = (
    "INSERT INTO job_events (job_id, attempt, event, from_state, to_state, reason, detail, actor)"
    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"
)
_AUDIT_SQL = "INSERT INTO audit (actor, action, subject, reason, detail) VALUES ($1, $2, $3, $4, $5)"


async def write_audit(
    conn: asyncpg.Connection,
    actor: str,
    action: str,
    subject: str,
    reason: str | None = None,
    detail: dict[str, Any] | None = None,
) -> None:
    await conn.execute(_AUDIT_SQL, actor, action, subject, reason, detail or {})


@dataclass(frozen=True, slots=True)
class JobEvent:
    """One ``job_events`` row (``write_job_events`` writes many in one round trip)."""

    job_id: str
    attempt: int
    event: str
    from_state: str | None
    to_state: str | None
    actor: str
    reason: str | None = None
    detail: dict[str, Any] | None = None


def _check_edge(job_id: str, event: str, from_state: str | None, to_state: str | None) -> None:
    if from_state and to_state and from_state != to_state and not allowed_change(from_state, to_state):
        # every state change writes its job event: this is where the lifecycle table is checked
        msg = f"job {job_id}: {from_state} -> {to_state} ({event}) is not in placement.lifecycle.TRANSITIONS"
        if get_settings().strict_job_transitions:
            raise InvalidJobTransition(msg)
        log.error(msg)


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
    _check_edge(job_id, event, from_state, to_state)
    await conn.execute(_JOB_EVENT_SQL, job_id, attempt, event, from_state, to_state, reason, detail or {}, actor)


async def write_job_events(conn: asyncpg.Connection, events: Sequence[JobEvent]) -> None:
    """Many job events in one pipelined round trip (each edge checked as ``write_job_event`` does)."""
    for e in events:
        _check_edge(e.job_id, e.event, e.from_state, e.to_state)
    if events:
        await conn.executemany(
            _JOB_EVENT_SQL,
            [
                (e.job_id, e.attempt, e.event, e.from_state, e.to_state, e.reason, e.detail or {}, e.actor)
                for e in events
            ],
        )


async def write_audits(
    conn: asyncpg.Connection, rows: Sequence[tuple[str, str, str, str | None, dict[str, Any] | None]]
) -> None:
    """Many audit rows, each (actor, action, subject, reason, detail), in one pipelined round trip."""
    if rows:
        await conn.executemany(_AUDIT_SQL, [(a, act, subj, r, d or {}) for a, act, subj, r, d in rows])
