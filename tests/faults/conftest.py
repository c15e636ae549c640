"""A stack whose Temporal server a test can stop, restart and freeze: the fault paths of issue 19.

The session's shared Temporal (``temporal_env``) cannot go down under one test, so each test
here gets its own dev server (its own port and SQLite file, which survives a restart) beside
the usual pieces: Postgres (a fresh database), one in-process control process, real node
agents on a simulated fleet, the REST API in-process. Durations are scaled to seconds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from common.db import pool_from_settings
from common.embedded import EmbeddedTemporal, any_free_port
from common.temporal import connect
from tests.e2e.conftest import PY, Stack, e2e_settings, kill_ranks, seed_cluster
from tests.faults.silent_link import SilentLink
from tests.support import eventually

pytestmark = pytest.mark.e2e

SLEEP = [PY, "-c", "import time; time.sleep(600)"]


@dataclass
class OutageStack(Stack):
    temporal: EmbeddedTemporal | None = None
    agents: list[Any] | None = None

    def temporal_down(self) -> None:
        assert self.temporal is not None
        self.temporal.stop()

    def temporal_up(self) -> None:
        assert self.temporal is not None
        self.temporal.start()

    def temporal_freeze(self) -> None:
        """Unreachable the way a hung server is: connections open, calls never answer."""
        assert self.temporal is not None and self.temporal.proc is not None
        os.killpg(self.temporal.proc.pid, signal.SIGSTOP)

    def temporal_thaw(self) -> None:
        assert self.temporal is not None and self.temporal.proc is not None
        os.killpg(self.temporal.proc.pid, signal.SIGCONT)

    async def start_agent(self, nodes: list[str]) -> Any:
        from worker_agent.agent import AgentProcess

        agent = AgentProcess(self.settings, nodes, backend="simulated")
        await agent.start()
        assert self.agents is not None
        self.agents.append(agent)
        return agent

    async def stop_agent(self, agent: Any) -> None:
        """The agent process goes away; its ranks (under their supervisors) do not."""
        assert self.agents is not None
        await agent.stop()
        self.agents.remove(agent)

    async def events(self, job_id: str) -> list[tuple[int, str, str | None, str]]:
        rows = await self.pool.fetch("SELECT * FROM job_events WHERE job_id = $1 ORDER BY id", job_id)
        return [(r["attempt"], r["event"], r["to_state"], r["reason"] or "") for r in rows]

    async def submit_until_accepted(self, timeout: float, **over: Any) -> str:
        """A job of 8 GPUs that sleeps, submitted as the CLI does: the same Idempotency-Key on
        every try, until a 202 (a 503 is retried)."""
        body = {
            "team": "alpha", "priority_class": "research", "image": "registry/test:1", "command": SLEEP,
            "gpu_type": "h100", "replicas": 1, "gpus_per_replica": 8, "max_runtime": "1h",
            "checkpoint": {"preemptible": True, "grace_seconds": 5},
        }  # fmt: skip
        body.update(over)
        headers = {"Authorization": "Bearer tok-alpha", "Idempotency-Key": uuid.uuid4().hex}

        async def accepted() -> str | None:
            # waited on, never cancelled: a call stuck on a silent connection does not end when
            # cancelled either, so a hang fails here rather than hanging the test
            call = asyncio.ensure_future(self.http.post("/v1/jobs", json=body, headers=headers))
            done, _ = await asyncio.wait({call}, timeout=timeout)
            assert done, f"the API did not answer a submission in {timeout}s"
            r = call.result()
            assert r.status_code in (202, 503), r.text
            return r.json()["job_id"] if r.status_code == 202 else None

        return await eventually(accepted, timeout=timeout, interval=0.2, what="the submission accepted")

    async def live_leases(self, job_id: str) -> list[Any]:
        return await self.pool.fetch(
            "SELECT * FROM leases WHERE job_id = $1 AND state = 'live' ORDER BY lease_id", job_id
        )


@pytest.fixture
def outage_overrides() -> dict:
    return {}


@pytest.fixture
async def link(db_dsn: str) -> AsyncIterator[SilentLink]:
    """A TCP path to the test's database that can go silent (silent_link.py)."""
    link = SilentLink(db_dsn)
    await link.start()
    yield link
    await link.close()


@pytest.fixture
async def outage_stack(pool, db_dsn, tmp_path: Path, outage_overrides) -> AsyncIterator[OutageStack]:
    server = EmbeddedTemporal(
        tmp_path / "temporal" / "t.db", port=any_free_port(), ui=False, log_file=tmp_path / "t.log"
    )
    server.start()
    try:
        async for stack in _stack_on(server, pool, db_dsn, tmp_path, outage_overrides):
            yield stack
    finally:  # whatever failed on the way up (a CI run once left a server behind)
        if server.proc is not None and server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGCONT)
        server.stop()


async def _stack_on(
    server: EmbeddedTemporal, pool: Any, db_dsn: str, tmp_path: Path, outage_overrides: dict
) -> AsyncIterator[OutageStack]:
    import httpx

    from api.main import create_app
    from control.process import ControlProcess

    over = {k: v for k, v in outage_overrides.items() if not k.startswith("_")}
    values: dict[str, Any] = dict(
        api_temporal_timeout_s=1.0,
        workflow_reconcile_s=2.0,
        report_delivery_poll_s=0.5,
        missing_task_release_s=3.0,
    )
    values.update(over)
    settings = e2e_settings(tmp_path, db_dsn, server.address, **values)
    nodes = await seed_cluster(pool, settings, nodes_per_block=outage_overrides.get("_nodes", 2))
    client: Client = await connect(settings)
    # "_own_pool": the control and the API connect as processes do (``settings.database_url``,
    # the pool's settings); the test's ``pool`` still checks the database directly
    served = await pool_from_settings(settings) if outage_overrides.get("_own_pool") else pool
    control = ControlProcess(settings, holder="c1", pool=served, client=client)
    stack = None
    try:
        await control.start()
        await eventually(lambda: _v(control.is_leader), timeout=10, what="leadership")
        app = create_app(settings, pool=served, temporal_client=client)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api", timeout=30)
        stack = OutageStack(settings, pool, client, http, nodes, None, [control], temporal=server, agents=[])
        groups = outage_overrides.get("_agents", "one for all")
        for n in [[n] for n in nodes] if groups == "one per node" else [nodes]:
            await stack.start_agent(n)
        stack.agent = stack.agents[0] if stack.agents else None
        yield stack
    finally:
        if stack is not None:
            await stack.http.aclose()
            for a in list(stack.agents or []):
                await a.stop()
        await control.stop()
        kill_ranks(settings.state_dir)
        if served is not pool:
            served.terminate()


async def _v(x):
    return x
