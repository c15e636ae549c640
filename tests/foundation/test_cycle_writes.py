"""A placement cycle's batched writes, against the real embedded Postgres: its victims are
marked PREEMPTING in one transaction (``job_states.mark_preempting_many``), each mark decided
as it would be alone, every change with its job event and audit row, and
nothing written when the epoch is stale or a job is unknown; its relabels likewise
(``allocations.relabel_jobs``)."""

from __future__ import annotations

import pytest

from store import allocations, job_states
from store.errors import StaleEpoch, UnknownSubject
from store.job_states import PreemptMark
from tests.foundation.builders import gang, leader, queued_job, small_cluster, team

SCOPE = "placement"


async def _placed(pool, epoch: int, job_id: str, node: str, gpu: int, *, running: bool) -> None:
    async with pool.acquire() as conn:
        await queued_job(conn, job_id, "alpha")
    await allocations.commit_gang(
        pool, scope=SCOPE, epoch=epoch, job_id=job_id, attempt=1, placements=gang((node, (gpu,)))
    )
    if running:
        await pool.execute("UPDATE jobs SET state = 'RUNNING', started_at = now() WHERE job_id = $1", job_id)


async def _rows(pool, job_id: str) -> tuple[str, int, int, int]:
    state, preemptions = await pool.fetchrow("SELECT state, preemptions FROM jobs WHERE job_id = $1", job_id)
    events = await pool.fetchval("SELECT count(*) FROM job_events WHERE job_id = $1 AND event = 'preempting'", job_id)
    audits = await pool.fetchval("SELECT count(*) FROM audit WHERE subject = $1 AND action = 'preempt'", job_id)
    return state, preemptions, events, audits


@pytest.fixture
async def stage(pool):
    async with pool.acquire() as conn:
        await small_cluster(conn, nodes_per_block=2)
        await team(conn, "alpha", guaranteed=16)
    epoch = await leader(pool)
    await _placed(pool, epoch, "run-a", "b0-n0", 0, running=True)
    await _placed(pool, epoch, "run-b", "b0-n0", 1, running=True)
    await _placed(pool, epoch, "starting", "b0-n1", 0, running=False)
    await _placed(pool, epoch, "already", "b0-n1", 1, running=True)
    # an earlier cycle's victim
    await job_states.mark_preempting_many(
        pool, scope=SCOPE, epoch=epoch, marks=[PreemptMark("already", 1, "earlier", "x")]
    )
    async with pool.acquire() as conn:
        await queued_job(conn, "waiting", "alpha")
    return epoch


async def test_each_victim_is_marked_as_alone_with_its_event_and_audit_row(pool, stage):
    epoch = stage
    marks = [
        PreemptMark("run-b", 1, "priority: for big", "big"),
        PreemptMark("starting", 1, "reclaim: for big", "big"),
        PreemptMark("already", 1, "priority: for big", "big"),  # already stopping: a no-op
        PreemptMark("run-a", 2, "priority: for big", "big"),  # another attempt: refused
        PreemptMark("waiting", 1, "priority: for big", "big"),  # not running: refused
        PreemptMark("run-b", 1, "priority: for big", "big"),  # the same mark again: a no-op
    ]
    out = await job_states.mark_preempting_many(pool, scope=SCOPE, epoch=epoch, marks=marks)
    assert [(o.applied, o.state, o.attempt) for o in out] == [
        (True, "PREEMPTING", 1),
        (True, "PREEMPTING", 1),
        (True, "PREEMPTING", 1),
        (False, "RUNNING", 1),
        (False, "QUEUED", 1),
        (True, "PREEMPTING", 1),
    ]
    assert await _rows(pool, "run-b") == ("PREEMPTING", 1, 1, 1)
    assert await _rows(pool, "starting") == ("PREEMPTING", 1, 1, 1)
    assert await _rows(pool, "already") == ("PREEMPTING", 1, 1, 1)  # only the earlier mark's rows
    assert await _rows(pool, "run-a") == ("RUNNING", 0, 0, 0)
    assert await _rows(pool, "waiting") == ("QUEUED", 0, 0, 0)
    event = await pool.fetchrow(
        "SELECT from_state, to_state, reason, detail, actor FROM job_events WHERE job_id = 'starting'"
        " AND event = 'preempting'"
    )
    assert (event["from_state"], event["to_state"], event["reason"], event["actor"]) == (
        "STARTING",
        "PREEMPTING",
        "reclaim: for big",
        "placement",
    )
    assert event["detail"] == {"attempt": 1, "epoch": epoch, "by_job": "big"}
    audit = await pool.fetchrow(
        "SELECT actor, reason, detail FROM audit WHERE subject = 'run-b' AND action = 'preempt'"
    )
    assert (audit["actor"], audit["reason"], audit["detail"]) == ("placement", "priority: for big", event["detail"])


