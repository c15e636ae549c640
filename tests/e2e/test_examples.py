"""Every spec in examples/ runs on the embedded stack, submitted through the CLI as a user
types it (`gpufleet submit -f examples/<spec> --wait`), and reaches its expected outcome:
the 1-GPU, 8-GPU and gang jobs succeed, the checkpointing job is preempted, resumes from its
checkpoint and succeeds, the serving replicas run until cancelled. The stack's teams are
alpha and beta, so the team line is rewritten; nothing else is."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from api.main import create_app
from api.schemas import JOB_SUBMIT_EXAMPLE
from cli import user_cmd
from cli.main import app as gpufleet
from store.seed import DEMO_CLASSES
from tests.api.test_cli import UvicornThread
from tests.e2e.conftest import PY
from tests.support import eventually, workflow_status

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TEAM = re.compile(r"^team: \S+$", re.M)


@pytest.fixture
def api(stack, monkeypatch):
    """The stack's API on a real loopback port (the CLI talks HTTP); its own pool and client."""
    monkeypatch.setattr(user_cmd, "WATCH_INTERVAL_S", 0.2)
    with UvicornThread(create_app(stack.settings)) as s:
        yield s.url


def spec(name: str, team: str) -> str:
    text = (EXAMPLES / name).read_text()
    assert TEAM.search(text), name
    return TEAM.sub(f"team: {team}", text)


async def gpufleet_cli(url: str, *args: str, stdin: str | None = None, token: str = "tok-alpha"):
    """`gpufleet ...` with GPUFLEET_API_URL and GPUFLEET_TOKEN exported, as the quickstart says."""
    env = {"GPUFLEET_API_URL": url, "GPUFLEET_TOKEN": token}
    return await asyncio.to_thread(
        lambda: CliRunner().invoke(gpufleet, list(args), input=stdin, env=env, catch_exceptions=False)
    )


def job_id_of(submit_output: str) -> str:
    m = re.search(r"submitted (\S+)", submit_output)
    assert m, submit_output
    return m.group(1)


def rank_output(stack, job_id: str, rows) -> list[str]:
    return [(stack.lease_dir(r["node_id"], r["lease_id"]) / "stdout.log").read_text() for r in rows]


async def leases(stack, job_id: str, attempt: int = 1):
    return await stack.pool.fetch(
        "SELECT * FROM leases WHERE job_id = $1 AND attempt = $2 ORDER BY rank", job_id, attempt
    )


def test_the_examples_parse_and_the_checkpointing_spec_carries_the_script():
    names = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert names == [
        "checkpointing.yaml",
        "eight-gpu.yaml",
        "gang-pack-block.yaml",
        "one-gpu.yaml",
        "prod-serving.yaml",
    ]
    for name in names:
        job = yaml.safe_load((EXAMPLES / name).read_text())
        assert job["team"] in ("pretrain", "infer", "research") and job["gpu_type"] == "h100"  # the demo cluster
        assert job["priority_class"] in DEMO_CLASSES[job["team"]], name  # `make up` lets the team submit it
        assert job["command"][0] == "python3"  # no GPU, no torch needed
    inline = yaml.safe_load((EXAMPLES / "checkpointing.yaml").read_text())["command"]
    assert inline[:2] == ["python3", "-c"] and inline[2] == (EXAMPLES / "train_checkpoint.py").read_text()
    readme = (EXAMPLES / "README.md").read_text()
    assert all(name in readme for name in names)


