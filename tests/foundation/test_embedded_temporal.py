"""The embedded Temporal dev server survives a start that loses a port race.

`temporal server start-dev` takes its HTTP, metrics and membership ports by binding a free
port and releasing it; another process can take one in between, and the server then exits
before it listens (seen once in five clean-clone CI runs). The start is tried again; a server
that keeps exiting ends in an error that carries its log's last line."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

import common.embedded as embedded
from common.embedded import EmbeddedTemporal, PlatformError, any_free_port
from common.temporal import temporal_cli_path

pytestmark = pytest.mark.e2e

BIND_ERROR = "listen tcp 127.0.0.1:41234: bind: address already in use"


def racing_cli(tmp_path: Path, fails: int) -> tuple[Path, Path]:
    """A `temporal` whose first `fails` dev-server starts exit as a lost port race does;
    everything else is the real CLI."""
    count = tmp_path / "starts"
    script = tmp_path / "temporal"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1 $2" = "server start-dev" ]; then\n'
        f'  n=$(cat "{count}" 2>/dev/null || echo 0); n=$((n+1)); echo $n > "{count}"\n'
        f'  if [ $n -le {fails} ]; then echo "{BIND_ERROR}"; exit 1; fi\n'
        "fi\n"
        f'exec "{temporal_cli_path()}" "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, count


def test_a_start_that_loses_a_port_race_is_tried_again(tmp_path, monkeypatch):
    script, count = racing_cli(tmp_path, fails=1)
    monkeypatch.setattr(embedded, "temporal_cli_path", lambda: str(script))
    server = EmbeddedTemporal(tmp_path / "t" / "t.db", port=any_free_port(), ui=False, log_file=tmp_path / "t.log")
    try:
        assert server.start(timeout_s=60) == server.address
        assert count.read_text().strip() == "2"
        assert server.proc is not None and server.proc.poll() is None
    finally:
        server.stop()


def test_a_server_that_keeps_exiting_fails_with_its_last_log_line(tmp_path, monkeypatch):
    script, count = racing_cli(tmp_path, fails=99)
    monkeypatch.setattr(embedded, "temporal_cli_path", lambda: str(script))
    server = EmbeddedTemporal(
        tmp_path / "t" / "t.db", port=any_free_port(), ui=False, log_file=tmp_path / "t.log", start_attempts=2
    )
    with pytest.raises(PlatformError) as raised:
        server.start(timeout_s=30)
    assert count.read_text().strip() == "2"
    message = str(raised.value)
    assert "exited with code 1 before listening" in message and BIND_ERROR in message
    assert "\n" not in message
