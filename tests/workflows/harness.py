"""A JobWorkflow test stand: a control worker, a fake node agent, and hand-made allocations.

Placement is played by the test (``Stand.allocate`` commits a gang under the
leader's epoch with the real store and signals it the way the cycle does), so
these tests pin the job lifecycle down independently of the placement engine.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
from temporalio.client import Client

from common.settings import Settings
from control.leader import signals
from control.leader.cycle import PlacementCycles
from control.leader.state import LeaderState
from store import allocations, audit, job_states, leadership
from store.allocations import GangPlacement
from store.seed import ensure_cluster
from store.teams import TeamQuota, set_quota
from tests.support import eventually
from workflows import messages as m

TRAIN = str(Path(__file__).resolve().parents[1] / "e2e" / "train.py")
PY = sys.executable


def scaled_settings(tmp: Path, **overrides: Any) -> Settings:
    uid = uuid.uuid4().hex[:8]
    base = dict(
        state_dir=tmp,
        control_task_queue=f"ctl-{uid}",
        agent_task_queue_mode="shared",
        agent_shared_task_queue=f"nodes-{uid}",
        agent_task_queue_prefix=f"n-{uid}-",
        leader_scope=f"placement-{uid}",
        gang_start_timeout_s=6.0,
        default_grace_s=3.0,
        borrowed_restart_backoff_s=2.0,  # scaled like the grace: 1,800 s by default
        start_task_timeout_s=5.0,
        stop_margin_s=3.0,
        allocation_resignal_s=1.0,
        placement_cycle_s=0.2,
        leader_renew_s=0.5,
        leader_ttl_s=2.0,
        # the control plane in one process (tests/e2e/test_job_worker_children.py runs children)
        control_job_workers=0,
    )
    base.update(overrides)
    return Settings(**base)


@dataclass
class Stand:
    pool: asyncpg.Pool
    client: Client
    settings: Settings
    agent: Any
    epoch: int
    nodes: list[str]
    node_worker: Any = None  # the agent's activity worker: shut down, no node picks up a task

    async def submit(
        self,
        job_id: str,
        *,
        command: list[str] | None = None,
        image: str = "registry/test:1",
        team: str = "alpha",
        priority_class: str = "research",
        replicas: int = 1,
        gpus_per_replica: int = 1,
        max_runtime_s: float = 3600.0,
        grace_s: float | None = None,
        preemptible: bool = True,
        start: bool = True,
        gpu_type: str = "h100",
    ) -> str:
        spec = {
            "image": image,
            "command": command or [PY, "-c", "pass"],
            "checkpoint": {"preemptible": preemptible, **({"grace_seconds": grace_s} if grace_s is not None else {})},
            "env": {"TEST": "1"},
        }
        async with self.pool.acquire() as conn:
            async with conn.transaction():
                await conn.execute(
                    "INSERT INTO jobs (job_id, team, priority_class, gpu_type, replicas, gpus_per_replica, spec,"
                    " max_runtime_s, submitted_by) VALUES ($1, $2, $3, $8, $4, $5, $6, $7, 'test')",
                    job_id,
                    team,
                    priority_class,
                    replicas,
                    gpus_per_replica,
                    spec,
                    max_runtime_s,
                    gpu_type,
                )
                await audit.write_job_event(conn, job_id, 1, "submitted", None, "QUEUED", "test", "submitted")
        if start:  # waiting for its allocation, as a re-queued job's next run does
            from workflows.job import JobWorkflow

            await self.client.start_workflow(
                JobWorkflow.run, m.JobInput(job_id=job_id), id=job_id, task_queue=self.settings.control_task_queue
            )
        return job_id

    async def allocate(
        self, job_id: str, *ranks: tuple[str, tuple[int, ...]], attempt: int | None = None
    ) -> m.Allocation:
        if attempt is None:
            attempt = await self.pool.fetchval("SELECT attempt FROM jobs WHERE job_id = $1", job_id)
        placements = [GangPlacement(rank=i, node_id=n, gpu_indices=g, borrowed=False) for i, (n, g) in enumerate(ranks)]
        await allocations.commit_gang(
            self.pool,
            scope=self.settings.leader_scope,
            epoch=self.epoch,
            job_id=job_id,
            attempt=attempt,
            placements=placements,
        )
        alloc = await signals.allocation_for(self.pool, self.settings, job_id, attempt)
        assert alloc is not None
        row = await self.pool.fetchrow("SELECT * FROM jobs WHERE job_id = $1", job_id)
        labels = m.JobLabels(
            row["team"], row["priority_class"], row["gpu_type"], row["replicas"] * row["gpus_per_replica"],
            row["submitted_at"].timestamp(),
        )  # fmt: skip
        await signals.signal_allocation(self.client, self.settings, alloc, labels)  # as the leader does
        return alloc

    async def preempt(self, job_id: str, *, by_job: str | None = None) -> None:
        attempt = await self.pool.fetchval("SELECT attempt FROM jobs WHERE job_id = $1", job_id)
        (o,) = await job_states.mark_preempting_many(
            self.pool,
            scope=self.settings.leader_scope,
            epoch=self.epoch,
            marks=[job_states.PreemptMark(job_id, attempt, "priority", by_job)],
        )
        assert o.applied, o
        await signals.signal_preempt(
            self.client, self.settings, m.PreemptRequest(job_id, attempt, self.epoch, "priority", by_job)
        )

    async def job(self, job_id: str) -> asyncpg.Record:
        return await self.pool.fetchrow("SELECT * FROM jobs WHERE job_id = $1", job_id)

    async def wait_state(
        self, job_id: str, *states: str, timeout: float = 20.0, attempt: int | None = None
    ) -> asyncpg.Record:
        async def probe():
            row = await self.job(job_id)
            if row["state"] in states and (attempt is None or row["attempt"] == attempt):
                return row
            return None

        return await eventually(probe, timeout=timeout, what=f"{job_id} in {states}")

    async def scheduled(self, job_id: str, activity: str, run_id: str | None = None) -> bool:
        """Has the job's workflow (its current run, or ``run_id``) scheduled ``activity``?"""
        async for e in self.client.get_workflow_handle(job_id, run_id=run_id).fetch_history_events():
            if e.HasField("activity_task_scheduled_event_attributes"):
                if e.activity_task_scheduled_event_attributes.activity_type.name == activity:
                    return True
        return False

    async def events(self, job_id: str) -> list[asyncpg.Record]:
        return await self.pool.fetch("SELECT * FROM job_events WHERE job_id = $1 ORDER BY id", job_id)

    async def transitions(self, job_id: str) -> list[tuple[int, str | None, str | None]]:
        return [
            (e["attempt"], e["from_state"], e["to_state"])
            for e in await self.events(job_id)
            if e["to_state"] is not None and e["from_state"] != e["to_state"]
        ]

    async def audit(self, job_id: str) -> list[asyncpg.Record]:
        return await self.pool.fetch("SELECT * FROM audit WHERE subject = $1 ORDER BY id", job_id)

    async def live_gpus(self, job_id: str) -> int:
        return await self.pool.fetchval("SELECT count(*) FROM allocations WHERE job_id = $1", job_id)

    async def result(self, job_id: str, timeout: float = 30.0) -> m.JobResult:
        handle = self.client.get_workflow_handle(job_id, result_type=m.JobResult)
        return await asyncio.wait_for(handle.result(), timeout)


