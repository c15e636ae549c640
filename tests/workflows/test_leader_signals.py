"""The leader's allocation signals under a slow server: one send per job at a time.

In a submit burst the queue for the leader's few signal slots outlasts
``allocation_resignal_s``; re-sending a job whose first send is still queued only doubled
the signals (and workflow tasks) a saturated Temporal had to take. The client here is a
scripted stand-in for Temporal's answer times: the test is about the leader's retry
bookkeeping, which is all in ``JobSignals``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from common.settings import Settings
from control.leader.signals import JobSignals
from tests.support import eventually
from workflows import messages as m


class ScriptedTemporal:
    """``start_workflow`` answers when the test releases it, or fails when told to."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.release = asyncio.Event()
        self.fail = False

    async def start_workflow(self, *_args: Any, id: str, **_kw: Any) -> None:
        self.calls.append(id)
        await self.release.wait()
        if self.fail:
            raise RuntimeError("scripted: not accepted")


def _alloc(job_id: str) -> m.Allocation:
    return m.Allocation(job_id=job_id, attempt=1, epoch=1, ranks=[])


def _signals(pool: Any, client: ScriptedTemporal, **over: Any) -> JobSignals:
    settings = Settings(**{"allocation_resignal_s": 0.05, "signal_timeout_s": 5.0, **over})
    return JobSignals(pool, client, settings)  # type: ignore[arg-type]


async def test_a_job_is_not_resent_while_its_send_is_unanswered(pool) -> None:
    client = ScriptedTemporal()
    signals = _signals(pool, client)
    signals.send(_alloc("job-a"), time.monotonic())
    await eventually(lambda: client.calls or None, timeout=5)
    # long past the re-send interval, the first send still unanswered: nothing re-sent
    assert signals.resend_due(time.monotonic() + 10) == 0
    assert signals.resend_due(time.monotonic() + 100) == 0
    assert client.calls == ["job-a"]
    client.release.set()
    await eventually(lambda: "job-a" not in signals.pending or None, timeout=5)
    assert client.calls == ["job-a"]
    await signals.close()


async def test_a_send_that_failed_is_resent_an_interval_after_its_answer(pool) -> None:
    client = ScriptedTemporal()
    client.fail = True
    client.release.set()
    signals = _signals(pool, client, allocation_resignal_s=1.0)
    signals.send(_alloc("job-b"), time.monotonic())
    await eventually(lambda: (client.calls and not signals._sending) or None, timeout=5)
    assert "job-b" in signals.pending  # kept: Temporal did not accept it
    answered = time.monotonic()
    assert signals.resend_due(answered) == 0  # the interval counts from the answer
    assert signals.resend_due(answered + 1.5) == 1
    await eventually(lambda: len(client.calls) == 2 or None, timeout=5)
    client.fail = False
    assert signals.resend_due(time.monotonic() + 10) == 1
    await eventually(lambda: "job-b" not in signals.pending or None, timeout=5)
    assert len(client.calls) == 3
    await signals.close()


async def test_a_send_that_hangs_gives_up_and_is_resent(pool) -> None:
    client = ScriptedTemporal()  # never released: a frozen server
    signals = _signals(pool, client, signal_timeout_s=0.2)
    signals.send(_alloc("job-c"), time.monotonic())
    await eventually(lambda: (client.calls and not signals._sending) or None, timeout=5)
    assert "job-c" in signals.pending
    assert signals.resend_due(time.monotonic() + 10) == 1
    await eventually(lambda: len(client.calls) == 2 or None, timeout=5)
    await signals.close()
