"""Shared test helpers: DSN handling and waiting with a deadline (never sleep-and-hope).

Every wait in the tests goes through one of these three:

* ``await eventually(probe, timeout=, interval=, what=)``: poll until ``probe()`` is truthy
  and return that value; fail once ``timeout`` has passed. "X happens (soon)".
* ``await holds(probe, for_s=, interval=, what=)``: poll for ``for_s`` seconds and fail at the
  first falsy ``probe()``. "X does not happen": the honest form of sleeping, then asserting
  that nothing happened (it still takes ``for_s``, but fails the moment X happens).
* ``eventually_sync(probe, timeout=, interval=, what=)``: ``eventually`` for plain functions
  and threads, where there is no event loop to await on.

The async two take a probe that returns a value or an awaitable (a coroutine function, or a
lambda returning a coroutine), so plain checks need no wrapper. An exception raised by a probe
is not swallowed: it fails the wait at once (a probe may assert that waiting still makes sense).
"""

from __future__ import annotations

import asyncio
import inspect
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

T = TypeVar("T")


def dsn_with_db(dsn: str, database: str) -> str:
    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


async def _value(probe: Callable[[], T | Awaitable[T]]) -> T:
    value = probe()
    return await value if inspect.isawaitable(value) else value


async def eventually(
    probe: Callable[[], T | Awaitable[T]],
    *,
    timeout: float = 10.0,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll ``probe`` until it returns a truthy value (returned) or the deadline passes."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = await _value(probe)
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")
        await asyncio.sleep(interval)


async def holds(
    probe: Callable[[], Any],
    *,
    for_s: float,
    interval: float = 0.05,
    what: str = "condition",
) -> None:
    """Poll ``probe`` for ``for_s`` seconds (first and last check included); fail as soon as
    it returns a falsy value."""
    start = time.monotonic()
    deadline = start + for_s
    while True:
        value = await _value(probe)
        if not value:
            took = time.monotonic() - start
            raise AssertionError(f"{what} stopped holding after {took:.2f}s of {for_s}s; value: {value!r}")
        left = deadline - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(interval, left))


def eventually_sync(
    probe: Callable[[], T],
    *,
    timeout: float = 10.0,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """``eventually`` for synchronous code: blocks the calling thread between polls."""
    deadline = time.monotonic() + timeout
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")
        time.sleep(interval)


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


async def workflow_status(client: Any, workflow_id: str) -> dict[str, Any]:
    """A job workflow's ``status`` query, or ``{}`` while the workflow does not exist yet or its
    first workflow task has not been scheduled (the server answers a query that early with
    WorkflowNotReady): for polling. A job's workflow starts after its allocation commits (the
    leader starts it with the allocation signal), so a job already STARTING in Postgres can
    briefly have no workflow; a poll's deadline still catches one that never starts."""
    from temporalio.service import RPCError, RPCStatusCode

    try:
        return await client.get_workflow_handle(workflow_id).query("status")
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND or "not scheduled yet" in str(e):
            return {}
        raise


def fill_disk(path: Path) -> None:
    """Write ``path`` until its filesystem has no byte left (a small tmpfs of a test's)."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(bytes(65536))
                f.flush()
        except OSError:
            pass
    assert shutil.disk_usage(path.parent).free < 65536
