"""The user CLI against the API served by a real uvicorn on a loopback port, with a
real database, the real Temporal dev server (stand-in job workflow) and a real HTTP
agent serving rank logs.

(The same flow on the whole `make up` stack with its printed dev token is the
integrator's end-to-end test.)"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import typer
import uvicorn
from typer.testing import CliRunner

from api.main import create_app
from cli.user_cmd import register
from store import allocations, leadership
from tests.api.agent_server import AgentLogServer
from tests.api.conftest import ADMIN, ALPHA, start_as_placed
from tests.foundation.builders import gang
from tests.support import eventually_sync

JOB_YAML = """\
team: alpha
name: cli-job
priority_class: research
image: registry/llm:1
command: [python, train.py, --lr, "0.1"]
gpu_type: h100
replicas: 1
gpus_per_replica: 8
topology: {pack: block, max_blocks: 1}
max_runtime: 4h
checkpoint: {preemptible: true, grace_seconds: 60}
env: {WANDB_MODE: offline}
"""


class UvicornThread:
    def __init__(self, app) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> UvicornThread:
        self.thread.start()

        def started() -> bool:
            assert self.thread.is_alive(), "uvicorn did not start"
            return self.server.started

        eventually_sync(started, timeout=20, what="uvicorn started")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()


@pytest.fixture
def cli_app() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


@pytest.fixture
def server(settings, cluster):
    with UvicornThread(create_app(settings)) as s:  # pool and Temporal client from settings
        yield s


@pytest.fixture
def agent():
    with AgentLogServer(key="test-log-signing-key") as a:
        yield a


def invoke(cli_app, *args: str, url: str, token: str, env: dict | None = None):
    runner = CliRunner()
    return runner.invoke(cli_app, [*args, "--url", url, "--token", token], env=env, catch_exceptions=False)


async def run(cli_app, *args: str, url: str, token: str = ALPHA, env: dict | None = None):
    """Invoke in a thread: the test's event loop keeps running the workflow worker."""
    return await asyncio.to_thread(invoke, cli_app, *args, url=url, token=token, env=env)


async def test_submit_follow_logs_cancel(cli_app, server, pool, temporal_env, worker, agent, tmp_path, task_queue):
    spec = tmp_path / "job.yaml"
    spec.write_text(JOB_YAML)
    r = await run(cli_app, "submit", "-f", str(spec), "--json", url=server.url)
    assert r.exit_code == 0, r.output
    job_id = json.loads(r.stdout)["job_id"]
    row = await pool.fetchrow(
        "SELECT team, name, spec, max_runtime_s, workflow_started FROM jobs WHERE job_id = $1", job_id
    )
    assert row["name"] == "cli-job" and row["max_runtime_s"] == 4 * 3600 and not row["workflow_started"]
    assert row["spec"]["command"] == ["python", "train.py", "--lr", "0.1"]

    r = await run(cli_app, "status", job_id, url=server.url)
    assert r.exit_code == 0 and job_id in r.stdout and "QUEUED" in r.stdout
    r = await run(cli_app, "list", url=server.url)
    assert r.exit_code == 0 and job_id in r.stdout
    r = await run(cli_app, "explain", job_id, url=server.url)
    assert r.exit_code == 0 and "next placement cycle" in r.stdout
    r = await run(cli_app, "queue", "--json", url=server.url)  # the team comes from /v1/me
    assert r.exit_code == 0 and json.loads(r.stdout)["jobs"][0]["job_id"] == job_id

    # placement gives it a node; the node's agent serves the rank's output
    epoch = await leadership.acquire_leadership(pool, scope="placement", holder="t", grpc_addr="x", ttl_s=60)
    await pool.execute("UPDATE nodes SET agent_addr = $1", agent.addr)
    [lease] = await allocations.commit_gang(
        pool, scope="placement", epoch=epoch, job_id=job_id, attempt=1, placements=gang(("b0-n0", tuple(range(8))))
    )
    await start_as_placed(temporal_env, task_queue, job_id)  # as the allocation does
    agent.logs[lease] = b"epoch 0 loss 2.31\n"
    agent.follow_lines[lease] = [b"epoch 1 loss 1.70\n", b"epoch 2 loss 1.21\n"]
    r = await run(cli_app, "logs", "-f", "--stream", "stdout", job_id, url=server.url)
    assert r.exit_code == 0, r.output
    assert r.stdout == "epoch 0 loss 2.31\nepoch 1 loss 1.70\nepoch 2 loss 1.21\n"
    assert agent.requests[-1]["follow"] is True

    r = await run(cli_app, "extend", job_id, "--by", "1h", "--reason", "converging", url=server.url)
    assert r.exit_code == 0 and "extended" in r.stdout
    r = await run(cli_app, "events", job_id, "--json", url=server.url)
    assert [e["event"] for e in json.loads(r.stdout)["events"]] == ["submitted", "allocated"]

    r = await run(cli_app, "cancel", job_id, "--reason", "done early", url=server.url)
    assert r.exit_code == 0 and f"{job_id}: CANCELLING" in r.stdout
    result = await asyncio.wait_for(temporal_env.client.get_workflow_handle(job_id).result(), 20)
    assert result == "CANCELLED by alice: done early"
    actions = await pool.fetch("SELECT actor, action FROM audit WHERE subject = $1 ORDER BY id", job_id)
    assert ("alice", "cancel_request") in [tuple(a) for a in actions]