async def test_the_one_gpu_eight_gpu_and_gang_examples_succeed(stack, api):
    for name, team, ranks in (
        ("one-gpu.yaml", "beta", 1),
        ("eight-gpu.yaml", "alpha", 1),
        ("gang-pack-block.yaml", "alpha", 4),
    ):
        token = f"tok-{team}"
        r = await gpufleet_cli(api, "submit", "-f", "-", "--wait", stdin=spec(name, team), token=token)
        assert r.exit_code == 0, (name, r.output)
        job_id = job_id_of(r.stdout)
        assert r.stdout.splitlines()[-1].startswith(f"{job_id}: SUCCEEDED (exit 0"), r.stdout
        rows = await leases(stack, job_id)
        assert len(rows) == ranks
        out = rank_output(stack, job_id, rows)
        if name == "one-gpu.yaml":
            assert "hello from rank 0 of 1" in out[0]
            r = await gpufleet_cli(api, "logs", job_id, token=token)
            assert r.exit_code == 0 and "hello from rank 0 of 1" in r.stdout, r.output
        if name == "eight-gpu.yaml":
            assert "rank 0: 8 GPUs (0,1,2,3,4,5,6,7)" in out[0]
        if name == "gang-pack-block.yaml":
            assert len({row["node_id"] for row in rows}) == 4
            masters = {re.search(r"master (\S+)", o).group(1) for o in out}
            assert len(masters) == 1 and all(f"rank {i}/4" in out[i] for i in range(4))
    # the OpenAPI example of POST /v1/jobs runs too
    job = await stack.submit(**{**JOB_SUBMIT_EXAMPLE, "team": "alpha"})
    assert (await stack.wait_state(job, "SUCCEEDED", timeout=60))["exit_code"] == 0


async def test_the_checkpointing_example_survives_preemption(stack, api):
    waiting = asyncio.create_task(
        gpufleet_cli(api, "submit", "-f", "-", "--wait", stdin=spec("checkpointing.yaml", "beta"), token="tok-beta")
    )
    job_id = await eventually(
        lambda: stack.pool.fetchval("SELECT job_id FROM jobs WHERE name = 'checkpointing-trainer'"), timeout=20
    )
    await stack.wait_state(job_id, "RUNNING", timeout=30)

    async def checkpointed():
        return (await workflow_status(stack.client, job_id)).get("checkpoint")

    await eventually(checkpointed, timeout=30, what="a checkpoint every rank reported")
    # a prod-batch job of another team needs 8 of its (borrowed) GPUs: it is preempted
    prod = await stack.submit(priority_class="prod-batch", replicas=1, gpus_per_replica=8, command=[PY, "-c", "pass"])
    r = await asyncio.wait_for(waiting, 120)
    assert r.exit_code == 0, r.output
    # --wait printed each state change across both attempts, and the outcome
    assert "RUNNING (attempt 2)" in r.stdout and "SUCCEEDED (attempt 2, exit 0" in r.stdout.splitlines()[-1]
    row = await stack.job(job_id)
    assert row["attempt"] == 2 and row["preemptions"] == 1 and row["last_checkpoint"]
    assert (await stack.wait_state(prod, "SUCCEEDED", timeout=30))["exit_code"] == 0
    first, second = (
        rank_output(stack, job_id, await leases(stack, job_id, 1)),
        rank_output(stack, job_id, await leases(stack, job_id, 2)),
    )
    assert all("SIGTERM at step" in o for o in first), first
    assert all("resumed from step" in o and "done: 40 steps" in o for o in second), second
    assert all("master " in o and "local_rank 0" in o for o in first + second)


async def test_the_serving_example_runs_its_replicas_until_cancelled(stack, api):
    r = await gpufleet_cli(api, "submit", "-f", "-", "--json", stdin=spec("prod-serving.yaml", "alpha"))
    assert r.exit_code == 0, r.output
    job_id = json.loads(r.stdout)["job_id"]
    await stack.wait_state(job_id, "RUNNING", timeout=30)
    rows = await leases(stack, job_id)

    async def serving():
        return all("serving on port" in o for o in rank_output(stack, job_id, rows))

    await eventually(serving, timeout=20, what="both replicas serving")
    ports = [int(re.search(r"serving on port (\d+)", o).group(1)) for o in rank_output(stack, job_id, rows)]
    reader, writer = await asyncio.open_connection("127.0.0.1", ports[1])
    writer.write(b"GET / HTTP/1.0\r\n\r\n")
    assert b"replica 1 ok" in await reader.read()
    writer.close()
    r = await gpufleet_cli(api, "status", job_id)
    assert r.exit_code == 0 and "RUNNING" in r.stdout and "prod-serving" in r.stdout
    r = await gpufleet_cli(api, "cancel", job_id, "--reason", "demo over")
    assert r.exit_code == 0 and "CANCELLING" in r.stdout
    r = await gpufleet_cli(api, "status", job_id, "--watch")  # ends with the job
    assert r.exit_code == 0 and "CANCELLED" in r.stdout
    assert (await stack.job(job_id))["state"] == "CANCELLED"
