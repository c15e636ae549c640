"""A minimal stand-in for the job workflow: start one rank on its node's queue, wait, stop it.

It drives the agent's activities by name (``start_task``/``stop_task``) exactly as the
real JobWorkflow does, so these tests check the agent without the control plane.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy

with workflow.unsafe.imports_passed_through():
    from common.contracts import StartTask, StartTaskResult, StopTask, StopTaskResult

FAST_RETRY = RetryPolicy(initial_interval=timedelta(seconds=0.2), maximum_interval=timedelta(seconds=1))


@dataclass(frozen=True)
class RankJob:
    task: StartTask
    task_queue: str
    stop_grace_s: float = 2.0
    wait_for_stop: bool = True


@dataclass(frozen=True)
class RankOutcome:
    start: StartTaskResult
    stop: StopTaskResult | None = None


@workflow.defn
class RankWorkflow:
    def __init__(self) -> None:
        self.state = "STARTING"
        self.attempt = 0
        self.pid: int | None = None
        self.stop_requested = False

    @workflow.run
    async def run(self, job: RankJob) -> RankOutcome:
        self.attempt = job.task.attempt
        started = await workflow.execute_activity(
            "start_task", job.task, result_type=StartTaskResult, task_queue=job.task_queue,
            start_to_close_timeout=timedelta(seconds=30), retry_policy=FAST_RETRY,
        )  # fmt: skip
        self.pid = started.pid
        self.state = "RUNNING" if started.accepted else "FAILED"
        if not job.wait_for_stop or not started.accepted:
            return RankOutcome(started)
        await workflow.wait_condition(lambda: self.stop_requested)
        self.state = "PREEMPTING"
        stopped = await workflow.execute_activity(
            "stop_task",
            StopTask(job.task.lease_id, job.task.epoch, job.task.node_id, job.stop_grace_s, "test stop"),
            result_type=StopTaskResult, task_queue=job.task_queue,
            start_to_close_timeout=timedelta(seconds=60), heartbeat_timeout=timedelta(seconds=10),
            retry_policy=FAST_RETRY,
        )  # fmt: skip
        self.state = "STOPPED"
        return RankOutcome(started, stopped)

    @workflow.signal
    def stop(self) -> None:
        self.stop_requested = True

    @workflow.query
    def status(self) -> dict:
        return {"state": self.state, "attempt": self.attempt, "pid": self.pid}