async def test_admin_commands_and_errors(cli_app, server, pool):
    r = await run(cli_app, "quota", "get", "alpha", url=server.url, token=ADMIN)
    assert r.exit_code == 0 and "h100" in r.stdout and "16" in r.stdout
    r = await run(
        cli_app,
        "quota",
        "set",
        "alpha",
        "--gpu-type",
        "h100",
        "--guaranteed",
        "24",
        "--reason",
        "grant",
        "--json",
        url=server.url,
        token=ADMIN,
    )
    assert r.exit_code == 0 and json.loads(r.stdout)["h100"]["guaranteed"] == 24
    r = await run(cli_app, "drain", "b1-n1", "--reason", "bad fan", "--evict", url=server.url, token=ADMIN)
    assert r.exit_code == 0 and "ready -> draining (evicting)" in r.stdout
    r = await run(cli_app, "nodes", "--json", url=server.url, token=ADMIN)
    states = {n["node_id"]: n["state"] for n in json.loads(r.stdout)["nodes"]}
    assert states == {"b0-n0": "ready", "b0-n1": "ready", "b1-n0": "ready", "b1-n1": "draining"}
    r = await run(cli_app, "nodes", "b1-n1", url=server.url, token=ADMIN)
    assert r.exit_code == 0 and "draining" in r.stdout
    r = await run(cli_app, "return-node", "b1-n1", "--reason", "fan replaced", url=server.url, token=ADMIN)
    assert r.exit_code == 0 and "draining -> burn_in" in r.stdout, r.stdout + r.stderr
    r = await run(cli_app, "return-node", "b1-n1", "--reason", "again", url=server.url, token=ADMIN)
    assert r.exit_code == 1 and "node_not_returnable" in r.stderr and "HTTP 409" in r.stderr
    # a team token cannot drain: the API's code and sentence on stderr, exit 1
    r = await run(cli_app, "drain", "b0-n0", "--reason", "x", url=server.url, token=ALPHA)
    assert r.exit_code == 1 and "admin_required" in r.stderr and "HTTP 403" in r.stderr
    r = await run(cli_app, "status", "j-missing", url=server.url)
    assert r.exit_code == 1 and "no job j-missing [job_not_found" in r.stderr
    # admission errors read as sentences
    bad = JOB_YAML.replace("replicas: 1", "replicas: 9")
    r = await asyncio.to_thread(
        lambda: CliRunner().invoke(cli_app, ["submit", "-f", "-", "--url", server.url, "--token", ALPHA], input=bad)
    )
    assert r.exit_code == 1 and "exceeds_cluster" in r.stderr and "72 h100 GPUs" in r.stderr
    # a body the schema refuses: which field, and why
    bad = JOB_YAML.replace("{pack: block, max_blocks: 1}", "{pack: block, max_blocks_wait_seconds: 60}")
    r = await asyncio.to_thread(
        lambda: CliRunner().invoke(cli_app, ["submit", "-f", "-", "--url", server.url, "--token", ALPHA], input=bad)
    )
    assert r.exit_code == 1 and "validation_error" in r.stderr, r.stderr
    assert "topology: Value error, max_blocks_wait_seconds needs pack=block and max_blocks" in r.stderr, r.stderr


