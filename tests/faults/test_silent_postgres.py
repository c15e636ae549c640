"""A Postgres whose connections go silent (its host vanished, or a failover moved its address
to a new host): every connection open at that moment stops answering and none is closed,
while new connections reach the database.

Before ``db_command_timeout_s`` a statement waiting on such a connection waited for ever: the
leader's renewal and its placement cycle hung, so it neither led nor let go (with one control
nothing was placed again), and each API request that drew a dead pooled connection hung, until
the pool had none left. Killing a local server, as the other fault tests do, closes its sockets
and could not show it.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from common.db import pool_from_settings
from control.leader.leadership import Leadership
from tests.faults.conftest import OutageStack
from tests.faults.silent_link import SilentLink
from tests.support import eventually
from tests.workflows.harness import scaled_settings

pytestmark = pytest.mark.e2e

# the durations of tests/e2e scaled (heartbeat 0.5 s, lease 4 s), and a node's silence and an
# idle transaction judged on the same scale as the lease (defaults: lease 15 s, suspect 30 s,
# down 90 s, idle in a transaction 60 s)
SCALED = {"suspect_after_s": 6.0, "down_after_s": 18.0, "takeover_quiet_s": 6.0, "db_idle_in_transaction_s": 16.0}


# shorter than the lease, and one whose doubled wait (the cancellation's) passes it, as by
# default (10 s, so up to 20 s, against a 15 s lease)
@pytest.fixture(params=[2.0, 6.0], ids=["deadline-2s", "deadline-6s"])
def outage_overrides(link: SilentLink, request: pytest.FixtureRequest) -> dict[str, Any]:
    return {"database_url": link.dsn, "_own_pool": True, "db_command_timeout_s": request.param, **SCALED}


async def test_connections_that_go_silent_cost_no_running_job_and_placement_goes_on(
    outage_stack: OutageStack, link: SilentLink
):
    s = outage_stack
    running = await s.submit_until_accepted(timeout=10)
    await s.wait_state(running, "RUNNING", timeout=30)
    epoch = await s.pool.fetchval("SELECT epoch FROM leader WHERE scope = $1", s.settings.leader_scope)

    link.go_silent()

    # the API finds its dead connections, answers 503 meanwhile, and takes the job
    bound = 10 * s.settings.db_command_timeout_s
    second = await s.submit_until_accepted(timeout=bound)
    # the leader (this one again, or under a new epoch) places it
    await s.wait_state(second, "RUNNING", timeout=bound + 30)
    (control,) = s.controls
    await eventually(lambda: control.is_leader, timeout=bound, what="the control leading")
    # the job running when the connections went silent was never touched
    row = await s.job(running)
    assert (row["state"], row["attempt"]) == ("RUNNING", 1), dict(row)
    assert [e for _, e, _, _ in await s.events(running)].count("requeued") == 0
    states = await s.pool.fetch("SELECT node_id, state FROM nodes ORDER BY node_id")
    assert {r["state"] for r in states} == {"ready"}, [dict(r) for r in states]
    now = await s.pool.fetchval("SELECT epoch FROM leader WHERE scope = $1", s.settings.leader_scope)
    assert now >= epoch


async def test_a_leader_whose_renewal_goes_unanswered_lets_go_before_a_successor_takes_over(
    pool: Any, link: SilentLink, tmp_path: Path
):
    # a dead connection stalls the renewal past the lease, as by default (up to 2 x 10 s against 15 s)
    settings = scaled_settings(tmp_path, leader_renew_s=0.25, leader_ttl_s=2.0, db_command_timeout_s=6.0)
    through_link = await pool_from_settings(settings, link.dsn)
    let_go: list[float] = []
    taken: list[float] = []

    async def noop(epoch: int) -> None:
        pass

    async def took(epoch: int) -> None:
        taken.append(time.monotonic())

    a = Leadership(
        through_link, settings, holder="a", grpc_addr="a:1", on_acquire=noop,
        on_lose=lambda why: let_go.append(time.monotonic()),
    )  # fmt: skip
    b = Leadership(pool, settings, holder="b", grpc_addr="b:1", on_acquire=took, on_lose=lambda why: None)
    tasks = [asyncio.create_task(a.run())]
    try:
        first = await eventually(lambda: a.epoch, timeout=10, what="a leading")
        tasks.append(asyncio.create_task(b.run()))
        await eventually(lambda: b._leader_addr == "a:1", timeout=10, what="b following a")
        silent_at = time.monotonic()
        link.go_silent()
        # a lets go by its own clock, within its lease (plus a loaded machine's slack; 12 s before) ...
        await eventually(lambda: let_go, timeout=20, what="a letting go")
        assert let_go[0] - silent_at <= settings.leader_ttl_s + 1.0, let_go[0] - silent_at
        # ... and before b takes the row as Postgres lets it: never two leaders
        second = await eventually(lambda: b.epoch, timeout=20, what="b leading")
        assert second == first + 1 and a.epoch is None
        assert let_go[0] < taken[0]
    finally:
        await b.stop(resign=True)
        await a.stop(resign=False)
        await asyncio.gather(*tasks, return_exceptions=True)
        through_link.terminate()


async def test_a_transaction_cut_off_before_its_commit_does_not_hold_its_locks(
    outage_stack: OutageStack, link: SilentLink
):
    """A partition rather than a dead host: the server's end of the connection lives on, idle in
    a transaction that holds the leader row, and nothing on the server would end it for the
    2 h of TCP keepalive's default. Each renewal and takeover then waits on that row."""
    s = outage_stack
    (control,) = s.controls
    scope = s.settings.leader_scope
    conn = await control.pool.acquire()  # one of the control's connections, as a renewal has
    tx = conn.transaction()
    await tx.start()
    cut = await conn.fetchval("SELECT expires_at FROM leader WHERE scope = $1 FOR UPDATE", scope)
    link.go_silent()  # the COMMIT will never reach the server

    async def renewed_since() -> bool:
        row = await s.pool.fetchrow("SELECT expires_at FROM leader WHERE scope = $1", scope)
        return row["expires_at"] > cut + timedelta(seconds=s.settings.leader_ttl_s) and control.is_leader

    # the server ends the abandoned transaction, and the leader renews (or takes the row) again
    await eventually(renewed_since, timeout=60, interval=0.5, what="the leader row renewed after the cut")
    job = await s.submit_until_accepted(timeout=30)
    await s.wait_state(job, "RUNNING", timeout=30)
    conn.terminate()
    await control.pool.release(conn)
