"""A control process started while Temporal (or Postgres) is down waits for it.

Before, `gpufleet control` exited at start when Temporal was unreachable (a host reboot
where the dev server comes up after control, or a control restart during an outage), and
under `gpufleet up` a dead control stops the platform. It now says what it waits for, one
line per try, takes leadership once the server is up, and a stop while it waits ends it
cleanly."""

from __future__ import annotations

import signal

import pytest

from common.embedded import EmbeddedTemporal, any_free_port
from tests.e2e.conftest import e2e_settings
from tests.e2e.test_failover import leader_row, spawn_control
from tests.support import eventually

pytestmark = pytest.mark.e2e


async def test_control_started_while_temporal_is_down_waits_and_then_leads(pool, db_dsn, tmp_path):
    port = any_free_port()
    server = EmbeddedTemporal(tmp_path / "temporal" / "t.db", port=port, ui=False, log_file=tmp_path / "t.log")
    settings = e2e_settings(tmp_path, db_dsn, server.address, connect_retry_max_s=1.0)
    log_path = tmp_path / "control.log"
    control = spawn_control(settings, "c1", any_free_port(), log_path)
    try:
        # it waits (does not exit), saying for what
        await eventually(
            lambda: "unreachable" in log_path.read_text() and "waiting for it" in log_path.read_text(),
            timeout=30, what="control says it waits for Temporal",
        )  # fmt: skip
        assert control.poll() is None, log_path.read_text()
        assert await leader_row(pool, settings) is None  # no leadership without Temporal
        server.start()
        row = await eventually(lambda: leader_row(pool, settings), timeout=60, what="control took leadership")
        assert row["holder"] == "c1"
        assert control.poll() is None
    finally:
        if control.poll() is None:
            control.send_signal(signal.SIGTERM)
            control.wait(30)
        server.stop()
    assert control.returncode == 0, log_path.read_text()
    assert "Traceback" not in log_path.read_text()


async def test_control_stopped_while_it_waits_for_temporal_exits_cleanly(pool, db_dsn, tmp_path):
    settings = e2e_settings(tmp_path, db_dsn, f"127.0.0.1:{any_free_port()}", connect_retry_max_s=1.0)
    log_path = tmp_path / "control.log"
    control = spawn_control(settings, "c1", any_free_port(), log_path)
    try:
        await eventually(lambda: "waiting for it" in log_path.read_text(), timeout=30, what="control waits")
        control.send_signal(signal.SIGTERM)
        code = control.wait(20)
    finally:
        if control.poll() is None:
            control.kill()
    assert code == 0, log_path.read_text()
    assert "Traceback" not in log_path.read_text()
