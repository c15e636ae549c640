"""`gpufleet logs` as a user types it, on the embedded stack (real agent, supervisor, rank):
a job that prints a line and dies with a message shows both, in order, each with its
stream; --tail, --json, and -f on a running job that returns when the job ends."""

from __future__ import annotations

import asyncio
import json

import pytest
import typer

from api.main import create_app
from cli.user_cmd import register
from tests.api.test_cli import UvicornThread, invoke
from tests.e2e.conftest import PY

pytestmark = pytest.mark.e2e

FAILING = [PY, "-c", "print('out'); import sys; sys.exit('boom')"]
SLOW = [PY, "-c", "import time\nfor i in range(3):\n    print(f'step {i}', flush=True); time.sleep(0.5)"]


async def gpufleet(url: str, *args: str):
    app = typer.Typer()
    register(app)
    return await asyncio.to_thread(invoke, app, *args, url=url, token="tok-alpha")


async def test_logs_of_a_failed_job_through_the_cli(stack):
    with UvicornThread(create_app(stack.settings)) as api:
        job_id = await stack.submit(command=FAILING)
        await stack.wait_state(job_id, "FAILED")

        r = await gpufleet(api.url, "logs", job_id, "--stream", "all")
        assert r.exit_code == 0, r.output
        assert r.stdout == "[stdout] out\n[stderr] boom\n"
        r = await gpufleet(api.url, "logs", job_id)  # both streams unless asked otherwise
        assert r.stdout == "[stdout] out\n[stderr] boom\n"
        r = await gpufleet(api.url, "logs", job_id, "--tail", "1")
        assert r.stdout == "[stderr] boom\n"
        r = await gpufleet(api.url, "logs", job_id, "--stream", "stderr")
        assert r.stdout == "boom\n"
        r = await gpufleet(api.url, "logs", job_id, "--json")
        recs = [json.loads(x) for x in r.stdout.splitlines()]
        assert [(x["rank"], x["stream"], x["line"]) for x in recs] == [(0, "stdout", "out"), (0, "stderr", "boom")]
        assert all(x["time"] for x in recs)
        r = await gpufleet(api.url, "logs", job_id, "--all-ranks")
        assert r.stdout == "[rank 0] [stdout] out\n[rank 0] [stderr] boom\n"
        r = await gpufleet(api.url, "logs", job_id, "--stream", "both")
        assert r.exit_code == 2 and "stdout, stderr or all" in r.stderr


async def test_follow_returns_when_the_job_ends(stack):
    with UvicornThread(create_app(stack.settings)) as api:
        job_id = await stack.submit(command=SLOW)
        await stack.wait_state(job_id, "RUNNING", "SUCCEEDED")
        r = await asyncio.wait_for(gpufleet(api.url, "logs", job_id, "-f", "--stream", "stdout"), 30)
        assert r.exit_code == 0, r.output
        assert r.stdout == "step 0\nstep 1\nstep 2\n"
        await stack.wait_state(job_id, "SUCCEEDED")
