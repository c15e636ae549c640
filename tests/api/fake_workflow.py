"""A stand-in ``JobWorkflow`` for the API's tests: it speaks the API's contract
(``workflows.messages``: start with JobInput, signal ``cancel``, update ``extend``)
and nothing else, so API tests do not depend on the lifecycle workflow's progress."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from workflows.messages import (
        JOB_WORKFLOW,
        QUERY_STATUS,
        SIGNAL_CANCEL,
        UPDATE_EXTEND,
        CancelRequest,
        ExtendRequest,
        ExtendResult,
        JobInput,
        JobStatus,
    )

MAX_EXTENSION_S = 7200.0


@workflow.defn(name=JOB_WORKFLOW)
class FakeJobWorkflow:
    def __init__(self) -> None:
        self._job_id = ""
        self._cancel: CancelRequest | None = None
        self._extensions = 0

    @workflow.run
    async def run(self, inp: JobInput) -> str:
        self._job_id = inp.job_id
        await workflow.wait_condition(lambda: self._cancel is not None)
        return f"CANCELLED by {self._cancel.actor}: {self._cancel.reason}"

    @workflow.signal(name=SIGNAL_CANCEL)
    def cancel(self, req: CancelRequest) -> None:
        if self._cancel is None:
            self._cancel = req

    @workflow.update(name=UPDATE_EXTEND)
    def extend(self, req: ExtendRequest) -> ExtendResult:
        if req.seconds > MAX_EXTENSION_S:
            return ExtendResult(
                granted=False, code="too_long", message="at most 2h per extension", extensions_used=self._extensions
            )
        self._extensions += 1
        return ExtendResult(
            granted=True,
            code="granted",
            message=f"extended by {req.seconds:.0f}s",
            new_deadline=workflow.now() + timedelta(seconds=req.seconds),
            extensions_used=self._extensions,
        )

    @workflow.query(name=QUERY_STATUS)
    def status(self) -> JobStatus:
        return JobStatus(job_id=self._job_id, state="CANCELLING" if self._cancel else "QUEUED", attempt=1)
