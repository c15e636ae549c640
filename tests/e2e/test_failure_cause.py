"""A failed job says why (issue 23): its exit code, the failing rank, node and signal, the last
lines of its stderr and whether the platform retries it, in GET /v1/jobs/{id}, explain and the
CLI as a user types it; on the embedded stack with real ranks."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
import typer
from typer.testing import CliRunner

from api.failure import failure_view
from api.main import create_app
from cli.user_cmd import register
from common.settings import Settings
from store.task_reports import RankEnd
from tests.api.test_cli import UvicornThread
from tests.e2e.conftest import PY

ALPHA = {"Authorization": "Bearer tok-alpha"}


@pytest.fixture
def stack_overrides() -> dict:
    return {"max_failed_attempts": 2}


async def _get(stack, path: str) -> dict:
    r = await stack.http.get(path, headers=ALPHA)
    assert r.status_code == 200, r.text
    return r.json()


async def _node_of(stack, job_id: str, attempt: int, rank: int) -> str:
    return await stack.pool.fetchval(
        "SELECT node_id FROM leases WHERE job_id = $1 AND attempt = $2 AND rank = $3", job_id, attempt, rank
    )


async def test_a_crashing_job_says_why_in_the_api_and_the_cli(stack):
    job = await stack.submit(command=[PY, "-c", "print('hi'); 1/0"])
    row = await stack.wait_state(job, "FAILED", timeout=60)
    assert (row["attempt"], row["exit_code"]) == (2, 1)  # max_failed_attempts = 2; the failing rank's code

    j = await _get(stack, f"/v1/jobs/{job}")
    f = j["failure"]
    assert j["exit_code"] == 1 and j["finished_at"]
    assert (f["kind"], f["attempt"], f["rank"], f["exit_code"], f["signal"]) == ("failed", 2, 0, 1, None)
    assert f["node_id"] == await _node_of(stack, job, 2, 0)
    assert f["stderr_tail"].splitlines()[-1] == "ZeroDivisionError: division by zero"
    assert "hi" not in f["stderr_tail"].splitlines()  # stdout stays out of it
    assert f["will_retry"] is False and f["retry"].startswith("no: 2 failed attempts caused by the job")
    assert [(r["rank"], r["state"], r["exit_code"]) for r in j["rank_results"]] == [(0, "EXITED", 1)]

    e = await _get(stack, f"/v1/jobs/{job}/explain")
    assert e["failure"] == f
    assert e["message"].startswith("the job finished: FAILED (exit code 1). attempt 2 failed: rank 0 on ")
    assert "ZeroDivisionError: division by zero" in e["message"] and "Will retry: no: " in e["message"]

    # the CLI, as a user types it, against a real HTTP server
    app = typer.Typer()
    register(app)
    with UvicornThread(create_app(stack.settings)) as server:

        def cli(*args: str):
            return CliRunner().invoke(app, [*args, "--url", server.url, "--token", "tok-alpha"], catch_exceptions=False)

        status = await asyncio.to_thread(cli, "status", job)
        explain = await asyncio.to_thread(cli, "explain", job)
    print(status.output, explain.output, sep="\n")  # the closing note shows it
    assert status.exit_code == 0, status.output
    for line in ("exit code", "failing rank", "ZeroDivisionError: division by zero", "will retry", "finished"):
        assert line in status.output, (line, status.output)
    assert f"rank 0 on {f['node_id']} (exited, exit code 1)" in status.output
    assert explain.exit_code == 0 and "FAILED (exit code 1)" in explain.output
    assert "ZeroDivisionError" in explain.output


async def test_a_rank_killed_by_a_signal_shows_the_signal(stack):
    job = await stack.submit(command=[PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    await stack.wait_state(job, "FAILED", timeout=60)
    j = await _get(stack, f"/v1/jobs/{job}")
    f = j["failure"]
    assert (j["exit_code"], f["exit_code"], f["signal"], f["signal_name"]) == (137, 137, 9, "SIGKILL")
    assert "was killed by SIGKILL (exit code 137)" in f["summary"]


async def test_a_command_that_cannot_start_says_so(stack):
    job = await stack.submit(command=["no-such-binary"])
    await stack.wait_state(job, "FAILED", timeout=60)
    f = (await _get(stack, f"/v1/jobs/{job}"))["failure"]
    assert f["exit_code"] == 127 and "gpufleet: cannot start ['no-such-binary']" in f["stderr_tail"]
    assert "No such file or directory" in f["stderr_tail"]


async def test_a_failed_attempt_that_is_retried_says_which_attempt_comes(stack):
    cmd = "import os, sys, time; sys.exit(3) if os.environ['GPUFLEET_ATTEMPT'] == '1' else time.sleep(60)"
    job = await stack.submit(command=[PY, "-c", cmd])
    await stack.wait_state(job, "RUNNING", attempt=2, timeout=60)
    j = await _get(stack, f"/v1/jobs/{job}")
    f = j["failure"]
    assert j["exit_code"] is None  # the job has not ended
    assert (f["kind"], f["attempt"], f["exit_code"], f["will_retry"], f["attempts_left"]) == ("failed", 1, 3, True, 1)
    assert f["retry"] == f"yes (attempt 2 of 2); not on {f['node_id']} again while another node is free"
    assert await _node_of(stack, job, 2, 0) != f["node_id"]  # the stack has another node free
    e = await _get(stack, f"/v1/jobs/{job}/explain")
    assert "Before: attempt 1 failed: rank 0 on " in e["message"] and "exited with code 3" in e["message"]
    assert (await stack.cancel(job)).status_code == 202
    await stack.wait_state(job, "CANCELLED", timeout=30)
    f = (await _get(stack, f"/v1/jobs/{job}"))["failure"]
    assert (f["kind"], f["attempt"], f["will_retry"], f["state"]) == ("cancelled", 2, False, "STOPPED")
    assert f["retry"] == "no: cancelled by alice (test)"


# ---------------------------------------------------------------- the rules, without a stack


def _end(rank: int, state: str = "EXITED", code: int | None = 1, **kw) -> RankEnd:
    return RankEnd(rank=rank, attempt=kw.pop("attempt", 1), lease_id=f"l-{rank}", node_id=f"n-{rank}", state=state,
                   exit_code=code, signal=kw.pop("signal", None), stderr_tail=kw.pop("tail", ""),
                   reason=kw.pop("reason", ""), at=kw.pop("at", None), received_at=datetime.now(UTC))  # fmt: skip


def _job(state: str, attempt: int, exit_code: int | None = None) -> dict:
    return {"state": state, "attempt": attempt, "exit_code": exit_code}


def test_an_infrastructure_failure_does_not_count_against_the_job():
    s = Settings(max_failed_attempts=3)
    last = {"event": "requeued", "attempt": 2, "reason": "rank 0 on n-0 was lost", "actor": "workflow",
            "detail": {"cause": "failed", "job_fault": False, "previous_attempt": 1}}  # fmt: skip
    f = failure_view(_job("QUEUED", 2), [_end(0, "LOST", None, reason="node lost")], last, 0, s)
    assert f is not None and (f["kind"], f["will_retry"], f["rank"]) == ("infrastructure", True, 0)
    assert f["retry"].startswith("yes (attempt 2): an infrastructure failure does not count")
    assert f["retry"].endswith("; not on n-0 again while another node is free")
    assert "rank 0 on n-0 was lost (node lost)" in f["summary"]


def test_a_preempted_attempt_says_so_and_a_job_that_never_failed_has_no_failure():
    s = Settings()
    last = {"event": "requeued", "attempt": 3, "reason": "preempted for j-x", "actor": "leader",
            "detail": {"cause": "preempted", "previous_attempt": 2}}  # fmt: skip
    f = failure_view(_job("RUNNING", 3), [_end(0, "STOPPED", 143, attempt=2, reason="preempted for j-x")], last, 1, s)
    assert f is not None and (f["kind"], f["attempt"], f["will_retry"]) == ("preempted", 2, True)
    assert "resumes from its last checkpoint" in f["retry"]
    assert failure_view(_job("RUNNING", 1), [], None, 0, s) is None
    assert failure_view(_job("SUCCEEDED", 1, 0), [_end(0, code=0)], None, 0, s) is None


def test_a_shell_exit_code_above_128_hints_at_the_signal():
    last = {"event": "failed", "attempt": 1, "reason": "1 failed attempts caused by the job", "actor": "workflow",
            "detail": {}}  # fmt: skip
    f = failure_view(_job("FAILED", 1, 137), [_end(0, code=137, tail="x\nKilled\n")], last, 0, Settings())
    assert f is not None and f["signal"] is None and "128 + SIGKILL" in f["summary"]
    assert "its stderr ends: Killed" in f["summary"] and f["retry"] == "no: 1 failed attempts caused by the job"
