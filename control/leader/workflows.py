"""Every active job has a running workflow (docs/design.md, Reports and ownership).

A job's GPUs are held by its live leases; only its workflow releases them. A QUEUED job
needs none: its allocation starts it (signal-with-start, control/leader/signals.py). A
placed job whose workflow failed or was terminated would hold its GPUs for ever. While this
process leads, every ``workflow_reconcile_s``, every placed job (any state but QUEUED and
the final ones) unchanged
  for that long is checked against Temporal's visibility; one with no running workflow
  (confirmed with a describe: visibility lags) gets one, started with what it needs:
  STARTING its allocation, PREEMPTING its preemption, RUNNING and CANCELLING nothing (the
  run adopts the gang or stops it). Postgres decides: a "not found" never means finished.

Each start is audited (``workflow_started``). Temporal calls have timeouts; nothing here
blocks placement or leadership.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.service import RPCError, RPCStatusCode

from common.settings import Settings
from control.leader.signals import allocation_for, start_with_signal
from placement.lifecycle import JobState
from store import jobs
from store.tx import Pool
from workflows import messages as m
from workflows.job import JobWorkflow

log = logging.getLogger("gpufleet.control.leader")

CHECK_EVERY_S = 5.0  # how often a leader looks whether the full check is due
IN_FLIGHT = 8


@dataclass
class ReconcileStats:
    checked: int = 0
    missing: int = 0
    started: int = 0
    errors: int = 0


class WorkflowOwnership:
    def __init__(self, pool: Pool, client: Client, settings: Settings, *, actor: str) -> None:
        self.pool = pool
        self.client = client
        self.settings = settings
        self.actor = actor
        self.last: ReconcileStats | None = None
        self._sem = asyncio.Semaphore(IN_FLIGHT)

    async def run(self, leading: Callable[[], bool]) -> None:
        """While ``leading()``: the full check every ``workflow_reconcile_s``."""
        next_full = time.monotonic() + self.settings.workflow_reconcile_s
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            if not leading():
                next_full = time.monotonic() + self.settings.workflow_reconcile_s
                continue
            try:
                if time.monotonic() >= next_full:
                    next_full = time.monotonic() + self.settings.workflow_reconcile_s
                    self.last = await self.reconcile_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # Postgres or Temporal unreachable: next time
                log.warning("workflow ownership check: %s", e)

    async def running_workflows(self) -> set[str]:
        """Ids of running job workflows, from Temporal's visibility."""
        query = f"WorkflowType = '{m.JOB_WORKFLOW}' AND ExecutionStatus = 'Running'"
        ids: set[str] = set()

        async def collect() -> None:
            async for wf in self.client.list_workflows(query, page_size=1000):
                ids.add(wf.id)

        await asyncio.wait_for(collect(), max(30.0, 3 * self.settings.api_temporal_timeout_s))
        return ids

    async def reconcile_once(self) -> ReconcileStats:
        stats = ReconcileStats()
        active = await jobs.active_jobs(self.pool, unchanged_for_s=self.settings.workflow_reconcile_s)
        # a QUEUED job needs no workflow (its allocation starts one); a requeued one keeps its own
        active = [r for r in active if r["state"] != JobState.QUEUED]
        stats.checked = len(active)
        if not active:
            return stats
        running = await self.running_workflows()
        suspects = [r for r in active if r["job_id"] not in running]
        results = await asyncio.gather(*(self._confirm_and_start(r) for r in suspects), return_exceptions=True)
        for res in results:
            if isinstance(res, BaseException):
                stats.errors += 1
                log.warning("workflow ownership: %s", res)
            elif res is not None:
                stats.missing += 1
                stats.started += int(res)
        if stats.missing:
            log.warning("workflow ownership: %d active job(s) had no running workflow; started %d",
                        stats.missing, stats.started)  # fmt: skip
        return stats

    async def _confirm_and_start(self, row) -> bool | None:
        """None: it has a running workflow after all; else whether one was started."""
        job_id, state, attempt = row["job_id"], row["state"], row["attempt"]
        timeout = self.settings.api_temporal_timeout_s
        async with self._sem:
            try:
                desc = await asyncio.wait_for(self.client.get_workflow_handle(job_id).describe(), timeout)
                if desc.status == WorkflowExecutionStatus.RUNNING:
                    return None
                why = f"its workflow is {desc.status.name.lower() if desc.status else 'closed'}"
            except RPCError as e:
                if e.status != RPCStatusCode.NOT_FOUND:
                    raise
                why = "it has no workflow"
            current = await jobs.get_job(self.pool, job_id)  # Postgres decides, now
            if current is None or current["state"] != state or current["attempt"] != attempt:
                return None  # it moved: whoever moved it owns it
            started = await asyncio.wait_for(self._start(job_id, state, attempt), timeout)
        reason = f"job {state} attempt {attempt} but {why}: workflow started"
        log.warning("job %s: %s", job_id, reason)
        await jobs.audit_workflow_restarted(self.pool, job_id, actor=self.actor, state=state, reason=reason)
        return started

    async def _start(self, job_id: str, state: str, attempt: int) -> bool:
        reuse = WorkflowIDReusePolicy.ALLOW_DUPLICATE  # checked above: Postgres says the job is active
        if state == JobState.STARTING:
            alloc = await allocation_for(self.pool, self.settings, job_id, attempt)
            if alloc is not None:
                return await start_with_signal(
                    self.client, self.settings, job_id, m.SIGNAL_ALLOCATED, alloc, reuse=reuse
                )
        if state == JobState.PREEMPTING:
            req = m.PreemptRequest(job_id, attempt, 0, "preempted (its workflow was restarted)")
            return await start_with_signal(self.client, self.settings, job_id, m.SIGNAL_PREEMPT, req, reuse=reuse)
        await self.client.start_workflow(
            JobWorkflow.run,
            m.JobInput(job_id=job_id),
            id=job_id,
            task_queue=self.settings.control_task_queue,
            id_reuse_policy=reuse,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        )
        return True
