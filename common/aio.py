"""Small asyncio helpers shared by the long-running processes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait until it has ended (its cancellation swallowed)."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


class Stopped(Exception):
    """The stop event was set before the awaited work finished (``unless_stopped``)."""


async def unless_stopped(aw: Awaitable[T], stop: asyncio.Event | None) -> T:
    """Await ``aw``, or cancel it and raise ``Stopped`` once ``stop`` is set first (a
    process told to stop while it still waits for a server at start)."""
    task = asyncio.ensure_future(aw)
    if stop is None:
        return await task
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise Stopped
    return task.result()


async def retry_until_reachable(
    open_: Callable[[], Awaitable[T]],
    *,
    what: str,
    retry_on: tuple[type[BaseException], ...],
    max_interval_s: float,
    log: logging.Logger,
) -> T:
    """``open_()`` until it succeeds, doubling the wait (0.5 s up to ``max_interval_s``) after
    each failure in ``retry_on``, one warning line each; anything else is raised at once (a
    wrong password is not an outage). Cancel the caller's task to give up."""
    delay = 0.5
    while True:
        try:
            return await open_()
        except retry_on as e:
            log.warning(
                "%s unreachable (%s: %s); waiting for it, next try in %.1fs",
                what, type(e).__name__, str(e)[:200] or "-", delay,
            )  # fmt: skip
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_interval_s)
