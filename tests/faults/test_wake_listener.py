"""The leader's LISTEN connection for wake-ups (store/wake.py) outlives what ends it.

A listening connection only waits, so before ``WakeListener.keep`` nothing noticed it closed
by a Postgres restart or failover, or gone silent with its host: every wake-up after that was
lost for the life of the process, and a job waited for the next periodic cycle (1 s by
default; 60 s here, so that only a wake-up places it in time).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.faults.conftest import OutageStack
from tests.faults.silent_link import SilentLink
from tests.support import eventually

pytestmark = pytest.mark.e2e

# the listener's backend: its last statement was its LISTEN or the keeper's question
LISTENING = (
    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    " AND (query LIKE 'LISTEN%' OR query LIKE '%pg_listening_channels%')"
)


@pytest.fixture(params=["terminated", "silent"])
def outage_overrides(link: SilentLink, request: pytest.FixtureRequest) -> dict[str, Any]:
    return {
        "database_url": link.dsn, "_own_pool": True, "_how": request.param,
        "placement_cycle_s": 60.0, "wake_check_s": 0.5, "db_command_timeout_s": 1.0,
    }  # fmt: skip


async def test_wake_ups_place_jobs_again_after_the_listening_connection_is_lost(
    outage_stack: OutageStack, link: SilentLink, outage_overrides: dict[str, Any]
):
    s = outage_stack
    first = await s.submit_until_accepted(timeout=10)
    await s.wait_state(first, "STARTING", timeout=10)  # a wake-up placed it
    (before,) = await eventually(lambda: s.pool.fetch(LISTENING), timeout=10, what="the listener")

    if outage_overrides["_how"] == "terminated":  # as a restart or failover of Postgres does
        await s.pool.execute("SELECT pg_terminate_backend($1)", before["pid"])
    else:  # the host gone without a reset: the old backend stays, nothing reaches it
        link.go_silent()

    async def listening_again() -> bool:
        return any(r["pid"] != before["pid"] for r in await s.pool.fetch(LISTENING))

    await eventually(listening_again, timeout=15, what="a fresh connection listening")
    second = await s.submit_until_accepted(timeout=15)
    # with the other connections silent too, a woken cycle may still draw a dead one, fail at
    # its deadline and wait for the periodic cycle: there the fresh listener is what is shown
    bound = 10.0 if outage_overrides["_how"] == "terminated" else s.settings.placement_cycle_s + 15
    await s.wait_state(second, "STARTING", timeout=bound)
