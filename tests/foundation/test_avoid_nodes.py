"""``jobs.avoid_nodes`` (migration 0017), against the real embedded Postgres: a failed attempt
adds the node its failing rank ran on (``task_reports.failing``), newest last, each node once,
the newest ``AVOID_NODES_KEPT``; a rank we stopped names no node, nor does a preemption."""

from __future__ import annotations

from store import job_states, task_reports
from store.job_states import AVOID_NODES_KEPT
from tests.foundation.builders import queued_job, team


async def _ended(pool, job: str, attempt: int, ends: list[tuple[str, str, int | None]], cause: str = "failed") -> None:
    """Attempt ``attempt`` runs, its ranks end as ``ends`` (node, state, exit code), and it is re-queued."""
    for state in ("STARTING", "RUNNING"):
        await pool.execute("UPDATE jobs SET state = $2 WHERE job_id = $1", job, state)
    for rank, (node, state, code) in enumerate(ends):
        report = {"lease_id": f"{job}.a{attempt}.r{rank}", "job_id": job, "attempt": attempt, "epoch": 1,
                  "rank": rank, "node_id": node, "state": state, "exit_code": code, "at": f"2026-01-01T00:00:0{rank}Z"}  # fmt: skip
        await task_reports.store(pool, report)
    out = await job_states.requeue_job(
        pool, job, attempt, cause=cause, reason="test", actor="test", job_fault=True, max_failed_attempts=100
    )
    assert out.applied and out.attempt == attempt + 1


async def _avoid(pool, job: str) -> list[str]:
    return await pool.fetchval("SELECT avoid_nodes FROM jobs WHERE job_id = $1", job)


async def test_each_failed_attempt_adds_the_node_its_failing_rank_ran_on(pool):
    async with pool.acquire() as conn:
        await team(conn, "alpha", guaranteed=16)
        await queued_job(conn, "j", "alpha", replicas=2)
    assert await _avoid(pool, "j") == []
    # rank 0 exited non-zero first (the agents' clocks), rank 1 after it (its peer gone)
    await _ended(pool, "j", 1, [("n-a", "EXITED", 1), ("n-b", "EXITED", 3)])
    assert await _avoid(pool, "j") == ["n-a"]
    first = "n-a"
    # a lost node is avoided too; a rank we stopped (a cancel, a preemption) names no node
    await _ended(pool, "j", 2, [("n-c", "LOST", None), ("n-d", "STOPPED", None)])
    await _ended(pool, "j", 3, [("n-e", "STOPPED", None), ("n-f", "STOPPED", None)])
    await _ended(pool, "j", 4, [("n-g", "STOPPED", None), ("n-h", "EXITED", 1)], cause="preempted")
    assert await _avoid(pool, "j") == [first, "n-c"]
    # the same node again moves to the end; only the newest AVOID_NODES_KEPT stay
    attempt = 5
    for node in ["n-1", "n-2", first, *[f"n-{i}" for i in range(3, 3 + AVOID_NODES_KEPT)]]:
        await _ended(pool, "j", attempt, [(node, "EXITED", 3), (node, "EXITED", 3)])
        attempt += 1
    kept = await _avoid(pool, "j")
    assert kept == [f"n-{i}" for i in range(3, 3 + AVOID_NODES_KEPT)]
    events = await pool.fetch(
        "SELECT detail FROM job_events WHERE job_id = 'j' AND event = 'attempt_failed' ORDER BY id LIMIT 3"
    )
    assert [e["detail"].get("failed_on") for e in events] == [first, "n-c", None]
