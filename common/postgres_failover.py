"""The small supervisor of a ``PostgresPair`` (docs/design.md, High availability).

``decide`` is pure: what it saw (``Observation``) in, one ``Action`` out. The rules, in order:

* the primary does not take writes:
  - its standby was synchronous (it holds every acknowledged commit) and is running:
    promote it at once when the primary's postmaster is gone, or once the primary has been
    unreachable for ``after_s`` (the old primary is SIGKILLed first: fenced, it never
    commits again);
  - no synchronous standby: promoting would lose acknowledged commits, so the primary is
    started again (crash recovery on its own data) once it is gone or stuck ``after_s``;
* the primary takes writes:
  - a standby streams and commits do not wait for it yet: make commits synchronous;
  - commits wait for a standby that has not streamed for ``after_s``: make them
    asynchronous (else every write would hang), and say so;
  - asynchronous and no standby running, or one not streaming for ``after_s``: seed a new
    standby from the primary (``pg_basebackup``; the old primary after a failover, its
    timeline forked, is seeded the same way).

``FailoverSupervisor`` observes, decides and acts every ``probe_s``; it runs in
``gpufleet up --ha`` and in the chaos harness, never in a process it supervises for.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from common.embedded import PlatformError
from common.postgres_pair import PostgresPair, accepts_writes, set_synchronous, streaming_standbys


class Action(Enum):
    NOTHING = "nothing"
    PROMOTE = "promote"  # fence the primary, promote the standby
    RESTART_PRIMARY = "restart_primary"  # no synchronous standby: the primary comes back
    MAKE_SYNCHRONOUS = "make_synchronous"
    MAKE_ASYNCHRONOUS = "make_asynchronous"
    SEED_STANDBY = "seed_standby"


@dataclass(frozen=True)
class Observation:
    primary_takes_writes: bool
    primary_running: bool  # its postmaster is alive (it may still not answer)
    primary_unreachable_s: float  # how long it has not taken writes (0 while it does)
    standby_running: bool
    standby_streaming: bool  # the primary lists it in pg_stat_replication (False while the primary is down)
    standby_not_streaming_s: float  # how long it has not streamed (0 while it does)
    synchronous: bool  # commits wait for the standby now


def decide(o: Observation, after_s: float) -> Action:
    if not o.primary_takes_writes:
        gone_or_stuck = not o.primary_running or o.primary_unreachable_s >= after_s
        if not gone_or_stuck:
            return Action.NOTHING  # a blip: wait
        if o.synchronous and o.standby_running:
            return Action.PROMOTE  # the standby has every acknowledged commit
        return Action.RESTART_PRIMARY  # only the primary has them
    if o.standby_streaming:
        return Action.NOTHING if o.synchronous else Action.MAKE_SYNCHRONOUS
    if o.synchronous:
        return Action.MAKE_ASYNCHRONOUS if o.standby_not_streaming_s >= after_s else Action.NOTHING
    if not o.standby_running or o.standby_not_streaming_s >= after_s:
        return Action.SEED_STANDBY
    return Action.NOTHING  # started a moment ago: give it time to connect


@dataclass
class FailoverSupervisor:
    pair: PostgresPair
    probe_s: float = 0.5
    after_s: float = 3.0
    log: Callable[[str], None] = lambda _msg: None
    events: list[dict[str, Any]] = field(default_factory=list)  # what it did, when (tests and chaos read them)
    _primary_bad_since: float | None = None
    _standby_bad_since: float | None = None

    def _event(self, kind: str, **details: Any) -> None:
        e = {"kind": kind, "at": time.time(), **details}
        self.events.append(e)
        self.log(" ".join([f"postgres {kind}", *(f"{k}={v}" for k, v in details.items())]))

    async def observe(self) -> Observation:
        pair, now = self.pair, time.monotonic()
        takes_writes = await accepts_writes(pair.primary)
        streaming = False
        if takes_writes:
            with contextlib.suppress(Exception):
                streaming = pair.standby.name in await streaming_standbys(pair.primary)
        self._primary_bad_since = None if takes_writes else (self._primary_bad_since or now)
        self._standby_bad_since = None if streaming else (self._standby_bad_since or now)
        return Observation(
            primary_takes_writes=takes_writes,
            primary_running=pair.primary.pid() is not None,
            primary_unreachable_s=now - self._primary_bad_since if self._primary_bad_since else 0.0,
            standby_running=pair.standby.pid() is not None,
            standby_streaming=streaming,
            standby_not_streaming_s=now - self._standby_bad_since if self._standby_bad_since else 0.0,
            synchronous=pair.synchronous,
        )

    async def step(self) -> Action:
        action = decide(await self.observe(), self.after_s)
        if action is not Action.NOTHING:
            await self.act(action)
        return action

    async def act(self, action: Action) -> None:
        pair = self.pair
        if action is Action.PROMOTE:
            old, new = pair.primary, pair.standby
            t = time.monotonic()
            await asyncio.to_thread(old.kill)  # fenced before the standby takes writes
            await asyncio.to_thread(new.promote)
            pair.swap()  # asynchronous until a new standby streams
            await set_synchronous(new, False)
            self._primary_bad_since = None
            self._standby_bad_since = time.monotonic()
            self._event("promoted", primary=new.name, old=old.name, took_s=round(time.monotonic() - t, 2),
                        note="writes are asynchronous until a standby is back")  # fmt: skip
        elif action is Action.RESTART_PRIMARY:
            p = pair.primary
            await asyncio.to_thread(p.kill)
            await asyncio.to_thread(p.start)
            self._primary_bad_since = None
            self._event("primary_restarted", primary=p.name, note="no synchronous standby to promote")
        elif action is Action.MAKE_SYNCHRONOUS:
            await set_synchronous(pair.primary, True)
            pair.synchronous = True
            pair.save_roles()
            self._event("synchronous", primary=pair.primary.name, standby=pair.standby.name)
        elif action is Action.MAKE_ASYNCHRONOUS:
            await set_synchronous(pair.primary, False)
            pair.synchronous = False
            pair.save_roles()
            self._event("asynchronous", primary=pair.primary.name, note="the standby stopped streaming")
        elif action is Action.SEED_STANDBY:
            s = pair.standby
            t = time.monotonic()
            await asyncio.to_thread(s.seed_from, pair.primary)
            await asyncio.to_thread(s.start)
            self._standby_bad_since = time.monotonic()  # it has after_s to start streaming
            self._event("standby_seeded", standby=s.name, took_s=round(time.monotonic() - t, 2))

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Observe and act until ``stop`` is set (or cancelled); a failed action is logged and tried again."""
        stop = stop or asyncio.Event()
        while not stop.is_set():
            try:
                await self.step()
            except (PlatformError, OSError) as e:
                self._event("action_failed", error=str(e)[:300])
            except Exception as e:  # asyncpg errors mid-action: observe again
                self._event("action_failed", error=f"{type(e).__name__}: {str(e)[:300]}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.probe_s)

    async def wait_synchronous(self, timeout_s: float) -> bool:
        """Run steps until commits wait for a standby (True) or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            await self.step()
            if self.pair.synchronous:
                return True
            await asyncio.sleep(self.probe_s)
        return False