async def test_an_admin_sets_a_teams_classes_and_a_refused_submit_says_why(cli_app, server, pool):
    r = await run(cli_app, "classes", "get", url=server.url)  # your own team
    assert r.exit_code == 0 and "prod-serving, prod-batch, research, preemptible" in r.stdout, r.stdout
    assert "none set: every class" in r.stdout
    r = await run(
        cli_app, "classes", "set", "alpha", "--allow", "research", "--reason", "research team", "--json",
        url=server.url, token=ADMIN,
    )  # fmt: skip
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout) == {"team": "alpha", "priority_classes": ["research"], "allowed": ["research"]}
    r = await run(cli_app, "classes", "get", url=server.url)
    assert r.exit_code == 0 and "research" in r.stdout and "restricted to these" in r.stdout, r.stdout
    r = await asyncio.to_thread(
        lambda: CliRunner().invoke(
            cli_app,
            ["submit", "-f", "-", "--url", server.url, "--token", ALPHA],
            input=JOB_YAML.replace("priority_class: research", "priority_class: prod-batch"),
        )
    )
    assert r.exit_code == 1 and "priority_class_not_allowed" in r.stderr and "HTTP 403" in r.stderr, r.stderr
    assert "team alpha may submit in research only, not prod-batch" in r.stderr
    # --allow or --any, not both and not neither; and only an admin
    for args in (["--any", "--allow", "research"], []):
        r = await run(cli_app, "classes", "set", "alpha", *args, "--reason", "x", url=server.url, token=ADMIN)
        assert r.exit_code == 2 and "--allow CLASS" in r.output, r.output
    r = await run(cli_app, "classes", "set", "alpha", "--any", "--reason", "x", url=server.url, token=ALPHA)
    assert r.exit_code == 1 and "admin_required" in r.stderr
    r = await run(cli_app, "classes", "set", "alpha", "--any", "--reason", "lifted", url=server.url, token=ADMIN)
    assert r.exit_code == 0 and "none set: every class" in r.stdout


async def test_submit_with_the_same_key_is_replayed(cli_app, server, pool, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text(JOB_YAML)
    first = await run(cli_app, "submit", "-f", str(spec), "--idempotency-key", "k1", "--json", url=server.url)
    again = await run(cli_app, "submit", "-f", str(spec), "--idempotency-key", "k1", "--json", url=server.url)
    assert json.loads(first.stdout) == json.loads(again.stdout)
    assert await pool.fetchval("SELECT count(*) FROM jobs") == 1


def test_url_and_token_come_from_settings(cli_app, monkeypatch):
    from cli.user_cmd import resolve

    monkeypatch.setenv("GPUFLEET_API_URL", "http://api.example:9000/")
    monkeypatch.setenv("GPUFLEET_TOKEN", "from-env")
    assert resolve(None, None) == ("http://api.example:9000", "from-env")
    assert resolve("http://other", "flag") == ("http://other", "flag")
    monkeypatch.delenv("GPUFLEET_API_URL")
    monkeypatch.setenv("GPUFLEET_API_PORT", "8123")
    assert resolve(None, None)[0] == "http://127.0.0.1:8123"


def test_unreachable_api_exits_3(cli_app, monkeypatch):
    """Refused connections are retried for client_retry_s, then exit 3."""
    monkeypatch.setattr("cli.user_cmd.RETRY_DELAYS", (0.01,))
    monkeypatch.setenv("GPUFLEET_CLIENT_RETRY_S", "0.3")
    started = time.monotonic()
    r = invoke(cli_app, "status", "j-1", url="http://127.0.0.1:1", token="t")
    assert r.exit_code == 3 and "cannot reach the API" in r.stderr
    assert 0.3 <= time.monotonic() - started < 10


class _Flaky(BaseHTTPRequestHandler):
    """Answers 503 to the first request, then 202: a retry must reuse the key."""

    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[str]] = []

    def log_message(self, *a) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        _Flaky.seen.append(self.headers.get("Idempotency-Key"))
        if len(_Flaky.seen) == 1:
            body, status = b'{"error": {"code": "database_unavailable", "message": "down", "details": null}}', 503
        else:
            body, status = b'{"job_id": "j-1", "state": "QUEUED", "queue_position": 1}', 202
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_retry_reuses_the_invocations_idempotency_key(cli_app, tmp_path, monkeypatch):
    monkeypatch.setattr("cli.user_cmd.RETRY_DELAYS", (0.01, 0.01))
    spec = tmp_path / "job.yaml"
    spec.write_text(JOB_YAML)
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        _Flaky.seen = []
        r = invoke(cli_app, "submit", "-f", str(spec), url=f"http://127.0.0.1:{srv.server_address[1]}", token="t")
        assert r.exit_code == 0 and "submitted j-1" in r.stdout
        assert len(_Flaky.seen) == 2 and _Flaky.seen[0] == _Flaky.seen[1] and _Flaky.seen[0].startswith("cli-")
        # a second invocation gets a key of its own
        r = invoke(cli_app, "submit", "-f", str(spec), url=f"http://127.0.0.1:{srv.server_address[1]}", token="t")
        assert _Flaky.seen[2] != _Flaky.seen[0]
    finally:
        srv.shutdown()
        srv.server_close()


