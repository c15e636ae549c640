"""The control side of the agents' gRPC stream (docs/design.md, Health, Leadership and Security).

Every control process runs one; the leader answers, the others redirect.

    from control.heartbeat_server import HeartbeatServer

    server = HeartbeatServer(
        settings,
        confirmed_leases=lambda node_id: live_lease_ids_on(node_id),     # (a) leases to confirm
        on_task_status=forward_to_job_workflow,                          # (b) TaskStatus -> job signals
        on_heartbeat=lambda entry: placement_state.saw(entry),           # (b) heartbeat events
        leader_address=lambda: None if i_am_leader() else leader_grpc_addr(),
        on_auth_failure=write_audit_row,
    )
    addr = await server.start()          # binds settings.control_grpc_host:control_grpc_port
    ...
    server.table.get(node_id)            # latest NodeHeartbeat; .report() -> HeartbeatReport
    server.table.silent(30.0)            # nodes silent for 30 s
    await server.stop()

Callbacks (all optional; called on the event loop, so keep them quick — queue work
elsewhere if it is slow):

``confirmed_leases(node_id) -> Iterable[str]``
    Lease ids the leader confirms in the HeartbeatAck; each confirmation restarts
    that rank's unconfirmed clock on the node. Unset: nothing is confirmed (ranks
    self-fence after ``unconfirmed_kill_s``).
``leases_to_stop(entry: NodeHeartbeat) -> Iterable[tuple[str, int] | tuple[str, int, str]]``
    Reconciliation: (lease_id, epoch[, reason]) of tasks with no live lease; the
    agent stops them (epoch-checked) with the default grace.
``on_heartbeat(entry: NodeHeartbeat) -> None``
    After a fresh heartbeat is in ``table`` (stale/duplicate ones never reach it).
``on_task_status(status: TaskStatus) -> None | Awaitable[None]``
    Each TaskStatus once (duplicates by node + seq are acknowledged without a
    second call). If it raises, the agent is told ``ok=false`` and retries later,
    so the report is never lost while the leader cannot forward it; if it raises
    ``ReportRefused`` (not this node's lease) the agent is told ``refused`` and drops it.
``leader_address() -> str | None``
    None when this process is the leader; otherwise the leader's gRPC address
    (``""`` if unknown, or if the leader's lease looks stale: ``Leadership.leader_grpc_addr``).
    Checked when a stream opens and on every heartbeat; the agent is sent a ``Redirect``
    and reconnects there. A stream that opens while no leader is known is *held* for up to
    ``hold_s`` (default half of ``agent_ack_timeout_s``, so the agent does not give up
    first): if this process takes over meanwhile the stream is served at once, if a leader
    becomes known it is redirected there, else it is told "leader unknown". So after a
    leader change the agents that found the new leader early are already connected to it,
    and the followers do not answer a retry storm while no one leads.
``authenticate(node_id, presented) -> bool | Awaitable[bool]``
    Whether ``presented`` is the node's credential; default: equal to
    ``proto.auth.node_credential`` (the control process passes ``control.node_auth``: the
    credentials an admin issued, derivation in dev only).
``on_auth_failure(AuthFailure) -> None | Awaitable[None]``
    A stream with a bad credential (UNAUTHENTICATED) or a message for another node
    than the stream's (PERMISSION_DENIED): write the audit row here.

``stats()`` gives counters and the handling time (receipt of a heartbeat to its ack
written) percentiles over the last 64K heartbeats; ``bench/heartbeat.py`` uses it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from array import array
from collections.abc import Awaitable, Callable, Iterable

import grpc

from common.contracts import TaskStatus
from common.tls import grpc_server_credentials
from control.agent_link import AuthFailure, HeartbeatTable, NodeHeartbeat, ReportRefused
from proto import agent_pb2 as pb
from proto import agent_pb2_grpc as pbg
from proto.auth import (
    CONTROL_BUSY,
    CREDENTIAL_KEY,
    NODE_ID_KEY,
    check_credential,
    metadata_value,
    node_credential,
)
from proto.convert import task_status_from_pb

log = logging.getLogger("gpufleet.control.heartbeats")

LATENCY_WINDOW = 1 << 16
SEEN_STATUSES_PER_NODE = 1024
HOLD_POLL_S = 0.1  # while streams are held, how often one watcher asks who leads

SERVER_OPTIONS = [
    ("grpc.max_concurrent_streams", 1 << 20),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),
    # Every agent reconnects at once after a leader change: let the burst queue
    # instead of cancelling streams beyond gRPC's default 1,000 pending calls.
    ("grpc.server.max_pending_requests", 20_000),
    ("grpc.server.max_pending_requests_hard_limit", 40_000),
]


class HeartbeatServer:
    def __init__(
        self,
        settings=None,
        *,
        host: str | None = None,
        port: int | None = None,
        confirmed_leases: Callable[[str], Iterable[str]] | None = None,
        leases_to_stop: Callable[[NodeHeartbeat], Iterable[tuple]] | None = None,
        on_heartbeat: Callable[[NodeHeartbeat], None] | None = None,
        on_task_status: Callable[[TaskStatus], Awaitable[None] | None] | None = None,
        leader_address: Callable[[], str | None] | None = None,
        authenticate: Callable[[str, str | None], bool | Awaitable[bool]] | None = None,
        on_auth_failure: Callable[[AuthFailure], Awaitable[None] | None] | None = None,
        hold_s: float | None = None,
    ) -> None:
        if settings is None:
            from common.settings import get_settings

            settings = get_settings()
        self.settings = settings
        self.host = settings.control_grpc_host if host is None else host
        self.port = settings.control_grpc_port if port is None else port
        self.confirmed_leases = confirmed_leases
        self.leases_to_stop = leases_to_stop
        self.on_heartbeat = on_heartbeat
        self.on_task_status = on_task_status
        self.leader_address = leader_address
        self.authenticate = authenticate or (
            lambda node_id, presented: check_credential(node_credential(settings, node_id), presented)
        )
        self.on_auth_failure = on_auth_failure
        self.hold_s = float(settings.agent_ack_timeout_s) / 2 if hold_s is None else hold_s
        self.table = HeartbeatTable()
        self.address = ""
        self._server: grpc.aio.Server | None = None
        self._seen: dict[str, dict[int, bool]] = {}
        self._lat = array("d", bytes(8 * LATENCY_WINDOW))
        self._holding = 0
        self._leader_news = asyncio.Event()  # set (and replaced) when a held stream may go on
        self._watch: asyncio.Task | None = None
        self.reset_stats()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        """Bind and serve; returns ``host:port`` (the bound port when ``port`` is 0)."""
        server = grpc.aio.server(options=SERVER_OPTIONS)
        pbg.add_ControlLinkServicer_to_server(_Servicer(self), server)
        creds = grpc_server_credentials(self.settings)  # control_tls: TLS, else plain text
        addr = f"{self.host}:{self.port}"
        bound = server.add_secure_port(addr, creds) if creds is not None else server.add_insecure_port(addr)
        if not bound:
            raise OSError(f"cannot listen on {self.host}:{self.port} (GPUFLEET_CONTROL_GRPC_PORT)")
        await server.start()
        self._server = server
        self.address = f"{self.host}:{bound}"
        log.info("heartbeat server listening on %s", self.address)
        return self.address

    async def stop(self, grace: float = 1.0) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    # ---------------------------------------------------------------------- stats
    def reset_stats(self) -> None:
        self.counters = {
            "streams": 0,
            "heartbeats": 0,
            "stale_heartbeats": 0,
            "task_statuses": 0,
            "duplicate_statuses": 0,
            "failed_statuses": 0,
            "refused_statuses": 0,
            "auth_failures": 0,
            "redirects": 0,
            "held": 0,
        }
        self._lat_n = 0

    def stats(self) -> dict:
        n = min(self._lat_n, LATENCY_WINDOW)
        lat = sorted(self._lat[:n]) if n else []

        def pct(p: float) -> float | None:
            return round(lat[min(n - 1, int(p * n))] * 1000, 3) if n else None

        return {**self.counters, "handling_ms": {"p50": pct(0.50), "p99": pct(0.99), "max": pct(1.0), "n": n}}

    # ------------------------------------------------------------------- handlers
    async def _auth_failed(self, failure: AuthFailure) -> None:
        self.counters["auth_failures"] += 1
        log.warning("agent auth failure: %s", failure)
        if self.on_auth_failure is not None:
            try:
                r = self.on_auth_failure(failure)
                if inspect.isawaitable(r):
                    await r
            except Exception:
                log.exception("on_auth_failure callback failed")

    def _leader_elsewhere(self) -> str | None:
        """None while this process leads; else the leader's address ("" when none is known)."""
        if self.leader_address is None:
            return None
        leader = self.leader_address()
        return None if leader is None else leader or ""

    def _redirect_to(self, leader: str) -> pb.ControlMessage:
        self.counters["redirects"] += 1
        why = "not the leader" if leader else "not the leader, and no live leader is known"
        return pb.ControlMessage(redirect=pb.Redirect(leader_addr=leader, reason=why))

    def _redirect(self) -> pb.ControlMessage | None:
        leader = self._leader_elsewhere()
        return None if leader is None else self._redirect_to(leader)

    async def _hold(self) -> str | None:
        """No leader is known: wait up to ``hold_s`` for this process to lead (None) or for a
        leader to become known (its address); "" when neither happened."""
        self.counters["held"] += 1
        deadline = time.monotonic() + self.hold_s
        self._holding += 1
        if self._watch is None or self._watch.done():
            self._watch = asyncio.create_task(self._watch_leadership(), name="heartbeat-hold-watch")
        try:
            while True:
                leader = self._leader_elsewhere()
                left = deadline - time.monotonic()
                if leader != "" or left <= 0:
                    return leader
                try:
                    await asyncio.wait_for(self._leader_news.wait(), left)
                except TimeoutError:
                    pass
        finally:
            self._holding -= 1

    async def _watch_leadership(self) -> None:
        """One poll for all held streams: wake them when a leader is known or this process leads."""
        while self._holding > 0:
            await asyncio.sleep(HOLD_POLL_S)
            if self._leader_elsewhere() != "":
                news, self._leader_news = self._leader_news, asyncio.Event()
                news.set()

    async def _status(self, node_id: str, m: pb.TaskStatus) -> pb.ControlMessage:
        seen = self._seen.setdefault(node_id, {})
        ok, refused, error = True, False, ""
        if m.seq in seen:
            self.counters["duplicate_statuses"] += 1
        else:
            try:
                status = task_status_from_pb(m)
                if self.on_task_status is not None:
                    r = self.on_task_status(status)
                    if inspect.isawaitable(r):
                        await r
                seen[m.seq] = True
                if len(seen) > SEEN_STATUSES_PER_NODE:
                    del seen[next(iter(seen))]
                self.counters["task_statuses"] += 1
            except ReportRefused as e:
                self.counters["refused_statuses"] += 1
                ok, refused, error = False, True, str(e)[:200]
                log.warning("TaskStatus from %s refused: %s", node_id, error)
            except Exception as e:
                self.counters["failed_statuses"] += 1
                ok, error = False, f"{type(e).__name__}: {str(e)[:200]}"
                log.warning("TaskStatus from %s not taken: %s", node_id, error)
        return pb.ControlMessage(
            task_status_ack=pb.TaskStatusAck(
                lease_id=m.lease_id, epoch=m.epoch, seq=m.seq, ok=ok, error=error, refused=refused
            )
        )

    def _ack(self, node_id: str, hb: pb.Heartbeat, entry: NodeHeartbeat | None) -> pb.ControlMessage:
        msg = pb.ControlMessage()
        ack = msg.heartbeat_ack
        ack.seq = hb.seq
        ack.server_time = time.time()
        if entry is not None:
            if self.on_heartbeat is not None:
                try:
                    self.on_heartbeat(entry)
                except Exception:
                    log.exception("on_heartbeat callback failed")
            if self.confirmed_leases is not None:
                ack.confirmed_lease_ids.extend(self.confirmed_leases(node_id))
            if self.leases_to_stop is not None:
                for ref in self.leases_to_stop(entry):
                    ack.stop.add(lease_id=ref[0], epoch=ref[1], reason=ref[2] if len(ref) > 2 else "")
        return msg


