"""A re-queue whose local activity ran in a workflow task that then failed (a signal came in
while the task completed, `UnhandledCommand`) moved the job's row to a new attempt, but
the workflow's history never recorded it: the retried task may take another path. Caught by
`gpufleet chaos --agents 8 --faults agent_stop,agent_kill --seed 23`: node_failed re-queued
attempt 1 in a task that failed; the retry also saw attempt 1's late exit 0
(earlier_attempt_succeeded), finished "attempt 1", was refused (the row was on attempt 2)
and the workflow completed with the job left QUEUED, never to run or end.

Here the row is moved on behind the workflow's back, as that lost re-queue did; each way
the workflow ends the job must end the attempt it finds instead: at once when it is queued,
through a run of its own (continue-as-new) when the leader had placed it meanwhile."""

from __future__ import annotations

import pytest

from store import job_states, task_reports
from tests.faults.test_report_store import report
from tests.workflows.harness import PY
from workflows import messages as m

SLEEP = [PY, "-c", "import time; time.sleep(60)"]


async def _requeued_behind_its_back(stand, job: str) -> None:
    await stand.allocate(job, (stand.nodes[0], (0,)))
    await stand.wait_state(job, "RUNNING")
    o = await job_states.requeue_job(
        stand.pool, job, 1, cause="failed", reason="node b0-n0: node_down", actor="workflow"
    )
    assert o.state == "QUEUED" and o.attempt == 2


@pytest.mark.parametrize("placed", [False, True], ids=["queued", "placed"])
@pytest.mark.parametrize("ending", ["earlier_success", "cancel"])
async def test_a_job_requeued_by_a_lost_task_still_ends_when_its_workflow_ends_it(stand, ending, placed):
    job = await stand.submit(f"j-lost-{ending}-{placed}", command=SLEEP, grace_s=1.0)
    await _requeued_behind_its_back(stand, job)
    if placed:  # the leader placed attempt 2 before the workflow's retried task ran
        await stand.allocate(job, (stand.nodes[1], (0,)))
    handle = stand.client.get_workflow_handle(job)
    if ending == "earlier_success":
        # attempt 1's exit 0 arrives after the re-queue; delivery tells the workflow
        lease = f"{job}.a1.r0"
        await task_reports.store(stand.pool, report(lease, job=job, attempt=1, epoch=stand.epoch))
        await handle.signal("earlier_attempt_succeeded", m.EarlierAttemptSucceeded(job, 1, "late exit 0"))
        want = "SUCCEEDED"
    else:
        await handle.signal("cancel", {"actor": "alice", "reason": "done with it"})
        want = "CANCELLED"
    res = await stand.result(job)
    row = await stand.job(job)
    assert (res.state, row["state"], row["attempt"]) == (want, want, 2)
    assert await stand.live_gpus(job) == 0
    attempt, _, to = (await stand.transitions(job))[-1]
    assert (attempt, to) == (2, want)
    if ending == "earlier_success":  # the finished work is not started again
        assert [s for s in stand.agent.starts if s.job_id == job and s.attempt == 2] == []
