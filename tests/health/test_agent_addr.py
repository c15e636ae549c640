"""The leader writes the address each agent advertises in its heartbeats to nodes.agent_addr
(where the API proxies rank logs from, and the host of a job's rendezvous): on change only,
under the leader's epoch. The health monitor runs on a real database with a heartbeat table
fed directly (no gRPC, no Temporal)."""

from __future__ import annotations

from control.agent_link import HeartbeatTable
from control.health.monitor import HealthMonitor
from control.leader.signals import JobSignals
from control.leader.state import LeaderState
from proto import agent_pb2 as pb
from store import leadership, nodes
from tests.foundation.builders import small_cluster
from tests.support import eventually, holds
from tests.workflows.harness import scaled_settings


async def test_heartbeat_agent_addr_is_written_to_the_node_row(pool, tmp_path, monkeypatch):
    settings = scaled_settings(tmp_path, health_sweep_s=0.1, takeover_quiet_s=60.0)
    async with pool.acquire() as conn:
        await small_cluster(conn, blocks=1, nodes_per_block=2)
    epoch = await leadership.acquire_leadership(
        pool, scope=settings.leader_scope, holder="test", grpc_addr="-", ttl_s=3600
    )
    table = HeartbeatTable()
    state = LeaderState(pool, settings, JobSignals(pool, None, settings))  # type: ignore[arg-type]
    monitor = HealthMonitor(pool, None, settings, state=state, table=lambda: table)  # type: ignore[arg-type]
    writes: list[str] = []
    real = nodes.set_agent_addr

    async def counting(db, **kw):
        writes.append(kw["addr"])
        return await real(db, **kw)

    monkeypatch.setattr(nodes, "set_agent_addr", counting)
    await monitor.take_over(epoch)

    async def addr(node: str):
        return await pool.fetchval("SELECT agent_addr FROM nodes WHERE node_id = $1", node)

    def beat(seq: int, agent_addr: str) -> None:
        msg = pb.Heartbeat(node_id="b0-n0", boot_id="boot-1", seq=seq, agent_addr=agent_addr)
        monitor.on_heartbeat(table.offer("b0-n0", msg))

    try:
        beat(1, "127.0.0.1:4242")
        await eventually(lambda: _eq(addr("b0-n0"), "127.0.0.1:4242"), timeout=5, what="agent_addr written")
        assert await addr("b0-n1") is None  # no heartbeat, nothing written
        for seq in (2, 3, 4):  # the same address again: no more writes
            beat(seq, "127.0.0.1:4242")
        await holds(lambda: writes == ["127.0.0.1:4242"], for_s=0.4, what="no second write")  # a few sweeps
        beat(5, "127.0.0.1:5353")  # the agent restarted on another port
        await eventually(lambda: _eq(addr("b0-n0"), "127.0.0.1:5353"), timeout=5, what="agent_addr rewritten")
        assert writes == ["127.0.0.1:4242", "127.0.0.1:5353"]
        # a deposed leader writes nothing
        await pool.execute("UPDATE leader SET epoch = epoch + 1 WHERE scope = $1", settings.leader_scope)
        beat(6, "127.0.0.1:6464")
        await eventually(lambda: _true(len(writes) == 3), timeout=5, what="the attempt")
        await holds(lambda: _eq(addr("b0-n0"), "127.0.0.1:5353"), for_s=0.2, what="the address unchanged")
    finally:
        await monitor.stop()


async def _eq(value, want) -> bool:
    return (await value) == want


async def _true(v: bool) -> bool:
    return v
