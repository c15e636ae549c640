"""Every job state change writes its job event, and that is where the lifecycle table is
checked: a change with no edge fails (strict, as the tests run) and writes nothing."""

from __future__ import annotations

import pytest

from activities import job_store, store
from common.settings import get_settings
from tests.foundation.builders import queued_job, team


async def test_a_state_change_outside_the_table_is_refused(pool):
    assert get_settings().strict_job_transitions  # tests/conftest.py
    async with pool.acquire() as conn:
        await team(conn, "alpha", 8)
        job = await queued_job(conn, "j-table", "alpha")
        with pytest.raises(store.InvalidJobTransition):
            async with conn.transaction():
                await conn.execute("UPDATE jobs SET state = 'RUNNING' WHERE job_id = $1", job)
                await store.write_job_event(conn, job, 1, "running", "QUEUED", "RUNNING", "test")
        assert await conn.fetchval("SELECT state FROM jobs WHERE job_id = $1", job) == "QUEUED"
        assert await conn.fetchval("SELECT count(*) FROM job_events WHERE job_id = $1", job) == 0


async def test_a_cancel_pending_when_a_starting_job_stops_is_an_edge(pool):
    async with pool.acquire() as conn:
        await team(conn, "alpha", 8)
        job = await queued_job(conn, "j-cancel", "alpha")
        await conn.execute("UPDATE jobs SET state = 'STARTING' WHERE job_id = $1", job)
    out = await job_store.finish_job(pool, job, 1, "CANCELLED", actor="alice", reason="changed my mind")
    assert out.applied and out.state == "CANCELLED"
