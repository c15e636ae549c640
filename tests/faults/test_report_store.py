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
