"""A dead or frozen leader and the agents' link (worker_agent.link, control.heartbeat_server,
control.leader.leadership): agents leave a frozen leader within seconds and in parallel, try
every address they know, are never sent back to a leader whose lease looks stale, and a
follower that takes over serves the streams it was holding.

Heartbeat 0.2 s, ack timeout 1 s, connect timeout 1 s here (5 s, 5 s, 5 s in production)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from pathlib import Path

import pytest

from common.embedded import any_free_port
from control.leader.leadership import Leadership
from store import leadership
from tests.agent.conftest import PY, Control, make_settings, wait_for
from tests.support import OutputReader, eventually
from worker_agent.agent import AgentProcess

ROOT = Path(__file__).resolve().parents[2]
ACK_S = 1.0
CONNECT_S = 1.0


@pytest.fixture
def settings(tmp_path):
    return make_settings(tmp_path, agent_ack_timeout_s=ACK_S, agent_connect_timeout_s=CONNECT_S)


@pytest.fixture
def frozen_leader(settings):
    """A leading heartbeat server in its own process (the test freezes it with SIGSTOP)."""
    port = any_free_port()
    proc = subprocess.Popen(
        [PY, "-m", "tests.agent.frozen_control", str(port), settings.agent_shared_secret],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
    )  # fmt: skip
    ok, lines = OutputReader(proc.stdout).until("ready", time.monotonic() + 30)
    assert ok, "".join(lines)
    yield proc, f"127.0.0.1:{port}"
    proc.send_signal(signal.SIGCONT)
    proc.kill()
    proc.wait(10)


async def test_agents_leave_a_frozen_leader_within_seconds_all_at_once(settings, frozen_leader):
    proc, frozen = frozen_leader
    # the standby still names the frozen process as the leader: its lease has not run out yet
    standby = Control(settings, leader_address=lambda: frozen)
    await standby.start()
    nodes = [f"node-{i:03d}" for i in range(120)]  # one agent process, as a simulated fleet is
    agent = AgentProcess(settings, nodes, backend="simulated", temporal=False,
                         control_addresses=[frozen, standby.server.address])  # fmt: skip
    await agent.start()
    try:
        links = list(agent.links.values())
        await wait_for(lambda: all(lk.connected_to == frozen for lk in links), timeout=20, what="linked to the leader")
        proc.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        # every agent notices within its ack deadline, is not sent back into the frozen process
        # by the standby's redirect, and waits at the standby until it takes over
        await wait_for(lambda: all(lk.connected_to is None for lk in links), timeout=10, what="the freeze noticed")
        noticed_s = time.monotonic() - frozen_at
        await asyncio.sleep(0)  # the standby takes over now
        standby.server.leader_address = None
        took_over_at = time.monotonic()
        linked: dict[str, float] = {}

        def relinked():
            for lk in links:
                if lk.connected_to == standby.server.address and lk.node.node_id not in linked:
                    linked[lk.node.node_id] = time.monotonic() - took_over_at
            return len(linked) == len(links)

        await wait_for(relinked, timeout=15, what="every agent at the new leader")
        slowest = max(linked.values())
        print(f"\nfreeze noticed by all in {noticed_s:.2f}s; all relinked {slowest:.2f}s after the takeover")
        # the freeze is noticed within heartbeat + ack timeout (+ scheduling slack on a busy machine)
        assert noticed_s < settings.heartbeat_interval_s + ACK_S + 1.5
        # in parallel: nobody waits behind another's connect deadline
        assert slowest < CONNECT_S + 2.0 + 3.0
        assert all(standby.server.table.get(n) is not None for n in nodes)
    finally:
        await agent.stop()
        await standby.stop()


async def test_a_leader_learned_from_a_redirect_is_tried_like_a_configured_one(settings):
    leader = Control(settings)
    await leader.start()
    addr = leader.server.address
    follower = Control(settings, leader_address=lambda: addr)
    await follower.start()
    agent = AgentProcess(settings, ["node-l"], backend="simulated", temporal=False,
                         control_addresses=[follower.server.address])  # fmt: skip
    await agent.start()
    again = Control(settings)
    try:
        link = agent.links["node-l"]
        await wait_for(lambda: link.connected_to == addr, what="redirected to the leader")
        assert link.addresses == [follower.server.address, addr]
        # the only configured address goes away; the leader restarts on its address
        await follower.stop()
        await leader.stop()
        again.server.port = int(addr.rsplit(":", 1)[1])
        await again.start()
        await wait_for(lambda: again.server.table.get("node-l"), timeout=15, what="back at the learned leader")
        # the server has the heartbeat before the agent has its ack: wait for the ack too
        await wait_for(lambda: link.connected_to == addr, timeout=5, what="acknowledged by the learned leader")
    finally:
        await agent.stop()
        await again.stop()


async def test_a_follower_that_takes_over_serves_the_stream_it_was_holding(tmp_path):
    settings = make_settings(tmp_path, agent_ack_timeout_s=6.0, agent_connect_timeout_s=CONNECT_S)
    follower = Control(settings, leader_address=lambda: "")  # no live leader known
    assert follower.server.hold_s == 3.0
    await follower.start()
    agent = AgentProcess(settings, ["node-h"], backend="simulated", temporal=False,
                         control_addresses=[follower.server.address])  # fmt: skip
    await agent.start()
    try:
        await wait_for(lambda: follower.server.counters["held"] == 1, what="the stream held")
        follower.server.leader_address = None  # it takes over
        link = agent.links["node-h"]
        await wait_for(lambda: link.connected_to == follower.server.address, timeout=5, what="served")
        c = follower.server.counters
        assert (c["streams"], c["redirects"], link.failures, link.redirects) == (1, 0, 0, 0)
    finally:
        await agent.stop()
        await follower.stop()


async def test_a_follower_told_of_no_leader_answers_leader_unknown_after_its_hold(settings):
    follower = Control(settings, leader_address=lambda: "")
    await follower.start()
    agent = AgentProcess(settings, ["node-u"], backend="simulated", temporal=False,
                         control_addresses=[follower.server.address])  # fmt: skip
    await agent.start()
    try:
        link = agent.links["node-u"]
        await wait_for(lambda: link.redirects >= 2, timeout=10, what="leader unknown, asked again")
        assert link.failures == 0 and link.connected_to is None
        assert "leader unknown" in link.last_error
    finally:
        await agent.stop()
        await follower.stop()


async def test_a_follower_sends_agents_only_to_a_leader_that_keeps_its_lease(pool, tmp_path):
    from tests.workflows.harness import scaled_settings

    s = scaled_settings(tmp_path, leader_renew_s=0.5, leader_ttl_s=3.0)
    # another control took the lease and then froze: it never renews
    epoch = await leadership.acquire_leadership(pool, scope=s.leader_scope, holder="b", grpc_addr="b:7", ttl_s=3.0)
    expires = await pool.fetchval("SELECT expires_at FROM leader WHERE scope = $1", s.leader_scope)
    took: list[int] = []

    async def on_acquire(e: int) -> None:
        took.append(e)

    lead = Leadership(pool, s, holder="a", grpc_addr="a:1", on_acquire=on_acquire, on_lose=lambda _: None)
    task = asyncio.create_task(lead.run())
    try:
        await eventually(lambda: lead.leader_grpc_addr == "b:7", timeout=5, what="the leader's address")
        # two renewals missed (1 s + 0.5 s slack): agents are no longer sent there
        await eventually(lambda: lead.leader_grpc_addr == "", timeout=5, what="the stale leader forgotten")
        assert not took, "the lease has not run out yet"
        await eventually(lambda: took, timeout=10, what="the takeover")
        acquired = await pool.fetchval("SELECT acquired_at FROM leader WHERE scope = $1", s.leader_scope)
        late = (acquired - expires).total_seconds()
        assert took == [epoch + 1] and 0 <= late < 0.5 + 0.5, f"taken {late:.2f}s after the lease ran out"
    finally:
        await lead.stop(resign=True)
        await asyncio.gather(task, return_exceptions=True)


def test_the_link_has_its_own_connection_and_keepalive_with_a_deadline(settings):
    from worker_agent.link import channel_options

    opts = dict(channel_options(settings))
    assert opts["grpc.use_local_subchannel_pool"] == 1
    assert opts["grpc.keepalive_timeout_ms"] == int(ACK_S * 1000)
    assert 0 < opts["grpc.keepalive_time_ms"] <= 30_000
    # a benchmark may let one process's simulated nodes share a connection; keepalive stays
    shared = dict(channel_options(settings, own_connection=False))
    assert "grpc.use_local_subchannel_pool" not in shared
    assert shared["grpc.keepalive_timeout_ms"] == opts["grpc.keepalive_timeout_ms"]


def test_a_failed_address_sits_out_a_lease_lifetime_of_the_rotation_while_another_answers(settings):
    from types import SimpleNamespace

    from worker_agent.link import ControlLink

    s = settings.model_copy(update={"leader_ttl_s": 15.0})
    link = ControlLink(s, SimpleNamespace(node_id="node-r"), ["a:1", "b:2"])  # type: ignore[arg-type]
    link.failed("a:1")
    now = time.monotonic()
    # if it led, a standby takes the lease within its lifetime: wait there, not in a connect deadline
    assert [link.next_address() for _ in range(3)] == ["b:2"] * 3
    # a follower naming it as the leader is believed again after the ack timeout (its view lags)
    assert link.recently_failed("a:1", now) and not link.recently_failed("a:1", now + ACK_S + 0.01)
    assert link.skipped("a:1", now + ACK_S + 0.01) and not link.skipped("a:1", now + 15.01)
    # when every address failed, the one that failed first is asked
    link.failed("b:2")
    assert link.next_address() == "a:1"


async def test_a_follower_asked_again_and_again_is_asked_over_one_connection(settings):
    follower = Control(settings, leader_address=lambda: "")
    await follower.start()
    agent = AgentProcess(settings, ["node-c"], backend="simulated", temporal=False,
                         control_addresses=[follower.server.address])  # fmt: skip
    await agent.start()
    try:
        link = agent.links["node-c"]
        await wait_for(lambda: link.redirects >= 1, timeout=10, what="leader unknown")
        channel = link._channels[follower.server.address]
        await wait_for(lambda: link.redirects >= 3, timeout=10, what="asked again")
        assert link._channels[follower.server.address] is channel
    finally:
        await agent.stop()
        await follower.stop()
    assert not link._channels, "closed with the link"


async def test_a_stream_whose_status_grpc_lost_is_no_strike_against_the_address(settings):
    """A control that cannot check credentials (Postgres down) ends each stream CONTROL_BUSY;
    when that races one of the agent's writes, gRPC's asyncio client reports INTERNAL "Internal
    error from Core" instead (grpc/grpc#36066). Counted as the address failing, an outage's
    worth of them kept nodes from following a redirect to the new leader for up to 8 ack
    timeouts afterwards. Neither that nor CONTROL_BUSY is a strike; a dead connection still is."""
    from types import SimpleNamespace

    import grpc

    from proto.auth import CONTROL_BUSY
    from worker_agent.link import ControlLink

    def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
        return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)

    link = ControlLink(settings, SimpleNamespace(node_id="node-s"), ["a:1", "b:2"])  # type: ignore[arg-type]
    lost = rpc_error(grpc.StatusCode.INTERNAL, "Internal error from Core")
    busy = rpc_error(grpc.StatusCode.UNAVAILABLE, f"{CONTROL_BUSY}: FileNotFoundError")
    dead = rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses")
    script = [lost, lost, busy, lost, lost, lost]
    tried: list[str] = []
    done = asyncio.Event()

    async def session(addr: str) -> None:
        tried.append(addr)
        if script:
            raise script.pop(0)
        done.set()
        await asyncio.Event().wait()  # then streams on

    async def until_streaming() -> None:
        """Run the link's loop through the scripted errors, until a session streams."""
        done.clear()
        running = asyncio.create_task(link._loop())
        try:
            await asyncio.wait_for(done.wait(), 30)
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)

    link._session = session  # type: ignore[method-assign]
    await until_streaming()
    assert link.failures == 6 and link.strikes == {} and link.failed_at == {}, (link.strikes, tried)
    assert not link.recently_failed("a:1") and not link.recently_failed("b:2")
    # both addresses stayed in the rotation: each was asked in turn
    assert tried[:4] == ["a:1", "b:2", "a:1", "b:2"]

    script[:] = [dead]
    await until_streaming()
    assert link.strikes == {tried[-2]: 1} and link.recently_failed(tried[-2]), (link.strikes, tried)
