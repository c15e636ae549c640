"""A tiny real HTTP server that speaks the agent's log contract (api/logs_proxy.py):

    GET /v1/leases/{lease_id}/logs?offset=N&follow=0|1&stream=&tail=&format=text|ndjson
    Authorization: Bearer <a per-lease log token signed with a node's log key>  ->  200, chunked

One server stands in for the agents of every node of the test cluster: a token is good when
it is signed with the key of one of ``nodes`` (the real agent takes the key of the node
holding the lease; tests/agent/test_link.py covers that).

Logs are whatever the test puts in ``logs[lease_id]`` (stdout lines) and
``records[lease_id]`` ((time, stream, line) tuples, after those); a record's offset is its
index + 1. With follow=1 the server also writes each of ``follow_lines[lease_id]`` (stdout)
as its own chunk, a little apart, then ends the response (as the agent does when the rank
exits).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

from proto.auth import check_lease_log_token, node_log_key

SMALL_CLUSTER = ("b0-n0", "b0-n1", "b1-n0", "b1-n1")  # tests.foundation.builders.small_cluster


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: AgentLogServer

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        segs = parts.path.split("/")
        if len(segs) != 5 or segs[1:3] != ["v1", "leases"] or segs[4] != "logs":
            return self._plain(404, b"no such route\n")
        lease_id = unquote(segs[3])
        q = parse_qs(parts.query)
        offset = int(q.get("offset", ["0"])[0])
        follow = q.get("follow", ["0"])[0] == "1"
        stream = q.get("stream", ["all"])[0]
        fmt = q.get("format", ["text"])[0]
        tail = int(q["tail"][0]) if "tail" in q else None
        self.server.requests.append(
            {
                "lease_id": lease_id,
                "offset": offset,
                "follow": follow,
                "stream": stream,
                "format": fmt,
                "tail": tail,
                "auth": self.headers.get("Authorization"),
            }
        )
        auth = self.headers.get("Authorization") or ""
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
        keys = [node_log_key(self.server.key, n) for n in self.server.nodes]
        if not any(check_lease_log_token(k, token, lease_id, now=time.time()) for k in keys):
            return self._plain(401, b"bad token\n")
        if lease_id not in self.server.logs and lease_id not in self.server.records:
            return self._plain(404, b"no such lease\n")
        self.send_response(200)
        self.send_header("Content-Type", "application/x-ndjson" if fmt == "ndjson" else "text/plain; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        recs = self.server.all_records(lease_id)
        picked = [(i + 1, r) for i, r in enumerate(recs) if i >= offset and stream in ("all", r[1])]
        if tail is not None:
            picked = picked[len(picked) - tail :] if tail else []
        end = len(recs)
        self._chunk(b"".join(self._render(o, r, fmt, stream) for o, r in picked))
        if follow and end >= offset:
            for line in self.server.follow_lines.get(lease_id, []):
                time.sleep(0.05)  # paces the chunks "a little apart" (what it serves), not a wait
                end += 1
                if stream in ("all", "stdout"):
                    self._chunk(self._render(end, (time.time(), "stdout", line.decode().rstrip("\n")), fmt, stream))
        if fmt == "ndjson":
            self._chunk(b'{"end":%d}\n' % end)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    @staticmethod
    def _render(offset: int, rec: tuple, fmt: str, stream: str) -> bytes:
        t, s, line = rec
        if fmt == "ndjson":
            obj = {"offset": offset, "time": t, "stream": s, "line": line, "partial": False}
            return json.dumps(obj).encode() + b"\n"
        return (f"[{s}] {line}\n" if stream == "all" else f"{line}\n").encode()

    def _chunk(self, data: bytes) -> None:
        if data:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    def _plain(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class AgentLogServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, key: str, nodes: tuple[str, ...] = SMALL_CLUSTER) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.key = key  # the API's log signing key, from which each node's log key derives
        self.nodes = nodes
        self.logs: dict[str, bytes] = {}
        self.follow_lines: dict[str, list[bytes]] = {}
        self.records: dict[str, list[tuple[float, str, str]]] = {}
        self.requests: list[dict] = []
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    def all_records(self, lease_id: str) -> list[tuple[float, str, str]]:
        """``logs`` (stdout lines, a millisecond apart from a fixed time) then ``records``."""
        lines = self.logs.get(lease_id, b"").decode().splitlines()
        return [(1_700_000_000.0 + i / 1000, "stdout", ln) for i, ln in enumerate(lines)] + self.records.get(
            lease_id, []
        )

    @property
    def addr(self) -> str:
        host, port = self.server_address[:2]
        return f"{host}:{port}"

    def __enter__(self) -> AgentLogServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(5)
