"""A tiny real HTTP server that speaks the agent's log contract (api/logs_proxy.py):

    GET /v1/leases/{lease_id}/logs?offset=N&follow=0|1
    Authorization: Bearer <a per-lease log token signed with a node's log key>  ->  200 text/plain, chunked

One server stands in for the agents of every node of the test cluster: a token is good when
it is signed with the key of one of ``nodes`` (the real agent takes the key of the node
holding the lease; tests/agent/test_link.py covers that).

Logs are whatever the test puts in ``logs[lease_id]``; with follow=1 the server
also writes each of ``follow_lines[lease_id]`` as its own chunk, a little apart,
then ends the response (as the agent does when the rank exits).
"""

from __future__ import annotations

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
        self.server.requests.append(
            {"lease_id": lease_id, "offset": offset, "follow": follow, "auth": self.headers.get("Authorization")}
        )
        auth = self.headers.get("Authorization") or ""
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else None
        keys = [node_log_key(self.server.key, n) for n in self.server.nodes]
        if not any(check_lease_log_token(k, token, lease_id, now=time.time()) for k in keys):
            return self._plain(401, b"bad token\n")
        if lease_id not in self.server.logs:
            return self._plain(404, b"no such lease\n")
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self._chunk(self.server.logs[lease_id][offset:])
        if follow:
            for line in self.server.follow_lines.get(lease_id, []):
                time.sleep(0.05)  # paces the chunks "a little apart" (what it serves), not a wait
                self._chunk(line)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

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
        self.requests: list[dict] = []
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

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
