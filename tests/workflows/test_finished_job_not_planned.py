"""A job whose earlier attempt had finished (every rank's exit 0 came after it was re-queued)
is refused a start by the store; the leader then stops planning it until its row moves on,
instead of planning, committing and being refused every cycle; and no running work is
preempted for such a job before it was ever placed (docs/design.md, Failure paths: finished
work is not run again)."""

from __future__ import annotations

from store import task_reports
from tests.faults.test_report_store import report
from tests.foundation.builders import queued_job, team


async def test_a_job_refused_for_an_earlier_success_is_planned_no_more_until_its_row_changes(pool, leader):
    cycles, epoch = leader
    async with pool.acquire() as conn:
        await queued_job(conn, "done", "alpha")
        await queued_job(conn, "other", "alpha")
    await pool.execute("UPDATE jobs SET attempt = 2 WHERE job_id = 'done'")  # re-queued once
    await task_reports.store(pool, report("done.a1.r0", job="done", attempt=1))  # its exit came late

    first = await cycles.run_cycle(epoch)
    assert first.failed_commits == 1 and first.placed == 1
    rows = {r["job_id"]: r["state"] for r in await pool.fetch("SELECT job_id, state FROM jobs")}
    assert rows == {"done": "QUEUED", "other": "STARTING"}
    assert await pool.fetchval("SELECT count(*) FROM leases WHERE job_id = 'done'") == 0
    assert cycles.state.finished_earlier == {"done": 2}

    # the next cycles neither plan it nor try its start again
    for _ in range(2):
        again = await cycles.run_cycle(epoch)
        assert again.failed_commits == 0 and again.errors == []
    assert "done" not in cycles.state.queue
    assert await pool.fetchval("SELECT state FROM jobs WHERE job_id = 'done'") == "QUEUED"

    # its workflow ends it (the earlier_success edge): the leader forgets it
    await pool.execute("UPDATE jobs SET state = 'SUCCEEDED', finished_at = now() WHERE job_id = 'done'")
    await cycles.run_cycle(epoch)
    assert cycles.state.finished_earlier == {} and "done" not in cycles.state.jobs


async def test_no_job_is_preempted_for_a_job_whose_earlier_attempt_finished(pool, leader):
    cycles, epoch = leader
    async with pool.acquire() as conn:
        await team(conn, "beta", guaranteed=0, borrow_limit=32)
        await queued_job(conn, "borrower", "beta", replicas=4, gpus_per_replica=8)  # the whole block
    assert (await cycles.run_cycle(epoch)).placed == 1
    # a re-run within alpha's guarantee: only reclaiming beta's borrowed GPUs makes room
    async with pool.acquire() as conn:
        await queued_job(conn, "done", "alpha", gpus_per_replica=8)
    await pool.execute("UPDATE jobs SET attempt = 2 WHERE job_id = 'done'")
    await task_reports.store(pool, report("done.a1.r0", job="done", attempt=1))  # its exit came late

    stats = await cycles.run_cycle(epoch)
    assert stats.preempted == 0 and stats.placed == 0
    assert await pool.fetchval("SELECT state FROM jobs WHERE job_id = 'borrower'") == "STARTING"
    assert cycles.state.finished_earlier == {"done": 2}
    assert "done" not in cycles.state.queue