async def test_a_stale_epoch_marks_nothing(pool, stage):
    old = stage
    await pool.execute("UPDATE leader SET expires_at = now() - interval '1 s'")
    new = await leader(pool, "c2")
    assert new > old
    with pytest.raises(StaleEpoch):
        await job_states.mark_preempting_many(
            pool, scope=SCOPE, epoch=old, marks=[PreemptMark("run-a", 1, "priority", "big")]
        )
    assert await _rows(pool, "run-a") == ("RUNNING", 0, 0, 0)


async def test_an_unknown_job_marks_none_of_the_others(pool, stage):
    marks = [PreemptMark("run-a", 1, "priority", "big"), PreemptMark("no-such-job", 1, "priority", "big")]
    with pytest.raises(UnknownSubject, match="no-such-job"):
        await job_states.mark_preempting_many(pool, scope=SCOPE, epoch=stage, marks=marks)
    assert await _rows(pool, "run-a") == ("RUNNING", 0, 0, 0)


async def test_no_marks_is_no_transaction(pool, stage):
    assert await job_states.mark_preempting_many(pool, scope=SCOPE, epoch=stage, marks=[]) == []


async def _borrowed(pool, job_id: str) -> list[bool]:
    rows = await pool.fetch("SELECT borrowed FROM allocations WHERE job_id = $1 ORDER BY gpu_index", job_id)
    return [r["borrowed"] for r in rows]


async def _relabel_audits(pool, job_id: str) -> list[dict]:
    rows = await pool.fetch("SELECT detail FROM audit WHERE subject = $1 AND action = 'relabel' ORDER BY id", job_id)
    return [r["detail"] for r in rows]


async def test_a_cycles_relabels_are_one_transaction_each_audited_where_it_changed(pool, stage):
    epoch = stage
    out = await allocations.relabel_jobs(
        pool,
        scope=SCOPE,
        epoch=epoch,
        relabels=[
            ("run-a", True),
            ("run-b", False),  # already guaranteed: no change, no audit row
            ("starting", True),
            ("starting", False),  # named twice: the last one applies
        ],
    )
    assert out == [1, 0, 0, 0]
    assert await _borrowed(pool, "run-a") == [True]
    assert await _borrowed(pool, "run-b") == [False]
    assert await _borrowed(pool, "starting") == [False]
    assert await _relabel_audits(pool, "run-a") == [{"borrowed": True, "gpus": 1, "epoch": epoch}]
    assert await _relabel_audits(pool, "run-b") == []
    assert await _relabel_audits(pool, "starting") == []
    back = await allocations.relabel_jobs(pool, scope=SCOPE, epoch=epoch, relabels=[("run-a", False)])
    assert back == [1] and await _borrowed(pool, "run-a") == [False]


async def test_a_stale_epoch_relabels_nothing(pool, stage):
    old = stage
    await pool.execute("UPDATE leader SET expires_at = now() - interval '1 s'")
    await leader(pool, "c2")
    with pytest.raises(StaleEpoch):
        await allocations.relabel_jobs(pool, scope=SCOPE, epoch=old, relabels=[("run-a", True), ("run-b", True)])
    assert await _borrowed(pool, "run-a") == [False] and await _borrowed(pool, "run-b") == [False]
    assert await _relabel_audits(pool, "run-a") == []
