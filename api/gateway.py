"""The API's only door to Temporal: start a job workflow, signal cancel, ask to extend.

The client comes from ``common.temporal.connect`` (the one factory), created lazily
and retried after a short pause when Temporal is unreachable, so the API serves
reads (and accepts submits, docs/design.md, Submit) while Temporal is down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from typing import Any, cast

from temporalio.client import (
    Client,
    RPCError,
    RPCTimeoutOrCancelledError,
    WorkflowUpdateFailedError,
    WorkflowUpdateRPCTimeoutOrCancelledError,
)
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCStatusCode

from common.settings import Settings
from common.temporal import connect
from workflows.job import JobWorkflow
from workflows.messages import SIGNAL_CANCEL, CancelRequest, ExtendRequest, ExtendResult, JobInput

log = logging.getLogger("gpufleet.api")

RETRY_CONNECT_AFTER_S = 2.0


class ControlUnavailable(Exception):
    """Temporal could not be reached (or did not answer in time)."""


class WorkflowClosed(Exception):
    """The job's workflow has already finished."""


class WorkflowMissing(Exception):
    """No workflow runs under this job id."""


class UpdateRejected(Exception):
    """The workflow refused the update (validator or handler failure)."""


class TemporalGateway:
    def __init__(self, settings: Settings, client: Client | None = None) -> None:
        self.settings = settings
        self._client = client
        self._retry_at = 0.0
        self._lock: asyncio.Lock | None = None

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self.settings.api_temporal_timeout_s)

    async def client(self) -> Client:
        if self._client is not None:
            return self._client
        if time.monotonic() < self._retry_at:
            raise ControlUnavailable("Temporal was unreachable a moment ago")
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._client is not None:
                return self._client
            try:
                self._client = await asyncio.wait_for(connect(self.settings), self.settings.api_temporal_timeout_s)
            except Exception as e:  # any failure to connect means "unavailable"
                self._retry_at = time.monotonic() + RETRY_CONNECT_AFTER_S
                log.warning("Temporal unreachable: %s", e)
                raise ControlUnavailable(str(e) or type(e).__name__) from e
            return self._client

    async def cancel_job(self, job_id: str, request: CancelRequest) -> None:
        """Signal ``cancel``; signal-with-start, so a job whose workflow was never
        started (Temporal was down at submit) is started and cancelled at once."""
        try:
            await self._start_job_workflow(job_id, start_signal=SIGNAL_CANCEL, start_signal_args=[request])
        except WorkflowAlreadyStartedError as e:
            # a closed workflow cannot be re-started under REJECT_DUPLICATE: the job is finished
            raise WorkflowClosed(job_id) from e

    async def _start_job_workflow(self, job_id: str, **options: Any) -> None:
        """Start (or signal-with-start) the job's workflow; Temporal trouble is ControlUnavailable."""
        client = await self.client()
        try:
            await asyncio.wait_for(
                client.start_workflow(
                    JobWorkflow.run,
                    JobInput(job_id=job_id),
                    id=job_id,
                    task_queue=self.settings.control_task_queue,
                    id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                    rpc_timeout=self.timeout,
                    **options,
                ),
                self.settings.api_temporal_timeout_s + 1,
            )
        except (TimeoutError, RPCError, RPCTimeoutOrCancelledError, OSError) as e:
            raise ControlUnavailable(str(e) or type(e).__name__) from e

    async def extend_job(self, job_id: str, request: ExtendRequest, update_id: str | None = None) -> ExtendResult:
        """Ask the job's workflow for more runtime. ``update_id`` (one per idempotency key):
        Temporal applies an update of a given id once and answers a repeat with the first
        result, so a retry of a request whose API process died after the update (before its
        transaction committed) extends once, not twice."""
        client = await self.client()
        handle = client.get_workflow_handle_for(JobWorkflow.run, job_id)
        try:
            result = await asyncio.wait_for(
                handle.execute_update(JobWorkflow.extend, request, id=update_id, rpc_timeout=self.timeout),
                self.settings.api_temporal_timeout_s + 1,
            )
            # the SDK types an async update's result as its coroutine; the value is the ExtendResult
            return cast(ExtendResult, result)
        except WorkflowUpdateFailedError as e:
            cause = e.cause
            raise UpdateRejected(str(getattr(cause, "message", None) or cause or e)) from e
        except RPCError as e:
            if e.status == RPCStatusCode.NOT_FOUND:
                raise WorkflowMissing(job_id) from e
            if e.status == RPCStatusCode.FAILED_PRECONDITION:
                raise WorkflowClosed(job_id) from e
            raise ControlUnavailable(str(e)) from e
        except (TimeoutError, WorkflowUpdateRPCTimeoutOrCancelledError, RPCTimeoutOrCancelledError, OSError) as e:
            raise ControlUnavailable(str(e) or type(e).__name__) from e
