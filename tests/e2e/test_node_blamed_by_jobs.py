"""A node that fails the jobs of several teams, jobs that then run elsewhere, is taken out for
burn-in (``store.node_blame``, the health table's ``unfit``; docs/design.md, Health), on the
embedded stack with real ranks.

A fault no health check sees fails every rank placed on the node while its GPUs read healthy.
Since each job's next attempt goes elsewhere (``jobs.avoid_nodes``), every job lost one
attempt there and went on; but the node stayed ready and took each new job's first attempt,
the queue's most urgent work (a failed attempt goes to the front of its class) first."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import fails_only_on
from tests.support import eventually

BAD = "b0-n0"  # the first node the stack seeds: where each first attempt lands
FAILS_ON_BAD = fails_only_on(BAD)


@pytest.fixture
def stack_overrides() -> dict:
    return {"_nodes": 2, "node_blame_min_jobs": 3, "node_blame_check_s": 0.5, "burn_in_seconds": 1.0}


async def test_a_node_that_fails_the_jobs_of_two_teams_is_cordoned_and_burnt_in(stack):
    other = next(n for n in stack.nodes if n != BAD)
    # alpha's two jobs: each fails first on BAD and succeeds on the other node; one team is not enough
    for _ in range(2):
        job = await stack.submit(gpus_per_replica=8, command=FAILS_ON_BAD)
        await stack.wait_state(job, "SUCCEEDED", timeout=60)
        placed = await stack.pool.fetch("SELECT attempt, node_id FROM leases WHERE job_id = $1 ORDER BY attempt", job)
        assert [(r["attempt"], r["node_id"]) for r in placed] == [(1, BAD), (2, other)]
    assert await stack.pool.fetchval("SELECT state FROM nodes WHERE node_id = $1", BAD) == "ready"
    # beta's job, the same: three jobs of two teams now blame the node
    job = await stack.submit(token="tok-beta", team="beta", gpus_per_replica=8, command=FAILS_ON_BAD)
    await stack.wait_state(job, "SUCCEEDED", timeout=60)
    audit = await eventually(
        lambda: stack.pool.fetchrow(
            "SELECT reason, detail FROM audit WHERE subject = $1 AND action = 'node_state' AND reason LIKE 'unfit:%'",
            BAD,
        ),
        timeout=20, what=f"{BAD} cordoned",
    )  # fmt: skip
    assert "jobs: the attempts of 3 jobs of 2 teams failed here first and then ran elsewhere" in audit["reason"]
    # out of service, the evidence is old: no rank left, it burns in and returns, with none against it
    await eventually(
        lambda: stack.pool.fetchval(
            "SELECT count(*) FROM audit WHERE subject = $1 AND action = 'node_state' AND detail->>'to' = 'ready'", BAD
        ),
        timeout=30, what=f"{BAD} back in service through burn-in",
    )  # fmt: skip
    assert await stack.pool.fetchval("SELECT state FROM nodes WHERE node_id = $1", BAD) == "ready"