async def seed(pool: asyncpg.Pool, settings: Settings, *, nodes_per_block: int = 4) -> tuple[list[str], int]:
    async with pool.acquire() as conn:
        nodes = await ensure_cluster(
            conn,
            gpu_type="h100",
            blocks=1,
            nodes_per_block=nodes_per_block,
            task_queue_prefix=settings.agent_task_queue_prefix,
        )
        for team in ("alpha", "beta"):
            await set_quota(conn, TeamQuota(team, "h100", 64, 64), actor="test", reason="fixture")
    epoch = await leadership.acquire_leadership(
        pool, scope=settings.leader_scope, holder="test", grpc_addr="-", ttl_s=3600
    )
    assert epoch is not None
    return nodes, epoch


def read_json(path: str | Path) -> dict:
    p = str(path)
    if p.startswith("file://"):
        p = p[len("file://") :]
    return json.loads(Path(p).read_text())


class NoTemporal:
    """Stands in for the Temporal client: every use fails (the leader logs it and re-signals later)."""

    def __getattr__(self, name: str):
        raise RuntimeError(f"no Temporal in this test ({name})")


async def leader_cycles(pool, settings, epoch: int, policy) -> PlacementCycles:
    """The leader's state and cycles without Temporal, taken over under ``epoch``."""
    client = NoTemporal()
    sig = signals.JobSignals(pool, client, settings)  # type: ignore[arg-type]
    state = LeaderState(pool, settings, sig)
    await state.take_over(epoch)
    return PlacementCycles(state, sig, client, policy=policy, actor="placement:test")  # type: ignore[arg-type]
