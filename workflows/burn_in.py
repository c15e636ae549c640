"""BurnInWorkflow: start a node's burn-in test (docs/design.md, Health: cordoned nodes pass burn-in
before returning). Started by the leader's health monitor (workflow id = the burn-in lease id);
it only runs ``start_task`` on the node's task queue — the monitor watches the rank through
heartbeats and its exit report, and judges it."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

from common.contracts import StartTask, StartTaskResult, start_task

BURN_IN_WORKFLOW = "BurnInWorkflow"


@dataclass(frozen=True)
class BurnInInput:
    node_id: str
    lease_id: str
    epoch: int
    task_queue: str
    gpu_indices: list[int]
    command: list[str] = field(default_factory=list)
    start_timeout_s: float = 60.0
    image: str = "burn-in"
    env: dict[str, str] = field(default_factory=dict)


@workflow.defn(name=BURN_IN_WORKFLOW)
class BurnInWorkflow:
    @workflow.run
    async def run(self, inp: BurnInInput) -> StartTaskResult:
        return await workflow.execute_activity(
            start_task,
            StartTask(
                lease_id=inp.lease_id,
                job_id=inp.lease_id,
                attempt=1,
                epoch=inp.epoch,
                node_id=inp.node_id,
                rank=0,
                world_size=1,
                image=inp.image,
                command=list(inp.command),
                gpu_indices=list(inp.gpu_indices),
                master_addr="127.0.0.1",
                master_port=29400,
                env=dict(inp.env),
            ),
            task_queue=inp.task_queue,
            start_to_close_timeout=timedelta(seconds=inp.start_timeout_s),
            schedule_to_close_timeout=timedelta(seconds=3 * inp.start_timeout_s),
            retry_policy=RetryPolicy(initial_interval=timedelta(milliseconds=500), maximum_attempts=3),
        )
