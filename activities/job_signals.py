"""Signals from the control plane to job workflows (allocation, preemption, start).

``signal_allocation`` is a signal-with-start: a committed gang always reaches a
workflow, even one the API never managed to start. Under REJECT_DUPLICATE a
closed workflow is never started again (a closed job workflow = a finished job),
so a late re-signal to a finished job is a harmless no-op.
"""

from __future__ import annotations

import asyncpg
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import WorkflowIDConflictPolicy, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from activities.job_activities import allocation_from_leases
from common.settings import Settings
from workflows import messages as m


async def allocation_for(
    db: asyncpg.Pool | asyncpg.Connection, settings: Settings, job_id: str, attempt: int
) -> m.Allocation | None:
    rows = await db.fetch(
        "SELECT l.lease_id, l.rank, l.node_id, l.gpu_indices, l.epoch, n.task_queue, n.agent_addr"
        " FROM leases l JOIN nodes n USING (node_id)"
        " WHERE l.job_id = $1 AND l.attempt = $2 AND l.state = 'live' ORDER BY l.rank",
        job_id,
        attempt,
    )
    return allocation_from_leases(settings, job_id, attempt, list(rows))


async def signal_allocation(client: Client, settings: Settings, alloc: m.Allocation) -> bool:
    """Deliver ``allocated`` (starting the workflow if it does not exist). False: the
    job's workflow has closed, nobody will act on it."""
    try:
        await client.start_workflow(
            m.JOB_WORKFLOW,
            m.JobInput(job_id=alloc.job_id),
            id=alloc.job_id,
            task_queue=settings.control_task_queue,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            start_signal=m.SIGNAL_ALLOCATED,
            start_signal_args=[alloc],
        )
        return True
    except WorkflowAlreadyStartedError:
        return False


async def signal_preempt(client: Client, req: m.PreemptRequest) -> bool:
    try:
        await client.get_workflow_handle(req.job_id).signal(m.SIGNAL_PREEMPT, req)
        return True
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            return False
        raise


async def start_job_workflow(client: Client, settings: Settings, job_id: str) -> bool:
    """Start a QUEUED job's workflow if it is not running (DESIGN.md, Submit). True when
    a workflow now runs (or ran) for it."""
    try:
        await client.start_workflow(
            m.JOB_WORKFLOW,
            m.JobInput(job_id=job_id),
            id=job_id,
            task_queue=settings.control_task_queue,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
        )
        return True
    except WorkflowAlreadyStartedError:
        return True


async def workflow_running(client: Client, job_id: str) -> bool:
    try:
        desc = await client.get_workflow_handle(job_id).describe()
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            return False
        raise
    return desc.status == WorkflowExecutionStatus.RUNNING


__all__ = [
    "allocation_for",
    "signal_allocation",
    "signal_preempt",
    "start_job_workflow",
    "workflow_running",
]
