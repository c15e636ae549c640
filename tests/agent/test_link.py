"""The gRPC stream between agents and the control leader: heartbeats, acks, reports, auth, redirects, logs.

Heartbeat interval 0.2 s here (5 s in production).
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from common.contracts import StopTask
from common.embedded import any_free_port
from proto import agent_pb2 as pb
from proto import agent_pb2_grpc as pbg
from proto.auth import lease_log_token, node_credential, node_log_key, node_metadata
from tests.agent.conftest import Control, make_settings, pid_alive, script, start_task, wait_for
from tests.support import holds
from worker_agent import statefiles as sf
from worker_agent.agent import AgentProcess
from worker_agent.nvml import write_fault

SLEEPER = "import time\nprint('hello from the rank', flush=True)\nwhile True:\n    time.sleep(0.05)\n"
SPINNER = "print('hello from the rank', flush=True)\nwhile True:\n    pass\n"  # one core busy: GPUs in use


async def test_heartbeats_carry_the_design_fields_and_acks_confirm_leases(agent, control, tmp_path):
    node = agent.nodes["node-a"]
    res = await node.start_task(start_task("node-a", "lease-hb", script(tmp_path, "s.py", SPINNER), gpus=(1, 3)))
    started_ms = int(time.time() * 1000)  # heartbeat seqs are ms-based: the first one built after the start

    def running():
        e = control.server.table.get("node-a")
        # the rank's use shows once the backend has measured it over a window (CPU_WINDOW_S)
        busy = e is not None and e.report().gpus[1].sm_util > 50
        return e is not None and e.seq > started_ms and e.lease_ids == ["lease-hb"] and busy and e

    entry = await wait_for(running, timeout=20, what="the busy lease in a heartbeat")
    r = entry.report()
    assert r.boot_id == node.boot_id and r.free_disk_bytes > 0 and r.agent_addr == agent.http_log_addr
    assert [g.index for g in r.gpus] == list(range(8)) and all(g.health == "ok" for g in r.gpus)
    assert r.gpus[1].sm_util > 50 and r.gpus[0].sm_util == 0  # GPUs 1 and 3 run the rank
    assert r.gpus[3].mem_used and r.gpus[3].mem_total and r.gpus[3].temperature_c
    lease = r.running[0]
    assert (lease.lease_id, lease.job_id, lease.epoch, lease.pid, lease.gpu_indices) == (
        "lease-hb",
        "job-lease-hb",
        1,
        res.pid,
        (1, 3),
    )
    assert r.cached_images == ("registry/test:1",)
    # the ack confirmed the lease: the supervisor's clock file moved
    before = sf.read_json(node.leases["lease-hb"].dir / sf.CONFIRMED)
    await wait_for(lambda: (sf.read_json(node.leases["lease-hb"].dir / sf.CONFIRMED) or {}).get("clock", 0)
                   > (before or {}).get("clock", 0), what="a new confirmation")  # fmt: skip
    # seq grows; the STARTED report reached the callback
    seq = entry.seq
    await wait_for(lambda: control.server.table.get("node-a").seq > seq, what="next heartbeat")
    await wait_for(lambda: "STARTED" in control.states("lease-hb"), what="STARTED report")
    assert control.statuses[0].node_id == "node-a" and control.statuses[0].job_id == "job-lease-hb"


async def test_task_status_is_retried_until_the_leader_takes_it(settings, tmp_path):
    failing = {"left": 3}
    got = []

    async def flaky(status):
        if failing["left"] > 0:
            failing["left"] -= 1
            raise RuntimeError("job workflow unreachable")
        got.append(status)

    c = Control(settings, on_task_status=flaky)
    await c.start()
    a = AgentProcess(settings, ["node-c"], backend="simulated", temporal=False, control_addresses=[c.server.address])
    await a.start()
    try:
        node = a.nodes["node-c"]
        await node.start_task(start_task("node-c", "lease-retry", script(tmp_path, "s.py", SLEEPER)))
        await node.stop_task(StopTask("lease-retry", 1, "node-c", 0.5, "done"))
        await wait_for(lambda: [s.state.value for s in got] == ["STARTED", "STOPPED"], timeout=15, what="both reports")
        assert c.server.counters["failed_statuses"] == 3
        await wait_for(lambda: not node.outbox, what="outbox drained")
        assert (node.leases["lease-retry"].dir / sf.REPORTED).exists()
    finally:
        await a.stop()
        await c.stop()


async def test_reports_made_while_the_control_plane_is_down_arrive_after_it_is_back(settings, tmp_path):
    port = any_free_port()
    addr = f"127.0.0.1:{port}"
    a = AgentProcess(settings, ["node-d"], backend="simulated", temporal=False, control_addresses=[addr])
    await a.start()
    c = None
    try:
        node = a.nodes["node-d"]
        res = await node.start_task(start_task("node-d", "lease-out", script(tmp_path, "s.py", SLEEPER)))
        await node.stop_task(StopTask("lease-out", 1, "node-d", 0.5, "done"))
        assert not pid_alive(res.pid) and len(node.outbox) == 2
        await holds(lambda: len(node.outbox) == 2, for_s=0.5, what="both reports kept while control is down")
        from control.heartbeat_server import HeartbeatServer

        got = []
        c = HeartbeatServer(settings, host="127.0.0.1", port=port, on_task_status=got.append)
        await c.start()
        await wait_for(lambda: [s.state.value for s in got] == ["STARTED", "STOPPED"], timeout=15, what="late reports")
    finally:
        await a.stop()
        if c is not None:
            await c.stop(0.2)


async def _refused(call, msg: pb.AgentMessage) -> grpc.StatusCode:
    """The status the server ended the stream with. A credential is checked from the call's
    metadata, so the server may refuse before the first message is even written (then the
    write raises; under load in CI it did)."""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call.write(msg)
        await call.read()
    return e.value.code()


async def test_bad_credentials_and_foreign_node_messages_are_rejected_and_audited(settings, control):
    async with grpc.aio.insecure_channel(control.server.address) as ch:
        stub = pbg.ControlLinkStub(ch)
        call = stub.Connect(metadata=node_metadata("node-a", "wrong-credential"))
        hb = pb.AgentMessage(heartbeat=pb.Heartbeat(node_id="node-a", seq=1))
        assert await _refused(call, hb) == grpc.StatusCode.UNAUTHENTICATED
        # a valid node sending a heartbeat for another node
        call = stub.Connect(metadata=node_metadata("node-a", node_credential(settings, "node-a")))
        hb = pb.AgentMessage(heartbeat=pb.Heartbeat(node_id="node-b", seq=1))
        assert await _refused(call, hb) == grpc.StatusCode.PERMISSION_DENIED
    assert [f.reason for f in control.auth_failures] == ["bad or missing node credential", "heartbeat for another node"]
    assert control.auth_failures[1].message_node_id == "node-b"
    assert control.server.table.get("node-b") is None and control.server.table.get("node-a") is None


async def test_stale_and_duplicate_heartbeats_are_dropped(settings, control):
    async with grpc.aio.insecure_channel(control.server.address) as ch:
        call = pbg.ControlLinkStub(ch).Connect(metadata=node_metadata("node-s", node_credential(settings, "node-s")))
        for seq in (5, 4, 5, 6):
            await call.write(pb.AgentMessage(heartbeat=pb.Heartbeat(node_id="node-s", boot_id="b1", seq=seq)))
            assert (await call.read()).heartbeat_ack.seq == seq
        await call.write(pb.AgentMessage(heartbeat=pb.Heartbeat(node_id="node-s", boot_id="b2", seq=1)))
        await call.read()
        call.cancel()
    assert control.server.counters["stale_heartbeats"] == 2
    assert control.server.table.get("node-s").boot_id == "b2"


async def test_non_leaders_redirect_agents_to_the_leader(settings, control, tmp_path):
    follower = Control(settings, leader_address=lambda: control.server.address)
    await follower.start()
    a = AgentProcess(settings, ["node-e"], backend="simulated", temporal=False,
                     control_addresses=[follower.server.address, control.server.address])  # fmt: skip
    await a.start()
    try:
        # the leader records the heartbeat before its acknowledgement reaches the agent
        link = a.links["node-e"]
        await wait_for(lambda: control.server.table.get("node-e") and link.connected_to == control.server.address,
                       what="heartbeat at the leader, acknowledged")  # fmt: skip
        assert follower.server.table.get("node-e") is None and follower.server.counters["redirects"] >= 1
        # leadership moves: the old leader now redirects to the follower, which leads
        follower.server.leader_address = None
        control.server.leader_address = lambda: follower.server.address
        await wait_for(lambda: follower.server.table.get("node-e"), timeout=10, what="heartbeat at the new leader")
        await wait_for(lambda: a.links["node-e"].connected_to == follower.server.address, what="link moved")
    finally:
        await a.stop()
        await follower.stop()


@pytest.mark.parametrize("fault,expect", [
    ({"xid": 79}, ("failed", "xid:79")),
    ({"ecc": "dbe"}, ("failed", "ecc:dbe=1")),
    ({"slow": 0.5}, ("degraded", "slow:0.5")),
    ({"link": 3}, ("failed", "nvlink:3:down")),
    ({"xid": 13}, ("degraded", "xid:13")),  # not a fatal Xid
])  # fmt: skip
async def test_simulated_faults_appear_in_the_heartbeat_within_one_interval(agent, control, settings, fault, expect):
    await wait_for(lambda: control.server.table.get("node-b"), what="first heartbeat")
    t0 = time.monotonic()
    write_fault(settings.state_dir, "node-b", gpu=6, **fault)  # what `gpufleet agent inject-fault` does

    def shows():
        e = control.server.table.get("node-b")
        g = e.report().gpus[6]
        return g.health == expect[0] and expect[1] in g.faults

    await wait_for(shows, timeout=5, interval=0.005, what=f"fault {fault}")
    took = time.monotonic() - t0
    assert took <= settings.heartbeat_interval_s + 0.1, took
    e = control.server.table.get("node-b")
    assert [g.health for i, g in enumerate(e.report().gpus) if i != 6] == ["ok"] * 7
    if expect[0] == "failed":
        assert e.failed_gpus() == [6]


async def test_a_hung_gpu_freezes_the_ranks_step_and_zeroes_utilization(agent, control, settings, tmp_path):
    node = agent.nodes["node-a"]
    body = "import json, os, time\nfor s in range(1, 10**6):\n" \
           "    json.dump({'step': s}, open(os.environ['GPUFLEET_PROGRESS_FILE'] + '.t', 'w'))\n" \
           "    os.replace(os.environ['GPUFLEET_PROGRESS_FILE'] + '.t', os.environ['GPUFLEET_PROGRESS_FILE'])\n" \
           "    time.sleep(0.05)\n"  # fmt: skip
    await node.start_task(start_task("node-a", "lease-hang", script(tmp_path, "steps.py", body), gpus=(4,)))
    await wait_for(lambda: (node.leases["lease-hang"].step or 0) > 3, what="steps")
    write_fault(settings.state_dir, "node-a", gpu=4, hang=True)

    def frozen():
        e = control.server.table.get("node-a")
        r = e.report()
        return r.gpus[4].sm_util == 0 and r.running and r.running[0].step_age_s > 0.5 and r

    r1 = await wait_for(frozen, timeout=5, what="frozen step")
    await holds(lambda: control.server.table.get("node-a").report().running[0].step == r1.running[0].step,
                for_s=0.5, what="the reported step frozen")  # fmt: skip
    r2 = control.server.table.get("node-a").report()
    assert r2.running[0].step == r1.running[0].step and node.leases["lease-hang"].step > r1.running[0].step


async def test_rank_logs_are_served_over_the_apis_http_contract(agent, settings, tmp_path):
    """The address heartbeats advertise (nodes.agent_addr) speaks api/logs_proxy.py's contract,
    read here with the API's own client."""
    from api.errors import ApiError
    from api.logs_proxy import open_agent_log

    key_b = node_log_key(settings.log_signing_key, "node-b")

    async def read(lease: str, token: str | None = None, **kw) -> bytes:
        token = token or lease_log_token(key_b, lease, now=time.time(), ttl_s=60)
        body = await open_agent_log(agent.http_log_addr, lease, token=token, **kw)
        return b"".join([c async for c in body])

    node = agent.nodes["node-b"]  # the second node of the process: lease ids are looked up across nodes
    await node.start_task(start_task("node-b", "lease-http", script(tmp_path, "s.py", SLEEPER)))
    await wait_for(lambda: (node.leases["lease-http"].dir / sf.STDOUT).stat().st_size > 0, what="output")
    assert await read("lease-http") == b"hello from the rank\n"
    assert await read("lease-http", stream="all") == b"[stdout] hello from the rank\n"
    # refused: a made-up token, the old static dev token, another lease's token, an expired
    # one, one signed with another key, one signed with the key of another node (node-a, in
    # the same agent process), one signed with the API's key itself
    other = lease_log_token(key_b, "lease-other", now=time.time(), ttl_s=60)
    stale = lease_log_token(key_b, "lease-http", now=time.time() - 120, ttl_s=60)
    forged = lease_log_token("another-key-another-key", "lease-http", now=time.time(), ttl_s=60)
    node_a = lease_log_token(node_log_key(settings.log_signing_key, "node-a"), "lease-http", now=time.time(), ttl_s=60)
    master = lease_log_token(settings.log_signing_key, "lease-http", now=time.time(), ttl_s=60)
    for bad in ("not-the-token", "dev-agent-log-token", other, stale, forged, node_a, master):
        with pytest.raises(ApiError) as e:
            await read("lease-http", token=bad)
        assert e.value.code == "agent_auth_failed", bad
    with pytest.raises(ApiError) as e:
        await read("nope")
    assert e.value.code == "logs_not_found"
    # the node's issued log key (GPUFLEET_AGENT_LOG_KEYS) is what it checks when it has one
    agent.settings.agent_log_keys["node-b"] = "issued-log-key-issued-log-key"
    with pytest.raises(ApiError) as e:
        await read("lease-http")
    assert e.value.code == "agent_auth_failed"
    issued = lease_log_token("issued-log-key-issued-log-key", "lease-http", now=time.time(), ttl_s=60)
    assert await read("lease-http", token=issued) == b"hello from the rank\n"
    del agent.settings.agent_log_keys["node-b"]
    # follow: the response stays open while the rank runs and ends after it exits
    follower = asyncio.create_task(read("lease-http", follow=True))
    await holds(lambda: not follower.done(), for_s=0.5, what="the follow response open")
    await node.stop_task(StopTask("lease-http", 1, "node-b", 0.5, "done"))
    assert await asyncio.wait_for(follower, 10) == b"hello from the rank\n"


async def test_reconciliation_stop_in_an_ack_stops_the_task(tmp_path):
    settings = make_settings(tmp_path)
    c = Control(settings, leases_to_stop=lambda e: [(lid, 1, "no live lease") for lid in e.lease_ids])
    c.confirm = False
    await c.start()
    a = AgentProcess(settings, ["node-g"], backend="simulated", temporal=False, control_addresses=[c.server.address])
    await a.start()
    try:
        node = a.nodes["node-g"]
        res = await node.start_task(start_task("node-g", "lease-orphan", script(tmp_path, "s.py", SLEEPER)))
        await wait_for(lambda: not pid_alive(res.pid), timeout=10, what="reconciliation stop")
        await wait_for(lambda: "STOPPED" in c.states("lease-orphan"), what="STOPPED report")
        assert node.leases["lease-orphan"].exit["reason"] == "no live lease"
    finally:
        await a.stop()
        await c.stop()
