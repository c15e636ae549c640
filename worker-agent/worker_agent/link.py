"""The agent side of the gRPC stream to the control leader (docs/design.md, Health and Leadership).

``ControlLink(settings, node).run()`` keeps one ``ControlLink.Connect`` stream open
to the leader, authenticated with the node's credential (``proto.auth``):

* sends a Heartbeat every ``heartbeat_interval_s`` (sooner when the node asks:
  a new TaskStatus or a new fault), and every unacknowledged TaskStatus;
* applies each HeartbeatAck (lease confirmations, reconciliation stops) to the node;
* drops TaskStatus reports from the outbox only when acknowledged, so reports
  survive reconnects and control-plane outages (they are retried);
* follows ``Redirect`` to the leader's address; on errors, or when no ack came
  for three intervals, reconnects to the next configured address with backoff.

Ranks never depend on this link: when it is down they keep running until their
leases have gone unconfirmed for ``unconfirmed_kill_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from proto import agent_pb2 as pb
from proto import agent_pb2_grpc as pbg
from proto.auth import node_credential, node_metadata
from worker_agent.node import NodeAgent

log = logging.getLogger("gpufleet.agent.link")

CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.enable_retries", 0),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5_000),
]


class _Redirected(Exception):
    def __init__(self, addr: str) -> None:
        super().__init__(addr)
        self.addr = addr


class ControlLink:
    def __init__(self, settings, node: NodeAgent, addresses: list[str] | None = None) -> None:
        self.settings = settings
        self.node = node
        self.addresses = list(addresses or settings.control_addresses)
        if not self.addresses:
            raise ValueError("no control addresses configured (GPUFLEET_CONTROL_ADDRESSES)")
        credential = node_credential(settings, node.node_id)
        if not credential:
            raise ValueError(f"no credential for node {node.node_id} (agent_credentials / agent_shared_secret)")
        self.metadata = node_metadata(node.node_id, credential)
        self.interval = float(settings.heartbeat_interval_s)
        self.connected_to: str | None = None  # the leader we are streaming to, when acknowledged
        self.acks = 0
        self.last_ack_at: float | None = None
        self.last_error: str = ""

    async def run(self) -> None:
        """Stream to the leader until cancelled."""
        idx = 0
        hops = 0
        preferred: str | None = None
        base = min(0.2, self.interval)
        backoff = base
        max_backoff = max(1.0, self.interval)
        while True:
            addr = preferred or self.addresses[idx % len(self.addresses)]
            preferred = None
            try:
                await self._session(addr)
                self.last_error = f"{addr}: stream ended"
            except _Redirected as r:
                if r.addr and r.addr != addr and hops < 3:
                    log.info("%s: %s is not the leader; redirected to %s", self.node.node_id, addr, r.addr)
                    preferred, hops = r.addr, hops + 1
                    continue
                self.last_error = f"{addr}: not the leader (leader {r.addr or 'unknown'})"
            except asyncio.CancelledError:
                raise
            except Exception as e:  # grpc errors, ack timeouts: reconnect
                self.last_error = f"{addr}: {type(e).__name__}: {_short(e)}"
            log.info("%s: control link: %s; reconnecting", self.node.node_id, self.last_error)
            hops = 0
            if self.connected_to is not None:
                backoff = base  # it had worked: retry soon
            self.connected_to = None
            idx += 1
            await asyncio.sleep(backoff)
            backoff = min(max_backoff, backoff * 2)

    async def _session(self, addr: str) -> None:
        node = self.node
        async with grpc.aio.insecure_channel(addr, options=CHANNEL_OPTIONS) as channel:
            stub = pbg.ControlLinkStub(channel)
            call = stub.Connect(metadata=self.metadata)
            node.forget_sent()
            acked = asyncio.Event()
            state = {"last_ack": time.monotonic()}

            async def receive() -> None:
                async for msg in call:
                    kind = msg.WhichOneof("body")
                    if kind == "heartbeat_ack":
                        state["last_ack"] = time.monotonic()
                        self.last_ack_at = time.time()
                        self.acks += 1
                        self.connected_to = addr
                        node.on_ack(msg.heartbeat_ack)
                        acked.set()
                    elif kind == "task_status_ack":
                        a = msg.task_status_ack
                        node.status_acked(a.seq, a.ok or a.refused)
                        if a.refused:
                            log.warning("%s: leader refused status %s: %s", node.node_id, a.seq, a.error)
                        elif not a.ok:
                            log.info("%s: leader did not take status %s: %s", node.node_id, a.seq, a.error)
                    elif kind == "redirect":
                        raise _Redirected(msg.redirect.leader_addr)

            async def send() -> None:
                next_hb = 0.0
                retry_s = max(1.0, 2 * self.interval)
                while True:
                    now = time.monotonic()
                    if now - state["last_ack"] > max(3 * self.interval, 3.0):
                        raise TimeoutError(f"no acknowledgement from {addr} for {now - state['last_ack']:.1f}s")
                    if now >= next_hb:
                        hb = await node.heartbeat()
                        await call.write(pb.AgentMessage(heartbeat=hb))
                        next_hb = time.monotonic() + self.interval
                    for m in node.pending_statuses(retry_s):
                        await call.write(pb.AgentMessage(task_status=m))
                    node.wake.clear()
                    timeout = max(0.0, next_hb - time.monotonic())
                    if node.outbox:
                        timeout = min(timeout, retry_s)
                    try:
                        await asyncio.wait_for(node.wake.wait(), timeout=timeout)
                    except TimeoutError:
                        pass
                    if node.take_heartbeat_request():  # e.g. a new fault: report it now
                        next_hb = 0.0

            recv_task = asyncio.create_task(receive())
            send_task = asyncio.create_task(send())
            try:
                done, _ = await asyncio.wait({recv_task, send_task}, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()  # raise what ended it
            finally:
                for t in (recv_task, send_task):
                    t.cancel()
                for t in (recv_task, send_task):
                    try:
                        await t
                    except (asyncio.CancelledError, Exception):
                        pass
                call.cancel()


def _short(e: Exception) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name} {e.details()}"
    return str(e)[:200]
