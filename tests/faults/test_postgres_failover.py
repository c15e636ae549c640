"""Postgres failover on one machine (issue 24): a primary with a synchronous standby, the
supervisor's rules as a table, and the real pair SIGKILLed under writes.

The supervisor is stepped by hand here (``step``), so each test decides exactly what
happens between two observations; the chaos run drives it on its own loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from common.db import migrate
from common.postgres_failover import Action, FailoverSupervisor, Observation, decide
from common.postgres_pair import PostgresPair
from store.errors import StaleEpoch
from store.leadership import acquire_leadership, check_epoch
from tests.support import eventually

AFTER_S = 2.0


def obs(**kw: object) -> Observation:
    base: dict[str, object] = dict(
        primary_takes_writes=True, primary_running=True, primary_unreachable_s=0.0, standby_running=True,
        standby_streaming=True, standby_not_streaming_s=0.0, synchronous=True,
    )  # fmt: skip
    base.update(kw)
    return Observation(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "seen, action",
    [
        # all well: nothing to do
        (obs(), Action.NOTHING),
        # the primary's postmaster is gone and the standby held every acknowledged commit
        (obs(primary_takes_writes=False, primary_running=False, standby_streaming=False), Action.PROMOTE),
        # the primary runs but has not answered for after_s: fenced (SIGKILL) and replaced
        (obs(primary_takes_writes=False, primary_unreachable_s=AFTER_S, standby_streaming=False), Action.PROMOTE),
        # a blip shorter than after_s: wait
        (obs(primary_takes_writes=False, primary_unreachable_s=0.5, standby_streaming=False), Action.NOTHING),
        # no synchronous standby: it may miss acknowledged commits, so the primary comes back instead
        (
            obs(primary_takes_writes=False, primary_running=False, synchronous=False, standby_streaming=False),
            Action.RESTART_PRIMARY,
        ),
        # synchronous, but the standby died with the primary: nothing to promote
        (
            obs(primary_takes_writes=False, primary_running=False, standby_running=False, standby_streaming=False),
            Action.RESTART_PRIMARY,
        ),
        # a standby streams and commits do not wait for it yet
        (obs(synchronous=False), Action.MAKE_SYNCHRONOUS),
        # commits wait for a standby that stopped streaming after_s ago: they would hang
        (obs(standby_streaming=False, standby_not_streaming_s=AFTER_S), Action.MAKE_ASYNCHRONOUS),
        (obs(standby_streaming=False, standby_not_streaming_s=0.5), Action.NOTHING),
        # asynchronous, no standby running (first start, or the old primary after a failover)
        (obs(synchronous=False, standby_running=False, standby_streaming=False), Action.SEED_STANDBY),
        # asynchronous, a standby runs but never streamed within after_s: seed it again
        (obs(synchronous=False, standby_streaming=False, standby_not_streaming_s=AFTER_S), Action.SEED_STANDBY),
        (obs(synchronous=False, standby_streaming=False, standby_not_streaming_s=0.5), Action.NOTHING),
    ],
)
def test_the_supervisor_rules(seen: Observation, action: Action) -> None:
    assert decide(seen, AFTER_S) is action


# ---------------------------------------------------------------------- the real pair


async def steps_until(sup: FailoverSupervisor, action: Action, timeout: float) -> None:
    async def took() -> Action | None:
        return action if await sup.step() is action else None

    await eventually(took, timeout=timeout, interval=0.2, what=f"the supervisor to {action.value}")


@pytest.fixture
async def pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[PostgresPair, FailoverSupervisor]]:
    root = Path(tmp_path_factory.mktemp("pgha"))
    p = PostgresPair(root)
    await asyncio.to_thread(p.start)
    sup = FailoverSupervisor(p, probe_s=0.2, after_s=AFTER_S)
    try:
        assert await sup.wait_synchronous(60), sup.events
        conn = await asyncpg.connect(p.dsn)
        try:
            await migrate(conn)  # the platform's schema (the leader row and its epoch)
            await conn.execute("CREATE TABLE acked (i int PRIMARY KEY)")
        finally:
            await conn.close()
        yield p, sup
    finally:
        await asyncio.to_thread(p.stop)


async def _writer(dsn: str, acked: list[int], stop: asyncio.Event, errors: list[str]) -> None:
    """Insert 0, 1, 2, ... one per commit; a number is acknowledged once its commit returned."""
    i = 0
    while not stop.is_set():
        try:
            conn = await asyncpg.connect(dsn, timeout=2)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as e:
            errors.append(type(e).__name__)
            await asyncio.sleep(0.05)
            continue
        try:
            while not stop.is_set():
                await conn.execute("INSERT INTO acked VALUES ($1)", i)
                acked.append(i)
                i += 1
                await asyncio.sleep(0.005)
        except Exception as e:  # any failed commit (asyncpg raises several kinds as a server dies)
            errors.append(type(e).__name__)
            i += 1  # that one may or may not have committed: never acknowledged, never asserted
        finally:
            conn.terminate()


async def _fail_over_under_writes(p: PostgresPair, sup: FailoverSupervisor) -> float:
    """SIGKILL the primary while a writer commits; return seconds until writes went on."""
    acked: list[int] = []
    errors: list[str] = []
    stop = asyncio.Event()
    writer = asyncio.create_task(_writer(p.dsn, acked, stop, errors))
    supervise = asyncio.create_task(sup.run(stop))
    try:
        await eventually(lambda: len(acked) > 50, timeout=30, what="the writer committing")
        old = p.primary.name
        t0 = time.monotonic()
        await asyncio.to_thread(p.primary.kill)
        n = len(acked)
        await eventually(lambda: len(acked) > n + 20, timeout=30, what="writes going on after the primary's SIGKILL")
        back_s = time.monotonic() - t0
        assert p.primary.name != old
        assert any(e["kind"] == "promoted" for e in sup.events)
    finally:
        stop.set()
        await asyncio.gather(writer, supervise)
    conn = await asyncpg.connect(p.dsn)
    try:
        present = {r["i"] for r in await conn.fetch("SELECT i FROM acked")}
    finally:
        await conn.close()
    lost = sorted(set(acked) - present)
    assert not lost, f"acknowledged commits lost in the failover: {lost[:10]}"
    return back_s


@pytest.mark.e2e
async def test_a_sigkilled_primary_is_replaced_and_no_acknowledged_commit_is_lost(
    pair: tuple[PostgresPair, FailoverSupervisor],
) -> None:
    p, sup = pair
    first = p.primary_name
    back_s = await _fail_over_under_writes(p, sup)
    assert back_s < 15, f"writes came back only after {back_s:.1f}s"
    # the old primary is seeded as the new standby and commits wait for it again
    assert await sup.wait_synchronous(60), sup.events
    assert p.standby.is_standby_data and p.primary_name != first
    # and the pair survives a second failover, back the other way
    await _fail_over_under_writes(p, sup)
    assert p.primary_name == first


@pytest.mark.e2e
async def test_a_leader_fenced_before_the_failover_stays_fenced_after_it(
    pair: tuple[PostgresPair, FailoverSupervisor],
) -> None:
    p, sup = pair
    pool = await asyncpg.create_pool(p.dsn, min_size=0, max_size=2)
    try:
        old_epoch = await acquire_leadership(pool, scope="s", holder="c1", grpc_addr="", ttl_s=0.1)
        assert old_epoch is not None
        await asyncio.sleep(0.2)
        new_epoch = await acquire_leadership(pool, scope="s", holder="c2", grpc_addr="", ttl_s=60)
        assert new_epoch == old_epoch + 1  # acknowledged, so on the standby too
        await asyncio.to_thread(p.primary.kill)
        await steps_until(sup, Action.PROMOTE, timeout=10)

        async def fenced_write(epoch: int) -> None:
            async with pool.acquire() as conn, conn.transaction():
                await check_epoch(conn, "s", epoch)

        async def new_primary_answers() -> bool | None:
            try:
                await fenced_write(new_epoch)
                return True
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                return None

        await eventually(new_primary_answers, timeout=15, what="the promoted standby taking writes")
        with pytest.raises(StaleEpoch):
            await fenced_write(old_epoch)
    finally:
        await pool.close()


@pytest.mark.e2e
async def test_losing_the_standby_degrades_to_asynchronous_writes_instead_of_hanging(
    pair: tuple[PostgresPair, FailoverSupervisor],
) -> None:
    p, sup = pair
    await asyncio.to_thread(p.standby.kill)
    conn = await asyncpg.connect(p.dsn)
    try:
        # this commit waits for a standby that is gone; the supervisor releases it after after_s
        insert = asyncio.create_task(conn.execute("INSERT INTO acked VALUES (1)"))
        await steps_until(sup, Action.MAKE_ASYNCHRONOUS, timeout=AFTER_S + 10)
        await asyncio.wait_for(insert, 10)
    finally:
        await conn.close()
    assert [e["kind"] for e in sup.events][-1] == "asynchronous"
    # a new standby is seeded and commits wait for it again
    assert await sup.wait_synchronous(60), sup.events


@pytest.mark.e2e
async def test_with_no_synchronous_standby_the_primary_comes_back_instead_of_a_promotion(
    pair: tuple[PostgresPair, FailoverSupervisor],
) -> None:
    p, sup = pair
    conn = await asyncpg.connect(p.dsn)
    try:
        await conn.execute("INSERT INTO acked VALUES (7)")
    finally:
        await conn.close()
    first = p.primary_name
    # both go at once: the standby may have every commit, but nothing says so; only the
    # primary's own data is sure to
    await asyncio.to_thread(p.standby.kill)
    await asyncio.to_thread(p.primary.kill)
    action = await sup.step()
    assert action is Action.RESTART_PRIMARY
    assert p.primary_name == first
    conn = await asyncpg.connect(p.dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM acked WHERE i = 7") == 1
    finally:
        await conn.close()
