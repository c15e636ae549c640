"""A rank's terminal report says why it ended: the signal that killed it and the last lines
of its stderr (bounded, always valid text), on the wire and from real ranks."""

from __future__ import annotations

from datetime import UTC, datetime

from common.contracts import TaskState, TaskStatus
from proto.convert import task_status_from_pb, task_status_to_pb
from tests.agent.conftest import PY, script, start_task, wait_for
from worker_agent.exit_cause import TAIL_BYTES, TAIL_LINES, exit_signal, stderr_tail
from worker_agent.node import NodeAgent

# ------------------------------------------------------------------ the tail


def test_the_tail_is_the_last_lines(tmp_path):
    p = tmp_path / "stderr.log"
    p.write_text("".join(f"line {i}\n" for i in range(100)))
    tail = stderr_tail(p)
    assert tail.splitlines() == [f"line {i}" for i in range(100 - TAIL_LINES, 100)]
    assert stderr_tail(p, max_lines=3) == "line 97\nline 98\nline 99"
    assert stderr_tail(tmp_path / "missing.log") == "" and stderr_tail(None) == ""
    (tmp_path / "empty.log").write_bytes(b"")
    assert stderr_tail(tmp_path / "empty.log") == ""


def test_the_tail_is_bounded_in_bytes(tmp_path):
    p = tmp_path / "stderr.log"
    p.write_text("x" * 10_000 + "\n" + "y" * 100 + "\n" + "z" * 50_000)  # one huge last line
    tail = stderr_tail(p)
    assert len(tail.encode()) <= TAIL_BYTES and tail.endswith("z" * 100)
    p.write_text(("a" * 300 + "\n") * 30)  # 20 lines would be 6 KiB: the newest whole lines within 4 KiB
    tail = stderr_tail(p)
    assert len(tail.encode()) <= TAIL_BYTES and all(line == "a" * 300 for line in tail.splitlines())


def test_non_utf8_bytes_and_nul_are_safe(tmp_path):
    p = tmp_path / "stderr.log"
    p.write_bytes(b"ok \xe2\x9c\x93\n\xff\xfe broken \x00 nul\nlast \xc3")  # a cut multi-byte char at the end
    tail = stderr_tail(p)
    assert tail.splitlines() == ["ok \u2713", "\ufffd\ufffd broken \ufffd nul", "last \ufffd"]
    tail.encode("utf-8")  # valid text, storable in Postgres (no NUL)
    p.write_bytes(b"\xff" * 10_000)  # each bad byte becomes 3 bytes of U+FFFD: still bounded
    assert 0 < len(stderr_tail(p).encode()) <= TAIL_BYTES


def test_the_signal_is_what_the_supervisor_recorded():
    assert exit_signal({"exit_code": 137, "signal": 9}) == 9
    assert exit_signal({"exit_code": 137, "signal": None}) is None  # a shell's 137: no signal of its own
    assert exit_signal(None) is None and exit_signal({"signal": True}) is None and exit_signal({"signal": 0}) is None


def test_the_cause_round_trips_through_the_wire():
    s = TaskStatus("n1", "l1", "j1", 2, 9, 3, TaskState.EXITED, datetime(2026, 1, 2, tzinfo=UTC), exit_code=137,
                   signal=9, stderr_tail="Traceback\nKilled \u2713", reason="")  # fmt: skip
    assert task_status_from_pb(task_status_to_pb(s)) == s
    bare = task_status_from_pb(task_status_to_pb(TaskStatus("n", "l", "j", 1, 1, 0, TaskState.LOST, s.at)))
    assert bare.signal is None and bare.stderr_tail == "" and bare.reason == ""


# --------------------------------------------------------------- real ranks


def _terminal_report(node: NodeAgent, lease_id: str):
    reports = [m for m in node.outbox.values() if m.lease_id == lease_id and m.state != 1]  # not STARTED
    return reports[-1] if reports else None


async def _ended(node: NodeAgent, lease_id: str):
    await wait_for(lambda: _terminal_report(node, lease_id) is not None, timeout=15, what=f"{lease_id} ended")
    return task_status_from_pb(_terminal_report(node, lease_id))


async def test_a_crashing_rank_reports_its_code_and_stderr_tail(node, tmp_path):
    cmd = script(tmp_path, "crash.py", "import sys\nprint('stdout-marker')\nsys.stderr.write('warming up\\n')\n1/0\n")
    assert (await node.start_task(start_task("node-t", "lease-crash", cmd))).accepted
    s = await _ended(node, "lease-crash")
    assert (s.state, s.exit_code, s.signal) == (TaskState.EXITED, 1, None)
    assert s.stderr_tail.startswith("warming up\nTraceback") and s.stderr_tail.splitlines()[-1].startswith(
        "ZeroDivisionError"
    )
    assert "stdout-marker" not in s.stderr_tail  # stdout is not stderr


async def test_a_rank_killed_by_a_signal_reports_the_signal(node, tmp_path):
    cmd = [PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    assert (await node.start_task(start_task("node-t", "lease-kill", cmd))).accepted
    s = await _ended(node, "lease-kill")
    assert (s.state, s.exit_code, s.signal, s.stderr_tail) == (TaskState.EXITED, 137, 9, "")


async def test_a_command_that_cannot_start_says_so(node, tmp_path):
    assert (await node.start_task(start_task("node-t", "lease-nobin", ["no-such-binary"]))).accepted
    s = await _ended(node, "lease-nobin")
    assert (s.state, s.exit_code, s.signal) == (TaskState.EXITED, 127, None)
    assert "cannot start ['no-such-binary']" in s.stderr_tail and "No such file" in s.reason
