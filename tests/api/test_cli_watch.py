"""Watching from the CLI: `submit --wait` exits with the job's outcome, `status --watch`
ends with the job, `list --watch` redraws until Ctrl-C; `list` shows elapsed, time left,
nodes and why a job waits; tables are never cut at 80 columns when piped; --json everywhere."""

from __future__ import annotations

import asyncio
import json
import time
import types

import pytest
import typer
from typer.testing import CliRunner

from api.main import create_app
from cli import user_cmd
from cli.user_cmd import register
from store import allocations, leadership
from tests.api.conftest import ALPHA
from tests.api.test_cli import UvicornThread
from tests.foundation.builders import gang
from tests.support import eventually, force_job_state

JOB_YAML = """\
team: alpha
name: a-rather-long-job-name-so-the-table-is-wider-than-eighty-columns
priority_class: research
image: registry/llm:1
command: [python3, train.py]
gpu_type: h100
replicas: 2
gpus_per_replica: 8
topology: {pack: block, max_blocks: 1}
max_runtime: 4h
"""


@pytest.fixture
def app_cli() -> typer.Typer:
    app = typer.Typer()
    register(app)
    return app


@pytest.fixture
def api_url(settings, cluster):
    with UvicornThread(create_app(settings)) as s:
        yield s.url


@pytest.fixture
def fast_watch(monkeypatch):
    monkeypatch.setattr(user_cmd, "WATCH_INTERVAL_S", 0.05)


def ctrl_c_after(monkeypatch, sleeps: int) -> None:
    """The CLI's n-th sleep raises KeyboardInterrupt, as Ctrl-C would."""
    calls = {"n": 0}

    def sleep(s: float) -> None:
        calls["n"] += 1
        if calls["n"] >= sleeps:
            raise KeyboardInterrupt
        time.sleep(min(s, 0.05))

    monkeypatch.setattr(user_cmd, "time", types.SimpleNamespace(sleep=sleep, monotonic=time.monotonic))


async def cli(app, *args: str, url: str, token: str = ALPHA, stdin: str | None = None):
    """Invoke in a thread (stdout is a pipe, not a terminal), so the test's loop keeps running."""
    return await asyncio.to_thread(
        lambda: CliRunner().invoke(app, [*args, "--url", url, "--token", token], input=stdin, catch_exceptions=False)
    )


async def submitted(pool, name: str | None = None) -> str:
    async def probe():
        return await pool.fetchval("SELECT job_id FROM jobs ORDER BY submitted_at DESC LIMIT 1")

    return await eventually(probe, timeout=10, interval=0.05, what="the job row")


async def run_on(pool, job_id: str, node: str, started_ago_s: int) -> None:
    epoch = await leadership.acquire_leadership(pool, scope="placement", holder="t", grpc_addr="x", ttl_s=60)
    epoch = epoch or await pool.fetchval("SELECT epoch FROM leader")
    await allocations.commit_gang(
        pool, scope="placement", epoch=epoch, job_id=job_id, attempt=1, placements=gang((node, tuple(range(8))))
    )
    await force_job_state(
        pool,
        "UPDATE jobs SET state = 'RUNNING', started_at = now() - make_interval(secs => $2) WHERE job_id = $1",
        job_id,
        started_ago_s,
    )


async def end(pool, job_id: str, state: str, exit_code: int | None) -> None:
    await force_job_state(
        pool,
        "UPDATE jobs SET state = $2, exit_code = $3, finished_at = now() WHERE job_id = $1",
        job_id,
        state,
        exit_code,
    )


async def test_list_shows_elapsed_time_left_nodes_and_reason_in_wide_rows(app_cli, api_url, pool):
    r = await cli(app_cli, "submit", "-f", "-", url=api_url, stdin=JOB_YAML)
    assert r.exit_code == 0, r.output
    running = await submitted(pool)
    await run_on(pool, running, "b0-n0", started_ago_s=125)
    r = await cli(app_cli, "submit", "-f", "-", url=api_url, stdin=JOB_YAML.replace("name: a-", "name: q-"))
    queued = await submitted(pool)
    assert queued != running
    await pool.execute("UPDATE jobs SET queue_position = 1, pending_reason = 'capacity' WHERE job_id = $1", queued)

    r = await cli(app_cli, "list", url=api_url)
    assert r.exit_code == 0, r.output
    header = next(line for line in r.stdout.splitlines() if "elapsed" in line)
    for column in ("job", "state", "elapsed", "left", "nodes", "reason"):
        assert column in header
    [run_row] = [line for line in r.stdout.splitlines() if running in line]
    assert "RUNNING" in run_row and "b0-n0" in run_row and "a-rather-long-job-name" in run_row
    assert "2m0" in run_row and "3h57m" in run_row  # elapsed ~2m05s, left 4h - 2m05s
    assert len(run_row) > 120 and "…" not in r.stdout  # piped: as wide as the content, nothing cut
    [queued_row] = [line for line in r.stdout.splitlines() if queued in line]
    assert "QUEUED" in queued_row and "capacity" in queued_row

    r = await cli(app_cli, "list", "--json", url=api_url)
    jobs = {j["job_id"]: j for j in json.loads(r.stdout)["jobs"]}
    assert jobs[running]["nodes"] == ["b0-n0"] and jobs[running]["max_runtime_s"] == 4 * 3600
    assert jobs[queued]["nodes"] == [] and jobs[queued]["pending_reason"] == "capacity"


