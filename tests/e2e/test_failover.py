"""Two real control processes; the leader is killed (SIGKILL) mid-run.

The other takes over with a higher epoch within 30 s, a write under the old epoch is
refused, running jobs finish, new jobs are placed by the new leader, and over the
whole lease history no GPU ever had two live leases."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from common.embedded import any_free_port
from common.temporal import connect
from store import allocations, errors
from tests.e2e.conftest import PY, Stack, e2e_settings, kill_ranks, seed_cluster
from tests.support import eventually

pytestmark = pytest.mark.e2e


def settings_env(settings, **over) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    for name, value in settings.model_dump(mode="json").items():
        if value is None:
            continue
        env[f"GPUFLEET_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    env.update({f"GPUFLEET_{k.upper()}": str(v) for k, v in over.items()})
    env["PYTHONUNBUFFERED"] = "1"
    return env


def spawn_control(settings, holder: str, port: int, log_path) -> subprocess.Popen:
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "cli.main", "control", "--holder", holder],
            env=settings_env(settings, control_grpc_port=port),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=os.getcwd(),
        )
    finally:
        log.close()


async def leader_row(pool, settings):
    return await pool.fetchrow("SELECT * FROM leader WHERE scope = $1 AND expires_at > now()", settings.leader_scope)


async def test_leader_killed_mid_run_the_other_takes_over_and_fences_the_old_epoch(
    pool, db_dsn, temporal_env, tmp_path
):
    from api.main import create_app
    from tests.workflows.test_placement_control import assert_no_gpu_had_two_live_leases
    from worker_agent.agent import AgentProcess

    ports = [any_free_port(), any_free_port()]
    settings = e2e_settings(
        tmp_path,
        db_dsn,
        temporal_env.client.service_client.config.target_host,
        control_addresses=[f"127.0.0.1:{p}" for p in ports],
    )
    nodes = await seed_cluster(pool, settings)
    procs: dict[str, subprocess.Popen] = {}
    agent = None
    http = None
    client = await connect(settings)
    try:
        procs["c1"] = spawn_control(settings, "c1", ports[0], tmp_path / "c1.log")

        async def c1_leads():
            row = await leader_row(pool, settings)
            return row if row is not None and row["holder"] == "c1" else None

        first = await eventually(c1_leads, timeout=60, interval=0.2, what="c1 leading")
        procs["c2"] = spawn_control(settings, "c2", ports[1], tmp_path / "c2.log")
        agent = AgentProcess(settings, nodes, backend="simulated")
        await agent.start()
        http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=create_app(settings, pool=pool, temporal_client=client)),
            base_url="http://api",
            timeout=30,
        )
        stack = Stack(settings, pool, client, http, nodes, agent, [])
        long_jobs = [
            await stack.submit(command=[PY, "-c", "import time; time.sleep(8)"], replicas=2, gpus_per_replica=8),
            await stack.submit(command=[PY, "-c", "import time; time.sleep(8)"]),
        ]
        for j in long_jobs:
            await stack.wait_state(j, "RUNNING", timeout=60)
        killed_at = time.monotonic()
        procs["c1"].send_signal(signal.SIGKILL)
        procs["c1"].wait()

        async def c2_leads():
            row = await leader_row(pool, settings)
            return row if row is not None and row["holder"] == "c2" else None

        second = await eventually(c2_leads, timeout=45, interval=0.2, what="c2 taking over")
        took = time.monotonic() - killed_at
        assert second["epoch"] > first["epoch"]
        assert took < 30, f"takeover took {took:.1f}s"
        # the old leader's epoch can no longer write
        stale = await stack.submit(
            command=[PY, "-c", "pass"], priority_class="preemptible", replicas=1, gpus_per_replica=1
        )
        with pytest.raises(errors.StaleEpoch):
            await allocations.commit_gang(
                pool,
                scope=settings.leader_scope,
                epoch=first["epoch"],
                job_id=stale,
                attempt=1,
                placements=[allocations.GangPlacement(0, nodes[3], (7,), False)],
            )
        # jobs that ran through the failover finish; new ones are placed by the new leader
        after = await stack.submit(command=[PY, "-c", "pass"])
        for j in [*long_jobs, after, stale]:
            await stack.wait_state(j, "SUCCEEDED", timeout=60)
        alloc = next(a for a in await stack.audit(after) if a["action"] == "allocate")
        assert alloc["detail"]["epoch"] == second["epoch"] and alloc["actor"] == "placement:c2"
        await assert_no_gpu_had_two_live_leases(pool)
        assert await pool.fetchval("SELECT count(*) FROM allocations") == 0
    finally:
        if http is not None:
            await http.aclose()
        if agent is not None:
            await agent.stop()
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                await asyncio.to_thread(p.wait, 20)
            except subprocess.TimeoutExpired:
                p.kill()
        kill_ranks(settings.state_dir)
