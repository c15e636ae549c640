"""Connections and transactions of the store: the one way every store function runs its SQL.

    async with transaction(pool_or_conn) as conn: ...   # one transaction, committed or rolled back

``Db`` is what every store function takes: a pool (it acquires a connection) or a
connection already inside the caller's transaction.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import asyncpg

Pool: TypeAlias = asyncpg.Pool  # what processes hold (``common.db.pool_from_settings`` makes one)
Db: TypeAlias = asyncpg.Pool | asyncpg.Connection


class transaction:
    """``async with transaction(pool_or_conn) as conn``: one transaction on a pooled or given connection."""

    def __init__(self, db: asyncpg.Pool | asyncpg.Connection) -> None:
        self._db = db
        self._conn: asyncpg.Connection | None = None
        self._acquired = False
        self._tx: Any = None

    async def __aenter__(self) -> asyncpg.Connection:
        if isinstance(self._db, asyncpg.Pool):
            self._conn = await self._db.acquire()
            self._acquired = True
        else:
            self._conn = self._db
        self._tx = self._conn.transaction()
        try:
            await self._tx.start()
        except BaseException:
            # ``async with`` never calls __aexit__ when __aenter__ raises: a BEGIN cut short (the
            # task cancelled as it ran, the connection lost) would keep the connection out of
            # the pool for good, idle in transaction, and ``Pool.close`` would wait on it for ever
            if self._acquired and isinstance(self._db, asyncpg.Pool):
                await self._db.release(self._conn)
            raise
        return self._conn

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self._conn is not None
        try:
            if exc_type is None:
                await self._tx.commit()
            else:
                await self._tx.rollback()
        finally:
            if self._acquired and isinstance(self._db, asyncpg.Pool):
                await self._db.release(self._conn)


async def ping(db: Db) -> None:
    await db.fetchval("SELECT 1")


async def set_lock_timeout(conn: asyncpg.Connection, seconds: float) -> None:
    """Only for the current transaction; 0 = wait forever (the default)."""
    ms = max(0, int(seconds * 1000))
    await conn.execute(f"SET LOCAL lock_timeout = '{ms}ms'")
