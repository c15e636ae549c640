"""Finished work is not started again (docs/design.md, Failure paths), on real Postgres.

An attempt's exits can reach the store after the attempt was re-queued (its node went
silent, its agent restarted). The leader may then be placing the next attempt at the same
moment: whichever of the two writes comes first, the next attempt is either refused or was
placed before the success was on record (and report delivery then stops it)."""

from __future__ import annotations

import asyncio

import pytest

from store import allocations, task_reports
from store.errors import EarlierAttemptSucceeded
from tests.faults.test_report_store import report
from tests.foundation.builders import gang, leader, queued_job, small_cluster, team

SCOPE = "placement"


@pytest.fixture
async def epoch(pool) -> int:
    async with pool.acquire() as conn:
        await small_cluster(conn, nodes_per_block=2)
        await team(conn, "alpha", guaranteed=16, borrow_limit=0)
    return await leader(pool)


async def second_attempt(pool, job_id: str, replicas: int = 2) -> None:
    """A job re-queued once: QUEUED at attempt 2."""
    async with pool.acquire() as conn:
        await queued_job(conn, job_id, "alpha", replicas=replicas)
    await pool.execute("UPDATE jobs SET attempt = 2 WHERE job_id = $1", job_id)


def exit0(job_id: str, rank: int, attempt: int = 1) -> dict:
    return report(f"{job_id}.a{attempt}.r{rank}", job=job_id, attempt=attempt, rank=rank)


async def start(pool, epoch: int, job_id: str) -> list[str]:
    return await allocations.commit_gang(
        pool,
        scope=SCOPE,
        epoch=epoch,
        job_id=job_id,
        attempt=2,
        placements=gang(("b0-n0", (0,)), ("b0-n1", (0,))),
    )


async def test_an_attempt_is_not_started_when_every_rank_of_an_earlier_one_exited_0(pool, epoch):
    await second_attempt(pool, "j-done")
    await task_reports.store(pool, exit0("j-done", 0))
    await task_reports.store(pool, exit0("j-done", 1))
    with pytest.raises(EarlierAttemptSucceeded, match="attempt 1 had exited 0 on every rank"):
        await start(pool, epoch, "j-done")
    # nothing written: the job waits, QUEUED, for its workflow to finish it
    assert await pool.fetchval("SELECT count(*) FROM leases WHERE job_id = 'j-done'") == 0
    assert await pool.fetchval("SELECT count(*) FROM allocations") == 0
    assert await pool.fetchval("SELECT state FROM jobs WHERE job_id = 'j-done'") == "QUEUED"
    assert await pool.fetchval("SELECT count(*) FROM audit WHERE subject = 'j-done'") == 0


@pytest.mark.parametrize(
    "on_record",
    [
        pytest.param([exit0("j", 0)], id="one-rank-of-two-exited-0"),
        pytest.param([exit0("j", 0), report("j.a1.r1", job="j", rank=1, exit_code=1)], id="one-rank-failed"),
        pytest.param([exit0("j", 0), report("j.a1.r1", "LOST", job="j", rank=1)], id="one-rank-lost"),
        pytest.param([exit0("j", 0), exit0("j", 1, attempt=2)], id="the-exits-are-of-two-attempts"),
    ],
)
async def test_an_attempt_starts_when_no_earlier_one_finished_on_every_rank(pool, epoch, on_record):
    await second_attempt(pool, "j")
    for r in on_record:
        await task_reports.store(pool, r)
    assert await start(pool, epoch, "j") == ["j.a2.r0", "j.a2.r1"]
    assert await pool.fetchval("SELECT state FROM jobs WHERE job_id = 'j'") == "STARTING"


async def late(yield_first: bool, write):
    """Every other round the exit's write lets the start's go first, so both orders come up."""
    if yield_first:
        await asyncio.sleep(0)
    return await write


async def test_a_late_last_exit_racing_the_start_of_the_next_attempt_never_follows_it(pool, epoch):
    """Each round the last rank's exit and the next attempt's start are written at once: the
    start is refused, or its lease was created before the exit was on record."""
    outcomes = []
    for i in range(40):
        job_id = f"j{i}"
        await second_attempt(pool, job_id)
        await task_reports.store(pool, exit0(job_id, 0))
        stored, started = await asyncio.gather(
            late(i % 2 == 1, task_reports.store(pool, exit0(job_id, 1))),
            start(pool, epoch, job_id),
            return_exceptions=True,
        )
        assert stored is True
        on_record = await pool.fetchval("SELECT received_at FROM task_reports WHERE job_id = $1 AND rank = 1", job_id)
        if isinstance(started, EarlierAttemptSucceeded):
            outcomes.append("refused")
            assert await pool.fetchval("SELECT count(*) FROM leases WHERE job_id = $1", job_id) == 0
            continue
        assert not isinstance(started, BaseException), started
        placed = await pool.fetchval("SELECT min(created_at) FROM leases WHERE job_id = $1", job_id)
        assert placed < on_record, (job_id, placed, on_record)
        outcomes.append("placed first")
        await allocations.release_job(pool, job_id, 2, reason="test", actor="test")
    assert len(outcomes) == 40
