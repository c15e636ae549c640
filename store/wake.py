"""Wake-ups: Postgres notifies ``gpufleet_wake`` when a job, node or quota changes
(migration 0005), so the leader runs a placement cycle at once instead of at its next tick.
A notification is only a hint: the change feed says what changed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import asyncpg

log = logging.getLogger("gpufleet.store")

WAKE_CHANNEL = "gpufleet_wake"


class WakeListener:
    """LISTEN on ``gpufleet_wake`` on a connection held from ``pool`` until ``close()``."""

    def __init__(self, pool: asyncpg.Pool, on_wake: Callable[[], None]) -> None:
        self.pool = pool
        self.on_wake = on_wake
        self._conn: asyncpg.Connection | None = None

    async def start(self) -> None:
        self._conn = await self.pool.acquire()
        await self._conn.add_listener(WAKE_CHANNEL, self._notified)

    def _notified(self, *_: object) -> None:
        self.on_wake()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            await conn.remove_listener(WAKE_CHANNEL, self._notified)
        except Exception as e:  # the connection may be gone with Postgres
            log.debug("wake listener: %s", e)
        await self.pool.release(conn)
