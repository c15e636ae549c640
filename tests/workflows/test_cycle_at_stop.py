"""A cycle that fails because leadership ended under it is not logged as a fault.

``gpufleet control`` stopping drops its leadership, then closes its pool. A cycle in flight
then fails on the closing pool; it used to log a traceback ("placement cycle under epoch N
failed"), which tests/faults/test_control_start_during_outage.py caught now and then on a
clean stop. A cycle that fails while this process still leads is still logged as one."""

from __future__ import annotations

import logging

import asyncpg

from control.leader.state import policy_from_settings
from tests.workflows.harness import leader_cycles, scaled_settings, seed


async def test_a_cycle_failing_after_leadership_ended_logs_no_traceback(pool, tmp_path, caplog):
    settings = scaled_settings(tmp_path)
    _, epoch = await seed(pool, settings)
    cycles = await leader_cycles(pool, settings, epoch, policy_from_settings(settings))
    calls = 0

    async def failing_cycle(e: int):
        nonlocal calls
        calls += 1
        if calls == 1:  # while leading: a fault, logged with its traceback, and cycling goes on
            raise RuntimeError("a fault while leading")
        cycles.state.drop()  # the stop drops leadership, then closes the pool under the cycle
        raise asyncpg.exceptions.InterfaceError("pool is closing")

    cycles.run_cycle = failing_cycle  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="gpufleet.control.leader"):
        await cycles.run(epoch)  # returns: it no longer leads
    assert calls == 2
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in errors] == [f"placement cycle under epoch {epoch} failed"]
    assert errors[0].exc_info is not None
    assert any("ended with the leadership: pool is closing" in r.getMessage() for r in caplog.records)
