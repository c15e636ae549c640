"""Rank logs, served by each agent process (gRPC ``NodeAgent.ReadLog``); the API proxies them.

Authenticated with ``authorization: Bearer <settings.agent_log_token>`` (the token
the API holds; rank processes never see it). ``control.agent_link.read_rank_log``
is the client.
"""

from __future__ import annotations

import asyncio
import socket
import time

import grpc

from proto import agent_pb2 as pb
from proto import agent_pb2_grpc as pbg
from proto.auth import bearer_token, check_credential

CHUNK = 64 * 1024
DEFAULT_MAX_BYTES = 1 << 20
MAX_BYTES = 16 << 20
MAX_FOLLOW_S = 3600.0


class LogService(pbg.NodeAgentServicer):
    def __init__(self, settings, nodes: dict) -> None:
        self.settings = settings
        self.nodes = nodes  # node_id -> NodeAgent

    async def ReadLog(self, request: pb.ReadLogRequest, context: grpc.aio.ServicerContext):
        if not check_credential(self.settings.agent_log_token, bearer_token(context.invocation_metadata())):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad or missing log token")
        node = self.nodes.get(request.node_id)
        if node is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"node {request.node_id} is not served here")
        path = node.log_path(request.lease_id, request.stream or "stdout")
        if path is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such lease or stream")
        lease = node.leases.get(request.lease_id)
        limit = min(request.max_bytes or DEFAULT_MAX_BYTES, MAX_BYTES)
        follow_until = time.monotonic() + min(request.follow_timeout_s or MAX_FOLLOW_S, MAX_FOLLOW_S)
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            yield pb.LogChunk(data=b"", offset=0, eof=not (lease and lease.live))
            return
        with f:
            size = f.seek(0, 2)
            offset = request.offset if request.offset >= 0 else max(0, size + request.offset)
            offset = min(offset, size)
            f.seek(offset)
            sent = 0
            while True:
                want = CHUNK if request.follow else min(CHUNK, limit - sent)
                data = f.read(want) if want > 0 else b""
                if data:
                    yield pb.LogChunk(data=data, offset=offset)
                    offset += len(data)
                    sent += len(data)
                    continue
                finished = not (lease and lease.live)
                if not request.follow or finished or time.monotonic() > follow_until:
                    rest = f.read(1)  # anything written after our last read?
                    eof = finished and not rest
                    yield pb.LogChunk(data=b"", offset=offset, eof=eof)
                    return
                await asyncio.sleep(node.poll_s)


def advertised(host: str, port: int) -> str:
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.getfqdn()
    return f"{host}:{port}"


async def start_log_server(settings, nodes: dict, listen: str | None = None) -> tuple[grpc.aio.Server, str]:
    """Start the log service; returns the server and the address to advertise."""
    listen = listen or settings.agent_listen
    host, _, port = listen.rpartition(":")
    server = grpc.aio.server()
    pbg.add_NodeAgentServicer_to_server(LogService(settings, nodes), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"cannot listen on {listen} (GPUFLEET_AGENT_LISTEN)")
    await server.start()
    return server, advertised(host.strip("[]"), bound)
