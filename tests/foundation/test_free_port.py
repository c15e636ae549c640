"""Choosing a port for a child to bind later (`common.embedded.any_free_port`), and the error a
child that exits before listening ends in (`cli.api_cmd.wait_listening`)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from cli.api_cmd import wait_listening
from common.embedded import PlatformError, any_free_port, ephemeral_port_range


def test_a_chosen_port_is_below_the_ephemeral_range_free_and_never_handed_out_twice():
    low, high = ephemeral_port_range()
    assert 0 < low <= high
    ports = [any_free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    if low > 11024:  # the kernel leaves room below its range (it does on every Linux default)
        assert all(10000 <= p < low for p in ports), ports
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_port_taken_now_is_not_chosen(monkeypatch):
    """A port someone holds is skipped: with the range narrowed to two ports, one taken, the
    other is the answer every time."""
    import random

    import common.embedded as embedded

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        free = taken + 1 if taken + 1 != 65536 else taken - 1
        picks = iter([taken, taken, free])
        monkeypatch.setattr(embedded, "ephemeral_port_range", lambda: (11100, 60999))
        monkeypatch.setattr(random.Random, "randrange", lambda self, a, b: next(picks))
        monkeypatch.setattr(embedded, "_handed_out", set())
        if embedded.port_in_use("127.0.0.1", free):
            pytest.skip(f"port {free} is in use on this machine")
        assert any_free_port() == free


def test_a_child_that_exits_before_listening_is_named_with_its_last_log_line(tmp_path):
    log = tmp_path / "api-2.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", "print('error: cannot bind 127.0.0.1:1 with SO_REUSEPORT'); raise SystemExit(1)"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    with pytest.raises(PlatformError) as e:
        wait_listening({"api-2": proc}, any_free_port(), 30, tmp_path)
    assert "api-2 exited with code 1 before listening" in str(e.value)
    assert "last log line: error: cannot bind 127.0.0.1:1 with SO_REUSEPORT" in str(e.value)