async def test_submit_wait_exits_with_the_jobs_outcome(app_cli, api_url, pool, fast_watch):
    for node, state, exit_code, expected in (
        ("b0-n0", "SUCCEEDED", 0, 0),
        ("b0-n1", "FAILED", 3, 10),
        ("b1-n0", "CANCELLED", None, 11),
    ):
        waiting = asyncio.create_task(cli(app_cli, "submit", "-f", "-", "--wait", url=api_url, stdin=JOB_YAML))
        job_id = await eventually(
            lambda: pool.fetchval("SELECT job_id FROM jobs WHERE state = 'QUEUED' LIMIT 1"), timeout=10, interval=0.05
        )
        await run_on(pool, job_id, node, started_ago_s=5)
        await asyncio.sleep(0.3)
        await end(pool, job_id, state, exit_code)
        r = await asyncio.wait_for(waiting, 20)
        assert r.exit_code == expected, (state, r.output)
        lines = r.stdout.splitlines()
        assert lines[0].startswith(f"submitted {job_id}")
        assert f"{job_id}: RUNNING on {node}" in r.stdout and lines[-1].startswith(f"{job_id}: {state}")
        if exit_code is not None:
            assert f"exit {exit_code}" in lines[-1]
        await pool.execute("DELETE FROM allocations WHERE job_id = $1", job_id)  # its GPUs back to the quota

    # --json: the final job, once; the exit code still says how it ended
    waiting = asyncio.create_task(cli(app_cli, "submit", "-f", "-", "--wait", "--json", url=api_url, stdin=JOB_YAML))
    job_id = await eventually(
        lambda: pool.fetchval("SELECT job_id FROM jobs WHERE state = 'QUEUED' LIMIT 1"), timeout=10, interval=0.05
    )
    await end(pool, job_id, "TIMED_OUT", None)
    r = await asyncio.wait_for(waiting, 20)
    assert r.exit_code == 12 and json.loads(r.stdout)["state"] == "TIMED_OUT"


async def test_status_watch_ends_with_the_job_and_list_watch_ends_on_ctrl_c(
    app_cli, api_url, pool, fast_watch, monkeypatch
):
    r = await cli(app_cli, "submit", "-f", "-", "--json", url=api_url, stdin=JOB_YAML)
    job_id = json.loads(r.stdout)["job_id"]
    watching = asyncio.create_task(cli(app_cli, "status", job_id, "--watch", url=api_url))
    await asyncio.sleep(0.3)
    await run_on(pool, job_id, "b0-n1", started_ago_s=1)
    await asyncio.sleep(0.3)
    await end(pool, job_id, "SUCCEEDED", 0)
    r = await asyncio.wait_for(watching, 20)
    assert r.exit_code == 0, r.output
    # piped: one table per refresh, the last one the ended job
    assert "QUEUED" in r.stdout and "RUNNING" in r.stdout and "b0-n1" in r.stdout
    assert "SUCCEEDED" in r.stdout.split("RUNNING")[-1] and r.stdout.count("SUCCEEDED") == 1

    ctrl_c_after(monkeypatch, sleeps=3)
    r = await cli(app_cli, "list", "--watch", url=api_url)
    assert r.exit_code == 0 and r.stdout.count("elapsed") == 3, r.output  # three refreshes, then a clean stop
    assert "Traceback" not in r.output and "Aborted" not in r.output

    ctrl_c_after(monkeypatch, sleeps=2)
    r = await cli(app_cli, "list", "--watch", "--json", url=api_url)
    docs = [json.loads(line) for line in r.stdout.splitlines()]
    assert r.exit_code == 0 and len(docs) == 2 and docs[0]["jobs"][0]["job_id"] == job_id


def test_help_documents_the_exit_codes_and_watch_flags(app_cli):
    r = CliRunner().invoke(app_cli, ["submit", "--help"], env={"COLUMNS": "200"})
    assert "0 SUCCEEDED, 10 FAILED, 11 CANCELLED, 12 TIMED_OUT" in " ".join(r.stdout.split())
    for cmd in ("status", "list"):
        r = CliRunner().invoke(app_cli, [cmd, "--help"], env={"COLUMNS": "200"})
        assert "--watch" in r.stdout and "--json" in r.stdout


def test_piped_output_is_not_cut_at_80_columns(capsys):
    con = user_cmd._out()
    assert con.width == user_cmd.PIPED_WIDTH  # pytest's captured stdout is not a terminal
    assert user_cmd._duration(3 * 3600 + 125) == "3h02m" and user_cmd._duration(65) == "1m05s"
    assert user_cmd._duration(None) == "-" and user_cmd._duration(2 * 86400 + 7200) == "2d02h"
