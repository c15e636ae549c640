"""A rank's output as the agent keeps and serves it (worker_agent.rank_logs, log_http): both
streams with the time of each line, interleaved in the order written; partial lines; a size
cap with rotation that keeps offsets (and followers) valid; tail; a rank that outlives its
supervisor keeps its output."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import pytest

from api.logs_proxy import open_agent_log
from proto.auth import lease_log_token, node_log_key
from tests.agent.conftest import pid_alive, script, start_task, wait_for
from worker_agent import rank_logs
from worker_agent import statefiles as sf
from worker_agent.log_http import LogHttpServer

ALTERNATING = """
    import sys, time
    for i in range(3):
        print(f"out {i}", flush=True)
        time.sleep(0.03)
        print(f"err {i}", file=sys.stderr, flush=True)
        time.sleep(0.03)
    sys.stdout.write("no newline yet")
    sys.stdout.flush()
    time.sleep(1.0)
    sys.exit("boom")
"""


def lines(lease_dir, offset=0):
    return [(r.stream, r.payload.decode(), r.partial) for r in rank_logs.read_records(lease_dir, offset)]


# --- the writer and reader, no process -------------------------------------------------------


def test_records_keep_the_order_written_and_partial_lines(tmp_path):
    relay = rank_logs.Relay(tmp_path, max_bytes=1 << 20, keep=1)
    relay.write("stdout", b"a\nb", now=1.0)
    relay.write("stderr", b"e1\n", now=2.0)
    relay.write("stdout", b"c\n", now=3.0)  # completes "bc"
    relay.write("stderr", b"progress 10%\r", now=4.0)
    relay.flush_partial(older_than=10.0, now=5.0)  # not old enough: held
    assert lines(tmp_path)[-1] == ("stdout", "bc", False)
    relay.flush_partial()  # old enough (or the rank ended): written, marked partial
    relay.finish(0)
    assert lines(tmp_path) == [
        ("stdout", "a", False),
        ("stderr", "e1", False),
        ("stdout", "bc", False),
        ("stderr", "progress 10%\r", True),
    ]
    # each stream's own file has its bytes exactly as written
    assert (tmp_path / sf.STDOUT).read_bytes() == b"a\nbc\n"
    assert (tmp_path / sf.STDERR).read_bytes() == b"e1\nprogress 10%\r"
    times = [r.time for r in rank_logs.read_records(tmp_path)]
    assert times[:3] == [1.0, 2.0, 3.0]
    # tail: the last N records of a stream, or of both
    assert lines(tmp_path, rank_logs.tail_offset(tmp_path, 1, "stdout")) == [
        ("stdout", "bc", False),
        ("stderr", "progress 10%\r", True),
    ]
    assert lines(tmp_path, rank_logs.tail_offset(tmp_path, 2)) == lines(tmp_path)[2:]
    assert lines(tmp_path, rank_logs.tail_offset(tmp_path, 99)) == lines(tmp_path)
    assert rank_logs.tail_offset(tmp_path, 0) == rank_logs.end_offset(tmp_path)


def test_a_long_line_is_cut_into_partial_records(tmp_path):
    relay = rank_logs.Relay(tmp_path, max_bytes=1 << 24, keep=0)
    relay.write("stdout", b"x" * (rank_logs.MAX_RECORD + 10) + b"\n", now=1.0)
    relay.finish(0)
    got = list(rank_logs.read_records(tmp_path))
    assert [(len(r.payload), r.partial) for r in got] == [(rank_logs.MAX_RECORD, True), (10, False)]


def test_rotation_caps_the_size_and_keeps_offsets(tmp_path):
    cap, keep = 64 * 1024, 2
    relay = rank_logs.Relay(tmp_path, max_bytes=cap, keep=keep)
    reader_at = 0
    seen: list[str] = []
    for i in range(3000):
        relay.write("stdout" if i % 2 else "stderr", b"line %05d\n" % i, now=float(i))
        if i % 100 == 0:  # a follower reading along, by offset, as rotation goes on
            for r in rank_logs.read_records(tmp_path, reader_at):
                reader_at = r.offset
                seen.append(r.payload.decode())
    relay.finish(0)
    for r in rank_logs.read_records(tmp_path, reader_at):
        reader_at = r.offset
        seen.append(r.payload.decode())
    assert seen == [f"line {i:05d}" for i in range(3000)]  # the follower missed nothing, saw nothing twice
    total = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert total <= cap + 1024, total  # the cap (plus a record)
    assert len(rank_logs.segments(tmp_path)) == keep + 1
    assert {p.name for p in tmp_path.iterdir() if p.name.startswith("stdout.log")} == {
        "stdout.log",
        "stdout.log.1",
        "stdout.log.2",
    }
    # the newest lines are kept; an offset rotated away reads from the oldest kept record
    kept = lines(tmp_path)
    assert kept[-1] == ("stdout", "line 02999", False) and kept[0][1] > "line 00000"
    assert lines(tmp_path, 0) == kept
    assert [x[1] for x in lines(tmp_path, rank_logs.tail_offset(tmp_path, 3, "stderr"))][::2] == [
        "line 02994",
        "line 02996",
        "line 02998",
    ]


# --- a real rank under its supervisor, served over HTTP ---------------------------------------


@pytest.fixture
async def http(node, settings):
    server = LogHttpServer(settings, {node.node_id: node})
    addr = await server.start("127.0.0.1:0")
    yield addr
    await server.stop()


async def read(addr, settings, lease: str, **kw) -> bytes:
    token = lease_log_token(node_log_key(settings.log_signing_key, "node-t"), lease, now=time.time(), ttl_s=60)
    body = await open_agent_log(addr, lease, token=token, **kw)
    return b"".join([c async for c in body])


async def test_both_streams_interleaved_and_served(node, http, settings, tmp_path):
    await node.start_task(start_task("node-t", "lease-both", script(tmp_path, "both.py", ALTERNATING)))
    st = node.leases["lease-both"]
    # follow from the start: it ends when the rank has exited, with everything it wrote
    follower = asyncio.create_task(read(http, settings, "lease-both", stream="all", follow=True))
    await wait_for(lambda: not st.live, what="the rank's exit")
    text = (await asyncio.wait_for(follower, 10)).decode()
    expected = [
        "[stdout] out 0",
        "[stderr] err 0",
        "[stdout] out 1",
        "[stderr] err 1",
        "[stdout] out 2",
        "[stderr] err 2",
        "[stdout] no newline yet",  # a partial line is not held forever: flushed after a moment
        "[stderr] boom",
    ]
    assert text.splitlines() == expected
    assert (await read(http, settings, "lease-both", stream="all")).decode().splitlines() == expected
    # one stream, exactly as written
    assert await read(http, settings, "lease-both", stream="stderr") == b"err 0\nerr 1\nerr 2\nboom\n"
    assert await read(http, settings, "lease-both", stream="stdout") == b"out 0\nout 1\nout 2\nno newline yet"
    assert await read(http, settings, "lease-both", stream="stderr", tail=1) == b"boom\n"
    # NDJSON: time, stream, line, and the offset to resume from
    recs = [json.loads(x) for x in (await read(http, settings, "lease-both", fmt="ndjson", stream="all")).splitlines()]
    assert recs[-1] == {"end": recs[-2]["offset"]}
    assert [r["line"] for r in recs[:-1]][:2] == ["out 0", "err 0"]
    assert all(recs[i]["time"] <= recs[i + 1]["time"] for i in range(len(recs) - 2))
    assert recs[6]["partial"] is True and recs[7]["partial"] is False
    resumed = await read(http, settings, "lease-both", fmt="ndjson", stream="all", offset=recs[5]["offset"])
    assert [json.loads(x).get("line") for x in resumed.splitlines()] == ["no newline yet", "boom", None]
    # the files the rest of the agent (and people) read are still there
    assert (st.dir / sf.STDERR).read_bytes() == b"err 0\nerr 1\nerr 2\nboom\n"


async def test_bad_parameters_are_refused(node, http, settings, tmp_path):
    import httpx

    await node.start_task(start_task("node-t", "lease-p", script(tmp_path, "p.py", "print('x')\n")))
    token = lease_log_token(node_log_key(settings.log_signing_key, "node-t"), "lease-p", now=time.time(), ttl_s=60)
    async with httpx.AsyncClient() as c:
        for q in ("stream=both", "format=xml", "tail=-1", "tail=x"):
            r = await c.get(f"http://{http}/v1/leases/lease-p/logs?{q}", headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 400, q


async def test_a_rank_keeps_its_output_when_its_supervisor_dies(node, http, settings, tmp_path):
    counter = """
        import time
        for i in range(1000):
            print(f"tick {i}", flush=True)
            time.sleep(0.02)
    """
    await node.start_task(start_task("node-t", "lease-orphan", script(tmp_path, "tick.py", counter)))
    st = node.leases["lease-orphan"]
    await wait_for(lambda: len(lines(st.dir)) >= 3, what="first ticks")
    old_sup = st.sup_pid
    os.kill(old_sup, signal.SIGKILL)  # the supervisor dies; the agent re-adopts the rank
    await wait_for(lambda: st.sup_pid != old_sup and pid_alive(st.sup_pid), what="an adopting supervisor")
    assert pid_alive(st.pid)  # the rank did not die of a broken pipe
    n = len(lines(st.dir))
    await wait_for(lambda: len(lines(st.dir)) >= n + 5, what="output read on by the new supervisor")
    got = lines(st.dir)
    # the line the dead supervisor held may reach the log cut (a partial "tick 4", then "1"): no tick
    whole = [m for m in (re.fullmatch(r"tick (\d+)\n?", x[1]) for x in got if not x[2]) if m]
    assert len(whole) >= len(got) - 2, got
    ticks = [int(m.group(1)) for m in whole]
    assert ticks == sorted(ticks) and len(set(ticks)) == len(ticks)  # in order, nothing twice
    missing = set(range(ticks[0], ticks[-1] + 1)) - set(ticks)
    assert len(missing) <= 1, missing  # at most the partial line the dead supervisor held
