"""Shared test helpers: DSN handling and polling with a deadline (never sleep-and-hope)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

T = TypeVar("T")


def dsn_with_db(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


async def eventually(
    probe: Callable[[], Awaitable[T]],
    *,
    timeout: float = 10.0,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll ``probe`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = await probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")
        await asyncio.sleep(interval)


async def force_job_state(db, sql: str, *args) -> None:
    """Run a test fixture's ``UPDATE jobs SET state = ...`` that skips the job state table
    (db/migrations/0006: the trigger lets a transaction that says so through)."""
    async with db.acquire() as conn:
        async with conn.transaction():
            await conn.execute("SELECT set_config('gpufleet.unchecked_state_changes', 'on', true)")
            await conn.execute(sql, *args)
