"""Leadership: the Postgres leader row with its fencing epoch (docs/design.md, Leadership).

``Leadership.run()`` takes the row when it is free or expired (epoch + 1) and renews it
every ``leader_renew_s``; a refused renewal, or none that succeeded for ``leader_ttl_s``,
loses it. That lease is counted by this process's clock from the moment each renewal was
sent, and a renewal still unanswered when it runs out (a connection gone silent) is not
waited for: the process stops leading before Postgres lets a successor take the row. It
talks to Postgres only: nothing here waits on Temporal, so a Temporal outage never costs
the lease. ``on_acquire(epoch)`` runs before the epoch is claimed
(a failure resigns it at once); ``on_lose(why)`` when it goes. A stop that comes while
``on_acquire`` runs waits for it (up to ``leader_ttl_s``) and then resigns, so a process that
is shutting down never finishes a take-over and leads on, unresigned, after its stop returned.

A follower reads the leader's row as it tries: ``leader_grpc_addr`` is the leader's address
while its lease looks kept, and "" once the leader has missed two renewals (frozen or gone:
agents are better off trying elsewhere than being sent back to it). The follower tries to
take the row again the moment the lease it read runs out, not a renewal interval later.

    lead = Leadership(pool, settings, holder="c1", grpc_addr=addr, on_acquire=..., on_lose=...)
    task = asyncio.create_task(lead.run())
    ...
    await lead.stop(resign=True)      # a clean stop: the successor need not wait for expiry
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from common.settings import Settings
from store import leadership as rows
from store.tx import Pool

log = logging.getLogger("gpufleet.control.leader")

STALE_SLACK_S = 0.5  # a renewal this late is not yet a missed one


class Leadership:
    def __init__(
        self,
        pool: Pool,
        settings: Settings,
        *,
        holder: str,
        grpc_addr: str,
        on_acquire: Callable[[int], Awaitable[None]],
        on_lose: Callable[[str], None],
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.holder = holder
        self.grpc_addr = grpc_addr
        self.on_acquire = on_acquire
        self.on_lose = on_lose
        self.epoch: int | None = None
        self._leader_addr = ""  # the leader's, as a follower last read it
        self._leader_expires_at = 0.0  # monotonic: when that leader's lease runs out, as last read
        self._last_renew = 0.0
        self._stopping = asyncio.Event()
        self._taking_over = asyncio.Lock()  # held while on_acquire runs; a stop waits for it
        self._resign_on_stop = True
        self._stop_gave_up = False  # a stop returned while on_acquire still ran: it hands back itself
        self._late: set[asyncio.Future[Any]] = set()  # renewals outlived by our lease, and their hand-backs

    @property
    def scope(self) -> str:
        return self.settings.leader_scope

    async def run(self) -> None:
        s = self.settings
        while not self._stopping.is_set():
            try:
                if self.epoch is None:
                    await self._try_acquire()
                else:
                    await self._renew()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("leadership: %s", e)
                if self.epoch is not None and time.monotonic() - self._last_renew > s.leader_ttl_s:
                    self.lose(f"no renewal for {s.leader_ttl_s}s")
            interval = s.leader_renew_s if self.epoch is not None else min(s.leader_renew_s, s.leader_ttl_s / 3)
            left = self._leader_expires_at - time.monotonic()
            if self.epoch is None and left > 0:  # try again the moment the lease read runs out
                interval = min(interval, left + 0.05)
            try:
                await asyncio.wait_for(self._stopping.wait(), interval)
            except TimeoutError:
                pass

    async def _try_acquire(self) -> None:
        s = self.settings
        sent = time.monotonic()  # the lease runs from no later than this, by our clock
        epoch = await rows.acquire_leadership(
            self.pool, scope=self.scope, holder=self.holder, grpc_addr=self.grpc_addr, ttl_s=s.leader_ttl_s
        )
        if epoch is None:
            lease = await rows.leader_lease(self.pool, self.scope)
            self._leader_addr = lease.grpc_addr if lease is not None else ""
            self._leader_expires_at = time.monotonic() + (lease.expires_in_s if lease is not None else 0.0)
            return
        self._leader_addr = ""
        self._last_renew = sent
        log.info("control %s takes leadership with epoch %d", self.holder, epoch)
        async with self._taking_over:
            if self._stopping.is_set():  # a stop came while the row was being taken: hand it back unused
                await self._hand_back(epoch)
                return
            try:
                await self.on_acquire(epoch)
            except Exception:
                await rows.resign_leadership(self.pool, scope=self.scope, holder=self.holder, epoch=epoch)
                raise
            self.epoch = epoch
            if self._stop_gave_up:  # that stop has returned without it: hand it back now
                await self._hand_back(epoch)
                self.lose("stopped while it took over", expected=True)

    async def _hand_back(self, epoch: int) -> bool:
        """Resign ``epoch`` on a stop; False for a kill (the lease runs out as a crashed
        leader's would) or where the resignation failed."""
        if not self._resign_on_stop:
            return False
        try:
            await rows.resign_leadership(self.pool, scope=self.scope, holder=self.holder, epoch=epoch)
        except Exception as e:
            log.warning("resign failed: %s", e)
            return False
        return True

    @property
    def leader_grpc_addr(self) -> str:
        """Where a follower sends agents: the leader's address while its lease looks kept; "" when
        none is recorded or the leader has not renewed for two renewal intervals (it may be frozen
        or gone; it is replaced once the lease runs out)."""
        s = self.settings
        if not self._leader_addr:
            return ""
        left = self._leader_expires_at - time.monotonic()
        if left < max(0.0, s.leader_ttl_s - 2 * s.leader_renew_s - STALE_SLACK_S):
            return ""
        return self._leader_addr

    async def _renew(self) -> None:
        assert self.epoch is not None
        epoch, ttl = self.epoch, self.settings.leader_ttl_s
        sent = time.monotonic()  # Postgres sets the new expiry after this: ours ends no later
        call = asyncio.ensure_future(
            rows.renew_leadership(self.pool, scope=self.scope, holder=self.holder, epoch=epoch, ttl_s=ttl)
        )
        # waited on, not cancelled: a call on a connection gone silent ends only at the pool's
        # statement deadline, which may come after our lease
        done, _ = await asyncio.wait({call}, timeout=max(0.0, self._last_renew + ttl - sent))
        if not done:
            self._late.add(call)
            call.add_done_callback(lambda c: self._late_renewal(c, epoch))
            self.lose(f"no renewal for {ttl}s (the last one is still unanswered)")
            return
        if call.result():
            self._last_renew = sent
        else:
            self.lose("renewal refused (expired or deposed)")

    def _late_renewal(self, call: asyncio.Future[bool], epoch: int) -> None:
        """A renewal answered after this process gave the epoch up: one that took effect keeps
        the row ours in Postgres, so hand it back rather than make a successor wait it out."""
        self._late.discard(call)
        if call.cancelled() or call.exception() is not None or not call.result():
            return
        log.info("control %s hands back epoch %d, renewed after it had let go", self.holder, epoch)
        task = asyncio.ensure_future(
            rows.resign_leadership(self.pool, scope=self.scope, holder=self.holder, epoch=epoch)
        )
        self._late.add(task)
        task.add_done_callback(self._handed_back)

    def _handed_back(self, task: asyncio.Future[Any]) -> None:
        self._late.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("hand-back of a late renewal failed: %s", task.exception())

    def lose(self, why: str, *, expected: bool = False) -> None:
        """Give the epoch up (``on_lose``): a warning, unless ``expected`` (a clean stop)."""
        if self.epoch is not None:
            if expected:
                log.info("control %s leaves leadership (epoch %d): %s", self.holder, self.epoch, why)
            else:
                log.warning("control %s loses leadership (epoch %d): %s", self.holder, self.epoch, why)
            self.epoch = None
            self.on_lose(why)

    async def stop(self, *, resign: bool) -> None:
        """Stop the loop; with ``resign`` give the lease up so a successor need not wait."""
        self._resign_on_stop = resign
        self._stopping.set()
        try:  # a take-over in flight finishes (or fails) first, then is resigned below
            await asyncio.wait_for(self._taking_over.acquire(), self.settings.leader_ttl_s)
        except TimeoutError:
            self._stop_gave_up = True
            log.warning(
                "stop: a take-over still runs after %ss; it hands back when it ends", self.settings.leader_ttl_s
            )
        else:
            self._taking_over.release()
        resigned = self.epoch is not None and await self._hand_back(self.epoch)
        why = "stopping (resigned: a successor takes over at once)" if resigned else "stopping"
        self.lose(why, expected=True)
