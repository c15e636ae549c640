"""The durable report store (store.task_reports) on real Postgres: a report sent again is one
row, delivery order is arrival order, and what is on record is what the leader acts on."""

from __future__ import annotations

import asyncio

from store import task_reports


def report(lease: str, state: str = "EXITED", *, job: str = "j-1", attempt: int = 1, rank: int = 0, **kw) -> dict:
    return {
        "lease_id": lease,
        "job_id": job,
        "attempt": attempt,
        "epoch": kw.pop("epoch", 3),
        "rank": rank,
        "node_id": "n-0",
        "state": state,
        "exit_code": kw.pop("exit_code", 0 if state == "EXITED" else None),
        "checkpoint_uri": kw.pop("checkpoint_uri", None),
        **kw,
    }


async def test_a_report_sent_again_is_stored_once(pool):
    assert await task_reports.store(pool, report("l-1"))
    assert not await task_reports.store(pool, report("l-1"))  # the agent re-sent it
    # the same lease at a newer epoch, or a new checkpoint, is a new report
    assert await task_reports.store(pool, report("l-1", epoch=4))
    assert await task_reports.store(pool, report("l-1", "RUNNING", checkpoint_uri="file:///ck/1"))
    assert not await task_reports.store(pool, report("l-1", "RUNNING", checkpoint_uri="file:///ck/1"))
    assert await task_reports.store(pool, report("l-1", "RUNNING", checkpoint_uri="file:///ck/2"))
    assert await pool.fetchval("SELECT count(*) FROM task_reports") == 4


async def test_concurrent_copies_of_one_report_make_one_row(pool):
    won = await asyncio.gather(*(task_reports.store(pool, report("l-9", rank=2)) for _ in range(16)))
    assert sorted(won) == [False] * 15 + [True]


async def test_undelivered_in_arrival_order_until_marked(pool):
    for i, job in enumerate(["j-a", "j-b", "j-a", "j-c"]):
        await task_reports.store(pool, report(f"l-{i}", job=job))
    rows = await task_reports.undelivered(pool)
    assert [(r.job_id, r.report["lease_id"]) for r in rows] == [
        ("j-a", "l-0"),
        ("j-b", "l-1"),
        ("j-a", "l-2"),
        ("j-c", "l-3"),
    ]
    assert [r.job_id for r in await task_reports.undelivered(pool, skip_jobs=["j-a"])] == ["j-b", "j-c"]
    await task_reports.mark(pool, [rows[0].id, rows[2].id], "delivered")
    await task_reports.mark(pool, [rows[1].id], "job_finished")
    assert [r.job_id for r in await task_reports.undelivered(pool)] == ["j-c"]
    # marking again changes nothing (a second leader marked the same rows)
    await task_reports.mark(pool, [rows[0].id], "job_finished")
    assert await pool.fetchval("SELECT outcome FROM task_reports WHERE id = $1", rows[0].id) == "delivered"


async def test_exits_on_record_and_ranks_that_exited_0(pool):
    await task_reports.store(pool, report("l-0", rank=0))
    await task_reports.store(pool, report("l-1", rank=1, exit_code=1))
    await task_reports.store(pool, report("l-2", "RUNNING", rank=2, checkpoint_uri="file:///ck"))
    await task_reports.store(pool, report("l-3", "LOST", rank=3))
    assert await task_reports.exits_for(pool, ["l-0", "l-1", "l-2", "l-3", "l-4"]) == {"l-0", "l-1", "l-3"}
    assert await task_reports.ranks_exited_ok(pool, "j-1", 1) == 1
    await task_reports.store(pool, report("l-0", rank=0, epoch=5))  # rank 0 again: still one rank
    assert await task_reports.ranks_exited_ok(pool, "j-1", 1) == 1
    assert await task_reports.ranks_exited_ok(pool, "j-1", 2) == 0


async def test_prune_forgets_only_delivered_reports(pool):
    await task_reports.store(pool, report("l-0"))
    await task_reports.store(pool, report("l-1"))
    (first, _) = await task_reports.undelivered(pool)
    await task_reports.mark(pool, [first.id], "delivered")
    assert await task_reports.prune(pool, older_than_s=0.0) == 1
    assert [r.report["lease_id"] for r in await task_reports.undelivered(pool)] == ["l-1"]


async def test_a_terminal_report_keeps_its_cause(pool):
    await task_reports.store(pool, report("l-0", exit_code=137, signal=9, stderr_tail="Traceback\nKilled", reason=""))
    await task_reports.store(pool, report("l-1", rank=1, exit_code=1, stderr_tail="bad \x00 byte"))
    await task_reports.store(pool, report("l-2", rank=2, exit_code=1, stderr_tail="é" + "x" * 9000))
    row = await pool.fetchrow("SELECT signal, stderr_tail, report FROM task_reports WHERE lease_id = 'l-0'")
    assert (row["signal"], row["stderr_tail"]) == (9, "Traceback\nKilled")
    assert "stderr_tail" not in row["report"]  # stored once, in its column
    ends = {e.rank: e for e in await task_reports.rank_ends(pool, "j-1")}
    assert ends[1].stderr_tail == "bad \ufffd byte"  # Postgres text holds no NUL
    assert len(ends[2].stderr_tail.encode()) == task_reports.TAIL_BYTES and ends[2].stderr_tail.endswith("x")
    assert (ends[0].exit_code, ends[0].signal, ends[0].node_id, ends[0].attempt) == (137, 9, "n-0", 1)


