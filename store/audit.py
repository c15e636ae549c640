"""Audit and job-event rows (invariant 7): written in the transaction of the change they record.

``write_job_event`` is where every job state change is checked against
``placement.lifecycle``'s table: an edge that is not in it is logged, or refused
with ``InvalidJobTransition`` when ``strict_job_transitions`` is set (the tests).
"""

from __future__ import annotations

import logging
from typing import Any

import asyncpg

from common.settings import get_settings
from placement.lifecycle import allowed_change
from store.errors import InvalidJobTransition

log = logging.getLogger("gpufleet.store")


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
