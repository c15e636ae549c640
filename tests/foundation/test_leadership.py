"""Leadership talks to Postgres alone (control/leader/leadership.py): it takes the leader row
with a higher epoch, renews it, loses it when deposed, and resigns it on a clean stop. No
Temporal runs in these tests."""

from __future__ import annotations

import asyncio

import pytest

from control.leader.leadership import Leadership
from store import leadership
from tests.support import eventually
from tests.workflows.harness import scaled_settings


async def _v(value):
    return value


@pytest.fixture
def settings(tmp_path):
    return scaled_settings(tmp_path, leader_renew_s=0.1, leader_ttl_s=0.6)


async def test_take_renew_lose_when_deposed_and_take_again(pool, settings):
    acquired: list[int] = []
    lost: list[str] = []

    async def on_acquire(epoch: int) -> None:
        acquired.append(epoch)

    lead = Leadership(pool, settings, holder="a", grpc_addr="a:1", on_acquire=on_acquire, on_lose=lost.append)
    task = asyncio.create_task(lead.run())
    try:
        first = await eventually(lambda: _v(lead.epoch), timeout=5, what="leadership")
        assert acquired == [first]
        # renewals keep it past its ttl
        expires = await pool.fetchval("SELECT expires_at FROM leader WHERE scope = $1", settings.leader_scope)

        async def renewed():
            return (
                await pool.fetchval("SELECT expires_at FROM leader WHERE scope = $1", settings.leader_scope) > expires
            )

        await eventually(renewed, timeout=5, what="a renewal")
        # another holder takes the row (as after an expiry): the next renewal is refused
        await pool.execute("UPDATE leader SET epoch = epoch + 1, holder = 'b' WHERE scope = $1", settings.leader_scope)
        await eventually(lambda: _v(lost), timeout=5, what="leadership lost")
        assert lead.epoch is None and "refused" in lost[0]
        # b's lease lapses: a takes the row again with a higher epoch
        await pool.execute(
            "UPDATE leader SET expires_at = now() - interval '1 s' WHERE scope = $1", settings.leader_scope
        )
        second = await eventually(lambda: _v(lead.epoch), timeout=5, what="leadership again")
        assert second > first + 1 and acquired == [first, second]
    finally:
        await lead.stop(resign=True)
        await asyncio.gather(task, return_exceptions=True)
    # resigned: a successor need not wait for the lease to expire
    assert await leadership.acquire_leadership(pool, scope=settings.leader_scope, holder="c", grpc_addr="c:1", ttl_s=5)


async def test_a_follower_knows_where_the_leader_is(pool, settings):
    epoch = await leadership.acquire_leadership(
        pool, scope=settings.leader_scope, holder="b", grpc_addr="b:7", ttl_s=60
    )
    assert epoch is not None

    async def never(_: int) -> None:
        raise AssertionError("the row is held: a follower never takes it")

    lead = Leadership(pool, settings, holder="a", grpc_addr="a:1", on_acquire=never, on_lose=lambda _: None)
    task = asyncio.create_task(lead.run())
    try:
        await eventually(lambda: _v(lead.leader_grpc_addr == "b:7"), timeout=5, what="the leader's address")
        assert lead.epoch is None
    finally:
        await lead.stop(resign=True)
        await asyncio.gather(task, return_exceptions=True)


async def test_a_failed_takeover_resigns_at_once(pool, settings):
    async def broken(_: int) -> None:
        raise RuntimeError("cannot rebuild")

    lead = Leadership(pool, settings, holder="a", grpc_addr="a:1", on_acquire=broken, on_lose=lambda _: None)
    task = asyncio.create_task(lead.run())
    try:

        async def resigned():
            row = await pool.fetchrow(
                "SELECT epoch, expires_at < now() AS free FROM leader WHERE scope = $1", settings.leader_scope
            )
            return row is not None and row["free"]

        await eventually(resigned, timeout=5, what="the row given back")
        assert lead.epoch is None
    finally:
        await lead.stop(resign=False)
        await asyncio.gather(task, return_exceptions=True)


async def _row_free(pool, settings) -> bool:
    return bool(await pool.fetchval("SELECT expires_at < now() FROM leader WHERE scope = $1", settings.leader_scope))


class _HeldTakeover:
    """A leadership whose ``on_acquire`` holds the takeover open until ``release`` is set."""

    def __init__(self, pool, settings) -> None:
        self.entered, self.release = asyncio.Event(), asyncio.Event()
        self.lost: list[str] = []
        self.lead = Leadership(
            pool, settings, holder="a", grpc_addr="a:1", on_acquire=self._held, on_lose=self.lost.append
        )
        self.task = asyncio.create_task(self.lead.run())

    async def _held(self, _: int) -> None:
        self.entered.set()
        await self.release.wait()

    async def close(self) -> None:
        self.release.set()
        await self.lead.stop(resign=True)
        await asyncio.gather(self.task, return_exceptions=True)


async def test_a_stop_during_a_takeover_waits_for_it_then_resigns(pool, settings):
    """The CI failure of stop 61: SIGTERM came while on_acquire ran; the stop found no epoch, the
    take-over then finished and the process led on (placement cycles against a closing pool,
    the row unresigned)."""
    held = _HeldTakeover(pool, settings)
    try:
        await asyncio.wait_for(held.entered.wait(), 5)
        stopping = asyncio.create_task(held.lead.stop(resign=True))
        await asyncio.sleep(0)  # one turn of the loop: the stop has begun and waits for the take-over
        assert not stopping.done()
        held.release.set()
        await asyncio.wait_for(stopping, 5)
    finally:
        await held.close()
    assert held.lead.epoch is None and len(held.lost) == 1 and "resigned" in held.lost[0]
    assert await _row_free(pool, settings)


async def test_a_takeover_that_outlasts_the_stop_gives_the_leadership_up_itself(pool, settings):
    held = _HeldTakeover(pool, settings)
    try:
        await asyncio.wait_for(held.entered.wait(), 5)
        await held.lead.stop(resign=True)  # gives up waiting after leader_ttl_s (the lease has run out by then)
        assert held.lost == []
        held.release.set()
        await asyncio.wait_for(held.task, 5)
    finally:
        await held.close()
    assert held.lead.epoch is None and held.lost == ["stopped while it took over"]
    assert await _row_free(pool, settings)