async def test_rank_ends_are_each_ranks_latest_end_in_the_newest_attempt(pool):
    await task_reports.store(pool, report("a1-r0", attempt=1, rank=0, exit_code=1, at="2026-01-01T00:00:02+00:00"))
    await task_reports.store(pool, report("a1-r1", "STOPPED", attempt=1, rank=1, exit_code=143))
    await task_reports.store(pool, report("a2-r0", "RUNNING", attempt=2, rank=0, checkpoint_uri="file:///ck"))
    await task_reports.store(pool, report("other", job="j-2", attempt=5))
    # attempt 2 has no end yet: the newest attempt with one is 1
    ends = await task_reports.rank_ends(pool, "j-1")
    assert [(e.attempt, e.rank, e.state) for e in ends] == [(1, 0, "EXITED"), (1, 1, "STOPPED")]
    assert task_reports.failing(ends).rank == 0  # a rank's own failure beats the ranks stopped for it
    await task_reports.store(pool, report("a2-r0", attempt=2, rank=0, exit_code=0))
    await task_reports.store(pool, report("a2-r1", attempt=2, rank=1, exit_code=3, at="2026-01-01T00:00:05+00:00"))
    await task_reports.store(pool, report("a2-r2", attempt=2, rank=2, exit_code=1, at="2026-01-01T00:00:01+00:00"))
    ends = await task_reports.rank_ends(pool, "j-1")
    assert [(e.attempt, e.rank, e.exit_code) for e in ends] == [(2, 0, 0), (2, 1, 3), (2, 2, 1)]
    assert task_reports.failing(ends).rank == 2  # the first to fail, not the lowest rank
    assert [e.rank for e in await task_reports.rank_ends(pool, "j-1", 1)] == [0, 1]
    assert task_reports.failing([e for e in ends if e.exit_code == 0]) is None
    # a re-started replica (same rank, new lease or epoch): its latest end
    await task_reports.store(pool, report("a2-r2", attempt=2, rank=2, exit_code=0, epoch=7))
    assert {e.rank: e.exit_code for e in await task_reports.rank_ends(pool, "j-1")}[2] == 0


async def test_prune_keeps_why_the_newest_failed_attempt_ended(pool):
    await task_reports.store(pool, report("a1-r0", attempt=1, rank=0, exit_code=1, stderr_tail="boom 1"))
    await task_reports.store(pool, report("a2-r0", attempt=2, rank=0, exit_code=1, stderr_tail="boom 2"))
    await task_reports.store(pool, report("a2-r1", "STOPPED", attempt=2, rank=1, exit_code=143))
    await task_reports.store(pool, report("a2-r2", attempt=2, rank=2, exit_code=0))
    await task_reports.store(pool, report("ok", job="j-ok", exit_code=0))
    await task_reports.mark(pool, [r.id for r in await task_reports.undelivered(pool)], "delivered")
    assert await task_reports.prune(pool, older_than_s=0.0) == 3  # attempt 1, the exit 0s
    ends = await task_reports.rank_ends(pool, "j-1")
    assert [(e.attempt, e.rank, e.stderr_tail) for e in ends] == [(2, 0, "boom 2"), (2, 1, "")]
    assert await task_reports.rank_ends(pool, "j-ok") == []
    assert await task_reports.prune(pool, older_than_s=0.0) == 0


async def test_finished_attempts_of_many_jobs_are_one_query_with_each_jobs_rule(pool):
    """``succeeded_attempts``: per job, the newest earlier attempt whose every rank exited 0."""
    for job, attempt, rank, state in [
        ("done", 1, 0, "EXITED"),
        ("done", 1, 1, "EXITED"),
        ("half", 1, 0, "EXITED"),  # one rank of two
        ("half", 1, 1, "LOST"),
        ("twice", 1, 0, "EXITED"),
        ("twice", 2, 0, "EXITED"),
        ("now", 3, 0, "EXITED"),  # the attempt asked about itself: not earlier
    ]:
        await task_reports.store(pool, report(f"{job}.a{attempt}.r{rank}", state, job=job, attempt=attempt, rank=rank))
    await task_reports.store(pool, report("failed.a1.r0", job="failed", exit_code=3))
    asks = [("done", 2, 2), ("half", 2, 2), ("twice", 3, 1), ("now", 3, 1), ("failed", 2, 1), ("none", 2, 1)]
    assert await task_reports.succeeded_attempts(pool, asks) == {"done": 1, "twice": 2}
    for job, before, replicas in asks:
        single = await task_reports.succeeded_attempt(pool, job, before=before, replicas=replicas)
        assert single == {"done": 1, "twice": 2}.get(job)
    assert await task_reports.succeeded_attempts(pool, []) == {}
