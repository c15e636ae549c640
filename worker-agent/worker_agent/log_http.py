"""Rank logs over HTTP: the contract the API's log proxy speaks (api/logs_proxy.py); and metrics.

    GET /v1/leases/{lease_id}/logs?offset=N&follow=0|1&stream=stdout|stderr|all&tail=N&format=text|ndjson
    Authorization: Bearer <a per-lease log token: proto.auth.lease_log_token, signed with
                           the node's log key (settings.agent_log_keys), valid for this
                           lease only, for a minute>
    -> 200, chunked: the lease's output records (worker_agent.rank_logs) of ``stream``
       (default all) from logical ``offset`` (default 0; offsets stay valid across rotation),
       or only the last ``tail`` of them;
       format=ndjson (what the API asks for): one object a line,
         {"offset": <where to resume after it>, "time": <unix s>, "stream": "stdout"|"stderr",
          "line": <text, no newline>, "partial": <true: the line had no newline yet>}
         then a last {"end": <offset to resume from>};
       format=text (default, for people with curl): one stream as written; all with a
       ``[stdout] `` / ``[stderr] `` prefix per line.
       With follow=1 the response stays open, carries new output as the rank writes it,
       and ends once the rank has exited and its last output is sent.
    401 a missing, expired or forged token, one for another lease, or one signed with
    another node's key; 404 no such lease on this agent (to a valid token); 405/400
    anything else.

    GET /metrics
    -> 200, Prometheus text exposition of this process's nodes' GPUs (worker_agent.metrics).
       No auth: it names no job and carries no secret, and Prometheus scrapes it.

Served by each agent process on ``settings.agent_http_listen``; its address is what heartbeats advertise as
``agent_addr`` and what the leader writes to ``nodes.agent_addr``. A small HTTP/1.1
server on asyncio streams: the agent takes no web framework as a dependency.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from prometheus_client import CONTENT_TYPE_LATEST

from common.tls import server_context
from proto.auth import check_lease_log_token, node_log_key
from worker_agent import rank_logs
from worker_agent.metrics import AgentMetrics

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
READ_BATCH = 1 << 20
STREAMS = ("stdout", "stderr", "all")
FORMATS = ("text", "ndjson")
MAX_HEADER_BYTES = 16 * 1024
HEADER_TIMEOUT_S = 10.0


def log_key(settings, node_id: str) -> str | None:
    """The key ``node_id``'s log endpoint checks tokens with: issued with its credential, or in
    dev derived from ``log_signing_key`` (which only ``gpufleet up``'s tests hand an agent)."""
    key = settings.agent_log_keys.get(node_id)
    if key:
        return key
    if settings.env == "dev" and settings.log_signing_key:
        return node_log_key(settings.log_signing_key, node_id)
    return None


def advertised(host: str, port: int) -> str:
    """The address to advertise for a listening socket (a wildcard host becomes this host's name)."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.getfqdn()
    return f"{host}:{port}"


class LogHttpServer:
    def __init__(self, settings, nodes: dict) -> None:
        self.settings = settings
        self.nodes = nodes  # node_id -> NodeAgent (one process may host many simulated nodes)
        self.metrics = AgentMetrics(nodes)
        self.server: asyncio.base_events.Server | None = None

    async def start(self, listen: str) -> str:
        """Listen; returns the address to advertise (``https://host:port`` with agent_tls_cert_file)."""
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")
        tls = server_context(
            self.settings.agent_tls_cert_file,
            self.settings.agent_tls_key_file,
            "agent_tls_cert_file/agent_tls_key_file",
        )
        self.server = await asyncio.start_server(
            self._handle, host or "0.0.0.0", int(port), limit=MAX_HEADER_BYTES, ssl=tls,
            ssl_handshake_timeout=HEADER_TIMEOUT_S if tls else None,
        )  # fmt: skip
        bound = self.server.sockets[0].getsockname()[1]
        return ("https://" if tls else "") + advertised(host, bound)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2.0)

    def _find(self, lease_id: str):
        """The node holding the lease and the lease's dir (where its output records are)."""
        for node in self.nodes.values():
            path = node.log_path(lease_id, "stdout")
            if path is not None:
                return node, path.parent
        return None, None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEADER_TIMEOUT_S)
            await self._serve(head.decode("latin-1"), writer)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a client that went away or sent garbage
        except Exception:
            log.exception("log request failed")
        finally:
            with contextlib.suppress(Exception):
                writer.close()
                await writer.wait_closed()

    async def _serve(self, head: str, writer: asyncio.StreamWriter) -> None:
        lines = head.split("\r\n")
        try:
            method, target, _ = lines[0].split(" ", 2)
        except ValueError:
            return await _plain(writer, 400, "bad request")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        parts = urlsplit(target)
        if parts.path == "/metrics":
            if method != "GET":
                return await _plain(writer, 405, "GET only")
            return await _respond(writer, 200, CONTENT_TYPE_LATEST, await self.metrics.scrape())
        segs = parts.path.split("/")
        if len(segs) != 5 or segs[1:3] != ["v1", "leases"] or segs[4] != "logs":
            return await _plain(writer, 404, "no such route")
        if method != "GET":
            return await _plain(writer, 405, "GET only")
        auth = headers.get("authorization", "")
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
        lease_id = unquote(segs[3])
        node, path = self._find(lease_id)
        # the token must be signed with the key of the node holding the lease; for a lease
        # not here, any hosted node's key (so a 404 tells nothing to a bad token)
        candidates = [node.node_id] if node is not None else list(self.nodes)
        now = time.time()
        if not any(
            (key := log_key(self.settings, n)) and check_lease_log_token(key, token, lease_id, now=now)
            for n in candidates
        ):
            return await _plain(writer, 401, "bad, expired or missing log token for this lease")
        q = parse_qs(parts.query)
        try:
            offset = max(0, int(q.get("offset", ["0"])[0]))
            tail = int(q["tail"][0]) if "tail" in q else None
        except ValueError:
            return await _plain(writer, 400, "offset and tail must be integers")
        follow = q.get("follow", ["0"])[0] == "1"
        stream = q.get("stream", ["all"])[0]
        fmt = q.get("format", ["text"])[0]
        if stream not in STREAMS or fmt not in FORMATS or (tail is not None and tail < 0):
            return await _plain(writer, 400, "stream is stdout, stderr or all; format text or ndjson; tail >= 0")
        if node is None or path is None:
            return await _plain(writer, 404, f"no lease {lease_id} on this agent")
        ctype = b"application/x-ndjson" if fmt == "ndjson" else b"text/plain; charset=utf-8"
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n" % ctype
        )
        await writer.drain()
        only = None if stream == "all" else stream
        if tail is not None:
            offset = max(offset, await asyncio.to_thread(rank_logs.tail_offset, path, tail, only))
        finishing = False
        while True:
            while True:  # all there is now, a batch at a time
                records = await asyncio.to_thread(_batch, path, offset)
                if not records:
                    break
                offset = records[-1].offset
                out = _render([r for r in records if only is None or r.stream == only], fmt, only is None)
                for k in range(0, len(out), CHUNK):
                    writer.write(b"%x\r\n%s\r\n" % (len(out[k : k + CHUNK]), out[k : k + CHUNK]))
                    await writer.drain()
            if not follow or finishing:
                break
            lease = node.leases.get(lease_id)
            if not (lease and lease.live):
                finishing = True  # the supervisor wrote the last output before the exit: one more read
                continue
            await asyncio.sleep(node.poll_s)
        if fmt == "ndjson":
            end = b'{"end":%d}\n' % offset
            writer.write(b"%x\r\n%s\r\n" % (len(end), end))
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def _batch(lease_dir: Path, offset: int) -> list[rank_logs.Record]:
    return list(rank_logs.read_records(lease_dir, offset, READ_BATCH))


def _render(records: list[rank_logs.Record], fmt: str, prefixed: bool) -> bytes:
    if fmt == "ndjson":
        return b"".join(
            json.dumps(
                {
                    "offset": r.offset,
                    "time": r.time,
                    "stream": r.stream,
                    "line": r.payload.decode("utf-8", "replace"),
                    "partial": r.partial,
                },
                separators=(",", ":"),
            ).encode()
            + b"\n"
            for r in records
        )
    if prefixed:
        return b"".join(b"[%s] %s\n" % (r.stream.encode(), r.payload) for r in records)
    return b"".join(r.payload if r.partial else r.payload + b"\n" for r in records)


async def _plain(writer: asyncio.StreamWriter, status: int, text: str) -> None:
    await _respond(writer, status, "text/plain; charset=utf-8", (text + "\n").encode())


async def _respond(writer: asyncio.StreamWriter, status: int, content_type: str, body: bytes) -> None:
    reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed"}[status]
    writer.write(
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    await writer.drain()


__all__ = ["LogHttpServer"]
