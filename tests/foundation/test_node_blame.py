"""``store.node_blame``, against the real embedded Postgres: a ready node is blamed when the
attempts of ``min_jobs`` jobs of ``min_teams`` teams failed first there (``failed_on``) since
its current state began, and each of those jobs then ran elsewhere; jobs that failed
everywhere, run there again, or have not run long elsewhere yet are no evidence."""

from __future__ import annotations

from store import allocations, node_blame, nodes
from store.audit import write_job_event
from tests.foundation.builders import gang, leader, queued_job, small_cluster, team

BAD, OTHER = "b0-n0", "b0-n1"
RAN_S = 60.0


async def _blamed(pool) -> dict[str, str]:
    return await node_blame.nodes_failing_jobs(pool, window_s=3600, ran_s=RAN_S, min_jobs=3, min_teams=2)


async def _failed_then(
    pool, epoch: int, job: str, team_: str, *, end: str, on: str = OTHER, ran_s: float = 600
) -> None:
    """``job``'s attempt 1 failed first on BAD; attempt 2 placed on ``on``, started ``ran_s``
    ago, and now ``end`` (RUNNING, SUCCEEDED or FAILED)."""
    async with pool.acquire() as conn:
        await queued_job(conn, job, team_, gpus_per_replica=8)
        await write_job_event(conn, job, 1, "attempt_failed", None, None, "test", "rank 0 exited with code 3",
                              {"job_fault": True, "failed_on": BAD, "rank": 0})  # fmt: skip
    await pool.execute("UPDATE jobs SET attempt = 2 WHERE job_id = $1", job)
    await allocations.commit_gang(
        pool, scope="placement", epoch=epoch, job_id=job, attempt=2, placements=gang((on, tuple(range(8))))
    )
    await pool.execute(
        "UPDATE jobs SET state = 'RUNNING', started_at = now() - make_interval(secs => $2) WHERE job_id = $1",
        job,
        ran_s,
    )
    if end != "RUNNING":
        await pool.execute("UPDATE jobs SET state = $2 WHERE job_id = $1", job, end)
        await allocations.release_job(pool, job, 2, reason="finished", actor="test")


async def test_a_node_is_blamed_by_the_jobs_of_two_teams_that_ran_elsewhere(pool):
    async with pool.acquire() as conn:
        await small_cluster(conn, nodes_per_block=3)
        await team(conn, "alpha", guaranteed=24)
        await team(conn, "beta", guaranteed=24)
    epoch = await leader(pool)
    await _failed_then(pool, epoch, "a1", "alpha", end="SUCCEEDED")
    await _failed_then(pool, epoch, "a2", "alpha", end="SUCCEEDED")
    await _failed_then(pool, epoch, "a3", "alpha", end="SUCCEEDED")
    assert await _blamed(pool) == {}  # three jobs, but of one team: a sweep of one broken config
    await _failed_then(pool, epoch, "b-everywhere", "beta", end="FAILED")  # the job's own fault
    await _failed_then(pool, epoch, "b-young", "beta", end="RUNNING", ran_s=5)  # not run long elsewhere yet
    await _failed_then(pool, epoch, "b-there", "beta", end="SUCCEEDED", on=BAD)  # ran there after all
    assert await _blamed(pool) == {}
    await _failed_then(pool, epoch, "b-runs", "beta", end="RUNNING", on="b0-n2", ran_s=2 * RAN_S)
    assert await _blamed(pool) == {
        BAD: "jobs: the attempts of 4 jobs of 2 teams failed here first and then ran elsewhere"
    }
    # taken out and back: what happened before its current state began is no evidence any more
    hepoch = await leader(pool, scope="health")
    for frm, to in (("ready", "cordoned"), ("cordoned", "ready")):
        assert await nodes.set_node_state(
            pool, scope="health", epoch=hepoch, node_id=BAD, expect=(frm,), to=to, reason="test", actor="test"
        )
        assert await _blamed(pool) == {}
