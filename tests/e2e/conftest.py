"""The embedded stack for end-to-end tests: Postgres, the Temporal dev server, a control
process (in-process, or real processes for failover), a simulated fleet of real node
agents (``worker_agent``, simulated NVML, real rank processes under supervisors) and
the REST API (in-process ASGI). Durations are scaled to seconds."""

from __future__ import annotations

import os
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
from temporalio.client import Client

from common.embedded import any_free_port
from common.settings import Principal, Settings
from common.temporal import connect
from store.seed import ensure_cluster
from store.teams import TeamQuota, set_quota
from tests.support import eventually

PY = sys.executable


def fails_only_on(node_id: str) -> list[str]:
    """A rank's command that exits 3 on ``node_id`` only (its work dir names the node) and 0
    elsewhere, as on a node with a fault of its own that no health check sees."""
    return [PY, "-c", f"import os, sys; sys.exit(3 if '/{node_id}/' in os.getcwd() else 0)"]


TRAIN_COUNTER = str(
    Path(__file__).resolve().parents[2] / "worker-agent" / "worker_agent" / "examples" / "train_counter.py"
)
TOKENS = {
    "tok-admin": Principal(name="root", admin=True),
    "tok-alpha": Principal(name="alice", team="alpha"),
    "tok-beta": Principal(name="bob", team="beta"),
}


def e2e_settings(tmp: Path, db_dsn: str, temporal_target: str, **over: Any) -> Settings:
    uid = uuid.uuid4().hex[:8]
    port = any_free_port()
    values: dict[str, Any] = dict(
        state_dir=tmp / "state",
        database_url=db_dsn,
        temporal_address=temporal_target,
        control_task_queue=f"ctl-{uid}",
        agent_task_queue_prefix=f"n-{uid}-",
        agent_shared_task_queue=f"nodes-{uid}",
        leader_scope=f"placement-{uid}",
        control_grpc_host="127.0.0.1",
        control_grpc_port=port,
        control_addresses=[f"127.0.0.1:{port}"],
        api_tokens=TOKENS,
        agent_shared_secret="e2e-secret",
        heartbeat_interval_s=0.5,
        agent_poll_s=0.05,
        agent_fence_grace_s=1.0,
        unconfirmed_kill_s=60.0,
        leader_renew_s=1.0,
        leader_ttl_s=4.0,
        placement_cycle_s=0.5,
        preemption_protect_s=0.0,
        gang_start_timeout_s=20.0,
        default_grace_s=5.0,
        borrowed_restart_backoff_s=2.0,  # scaled like the grace: 1,800 s by default
        start_task_timeout_s=10.0,
        stop_margin_s=3.0,
        allocation_resignal_s=1.0,
        api_temporal_timeout_s=5.0,
        db_pool_max=20,
        # the control plane in one process (tests/e2e/test_job_worker_children.py runs children)
        control_job_workers=0,
    )
    values.update(over)
    return Settings(**values)


