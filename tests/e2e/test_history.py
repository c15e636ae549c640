"""A job's Temporal history reads as its timeline (docs/design.md, Jobs): the workflow starts
when the job is placed, not in the future; it carries the job's team, class, size, state and
attempt as search attributes, so the Temporal UI filters by them."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from temporalio.service import RPCError, RPCStatusCode

from tests.e2e.conftest import PY
from tests.support import eventually

pytestmark = pytest.mark.e2e


async def _listed(client, query: str) -> list:
    return [wf async for wf in client.list_workflows(query)]


async def test_a_history_starts_at_placement_with_real_times_and_filters_by_team_and_state(stack):
    job = await stack.submit(command=[PY, "-c", "import time; time.sleep(4)"], gpus_per_replica=2)
    running = await stack.wait_state(job, "RUNNING")
    queued = await stack.submit(command=[PY, "-c", "pass"], gpus_per_replica=8, replicas=4)  # waits for all 32
    c = stack.client
    desc = await c.get_workflow_handle(job).describe()
    now = datetime.now(UTC)
    submitted = (await stack.job(job))["submitted_at"]
    assert submitted <= desc.start_time <= now  # started by its allocation, not scheduled ahead
    assert desc.execution_time is None or desc.execution_time <= now
    assert running["state"] == "RUNNING"

    # a queued job costs Temporal nothing: no workflow until placed (the leader has ranked it)
    await eventually(lambda: stack.pool.fetchval("SELECT pending_reason FROM jobs WHERE job_id = $1", queued),
                     timeout=10, what="the queued job ranked")  # fmt: skip
    assert (await stack.job(queued))["state"] == "QUEUED"
    with pytest.raises(RPCError) as e:
        await c.get_workflow_handle(queued).describe()
    assert e.value.status == RPCStatusCode.NOT_FOUND

    by_team = f'GpufleetTeam = "alpha" AND GpufleetState = "RUNNING" AND WorkflowId = "{job}"'
    assert [wf.id for wf in await eventually(lambda: _listed(c, by_team), timeout=10, what="listed by team")] == [job]
    sa = desc.typed_search_attributes
    from workflows import search_attributes as keys

    assert sa.get(keys.TEAM) == "alpha" and sa.get(keys.PRIORITY_CLASS) == "research"
    assert sa.get(keys.GPUS) == 2 and sa.get(keys.ATTEMPT) == 1 and sa.get(keys.GPU_TYPE) == "h100"
    assert abs((sa.get(keys.SUBMITTED_AT) - submitted).total_seconds()) < 1

    await stack.wait_state(job, "SUCCEEDED")
    done = f'GpufleetTeam = "alpha" AND GpufleetState = "SUCCEEDED" AND WorkflowId = "{job}"'
    await eventually(lambda: _listed(c, done), timeout=10, what="listed as SUCCEEDED")
    desc = await c.get_workflow_handle(job).describe()
    assert desc.close_time is not None and desc.close_time > desc.start_time  # a real, positive duration
    assert await _listed(c, f'GpufleetTeam = "beta" AND WorkflowId = "{job}"') == []


async def test_a_job_that_fails_for_good_reads_failed_in_its_history(stack):
    job = await stack.submit(command=[PY, "-c", "import sys; sys.exit(3)"])
    row = await stack.wait_state(job, "FAILED", timeout=60)
    from workflows import search_attributes as keys

    async def final():
        sa = (await stack.client.get_workflow_handle(job).describe()).typed_search_attributes
        return sa if sa.get(keys.STATE) == "FAILED" else None

    sa = await eventually(final, timeout=10, what="GpufleetState FAILED")
    assert sa.get(keys.ATTEMPT) == row["attempt"]
    listed = f'GpufleetTeam = "alpha" AND GpufleetState = "FAILED" AND WorkflowId = "{job}"'
    await eventually(lambda: _listed(stack.client, listed), timeout=10, what="listed as FAILED")
