"""Forward agents' TaskStatus reports to job workflows as signals, batched per job.

The heartbeat server (or a test's simulated agent) calls ``submit(status)``; a
background task groups what arrived within ``flush_s`` by job id and sends one
``task_status`` signal (``TaskStatusBatch``) per job. A signal to a finished
workflow is dropped (the job no longer cares); other failures are retried a few
times, then dropped with a warning (the job's own timeouts cover a lost report).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from common.aio import cancel_and_wait
from common.contracts import TaskState, TaskStatus
from workflows.job import JobWorkflow
from workflows.messages import TaskStatusBatch

log = logging.getLogger(__name__)

MAX_BATCH = 500


class TaskStatusForwarder:
    def __init__(self, client: Client, *, flush_s: float = 0.02, concurrency: int = 64) -> None:
        self.client = client
        self.flush_s = flush_s
        self._pending: dict[str, list[TaskStatus]] = defaultdict(list)
        self._wake = asyncio.Event()
        self._sem = asyncio.Semaphore(concurrency)
        self._task: asyncio.Task | None = None
        self._inflight: set[asyncio.Task] = set()
        self.sent = 0
        self.dropped = 0
        self.skipped = 0

    @staticmethod
    def worth_forwarding(status: TaskStatus) -> bool:
        """A plain STARTED report tells the job nothing new (it learns of every start from
        StartTask's result); STARTED with a checkpoint, and every exit, are forwarded."""
        return not (status.state == TaskState.STARTED and not status.checkpoint_uri)

    def submit(self, status: TaskStatus) -> None:
        if not self.worth_forwarding(status):
            self.skipped += 1
            return
        self._pending[status.job_id].append(status)
        self._wake.set()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="task-status-forwarder")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        await self.flush()

    async def flush(self) -> None:
        batches, self._pending = self._pending, defaultdict(list)
        for job_id, statuses in batches.items():
            for i in range(0, len(statuses), MAX_BATCH):
                t = asyncio.create_task(self._send(job_id, statuses[i : i + MAX_BATCH]))
                self._inflight.add(t)
                t.add_done_callback(self._inflight.discard)
        if self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(self.flush_s)  # let a burst of reports for one job gather
            batches, self._pending = self._pending, defaultdict(list)
            for job_id, statuses in batches.items():
                for i in range(0, len(statuses), MAX_BATCH):
                    t = asyncio.create_task(self._send(job_id, statuses[i : i + MAX_BATCH]))
                    self._inflight.add(t)
                    t.add_done_callback(self._inflight.discard)

    async def _send(self, job_id: str, statuses: list[TaskStatus]) -> None:
        async with self._sem:
            for attempt in range(5):
                try:
                    await self.client.get_workflow_handle(job_id).signal(
                        JobWorkflow.task_status, TaskStatusBatch(statuses=statuses)
                    )
                    self.sent += len(statuses)
                    return
                except RPCError as e:
                    if e.status == RPCStatusCode.NOT_FOUND:
                        self.dropped += len(statuses)
                        return  # the job's workflow has finished
                    log.warning("task status for %s not delivered (try %d): %s", job_id, attempt + 1, e)
                    await asyncio.sleep(0.2 * (attempt + 1))
            self.dropped += len(statuses)
