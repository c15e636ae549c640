"""The allocation invariants, against the real embedded Postgres (docs/design.md, Invariants)."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from store import allocations, jobs, leadership
from store.errors import AllocationConflict, QuotaExceeded, StaleEpoch
from tests.foundation.builders import gang, leader, queued_job, small_cluster, team

SCOPE = "placement"


@pytest.fixture
async def cluster(pool):
    async with pool.acquire() as conn:
        nodes = await small_cluster(conn, nodes_per_block=2)
        await team(conn, "alpha", guaranteed=16, borrow_limit=0)
        await team(conn, "beta", guaranteed=16, borrow_limit=0)
    return nodes


async def count(pool, sql, *args) -> int:
    return await pool.fetchval(sql, *args)


async def test_second_allocation_of_same_gpu_fails(pool, cluster):
    epoch = await leader(pool)
    async with pool.acquire() as conn:
        await queued_job(conn, "j1", "alpha")
        await queued_job(conn, "j2", "beta")
    await allocations.commit_gang(
        pool, scope=SCOPE, epoch=epoch, job_id="j1", attempt=1, placements=gang(("b0-n0", (3,)))
    )
    with pytest.raises(AllocationConflict):
        await allocations.commit_gang(
            pool, scope=SCOPE, epoch=epoch, job_id="j2", attempt=1, placements=gang(("b0-n0", (3,)))
        )
    owner = await pool.fetchval("SELECT job_id FROM allocations WHERE node_id = 'b0-n0' AND gpu_index = 3")
    assert owner == "j1"
    assert await pool.fetchval("SELECT state FROM jobs WHERE job_id = 'j2'") == "QUEUED"


async def test_gang_whose_last_row_conflicts_leaves_nothing(pool, cluster):
    epoch = await leader(pool)
    async with pool.acquire() as conn:
        await queued_job(conn, "blocker", "alpha")
        await queued_job(conn, "big", "beta", replicas=2, gpus_per_replica=8)
    await allocations.commit_gang(
        pool, scope=SCOPE, epoch=epoch, job_id="blocker", attempt=1, placements=gang(("b0-n1", (7,)))
    )
    with pytest.raises(AllocationConflict):
        await allocations.commit_gang(
            pool,
            scope=SCOPE,
            epoch=epoch,
            job_id="big",
            attempt=1,
            placements=gang(("b0-n0", tuple(range(8))), ("b0-n1", tuple(range(8)))),
        )
    assert await count(pool, "SELECT count(*) FROM allocations WHERE job_id = 'big'") == 0
    assert await count(pool, "SELECT count(*) FROM leases WHERE job_id = 'big'") == 0
    assert await count(pool, "SELECT count(*) FROM audit WHERE subject = 'big'") == 0
    assert await count(pool, "SELECT count(*) FROM job_events WHERE job_id = 'big'") == 0


async def test_commit_with_stale_epoch_fails_and_writes_nothing(pool, cluster):
    old = await leader(pool, "c1")
    await pool.execute("UPDATE leader SET expires_at = now() - interval '1 s'")
    new = await leader(pool, "c2")
    assert new > old
    async with pool.acquire() as conn:
        await queued_job(conn, "j1", "alpha")
    with pytest.raises(StaleEpoch):
        await allocations.commit_gang(
            pool, scope=SCOPE, epoch=old, job_id="j1", attempt=1, placements=gang(("b0-n0", (0,)))
        )
    assert await count(pool, "SELECT count(*) FROM allocations") == 0
    assert await count(pool, "SELECT count(*) FROM leases") == 0
    assert await count(pool, "SELECT count(*) FROM audit WHERE action = 'allocate'") == 0
    await allocations.commit_gang(
        pool, scope=SCOPE, epoch=new, job_id="j1", attempt=1, placements=gang(("b0-n0", (0,)))
    )


async def test_fifty_racing_commits_leave_one_owner_per_gpu(pool, cluster):
    """50 concurrent tasks commit overlapping gangs on 2 nodes x 8 GPUs."""
    epoch = await leader(pool)
    async with pool.acquire() as conn:
        await team(conn, "alpha", guaranteed=1000, borrow_limit=0)
        for i in range(50):
            await queued_job(conn, f"r{i}", "alpha", replicas=2, gpus_per_replica=4)

    async def attempt(i: int):
        # overlapping windows of 4 GPUs on each node
        a, b = i % 5, (i * 3) % 5
        placements = gang(("b0-n0", tuple(range(a, a + 4))), ("b0-n1", tuple(range(b, b + 4))))
        try:
            await allocations.commit_gang(
                pool, scope=SCOPE, epoch=epoch, job_id=f"r{i}", attempt=1, placements=placements
            )
            return "ok"
        except AllocationConflict as e:
            return e

    results = await asyncio.gather(*(attempt(i) for i in range(50)))
    winners = [i for i, r in enumerate(results) if r == "ok"]
    losers = [r for r in results if r != "ok"]
    assert winners and losers
    assert all(isinstance(r, AllocationConflict) for r in losers)
    rows = await pool.fetch("SELECT node_id, gpu_index, job_id FROM allocations")
    assert len({(r["node_id"], r["gpu_index"]) for r in rows}) == len(rows)
    # every winner holds its whole gang; no loser holds anything
    by_job = {}
    for r in rows:
        by_job.setdefault(r["job_id"], 0)
        by_job[r["job_id"]] += 1
    assert sorted(by_job) == sorted(f"r{i}" for i in winners)
    assert all(n == 8 for n in by_job.values())


async def test_guaranteed_usage_above_guarantee_is_refused(pool, cluster):
    epoch = await leader(pool)
    async with pool.acquire() as conn:
        await team(conn, "small", guaranteed=4, borrow_limit=2)
        await queued_job(conn, "g1", "small", gpus_per_replica=4)
        await queued_job(conn, "g2", "small", gpus_per_replica=1)
        await queued_job(conn, "b1", "small", gpus_per_replica=2)
        await queued_job(conn, "b2", "small", gpus_per_replica=1)
    await allocations.commit_gang(
        pool, scope=SCOPE, epoch=epoch, job_id="g1", attempt=1, placements=gang(("b0-n0", (0, 1, 2, 3)))
    )
    with pytest.raises(QuotaExceeded):
        await allocations.commit_gang(
            pool, scope=SCOPE, epoch=epoch, job_id="g2", attempt=1, placements=gang(("b0-n0", (4,)))
        )
    # borrowing is allowed up to the borrow limit, and marked
    await allocations.commit_gang(
        pool, scope=SCOPE, epoch=epoch, job_id="b1", attempt=1, placements=gang(("b0-n0", (4, 5)), borrowed=True)
    )
    with pytest.raises(QuotaExceeded):
        await allocations.commit_gang(
            pool, scope=SCOPE, epoch=epoch, job_id="b2", attempt=1, placements=gang(("b0-n0", (6,)), borrowed=True)
        )
    flags = await pool.fetch("SELECT job_id, borrowed FROM allocations ORDER BY gpu_index")
    assert [(r["job_id"], r["borrowed"]) for r in flags] == [("g1", False)] * 4 + [("b1", True)] * 2


async def test_every_commit_writes_its_audit_row_in_the_same_transaction(pool, cluster):
    epoch = await leader(pool)
    async with pool.acquire() as conn:
        await queued_job(conn, "j1", "alpha", replicas=2, gpus_per_replica=2)
    await allocations.commit_gang(
        pool, scope=SCOPE, epoch=epoch, job_id="j1", attempt=1, placements=gang(("b0-n0", (0, 1)), ("b0-n1", (0, 1)))
    )
    audit = await pool.fetch("SELECT actor, action, detail, xmin::text AS tx FROM audit WHERE subject = 'j1'")
    alloc_tx = {r["tx"] for r in await pool.fetch("SELECT xmin::text AS tx FROM allocations WHERE job_id = 'j1'")}
    event = await pool.fetchrow("SELECT from_state, to_state, xmin::text AS tx FROM job_events WHERE job_id = 'j1'")
    assert [r["action"] for r in audit] == ["allocate"]
    assert alloc_tx == {audit[0]["tx"]} == {event["tx"]}
    assert (event["from_state"], event["to_state"]) == ("QUEUED", "STARTING")
    assert len(audit[0]["detail"]["placements"]) == 2


async def test_release_by_lease_never_frees_a_newer_lease(pool, cluster):
    epoch = await leader(pool)
    async with pool.acquire() as conn:
        await queued_job(conn, "j1", "alpha")
        await queued_job(conn, "j2", "alpha")
    (l1,) = await allocations.commit_gang(
        pool, scope=SCOPE, epoch=epoch, job_id="j1", attempt=1, placements=gang(("b0-n0", (0,)))
    )
    assert await allocations.release_lease(pool, l1, reason="exited", actor="test")
    (l2,) = await allocations.commit_gang(
        pool, scope=SCOPE, epoch=epoch, job_id="j2", attempt=1, placements=gang(("b0-n0", (0,)))
    )
    # a stale, duplicated "task exited" for the old lease
    assert not await allocations.release_lease(pool, l1, reason="exited", actor="test")
    assert await pool.fetchval("SELECT lease_id FROM allocations WHERE node_id = 'b0-n0' AND gpu_index = 0") == l2


async def test_leadership_is_exclusive_and_epochs_increase(pool):
    e1 = await leader(pool, "c1")
    assert await leadership.acquire_leadership(pool, scope=SCOPE, holder="c2", grpc_addr="a", ttl_s=30) is None
    assert await leadership.renew_leadership(pool, scope=SCOPE, holder="c1", epoch=e1, ttl_s=30)
    await leadership.resign_leadership(pool, scope=SCOPE, holder="c1", epoch=e1)
    e2 = await leader(pool, "c2")
    assert e2 == e1 + 1
    assert not await leadership.renew_leadership(pool, scope=SCOPE, holder="c1", epoch=e1, ttl_s=30)


async def test_a_begin_cut_short_gives_the_connection_back_to_the_pool(pool, monkeypatch):
    """A task cancelled while its BEGIN runs (seen in CI after a test killed the leader; which of
    its tasks was not found) must not keep the connection: it goes back to the pool, rolled
    back, and the pool still closes."""
    import asyncpg.transaction

    from store.tx import transaction

    real_start = asyncpg.transaction.Transaction.start

    async def begin_then_cancelled(self):
        await real_start(self)  # the server ran BEGIN; the task is cancelled as the reply comes
        raise asyncio.CancelledError

    monkeypatch.setattr(asyncpg.transaction.Transaction, "start", begin_then_cancelled)
    with pytest.raises(asyncio.CancelledError):
        async with transaction(pool):
            pytest.fail("the body must not run")
    monkeypatch.undo()
    assert pool.get_size() == pool.get_idle_size()  # nothing left checked out
    stuck = await pool.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND state = 'idle in transaction'"
    )
    assert stuck == 0
    async with transaction(pool) as conn:  # and the pool still serves transactions
        assert await conn.fetchval("SELECT 1") == 1
    await asyncio.wait_for(pool.close(), 10)


async def test_each_team_has_its_own_number_for_its_ranks_user(pool, cluster):
    """Agents run a team's ranks as agent_rank_id_base + teams.rank_id (docs/security.md):
    the store numbers each team once, never twice the same, and no write may change it."""
    numbers = dict(await pool.fetch("SELECT name, rank_id FROM teams"))
    assert set(numbers) >= {"alpha", "beta"} and None not in numbers.values()
    assert len(set(numbers.values())) == len(numbers)
    await pool.execute("INSERT INTO teams (name) VALUES ('gamma')")
    assert await pool.fetchval("SELECT rank_id FROM teams WHERE name = 'gamma'") > max(numbers.values())
    for sql in (
        "UPDATE teams SET rank_id = 99 WHERE name = 'alpha'",
        "INSERT INTO teams (name, rank_id) VALUES ('delta', 99)",
    ):
        with pytest.raises(asyncpg.exceptions.GeneratedAlwaysError):
            await pool.execute(sql)
    # the job's snapshot carries it to the StartTask
    async with pool.acquire() as conn:
        await queued_job(conn, "j1", "beta")
    job, _ = await jobs.load_job(pool, "j1")
    assert job is not None and job["team_rank_id"] == numbers["beta"]


async def test_each_job_has_its_own_number_above_every_teams(pool, cluster):
    """Agents run a job's ranks as uid agent_rank_id_base + jobs.rank_id (docs/security.md):
    one number per job, never reused or changed, and never one a team's user had (teams are
    numbered below 1,000,000, jobs from it)."""
    async with pool.acquire() as conn:
        for i, team in enumerate(("alpha", "alpha", "beta")):
            await queued_job(conn, f"j{i}", team)
    numbered = [(await jobs.load_job(pool, f"j{i}"))[0]["job_rank_id"] for i in range(3)]
    assert len(set(numbered)) == 3 and min(numbered) >= 1_000_000, numbered
    assert numbered == [await pool.fetchval("SELECT rank_id FROM jobs WHERE job_id = $1", f"j{i}") for i in range(3)]
    with pytest.raises(asyncpg.exceptions.GeneratedAlwaysError):
        await pool.execute("UPDATE jobs SET rank_id = 1000000 WHERE job_id = 'j2'")
    assert (
        await pool.fetchval(
            "SELECT seqmax FROM pg_sequence WHERE seqrelid = pg_get_serial_sequence('teams', 'rank_id')::regclass"
        )
        == 999_999
    )
