"""A deliberately broken build is caught by the checker (issue 19, "Must show").

``test_faults: ack_before_durable`` makes control acknowledge an agent's report before it is
stored (the store runs in the background, once). The scenario drives the one moment where
that matters, deterministically: a rank exits 0 while Postgres is down. The healthy build
refuses the report until it is stored (the agent keeps it and sends it again); the broken one
acknowledges it, so the agent forgets it, the store fails, and the success is lost: the lease
is later found without its task and the job runs again. The real checker then judges the
real recorded history (Postgres, Temporal's visibility, the agents' records).

The same scenario on the healthy build is the control: there every invariant holds, so the
broken build's failure is the switch's doing, not the scenario's.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from chaos.checker import check
from chaos.history import RankRecord, load, read_agent_records
from chaos.run import check_params
from chaos.stack import ChaosStack, Layout
from chaos.timeline import Fault, RunRecord, Submission
from common.temporal import connect
from tests.support import eventually, holds

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT")


async def _stack(test_faults: tuple[str, ...]) -> AsyncIterator[ChaosStack]:
    # a short root: Postgres' unix socket path must stay under 107 characters
    root = Path(tempfile.mkdtemp(prefix="gpufleet-chaos-"))
    stack = ChaosStack(root, Layout(blocks=1, nodes_per_block=2, agents=1, controls=("c1",), test_faults=test_faults))
    try:
        await stack.start()
        yield stack
    finally:
        left = await stack.stop()
        assert not left, f"the teardown had to kill {left}"
        assert not root.exists()


@pytest.fixture
async def healthy() -> AsyncIterator[ChaosStack]:
    async for s in _stack(()):
        yield s


@pytest.fixture
async def broken() -> AsyncIterator[ChaosStack]:
    async for s in _stack(("ack_before_durable",)):
        yield s


async def _fetch(stack: ChaosStack, sql: str, *args: Any) -> Any:
    """A probe's read: None while Postgres is restarting (the probe then polls again)."""
    assert stack.pool is not None
    try:
        return await stack.pool.fetchval(sql, *args)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
        return None


def _ranks(stack: ChaosStack, job_id: str) -> list[RankRecord]:
    return [r for r in read_agent_records(stack.state) if r.job_id == job_id]


async def _exit_during_a_postgres_outage(stack: ChaosStack, *, acknowledged: bool) -> dict[str, Any]:
    """Submit a one-rank job that exits 0 when told; tell it while Postgres is down; bring
    Postgres back; wait for the job to end; judge the history. Returns the verdict and facts."""
    assert stack.settings is not None
    go = stack.root / "go"
    team = stack.teams["alpha"]
    name = "chaos-broken-build"
    body = {
        "team": "alpha", "name": name, "priority_class": "research", "image": "registry/chaos:1",
        "gpu_type": "h100", "replicas": 1, "gpus_per_replica": 1, "max_runtime": "1h",
        # the rank exits 0 once the test says so (a file), not after a guessed time
        "command": [sys.executable, "-c", f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"],
    }  # fmt: skip
    t0 = time.time()
    async with httpx.AsyncClient(base_url=stack.api_url, timeout=15.0) as http:
        r = await http.post(
            "/v1/jobs", json=body, headers={"Authorization": f"Bearer {team.token}", "Idempotency-Key": "k-broken"}
        )
    assert r.status_code == 202, r.text
    job_id = r.json()["job_id"]
    sub = Submission("k-broken", team.principal, "alpha", name, "short", "research", 1, 1, t0, (202,), (job_id,))

    sql = "SELECT state FROM jobs WHERE job_id = $1"

    async def state_is(*states: str) -> bool:
        return await _fetch(stack, sql, job_id) in states

    await eventually(lambda: state_is("RUNNING"), timeout=60, what="the job RUNNING")
    await eventually(lambda: any(x.started_at for x in _ranks(stack, job_id)), timeout=30, what="its rank started")

    down = time.time()
    await stack.stop_postgres(immediate=False)
    go.touch()
    (rank,) = await eventually(
        lambda: [x for x in _ranks(stack, job_id) if x.exit_state == "EXITED" and x.exit_code == 0],
        timeout=30,
        what="the rank's exit 0 on record",
    )
    acked = lambda: any(x.reported_at is not None for x in _ranks(stack, job_id))  # noqa: E731
    if acknowledged:  # the broken build acknowledges a report it has not stored
        await eventually(acked, timeout=30, what="the ack")
    else:  # the healthy one does not while Postgres is down: the agent keeps the report
        await holds(lambda: not acked(), for_s=3.0, what="no ack while Postgres is down")
    await stack.start_postgres()
    up = time.time()

    await eventually(lambda: state_is(*TERMINAL), timeout=120, interval=0.5, what="the job ended")
    rec = RunRecord(
        submissions=(sub,),
        faults=(Fault("postgres_restart", down, up, "postgres", (), {"immediate": False}),),
        started_at=t0,
        faults_ended_at=up,
    )
    client = await connect(stack.settings)
    h = await load(stack.dsn, stack.state, temporal_client=client, scope=stack.settings.leader_scope)
    verdict = check(h, rec, check_params(stack.settings))
    return {"verdict": verdict, "job": h.jobs[job_id], "ranks": _ranks(stack, job_id), "first": rank}


async def test_the_healthy_build_keeps_a_report_made_while_postgres_is_down(healthy: ChaosStack) -> None:
    out = await _exit_during_a_postgres_outage(healthy, acknowledged=False)
    v = out["verdict"]
    assert v.ok, v.counterexamples
    assert out["job"].state == "SUCCEEDED" and out["job"].attempt == 1
    assert [x.attempt for x in out["ranks"]] == [1], "ran once"


async def test_acknowledging_before_the_report_is_durable_is_caught_as_a_rerun(broken: ChaosStack) -> None:
    out = await _exit_during_a_postgres_outage(broken, acknowledged=True)
    v = out["verdict"]
    assert v.invariants["no_rerun_of_finished_rank"] is False, v.counterexamples
    (example, *_) = v.counterexamples["no_rerun_of_finished_rank"]
    assert example["job"] == out["job"].job_id and example["succeeded_attempt"] == 1
    assert any(x.attempt > 1 and x.started_at for x in out["ranks"])