class _DiesMidRequest(BaseHTTPRequestHandler):
    """Drops the first request's connection after reading it (an API process killed
    mid-request: the client sees a reset, not an answer), then answers 202."""

    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[str]] = []

    def log_message(self, *a) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        _DiesMidRequest.seen.append(self.headers.get("Idempotency-Key"))
        if len(_DiesMidRequest.seen) == 1:
            # RST rather than FIN, as the kernel does for a killed process with unread data
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            self.close_connection = True
            return
        body = b'{"job_id": "j-1", "state": "QUEUED", "queue_position": 1}'
        self.send_response(202)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_request_whose_api_died_mid_request_is_retried_with_its_key(monkeypatch):
    from cli.user_cmd import ApiClient

    monkeypatch.setattr("cli.user_cmd.RETRY_DELAYS", (0.01,))
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _DiesMidRequest)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        _DiesMidRequest.seen = []
        api = ApiClient(f"http://127.0.0.1:{srv.server_address[1]}", "t", retry_s=5)
        r = api.request("POST", "/v1/jobs", json_body={"x": 1}, write=True)
        assert r["job_id"] == "j-1"
        assert len(_DiesMidRequest.seen) == 2 and _DiesMidRequest.seen[0] == _DiesMidRequest.seen[1]
        assert len(api.retries) == 1 and api.retries[0] in ("RemoteProtocolError", "ReadError"), api.retries
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_api_socket_shares_its_port_only_with_reuse_port():
    from cli.api_cmd import bind_socket

    a = bind_socket("127.0.0.1", 0, reuse_port=True)
    port = a.getsockname()[1]
    a.listen()
    b = bind_socket("127.0.0.1", port, reuse_port=True)
    b.listen()
    try:
        with pytest.raises(OSError):
            bind_socket("127.0.0.1", port, reuse_port=False)
    finally:
        a.close()
        b.close()


def test_gpufleet_api_serve_runs_uvicorn_and_stops_cleanly(db_dsn, tmp_path):
    """`gpufleet api` (cli.api_cmd.serve) as its own process: /healthz answers, SIGINT
    ends it with exit code 0 (hard exit after uvicorn's clean shutdown)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    from common.embedded import any_free_port

    port = any_free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    env |= {
        "GPUFLEET_DATABASE_URL": db_dsn,
        "GPUFLEET_API_PORT": str(port),
        "GPUFLEET_TEMPORAL_ADDRESS": "127.0.0.1:1",
        "GPUFLEET_API_TOKENS": json.dumps({"t": {"name": "a", "admin": True}}),
        "GPUFLEET_ENV": "dev",
    }
    code = "import typer; from cli.api_cmd import serve; typer.run(serve)"
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "--log-level", "warning"],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def healthz() -> httpx.Response | None:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
        except httpx.TransportError:
            assert proc.poll() is None, proc.stdout.read()
            return None

    try:
        r = eventually_sync(healthz, timeout=30, interval=0.2, what="the API answering /healthz")
        assert r.status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/v1/me", headers={"Authorization": "Bearer t"}).json()["admin"]
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
