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
    (db/migrations/0007: the trigger lets a transaction that says so through)."""
    async with db.acquire() as conn:
        async with conn.transaction():
            await conn.execute("SELECT set_config('gpufleet.unchecked_state_changes', 'on', true)")
            await conn.execute(sql, *args)


class OutputReader:
    """A child process's text output, read by a thread into a queue so a reader never
    blocks past its deadline (the child may print nothing for a while, or never exit)."""

    def __init__(self, stream) -> None:
        import queue
        import threading

        self._lines: queue.Queue[str | None] = queue.Queue()
        self.ended = False

        def pump() -> None:
            for line in stream:
                self._lines.put(line)
            self._lines.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def until(self, marker: str, deadline: float) -> tuple[bool, list[str]]:
        """Lines up to and including the first one holding ``marker`` (True), or all lines
        read before the output ended or ``deadline`` (``time.monotonic()``) passed (False)."""
        import queue

        out: list[str] = []
        while not self.ended and time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                self.ended = True
                break
            out.append(line)
            if marker in line:
                return True, out
        return False, out

    def rest(self, quiet_s: float = 5.0) -> str:
        """What is left, until the output ends or stays quiet for ``quiet_s``."""
        import queue

        out: list[str] = []
        while not self.ended:
            try:
                line = self._lines.get(timeout=quiet_s)
            except queue.Empty:
                break
            if line is None:
                self.ended = True
                break
            out.append(line)
        return "".join(out)