class _Servicer(pbg.ControlLinkServicer):
    def __init__(self, server: HeartbeatServer) -> None:
        self.s = server

    async def Connect(self, request_iterator, context):
        s = self.s
        md = context.invocation_metadata()
        node_id = metadata_value(md, NODE_ID_KEY)
        peer = context.peer()
        try:
            verdict = s.authenticate(node_id, metadata_value(md, CREDENTIAL_KEY)) if node_id else False
            if inspect.isawaitable(verdict):
                verdict = await verdict
        except Exception as e:  # the credentials are in Postgres: it is down or slow
            log.warning("cannot check %s's credential now: %s", node_id, e)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"{CONTROL_BUSY}: {type(e).__name__}")
            return
        if not node_id or not verdict:
            await s._auth_failed(AuthFailure(node_id, peer, "bad or missing node credential"))
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad or missing node credential")
            return  # abort raises; this tells the type checker node_id is set below
        leader = s._leader_elsewhere()
        if leader == "" and s.hold_s > 0:
            leader = await s._hold()
        if leader is not None:
            yield s._redirect_to(leader)
            return
        s.counters["streams"] += 1
        counters = s.counters
        table = s.table
        lat = s._lat
        perf = time.perf_counter
        async for msg in request_iterator:
            t0 = perf()
            kind = msg.WhichOneof("body")
            if kind == "heartbeat":
                hb = msg.heartbeat
                if hb.node_id != node_id:
                    await s._auth_failed(AuthFailure(node_id, peer, "heartbeat for another node", hb.node_id))
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, "heartbeat for another node")
                if s.leader_address is not None:
                    redirect = s._redirect()
                    if redirect is not None:
                        yield redirect
                        return
                entry = table.offer(node_id, hb, peer)
                if entry is None:
                    counters["stale_heartbeats"] += 1
                else:
                    counters["heartbeats"] += 1
                yield s._ack(node_id, hb, entry)
                lat[s._lat_n % LATENCY_WINDOW] = perf() - t0
                s._lat_n += 1
            elif kind == "task_status":
                ts = msg.task_status
                if ts.node_id != node_id:
                    await s._auth_failed(AuthFailure(node_id, peer, "task status for another node", ts.node_id))
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED, "task status for another node")
                yield await s._status(node_id, ts)
