"""A job whose attempt failed on a node runs its next attempt on another one (``jobs.avoid_nodes``,
docs/design.md, Placement), on the embedded stack with real ranks.

A node fault no health check sees (a GPU that fails CUDA's init while NVML reads it healthy, a
broken library, a missing mount) fails every rank placed there. Before this, the leader put
each next attempt back on that node, whose GPUs were free the moment the attempt ended, while
the other node sat idle: three attempts there, and the job FAILED, "3 failed attempts caused by
the job"."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import fails_only_on

BAD = "b0-n0"  # the first node the stack seeds: where the first attempt lands
FAILS_ON_BAD = fails_only_on(BAD)


@pytest.fixture
def stack_overrides() -> dict:
    return {"_nodes": 2}


async def test_a_job_whose_attempt_failed_on_a_node_runs_its_next_attempt_on_another(stack):
    other = next(n for n in stack.nodes if n != BAD)
    job = await stack.submit(gpus_per_replica=8, command=FAILS_ON_BAD)
    row = await stack.wait_state(job, "SUCCEEDED", timeout=90)
    placed = await stack.pool.fetch("SELECT attempt, node_id FROM leases WHERE job_id = $1 ORDER BY attempt", job)
    assert [(r["attempt"], r["node_id"]) for r in placed] == [(1, BAD), (2, other)]
    assert row["attempt"] == 2
    assert await stack.pool.fetchval("SELECT avoid_nodes FROM jobs WHERE job_id = $1", job) == [BAD]
    failed = await stack.pool.fetchrow(
        "SELECT detail FROM job_events WHERE job_id = $1 AND event = 'attempt_failed'", job
    )
    detail = json.loads(failed["detail"]) if isinstance(failed["detail"], str) else failed["detail"]
    assert (detail["failed_on"], detail["rank"], detail["job_fault"]) == (BAD, 0, True)
