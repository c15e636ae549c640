"""A preempted job whose ranks had all ended by themselves with 0 has finished: it succeeds and
is not run again (placement.lifecycle: PREEMPTING --exit_ok--> SUCCEEDED). Found by
`gpufleet chaos` (issue 19): a rank exited 0 0.7 s after its job was picked as a victim, before
its exit report reached the workflow; the stop then found it ended, and the workflow, counting
it STOPPED, re-queued the job and attempt 2 ran the finished work again."""

from __future__ import annotations

from tests.support import eventually
from tests.workflows.harness import PY

QUICK = [PY, "-c", "import time; time.sleep(0.5)"]
# a rank that ends its work and exits 0 when told to stop (the job helper would exit 143)
ZERO_ON_SIGTERM = [
    PY,
    "-c",
    "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); time.sleep(60)",
]


async def test_a_job_whose_ranks_ended_with_0_before_the_stop_succeeds_and_is_not_requeued(stand):
    job = "j-done-before-stop"
    lease = f"{job}.a1.r0"
    stand.agent.held_exits.add(lease)  # its exit report is late: the preemption comes first
    await stand.submit(job, command=QUICK, grace_s=5.0)
    await stand.allocate(job, (stand.nodes[0], (0,)))
    await stand.wait_state(job, "RUNNING")
    await eventually(lambda: lease in stand.agent.tasks and stand.agent.tasks[lease].done.is_set(), timeout=10)
    await stand.preempt(job, by_job="j-prod")
    res = await stand.result(job)
    assert res.state == "SUCCEEDED" and res.attempt == 1, res
    assert lease not in stand.agent.signals_seen  # nothing left to signal: it had ended
    assert (await stand.transitions(job))[-2:] == [(1, "RUNNING", "PREEMPTING"), (1, "PREEMPTING", "SUCCEEDED")]
    stand.agent.release_exit(lease)  # the late report changes nothing
    assert (await stand.job(job))["state"] == "SUCCEEDED"


async def test_a_rank_the_stop_ended_is_requeued_even_with_exit_0(stand):
    job = "j-zero-on-sigterm"
    await stand.submit(job, command=ZERO_ON_SIGTERM, grace_s=5.0)
    await stand.allocate(job, (stand.nodes[0], (0,)))
    await stand.wait_state(job, "RUNNING")
    await stand.preempt(job, by_job="j-prod")
    await stand.wait_state(job, "QUEUED", attempt=2)
    assert stand.agent.signals_seen[f"{job}.a1.r0"] == ["SIGTERM"]


async def test_a_requeue_finds_every_exit_0_on_record_and_succeeds_instead(stand):
    """The workflow took the rank for stopped (an older agent's stop result says nothing of
    how it ended), but its exit 0 is in the store: the re-queue's transaction sees it."""
    job = "j-exit-on-record"
    lease = f"{job}.a1.r0"
    stand.agent.held_exits.add(lease)
    stand.agent.stop_says_state = False
    await stand.submit(job, command=QUICK, grace_s=5.0)
    await stand.allocate(job, (stand.nodes[0], (0,)))
    await stand.wait_state(job, "RUNNING")
    await eventually(lambda: lease in stand.agent.tasks and stand.agent.tasks[lease].done.is_set(), timeout=10)
    req = stand.agent.tasks[lease].req
    report = {"lease_id": lease, "job_id": job, "attempt": 1, "epoch": req.epoch, "rank": 0, "node_id": req.node_id,
              "state": "EXITED", "exit_code": 0, "checkpoint_uri": None}  # fmt: skip
    # stored (the agent was acknowledged) but not yet seen by the workflow: one statement, so
    # the stand's delivery cannot send it in between
    await stand.pool.execute(
        "INSERT INTO task_reports (lease_id, job_id, attempt, epoch, rank, node_id, state, exit_code, report,"
        " delivered_at, outcome) VALUES ($1, $2, 1, $3, 0, $4, 'EXITED', 0, $5, now(), 'delivered')",
        lease, job, req.epoch, req.node_id, report,
    )  # fmt: skip
    await stand.preempt(job, by_job="j-prod")
    res = await stand.result(job)
    assert res.state == "SUCCEEDED" and res.attempt == 1, res
    events = await stand.pool.fetch("SELECT * FROM job_events WHERE job_id = $1 ORDER BY id", job)
    assert events[-1]["to_state"] == "SUCCEEDED" and "on record" in events[-1]["reason"]
    assert not [e for e in events if e["attempt"] == 2]
