"""`gpufleet up` from scratch: URLs printed, /healthz 200, the Temporal UI answers,
Ctrl-C stops every child; a second start finds the state again."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from common.embedded import any_free_port
from tests.support import OutputReader

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def start(state: Path, ports: dict[str, int], *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`gpufleet up *args` on these ports, with only the GPUFLEET_ settings given here (and ``env``)."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    child_env.update(
        {
            "GPUFLEET_STATE_DIR": str(state),
            "GPUFLEET_API_PORT": str(ports["api"]),
            "GPUFLEET_TEMPORAL_PORT": str(ports["temporal"]),
            "GPUFLEET_TEMPORAL_UI_PORT": str(ports["ui"]),
            "GPUFLEET_CONTROL_GRPC_PORT": str(ports["grpc"]),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
    )
    return subprocess.Popen(
        [sys.executable, "-m", "cli.main", "up", *args],
        cwd=ROOT,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def read_until(proc: subprocess.Popen, marker: str, timeout: float) -> str:
    """Read the child's output until ``marker`` appears (no blocking past the deadline)."""
    found, out = _reader(proc).until(marker, time.monotonic() + timeout)
    if found:
        return "".join(out)
    raise AssertionError(f"no {marker!r} within {timeout}s; output:\n{''.join(out)}")


def _reader(proc: subprocess.Popen) -> OutputReader:
    if not hasattr(proc, "_reader"):
        proc._reader = OutputReader(proc.stdout)  # type: ignore[attr-defined]
    return proc._reader  # type: ignore[attr-defined]


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return read_rest(proc)


def read_rest(proc: subprocess.Popen) -> str:
    return _reader(proc).rest()


def test_make_up_brings_the_platform_up_and_down(state_root):
    ports = {"api": any_free_port(), "temporal": any_free_port(), "ui": any_free_port(), "grpc": any_free_port()}
    proc = start(state_root / "state", ports)
    try:
        out = read_until(proc, "Ctrl-C stops everything", 180)
        assert f"http://127.0.0.1:{ports['api']}/docs" in out
        assert f"http://127.0.0.1:{ports['ui']}" in out
        assert "team pretrain" in out and "admin" in out
        assert httpx.get(f"http://127.0.0.1:{ports['api']}/healthz", timeout=10).status_code == 200
        assert httpx.get(f"http://127.0.0.1:{ports['ui']}/", timeout=10).status_code == 200
        assert_least_privilege(proc, tokens=(state_root / "state" / "tokens.json").read_text())
    finally:
        tail = stop(proc)
    assert_stopped(proc, tail, ports)
    # state survives: a second start reuses the same tokens and database; Ctrl-C right after
    # the banner stops everything too (a signal before the handler was set once left the
    # Temporal dev server, in its own session, running)
    tokens = (state_root / "state" / "tokens.json").read_text()
    proc = start(state_root / "state", ports)
    try:
        read_until(proc, "Ctrl-C stops everything", 180)
    finally:
        tail = stop(proc)
    assert_stopped(proc, tail, ports)
    assert (state_root / "state" / "tokens.json").read_text() == tokens


def assert_least_privilege(proc: subprocess.Popen, tokens: str) -> None:
    """Each child holds only the secrets it uses: the agent no API token, no database login
    and neither the secret every node's credential derives from nor the key every node's
    log key derives from; control no API token and no log key."""
    envs = {}
    for child in psutil.Process(proc.pid).children():
        cmd = " ".join(child.cmdline())
        role = next((r for r in ("agent", "control", "api") if f"cli.main {r}" in cmd), None)
        if role:
            envs[role] = child.environ()
    assert set(envs) == {"agent", "control", "api"}, envs.keys()
    token = next(iter(json.loads(tokens)))
    agent = envs["agent"]
    assert "GPUFLEET_DATABASE_URL" not in agent and "GPUFLEET_AGENT_SHARED_SECRET" not in agent
    assert token not in json.dumps(agent) and json.loads(agent["GPUFLEET_AGENT_CREDENTIALS"])
    assert "GPUFLEET_LOG_SIGNING_KEY" not in agent and json.loads(agent["GPUFLEET_AGENT_LOG_KEYS"])
    assert "GPUFLEET_LOG_SIGNING_KEY" not in envs["control"] and envs["api"]["GPUFLEET_LOG_SIGNING_KEY"]
    assert token not in json.dumps(envs["control"]) and envs["control"]["GPUFLEET_DATABASE_URL"]
    assert token in envs["api"]["GPUFLEET_API_TOKENS"]
    assert all(env["GPUFLEET_ENV"] == "dev" for env in envs.values())


def assert_stopped(proc: subprocess.Popen, tail: str, ports: dict[str, int]) -> None:
    assert proc.returncode == 0, tail
    assert "stopped" in tail
    # every child is gone: the ports are free again
    for port in ports.values():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
