"""Bad settings end with a one-line error that names the problem, not a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from common.embedded import any_free_port

ROOT = Path(__file__).resolve().parents[2]


def gpufleet(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def test_unreachable_database_url(tmp_path):
    r = gpufleet("db", "migrate", env={"GPUFLEET_DATABASE_URL": "postgresql://u:secret@127.0.0.1:9/x"})
    line = one_line_error(r)
    assert "cannot reach the database" in line and "secret" not in line


def test_unreachable_database_for_up(tmp_path):
    r = gpufleet(
        "up",
        env={
            "GPUFLEET_DATABASE_URL": "postgresql://u@127.0.0.1:9/x",
            "GPUFLEET_STATE_DIR": str(tmp_path),
            "GPUFLEET_API_PORT": str(any_free_port()),
            "GPUFLEET_CONTROL_GRPC_PORT": str(any_free_port()),
        },
    )
    assert "cannot reach the database" in one_line_error(r)


def test_port_in_use(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = gpufleet("up", env={"GPUFLEET_STATE_DIR": str(tmp_path), "GPUFLEET_API_PORT": str(port)})
    line = one_line_error(r)
    assert f"port {port}" in line and "GPUFLEET_API_PORT" in line


def test_unwritable_state_dir(tmp_path):
    # a regular file where a directory is needed fails for root too
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = gpufleet("up", env={"GPUFLEET_STATE_DIR": str(blocker / "state")})
    line = one_line_error(r)
    assert "state dir" in line and "not writable" in line


def test_invalid_setting_value():
    r = gpufleet("db", "migrate", env={"GPUFLEET_API_PORT": "eighty"})
    assert "GPUFLEET_API_PORT" in one_line_error(r)


def test_a_renamed_setting_is_refused_with_its_new_name_not_ignored():
    """GPUFLEET_AGENT_TEAM_UID_BASE numbered teams; its successor numbers jobs. An operator's
    0 (every rank as one user, the documented upgrade step) must not silently stop applying."""
    r = gpufleet("db", "migrate", env={"GPUFLEET_AGENT_TEAM_UID_BASE": "0"})
    line = one_line_error(r)
    assert "GPUFLEET_AGENT_TEAM_UID_BASE was renamed GPUFLEET_AGENT_RANK_ID_BASE" in line, line


def test_help_lists_the_commands():
    r = gpufleet("--help")
    assert r.returncode == 0
    for cmd in ("up", "db", "bench"):
        assert cmd in r.stdout
