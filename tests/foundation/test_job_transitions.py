"""The job state table (placement/lifecycle.py) guards every state change three times: the
job workflow checks each change it asks for, the store's job event write checks it (strict
in the tests), and Postgres refuses a change with no edge (db/migrations/0007, whose rows
must equal the table's pairs)."""

from __future__ import annotations

import asyncpg
import pytest

from common.settings import get_settings
from placement.lifecycle import STATE_CHANGES
from store import audit, errors, job_states
from tests.foundation.builders import queued_job, team
from workflows.job import IllegalTransition, JobWorkflow


async def test_the_postgres_mirror_is_the_table(pool):
    rows = await pool.fetch("SELECT from_state, to_state FROM job_state_changes")
    assert {(r["from_state"], r["to_state"]) for r in rows} == {(a.value, b.value) for a, b in STATE_CHANGES}


async def test_postgres_refuses_a_state_change_with_no_edge(pool):
    async with pool.acquire() as conn:
        await team(conn, "alpha", 8)
        job = await queued_job(conn, "j-db", "alpha")
        with pytest.raises(asyncpg.CheckViolationError, match="QUEUED -> RUNNING"):
            await conn.execute("UPDATE jobs SET state = 'RUNNING' WHERE job_id = $1", job)
        await conn.execute("UPDATE jobs SET state = 'STARTING' WHERE job_id = $1", job)  # an edge
        assert await conn.fetchval("SELECT state FROM jobs WHERE job_id = $1", job) == "STARTING"


async def test_the_job_event_write_refuses_a_change_with_no_edge(pool):
    assert get_settings().strict_job_transitions  # tests/conftest.py
    async with pool.acquire() as conn:
        await team(conn, "alpha", 8)
        job = await queued_job(conn, "j-table", "alpha")
        with pytest.raises(errors.InvalidJobTransition):
            await audit.write_job_event(conn, job, 1, "running", "QUEUED", "RUNNING", "test")
        assert await conn.fetchval("SELECT count(*) FROM job_events WHERE job_id = $1", job) == 0


async def test_a_cancel_pending_when_a_starting_job_stops_is_an_edge(pool):
    async with pool.acquire() as conn:
        await team(conn, "alpha", 8)
        job = await queued_job(conn, "j-cancel", "alpha")
        await conn.execute("UPDATE jobs SET state = 'STARTING' WHERE job_id = $1", job)
    out = await job_states.finish_job(pool, job, 1, "CANCELLED", actor="alice", reason="changed my mind")
    assert out.applied and out.state == "CANCELLED"


@pytest.mark.parametrize(
    ("current", "to", "edge"),
    [
        ("QUEUED", "STARTING", True),
        ("STARTING", "RUNNING", True),
        ("RUNNING", "PREEMPTING", True),
        ("PREEMPTING", "QUEUED", True),
        ("RUNNING", "RUNNING", True),  # no change
        ("QUEUED", "RUNNING", False),
        ("SUCCEEDED", "QUEUED", False),
        ("CANCELLING", "QUEUED", False),
    ],
)
def test_the_job_workflow_asks_only_for_edges_of_the_table(current, to, edge):
    wf = JobWorkflow()
    wf._state = current
    if edge:
        wf._expect(to)
    else:
        with pytest.raises(IllegalTransition, match=f"{current} -> {to}"):
            wf._expect(to)