async def seed_cluster(
    pool: asyncpg.Pool, settings: Settings, *, blocks: int = 1, nodes_per_block: int = 4
) -> list[str]:
    async with pool.acquire() as conn:
        nodes = await ensure_cluster(
            conn,
            gpu_type="h100",
            blocks=blocks,
            nodes_per_block=nodes_per_block,
            task_queue_prefix=settings.agent_task_queue_prefix,
        )
        total = blocks * nodes_per_block * 8
        for team in ("alpha", "beta"):
            await set_quota(conn, TeamQuota(team, "h100", total // 2, total), actor="test", reason="fixture")
    return nodes


def kill_ranks(state_dir: Path) -> None:
    """Kill every rank and supervisor the agents of this test started (by recorded pid)."""
    from worker_agent import statefiles as sf

    for sup_file in (state_dir / "agent").glob("*/leases/*/" + sf.SUPERVISOR):
        sup = sf.read_json(sup_file) or {}
        for key in ("rank_pgid", "rank_pid"):
            pid = sup.get(key)
            if pid:
                try:
                    os.killpg(pid, signal.SIGKILL) if key == "rank_pgid" else os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        spid = sup.get("supervisor_pid")
        if spid and sf.process_alive(spid, sup.get("supervisor_start")):
            try:
                os.kill(spid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass
class Stack:
    settings: Settings
    pool: asyncpg.Pool
    client: Client
    http: httpx.AsyncClient
    nodes: list[str]
    agent: Any
    controls: list[Any]

    async def submit(self, token: str = "tok-alpha", **over: Any) -> str:
        body = {
            "team": "alpha",
            "priority_class": "research",
            "image": "registry/test:1",
            "command": [PY, "-c", "pass"],
            "gpu_type": "h100",
            "replicas": 1,
            "gpus_per_replica": 1,
            "max_runtime": "1h",
            "checkpoint": {"preemptible": True, "grace_seconds": 5},
        }
        body.update(over)
        r = await self.http.post(
            "/v1/jobs", json=body, headers={"Authorization": f"Bearer {token}", "Idempotency-Key": uuid.uuid4().hex}
        )
        assert r.status_code == 202, r.text
        return r.json()["job_id"]

    async def cancel(self, job_id: str, token: str = "tok-alpha") -> httpx.Response:
        return await self.http.delete(
            f"/v1/jobs/{job_id}",
            params={"reason": "test"},
            headers={"Authorization": f"Bearer {token}", "Idempotency-Key": uuid.uuid4().hex},
        )

    async def extend(self, job_id: str, by: str | int, token: str = "tok-alpha") -> httpx.Response:
        return await self.http.post(
            f"/v1/jobs/{job_id}:extend",
            json={"by": by, "reason": "test"},
            headers={"Authorization": f"Bearer {token}", "Idempotency-Key": uuid.uuid4().hex},
        )

    async def job(self, job_id: str) -> asyncpg.Record:
        return await self.pool.fetchrow("SELECT * FROM jobs WHERE job_id = $1", job_id)

    async def wait_state(self, job_id: str, *states: str, timeout: float = 30.0, attempt: int | None = None):
        async def probe():
            row = await self.job(job_id)
            if row["state"] in states and (attempt is None or row["attempt"] == attempt):
                return row
            return None

        try:
            return await eventually(probe, timeout=timeout, interval=0.1, what=f"{job_id} in {states}")
        except AssertionError as e:
            row = await self.job(job_id)
            events = [
                (r["attempt"], r["event"], r["to_state"], r["reason"])
                for r in await self.pool.fetch("SELECT * FROM job_events WHERE job_id = $1 ORDER BY id", job_id)
            ]
            raise AssertionError(f"{e}; the job is {row['state']} attempt {row['attempt']}; events: {events}") from None

    async def transitions(self, job_id: str) -> list[tuple[int, str | None, str | None]]:
        rows = await self.pool.fetch("SELECT * FROM job_events WHERE job_id = $1 ORDER BY id", job_id)
        return [
            (e["attempt"], e["from_state"], e["to_state"])
            for e in rows
            if e["to_state"] is not None and e["from_state"] != e["to_state"]
        ]

    async def audit(self, job_id: str) -> list[asyncpg.Record]:
        return await self.pool.fetch("SELECT * FROM audit WHERE subject = $1 ORDER BY id", job_id)

    def lease_dir(self, node_id: str, lease_id: str) -> Path:
        return self.settings.state_dir / "agent" / node_id / "leases" / lease_id


@pytest.fixture
def stack_overrides() -> dict:
    return {}


@pytest.fixture
async def stack(pool, db_dsn, temporal_env, tmp_path, stack_overrides):
    """One in-process control process (the leader), real agents for every node, the API."""
    from api.main import create_app
    from control.process import ControlProcess
    from worker_agent.agent import AgentProcess

    target = temporal_env.client.service_client.config.target_host
    over = {k: v for k, v in stack_overrides.items() if not k.startswith("_")}
    settings = e2e_settings(tmp_path, db_dsn, target, **over)
    nodes = await seed_cluster(pool, settings, nodes_per_block=stack_overrides.get("_nodes", 4))
    hosted = nodes[: stack_overrides.get("_agent_nodes", len(nodes))]
    client = await connect(settings)
    control = ControlProcess(settings, holder="c1", pool=pool, client=client)
    await control.start()
    await eventually(lambda: _v(control.is_leader), timeout=10, what="leadership")
    agent = AgentProcess(settings, hosted, backend="simulated")
    await agent.start()
    app = create_app(settings, pool=pool, temporal_client=client)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api", timeout=30)
    try:
        yield Stack(settings, pool, client, http, nodes, agent, [control])
    finally:
        await http.aclose()
        await agent.stop()
        await control.stop()
        kill_ranks(settings.state_dir)


async def _v(x):
    return x
