"""A placement cycle that fails after its gangs committed (Postgres going away while it marks
its victims) loses nothing: the next cycle learns the commits from the store's change feed,
signals the gangs it had not signalled, and places nothing twice (docs/design.md, "A cycle's
writes"; control/leader/state.py adopts what this leader did not signal)."""

from __future__ import annotations

import pytest

from placement.lifecycle import JobState
from store import job_states
from tests.foundation.builders import queued_job
from workflows import messages as m


async def test_gangs_committed_by_a_cycle_that_failed_are_signalled_by_the_next(pool, leader, monkeypatch):
    cycles, epoch = leader
    async with pool.acquire() as conn:
        await queued_job(conn, "a", "alpha", gpus_per_replica=4)

    real = job_states.mark_preempting_many

    async def postgres_gone(*args, **kwargs):
        raise ConnectionError("the connection was closed in the middle of operation")

    monkeypatch.setattr(job_states, "mark_preempting_many", postgres_gone)
    with pytest.raises(ConnectionError):
        await cycles.run_cycle(epoch)
    # committed in the store, but neither applied to the leader's memory nor signalled
    assert await pool.fetchval("SELECT state FROM jobs WHERE job_id = 'a'") == "STARTING"
    leased = await pool.fetch("SELECT node_id, gpu_index FROM allocations WHERE job_id = 'a'")
    assert len(leased) == 4
    assert cycles.state.jobs["a"].state == JobState.QUEUED
    assert "a" not in cycles.signals.pending

    monkeypatch.setattr(job_states, "mark_preempting_many", real)
    async with pool.acquire() as conn:
        await queued_job(conn, "b", "alpha", gpus_per_replica=4)
    stats = await cycles.run_cycle(epoch)
    assert stats.errors == [] and stats.failed_commits == 0
    assert stats.placed == 1  # b only: a is not placed again
    assert cycles.state.jobs["a"].state == JobState.STARTING
    pending = cycles.signals.pending["a"]
    assert pending.kind == JobState.STARTING and isinstance(pending.message, m.Allocation)
    assert sorted((r.node_id, g) for r in pending.message.ranks for g in r.gpu_indices) == sorted(
        (r["node_id"], r["gpu_index"]) for r in leased
    )
    assert cycles.state.cluster is not None and cycles.state.cluster.is_running("a")
    # one owner per GPU, and the two jobs' GPUs apart
    rows = await pool.fetch("SELECT job_id, node_id, gpu_index FROM allocations ORDER BY job_id")
    assert [r["job_id"] for r in rows].count("b") == 4
    assert len({(r["node_id"], r["gpu_index"]) for r in rows}) == 8
