"""The agent side of the gRPC stream to the control leader (docs/design.md, Health and Leadership).

``ControlLink(settings, node).run()`` keeps one ``ControlLink.Connect`` stream open
to the leader, authenticated with the node's credential (``proto.auth``):

* sends a Heartbeat every ``heartbeat_interval_s`` (sooner when the node asks:
  a new TaskStatus or a new fault), and every unacknowledged TaskStatus;
* applies each HeartbeatAck (lease confirmations, reconciliation stops) to the node;
* drops TaskStatus reports from the outbox only when acknowledged, so reports
  survive reconnects and control-plane outages (they are retried);
* follows ``Redirect`` to the leader's address.

A dead or frozen leader is noticed within seconds, and every wait has a deadline:

* connecting: an address whose channel is not ready within ``agent_connect_timeout_s`` is
  given up (a frozen process still completes TCP handshakes in its kernel, never HTTP/2's);
* streaming: a heartbeat not acknowledged within ``agent_ack_timeout_s`` ends the stream,
  and so does a write that cannot complete in that time; gRPC keepalive pings, with the
  same timeout, catch a connection that died without a word;
* every control address it knows is tried in turn: the configured ``control_addresses``
  and any leader address learned from a redirect. An address that failed is not followed
  on a redirect for ``agent_ack_timeout_s`` after its first failure in a row and twice as
  long after each further one (up to 8x), so a follower's redirect to a leader that froze a
  moment ago (the follower's view lags) does not send the agent back into it. In the
  rotation it is skipped for at least ``leader_ttl_s`` while another address is left: if it
  led, a standby takes the lease within that time, and the agent is better off waiting at
  the standby (which holds its stream) than inside a connect deadline of the frozen one at
  the moment of the takeover. When every address failed, the one that failed first is tried;
* a control process that cannot check credentials (Postgres is down) answers ``CONTROL_BUSY``:
  it is up, so that is no failure of its address. Nor is a stream ended under one of our
  writes, which gRPC's asyncio client reports as ``INTERNAL: Internal error from Core`` in
  place of the server's own status (grpc/grpc#36066): the address is not known to have
  failed, so neither strike nor pardon (``_status_lost``). Counted as failures, those masked
  busy answers piled up strikes during an outage (two in five of the errors the agents of 3,008
  nodes saw in a 30-s Postgres outage, ``gpufleet bench outage``), and a node could then keep
  away from the new leader for up to 8 ack timeouts;
* a follower that knows no live leader answers "leader unknown" (it may hold the stream
  for a while first, ``control.heartbeat_server``); the agent retries after a short
  jittered back-off, so thousands of agents do not arrive in lockstep.

Each link has its own gRPC channels and connections (a local subchannel pool): a process
hosting many simulated nodes re-links them in parallel, as separate hosts would, and no
stream waits behind another's dead connection. A channel is kept while its address answers
(a follower asked again and again during a takeover costs a stream, not a TCP and HTTP/2
handshake each time), closed when the address fails, and the channels to other addresses
are closed once the link is acknowledged by a leader.

Ranks never depend on this link: when it is down they keep running until their
leases have gone unconfirmed for ``unconfirmed_kill_s``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

import grpc

from common.tls import grpc_channel_credentials
from proto import agent_pb2 as pb
from proto import agent_pb2_grpc as pbg
from proto.auth import CONTROL_BUSY, node_credential, node_metadata
from worker_agent.node import NodeAgent

log = logging.getLogger("gpufleet.agent.link")

MAX_REDIRECT_HOPS = 3
MAX_PENALTY_DOUBLINGS = 3  # an address failing again and again is skipped for at most 8 x the ack timeout


def channel_options(settings, *, own_connection: bool = True) -> list[tuple[str, int]]:
    """gRPC options of one link's channel: keepalive with a deadline, its own connection
    (``own_connection=False``: the links of one process to one address share a connection,
    as a benchmark hosting thousands of simulated nodes in a few processes may want)."""
    interval = float(settings.heartbeat_interval_s)
    options = [
        ("grpc.keepalive_time_ms", int(1000 * min(30.0, max(2.0, 2 * interval)))),
        ("grpc.keepalive_timeout_ms", int(1000 * float(settings.agent_ack_timeout_s))),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.enable_retries", 0),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]
    if own_connection:  # one connection per link: a dead connection is never shared by other nodes' streams
        options.append(("grpc.use_local_subchannel_pool", 1))
    return options


class _Redirected(Exception):
    def __init__(self, addr: str) -> None:
        super().__init__(addr)
        self.addr = addr


class ControlLink:
    def __init__(
        self, settings, node: NodeAgent, addresses: list[str] | None = None, *, own_connection: bool = True
    ) -> None:
        self.settings = settings
        self.node = node
        self.addresses = list(dict.fromkeys(addresses or settings.control_addresses))  # configured, then learned
        if not self.addresses:
            raise ValueError("no control addresses configured (GPUFLEET_CONTROL_ADDRESSES)")
        credential = node_credential(settings, node.node_id)
        if not credential:
            raise ValueError(f"no credential for node {node.node_id} (agent_credentials / agent_shared_secret)")
        self.metadata = node_metadata(node.node_id, credential)
        self.interval = float(settings.heartbeat_interval_s)
        self.ack_timeout = float(settings.agent_ack_timeout_s)
        self.connect_timeout = float(settings.agent_connect_timeout_s)
        # the rotation skips a failed address this long at least: a leader's lease lifetime
        self.lease_s = float(settings.leader_ttl_s)
        self.options = channel_options(settings, own_connection=own_connection)
        self.credentials = grpc_channel_credentials(settings)
        self.connected_to: str | None = None  # the leader we are streaming to, when acknowledged
        self.acks = 0
        self.last_ack_at: float | None = None
        self.last_error: str = ""
        self.failures = 0  # sessions that ended in an error (connect or ack deadline, gRPC error)
        self.redirects = 0
        self.failed_at: dict[str, float] = {}  # address -> monotonic time it last failed
        self.strikes: dict[str, int] = {}  # address -> failures in a row (an answer of any kind resets it)
        self._next = 0  # rotation over self.addresses
        self._channels: dict[str, grpc.aio.Channel] = {}  # address -> open channel (module docstring)

    # ------------------------------------------------------------------ addresses

    def learn(self, addr: str) -> None:
        """A leader address from a redirect: kept, and tried like a configured one from now on."""
        if addr and addr not in self.addresses:
            self.addresses.append(addr)

    def failed(self, addr: str) -> None:
        self.failed_at[addr] = time.monotonic()
        self.strikes[addr] = self.strikes.get(addr, 0) + 1

    def answered(self, addr: str) -> None:
        """It answered (acknowledged, or said it does not lead): it is alive."""
        self.strikes.pop(addr, None)
        self.failed_at.pop(addr, None)

    def penalty(self, addr: str) -> float:
        """How long a redirect to ``addr`` is not followed after its latest failure."""
        return self.ack_timeout * 2 ** min(self.strikes.get(addr, 1) - 1, MAX_PENALTY_DOUBLINGS)

    def recently_failed(self, addr: str, now: float | None = None) -> bool:
        at = self.failed_at.get(addr)
        if at is None:
            return False
        return (time.monotonic() if now is None else now) - at < self.penalty(addr)

    def skipped(self, addr: str, now: float) -> bool:
        """Left out of the rotation: failed within its penalty or the lease lifetime, the longer."""
        at = self.failed_at.get(addr)
        return at is not None and now - at < max(self.penalty(addr), self.lease_s)

    def next_address(self) -> str:
        """The next address in turn that is not skipped; if all are, the one that failed first."""
        now = time.monotonic()
        n = len(self.addresses)
        for i in range(n):
            addr = self.addresses[(self._next + i) % n]
            if not self.skipped(addr, now):
                self._next = (self._next + i + 1) % n
                return addr
        addr = min(self.addresses, key=lambda a: self.failed_at.get(a, 0.0))
        self._next = (self.addresses.index(addr) + 1) % n
        return addr

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Stream to the leader until cancelled."""
        try:
            await self._loop()
        finally:
            for addr in list(self._channels):
                await self._close(addr)

    async def _loop(self) -> None:
        hops = 0
        preferred: str | None = None
        base = min(0.2, self.interval)
        max_backoff = min(2.0, max(1.0, self.interval))
        backoff = base
        while True:
            addr = preferred or self.next_address()
            preferred = None
            try:
                await self._session(addr)
                self.last_error = f"{addr}: stream ended"
                self.failed(addr)
                await self._close(addr)
            except _Redirected as r:
                self.redirects += 1
                self.answered(addr)
                self.learn(r.addr)
                if r.addr and r.addr != addr and hops < MAX_REDIRECT_HOPS and not self.recently_failed(r.addr):
                    log.info("%s: %s is not the leader; redirected to %s", self.node.node_id, addr, r.addr)
                    preferred, hops = r.addr, hops + 1
                    continue
                # alive but not leading, and no leader it would name (or one that just failed us)
                self.last_error = f"{addr}: not the leader (leader {r.addr or 'unknown'})"
                if r.addr and self.recently_failed(r.addr):
                    # it names a leader that just failed us: ask again when we would follow
                    # the redirect, not sooner (thousands of agents asking a follower in a
                    # loop while it takes over is load it does not need)
                    wait = self.failed_at[r.addr] + self.penalty(r.addr) - time.monotonic()
                    backoff = max(backoff, min(wait, self.ack_timeout))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # grpc errors, connect and ack deadlines: try another address
                self.failures += 1
                if isinstance(e, grpc.aio.AioRpcError) and CONTROL_BUSY in (e.details() or ""):
                    self.answered(addr)  # up, but it cannot check credentials now: not its failure
                elif not _status_lost(e):
                    self.failed(addr)
                await self._close(addr)
                self.last_error = f"{addr}: {type(e).__name__}: {_short(e)}"
            log.info("%s: control link: %s; reconnecting", self.node.node_id, self.last_error)
            hops = 0
            if self.connected_to is not None:
                backoff = base  # it had worked: retry soon
            self.connected_to = None
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))  # jittered: a fleet does not retry in step
            backoff = min(max_backoff, backoff * 2)

    async def _close(self, addr: str) -> None:
        channel = self._channels.pop(addr, None)
        if channel is not None:
            await channel.close()

    async def _linked(self, addr: str) -> None:
        """Acknowledged by the leader at ``addr``: the channels to other addresses go."""
        self.answered(addr)
        for other in [a for a in self._channels if a != addr]:
            await self._close(other)

    async def _session(self, addr: str) -> None:
        node = self.node
        channel = self._channels.get(addr)
        if channel is None:
            if self.credentials is not None:  # control_tls: the server's certificate is checked
                channel = grpc.aio.secure_channel(addr, self.credentials, options=self.options)
            else:
                channel = grpc.aio.insecure_channel(addr, options=self.options)
            self._channels[addr] = channel
        try:
            await asyncio.wait_for(channel.channel_ready(), self.connect_timeout)
        except TimeoutError:
            raise TimeoutError(f"not connected within {self.connect_timeout:.1f}s") from None
        stub = pbg.ControlLinkStub(channel)
        call = stub.Connect(metadata=self.metadata)
        node.forget_sent()
        # when the oldest heartbeat not yet acknowledged was sent (None: all acknowledged)
        unacked: dict[str, float | None] = {"since": None}
        first = True

        async def receive() -> None:
            nonlocal first
            async for msg in call:
                kind = msg.WhichOneof("body")
                if kind == "heartbeat_ack":
                    unacked["since"] = None
                    self.last_ack_at = time.time()
                    self.acks += 1
                    self.connected_to = addr
                    node.on_ack(msg.heartbeat_ack)
                    if first:
                        first = False
                        await self._linked(addr)
                elif kind == "task_status_ack":
                    a = msg.task_status_ack
                    node.status_acked(a.seq, a.ok or a.refused)
                    if a.refused:
                        log.warning("%s: leader refused status %s: %s", node.node_id, a.seq, a.error)
                    elif not a.ok:
                        log.info("%s: leader did not take status %s: %s", node.node_id, a.seq, a.error)
                elif kind == "redirect":
                    raise _Redirected(msg.redirect.leader_addr)

        def deadline() -> float:
            since = unacked["since"]
            return float("inf") if since is None else since + self.ack_timeout

        async def write(m: pb.AgentMessage) -> None:
            left = min(deadline(), time.monotonic() + self.ack_timeout) - time.monotonic()
            try:
                await asyncio.wait_for(call.write(m), max(0.0, left))
            except TimeoutError:
                raise TimeoutError(f"{addr} took no message for {self.ack_timeout:.1f}s") from None

        async def send() -> None:
            next_hb = 0.0
            retry_s = max(1.0, 2 * self.interval)
            while True:
                now = time.monotonic()
                if now >= deadline():
                    raise TimeoutError(f"no acknowledgement from {addr} for {now - (unacked['since'] or now):.1f}s")
                if now >= next_hb:
                    hb = await node.heartbeat()
                    if unacked["since"] is None:
                        unacked["since"] = time.monotonic()
                    await write(pb.AgentMessage(heartbeat=hb))
                    next_hb = time.monotonic() + self.interval
                for m in node.pending_statuses(retry_s):
                    await write(pb.AgentMessage(task_status=m))
                node.wake.clear()
                timeout = max(0.0, min(next_hb, deadline()) - time.monotonic())
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


# what gRPC's asyncio client reports when one of our writes meets a stream that has ended: the
# status the server sent (CONTROL_BUSY, a redirect's end) is overwritten (grpc/grpc#36066)
_LOST_STATUS_DETAILS = "Internal error from Core"


def _status_lost(e: Exception) -> bool:
    """The stream ended under a write and gRPC lost the server's status: the server may have
    answered (it ends streams itself) or the connection died; the next session tells which."""
    return (
        isinstance(e, grpc.aio.AioRpcError)
        and e.code() == grpc.StatusCode.INTERNAL
        and (e.details() or "") == _LOST_STATUS_DETAILS
    )


def _short(e: Exception) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name} {e.details()}"
    return str(e)[:200]
