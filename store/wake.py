"""Wake-ups: Postgres notifies ``gpufleet_wake`` when a job, node or quota changes
(migration 0005), so the leader runs a placement cycle at once instead of at its next tick.
A notification is only a hint: the change feed says what changed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import asyncpg

log = logging.getLogger("gpufleet.store")

WAKE_CHANNEL = "gpufleet_wake"
# the ping: the connection answers, and still listens on the channel
_STILL_LISTENING = "SELECT $1 = ANY(ARRAY(SELECT pg_listening_channels()))"


class WakeListener:
    """LISTEN on ``gpufleet_wake`` on a connection held from ``pool`` until ``close()``.

    ``keep(check_s)`` keeps it listening: a listening connection does nothing but wait, so
    nothing else would notice it end (a Postgres restart or failover closes it) or go silent
    (a host gone without a reset), and every wake-up after that would be lost until the
    process restarts. Every ``check_s`` it is asked whether it still listens (the pool's
    statement deadline bounds the question); one closed, unanswering or no longer listening
    is dropped, a fresh one listens, and ``on_wake`` runs once for what was notified while
    nothing listened.
    """

    def __init__(self, pool: asyncpg.Pool, on_wake: Callable[[], None]) -> None:
        self.pool = pool
        self.on_wake = on_wake
        self._conn: asyncpg.Connection | None = None
        self._closed = False

    async def start(self) -> None:
        conn = await self.pool.acquire()
        try:
            await conn.add_listener(WAKE_CHANNEL, self._notified)
        except BaseException:
            await self._drop(conn)
            raise
        self._conn = conn

    async def keep(self, check_s: float) -> None:
        while not self._closed:
            await asyncio.sleep(check_s)
            if self._closed:
                return
            conn = self._conn
            if conn is not None and _open(conn):
                try:
                    if await conn.fetchval(_STILL_LISTENING, WAKE_CHANNEL):
                        continue
                    log.warning("wake listener: its connection no longer listens: listening on a fresh one")
                except Exception as e:
                    log.warning("wake listener: its connection does not answer (%s): listening on a fresh one", e)
            self._conn = None
            if conn is not None:
                await self._drop(conn)
            if self._closed:
                return
            try:
                await self.start()
            except Exception as e:  # the periodic cycle still runs; the next check tries again
                log.warning("wake listener: cannot LISTEN: %s", e)
                continue
            self.on_wake()  # what changed while nothing listened

    def _notified(self, *_: object) -> None:
        self.on_wake()

    async def _drop(self, conn: asyncpg.Connection) -> None:
        """Give a connection that may be dead back without waiting on it: closed first, so the
        pool's reset (which would wait on a silent one) is not tried."""
        if _open(conn):
            conn.terminate()
        await self.pool.release(conn)  # a no-op for one the pool has taken back

    async def close(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if not _open(conn):
            await self._drop(conn)
            return
        try:
            await conn.remove_listener(WAKE_CHANNEL, self._notified)
        except Exception as e:  # the connection may be gone with Postgres
            log.debug("wake listener: %s", e)
            await self._drop(conn)
            return
        await self.pool.release(conn)


def _open(conn: asyncpg.Connection) -> bool:
    try:
        return not conn.is_closed()
    except asyncpg.InterfaceError:  # closed under us: the pool has already taken it back
        return False
