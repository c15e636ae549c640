"""The leader publishes the hot spares it holds for large gangs (docs/design.md, Placement):
a write only when the set changes, under the epoch, so the API can show them while the
control plane is down. The leader state runs on a real database; no Temporal is needed
(the cycle's signals go out in the background and a failed one is only logged)."""

from __future__ import annotations

import dataclasses

import pytest

from control.leader.state import policy_from_settings
from store import allocations, leadership, publications
from store.errors import StaleEpoch
from tests.foundation.builders import queued_job, small_cluster, team
from tests.support import force_job_state
from tests.workflows.harness import leader_cycles, scaled_settings


@pytest.fixture
async def leader(pool, tmp_path):
    settings = scaled_settings(tmp_path)
    async with pool.acquire() as conn:
        await small_cluster(conn, blocks=2, nodes_per_block=4)
        await team(conn, "alpha", 64, 0)
    epoch = await leadership.acquire_leadership(
        pool, scope=settings.leader_scope, holder="test", grpc_addr="-", ttl_s=3600
    )
    assert epoch is not None
    # a gang of >= 16 GPUs gets ceil(0.5 x its nodes) hot spares
    policy = dataclasses.replace(policy_from_settings(settings), hot_spare_min_gpus=16, hot_spare_fraction=0.5)
    return await leader_cycles(pool, settings, epoch, policy), epoch


async def published(pool) -> dict[str, tuple[str, int]]:
    return {r["node_id"]: (r["job_id"], r["epoch"]) for r in await pool.fetch("SELECT * FROM hot_spares")}


async def test_leader_publishes_hot_spares_on_change_only(pool, leader, monkeypatch):
    cycles, epoch = leader
    writes: list[dict[str, str]] = []
    real = publications.publish_hot_spares

    async def counting(db, **kw):
        writes.append(dict(kw["spares"]))
        await real(db, **kw)

    monkeypatch.setattr(publications, "publish_hot_spares", counting)
    async with pool.acquire() as conn:
        await queued_job(conn, "big", "alpha", replicas=4, gpus_per_replica=8)  # 32 GPUs, 4 whole nodes
        await queued_job(conn, "small", "alpha", replicas=1, gpus_per_replica=2)  # below the threshold
    result = await cycles.run_cycle(epoch)
    assert result.placed == 2
    big_nodes = {r["node_id"] for r in await pool.fetch("SELECT node_id FROM leases WHERE job_id = 'big'")}
    assert len(big_nodes) == 4
    spares = await published(pool)
    assert len(spares) == 2 and set(spares.values()) == {("big", epoch)}  # ceil(0.5 x 4)
    assert not set(spares) & big_nodes
    assert not await pool.fetchval("SELECT count(*) FROM allocations WHERE node_id = ANY($1::text[])", list(spares))
    assert spares.keys() == set(cycles.state.cluster.spares("big"))
    assert len(writes) == 1

    # nothing changed: no write
    await cycles.run_cycle(epoch)
    await cycles.run_cycle(epoch)
    assert len(writes) == 1

    # the gang ends: its spares go back to the pool, and the published rows with them
    await force_job_state(pool, "UPDATE jobs SET state = 'SUCCEEDED' WHERE job_id = 'big'")
    await allocations.release_job(pool, "big", 1, reason="done", actor="test")
    await cycles.run_cycle(epoch)
    assert await published(pool) == {}
    assert writes[-1] == {} and len(writes) == 2


async def test_a_deposed_leader_cannot_publish_spares(pool, leader):
    cycles, epoch = leader
    async with pool.acquire() as conn:
        await queued_job(conn, "big", "alpha", replicas=2, gpus_per_replica=8)
    await cycles.run_cycle(epoch)
    before = await published(pool)
    assert len(before) == 1
    await pool.execute("UPDATE leader SET epoch = epoch + 1 WHERE scope = $1", cycles.scope)
    with pytest.raises(StaleEpoch):
        await publications.publish_hot_spares(pool, scope=cycles.scope, epoch=epoch, spares={})
    assert await published(pool) == before


async def test_guaranteed_work_that_waited_takes_a_spare_and_the_published_set_shrinks(pool, leader):
    """Policy.spares_yield_after_s through the leader: the plan's ``spares_taken`` node leaves
    the gang's pool in the leader's state and in the published rows, and the job's lease is on it."""
    cycles, epoch = leader
    async with pool.acquire() as conn:
        await queued_job(conn, "big", "alpha", replicas=4, gpus_per_replica=8)  # 4 nodes, 2 spares
    await cycles.run_cycle(epoch)
    spares = await published(pool)
    assert len(spares) == 2
    async with pool.acquire() as conn:
        await queued_job(conn, "fill1", "alpha", gpus_per_replica=8)
        await queued_job(conn, "fill2", "alpha", gpus_per_replica=8)
    await cycles.run_cycle(epoch)
    async with pool.acquire() as conn:
        await queued_job(conn, "late", "alpha", gpus_per_replica=8)  # 56 of alpha's 64 guaranteed GPUs
    cycles.policy = dataclasses.replace(cycles.policy, spares_yield_after_s=None)
    await cycles.run_cycle(epoch)
    assert await published(pool) == spares
    assert not await pool.fetchval("SELECT count(*) FROM allocations WHERE job_id = 'late'")
    cycles.policy = dataclasses.replace(cycles.policy, spares_yield_after_s=0.0)
    await cycles.run_cycle(epoch)
    late_nodes = {r["node_id"] for r in await pool.fetch("SELECT node_id FROM leases WHERE job_id = 'late'")}
    assert len(late_nodes) == 1 and late_nodes <= spares.keys()
    left = await published(pool)
    assert len(left) == 1 and left.keys() == spares.keys() - late_nodes
    assert left.keys() == set(cycles.state.cluster.spares("big"))
