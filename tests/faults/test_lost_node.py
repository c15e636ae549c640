"""Issue 19, defect 4: a lost node's job ran twice at once, and ranks that had exited 0 while
their node was unreachable were counted lost and run again.

Restarting a lost node's gang at once stays (utilization); what changes is that the attempts
cannot corrupt each other (each writes its own checkpoint dir) and that a late exit 0 of every
rank of the earlier attempt finishes the job instead of leaving attempt 2 to redo the work.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import PY
from tests.faults.conftest import OutageStack
from tests.support import eventually

pytestmark = pytest.mark.e2e

# attempt 1 finishes in 3 s; any later attempt would run for 10 minutes (redoing the work)
BY_ATTEMPT = [
    PY,
    "-c",
    "import os, time; time.sleep(3 if os.environ['GPUFLEET_ATTEMPT'] == '1' else 600)",
]

LOST_NODE = {
    "_nodes": 2,
    "_agents": "one per node",
    "suspect_after_s": 1.5,
    "down_after_s": 3.0,
    "takeover_quiet_s": 0.0,
    "unconfirmed_kill_s": 60.0,  # the old rank is not fenced before it exits by itself
}


@pytest.mark.parametrize("outage_overrides", [LOST_NODE])
async def test_a_late_exit_0_of_a_lost_nodes_attempt_finishes_the_job_and_attempts_write_apart(
    outage_stack: OutageStack,
):
    s = outage_stack
    job = await s.submit(command=BY_ATTEMPT, checkpoint={"preemptible": True, "grace_seconds": 5})
    await s.wait_state(job, "RUNNING", timeout=30)
    (first,) = await s.live_leases(job)
    lost = first["node_id"]
    (agent,) = [a for a in s.agents or [] if lost in a.node_ids]
    await s.stop_agent(agent)  # the node goes silent; its rank goes on and exits 0 meanwhile

    # the leader marks it down and restarts the gang elsewhere at once
    await s.wait_state(job, "RUNNING", timeout=60, attempt=2)
    (second,) = await s.live_leases(job)
    assert second["node_id"] != lost
    exit_file = s.lease_dir(lost, first["lease_id"]) / "exit.json"
    await eventually(exit_file.exists, timeout=30, what="attempt 1's exit on the lost node")
    assert json.loads(exit_file.read_text())["exit_code"] == 0

    # each attempt was told its own checkpoint dir
    dirs = {
        lease["lease_id"]: json.loads((s.lease_dir(lease["node_id"], lease["lease_id"]) / "task.json").read_text())
        for lease in (first, second)
    }
    ck1, ck2 = (dirs[x["lease_id"]]["checkpoint_dir"] for x in (first, second))
    assert ck1.endswith("attempt-1") and ck2.endswith("attempt-2") and ck1 != ck2

    # the node's agent comes back and reports attempt 1's exit 0: the work is done, so the job
    # succeeds and attempt 2 (which would redo it) is stopped, not left to run
    await s.start_agent([lost])
    row = await s.wait_state(job, "SUCCEEDED", timeout=60)
    assert row["attempt"] == 2
    assert await s.live_leases(job) == []
    reasons = [r for a, e, to, r in await s.events(job) if to == "SUCCEEDED"]
    assert reasons and "attempt 1" in reasons[-1], await s.events(job)
