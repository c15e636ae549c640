"""The leader's signals to job workflows: allocations and preemptions, delivered at least once.

A signal Temporal accepted is in the workflow's history and cannot be lost; one that
was not accepted (the RPC failed, or this process died before sending it) is re-sent
with a doubling interval until it is, or until the job's state says it is no longer
needed. A new leader re-derives what to send from the store (every STARTING and
PREEMPTING job), so nothing here needs to survive a change of leader.

``signal_allocation`` and ``signal_preempt`` are signal-with-start: a committed gang or a
victim always reaches a workflow. A new job's workflow starts with its allocation (the API
starts none at submit), so its history begins when it was placed; one that failed is
started again. A workflow that completed is not started again (it ends
only when its job has ended: a late re-signal to a finished job is a no-op); one that
failed or was terminated is, since Postgres says the job is still active.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from temporalio.client import Client
from temporalio.common import WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError

from common.settings import Settings
from placement.lifecycle import JobState
from store import allocations, jobs
from store.tx import Db
from workflows import messages as m
from workflows import search_attributes
from workflows.job import JobWorkflow

log = logging.getLogger("gpufleet.control.leader")

MAX_RESIGNAL_S = 60.0
# signals in flight: a burst of concurrent writes overruns the embedded server's single
# SQLite writer (persistence deadlines, then retries seconds later); a few at a time flow
IN_FLIGHT = 8


async def allocation_for(db: Db, settings: Settings, job_id: str, attempt: int) -> m.Allocation | None:
    """The ``allocated`` signal of a committed gang, from its live leases (None: none live)."""
    rows = await allocations.live_gang(db, job_id, attempt)
    return m.allocation_from_leases(job_id, attempt, rows, settings.node_task_queue)


async def start_with_signal(
    client: Client,
    settings: Settings,
    job_id: str,
    signal: str,
    arg: object,
    *,
    reuse: WorkflowIDReusePolicy = WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY,
    labels: m.JobLabels | None = None,
    state: str = JobState.STARTING,
    attempt: int = 1,
) -> bool:
    """Signal the job's workflow, starting it when none runs (signal-with-start). False: its
    workflow completed (the job ended) and is not started again. With ``labels`` a started
    run carries gpufleet's search attributes (registered first: ``ensure_search_attributes``)."""
    try:
        await client.start_workflow(
            JobWorkflow.run,
            m.JobInput(job_id=job_id, labels=labels),
            id=job_id,
            task_queue=settings.control_task_queue,
            id_reuse_policy=reuse,
            start_signal=signal,
            start_signal_args=[arg],
            search_attributes=search_attributes.at_start(labels, state, attempt) if labels is not None else None,
        )
        return True
    except WorkflowAlreadyStartedError:
        return False


async def signal_allocation(
    client: Client, settings: Settings, alloc: m.Allocation, labels: m.JobLabels | None = None
) -> bool:
    """Deliver ``allocated``, starting the workflow if none runs: a new job's workflow starts
    here, its start and allocation in one workflow task. False: the job's workflow has
    completed, nobody will act on it."""
    return await start_with_signal(
        client, settings, alloc.job_id, m.SIGNAL_ALLOCATED, alloc,
        labels=labels, state=JobState.STARTING, attempt=alloc.attempt,
    )  # fmt: skip


async def signal_preempt(
    client: Client, settings: Settings, req: m.PreemptRequest, labels: m.JobLabels | None = None
) -> bool:
    """Deliver ``preempt`` (starting the workflow if none runs: a victim without a workflow
    would hold its GPUs for ever). False: the job's workflow has completed."""
    return await start_with_signal(
        client, settings, req.job_id, m.SIGNAL_PREEMPT, req, labels=labels, state=JobState.PREEMPTING,
        attempt=req.attempt,
    )  # fmt: skip


@dataclass
class _Pending:
    kind: JobState  # STARTING: an allocation; PREEMPTING: a preemption
    attempt: int
    message: m.Allocation | m.PreemptRequest
    due: float  # monotonic
    interval: float


class JobSignals:
    """Allocations and preemptions sent by this leader, kept until Temporal accepts them."""

    def __init__(self, db: Db, client: Client, settings: Settings) -> None:
        self.db = db
        self.client = client
        self.settings = settings
        self.pending: dict[str, _Pending] = {}
        self._sem = asyncio.Semaphore(IN_FLIGHT)
        # jobs with a send queued or on the wire: a re-send waits for its answer, because in a
        # burst the queue for the IN_FLIGHT slots outlasts allocation_resignal_s and re-sending
        # then only doubles the signals (and workflow tasks) a saturated server must take
        self._sending: dict[str, int] = {}  # job id -> sends not yet answered
        self._in_flight: set[asyncio.Task] = set()
        # a job's search-attribute labels, when the namespace has them (ControlProcess sets it)
        self.labels: Callable[[str], m.JobLabels | None] = lambda _job_id: None

    def clear(self) -> None:
        self.pending.clear()

    def send(self, msg: m.Allocation | m.PreemptRequest, now: float) -> None:
        """Send ``msg`` now (in the background) and keep it until Temporal accepts it."""
        kind = JobState.STARTING if isinstance(msg, m.Allocation) else JobState.PREEMPTING
        first = self.settings.allocation_resignal_s
        self.pending[msg.job_id] = _Pending(kind, msg.attempt, msg, now + first, first)
        self._spawn(msg)

    def resend_due(self, now: float) -> int:
        """Re-send what is due (its interval doubling); returns how many."""
        due = [p for job_id, p in self.pending.items() if p.due <= now and job_id not in self._sending]
        for p in due:
            p.interval = min(p.interval * 2, MAX_RESIGNAL_S)
            p.due = now + p.interval
            self._spawn(p.message)
        return len(due)

    def forget(self, job_id: str) -> None:
        self.pending.pop(job_id, None)

    def keep_if(self, job_id: str, state: str, attempt: int) -> bool:
        """Drop what is pending for ``job_id`` unless the job is still in the state (and
        attempt) it was sent for; True when something is still pending."""
        p = self.pending.get(job_id)
        if p is None:
            return False
        if p.kind != state or p.attempt != attempt:
            del self.pending[job_id]
            return False
        return True

    async def adopt(self, job_id: str, state: str, attempt: int, epoch: int, now: float) -> None:
        """Signal a gang or a victim this leader did not signal itself (another leader's
        commit, or a cycle that failed after committing), due at once."""
        first = self.settings.allocation_resignal_s
        if state == JobState.STARTING:
            alloc = await allocation_for(self.db, self.settings, job_id, attempt)
            if alloc is not None:
                self.pending[job_id] = _Pending(JobState.STARTING, attempt, alloc, now, first)
        elif state == JobState.PREEMPTING:
            req = m.PreemptRequest(job_id, attempt, epoch, "preempted (re-signalled)")
            self.pending[job_id] = _Pending(JobState.PREEMPTING, attempt, req, now, first)

    def _spawn(self, msg: m.Allocation | m.PreemptRequest) -> None:
        # the cycle (and the next one) does not wait for Temporal round trips
        self._sending[msg.job_id] = self._sending.get(msg.job_id, 0) + 1
        t = asyncio.create_task(self._signal(msg))
        self._in_flight.add(t)
        t.add_done_callback(self._in_flight.discard)

    async def _signal(self, msg: m.Allocation | m.PreemptRequest) -> None:
        try:
            accepted = await self._send(msg)
        finally:
            left = self._sending.pop(msg.job_id, 1) - 1
            if left:
                self._sending[msg.job_id] = left
            p = self.pending.get(msg.job_id)
            if p is not None and p.message is msg:
                # not accepted: the retry interval counts from this answer, not from the send
                p.due = max(p.due, time.monotonic() + p.interval)
        if not accepted:
            return
        # outside the Temporal slots: a Postgres round trip holds no signal of another job back
        try:
            await jobs.mark_workflow_started(self.db, [msg.job_id])
        except Exception as e:  # informational (GET /v1/jobs/{id}): the next signal marks it
            log.debug("cannot mark %s's workflow started: %s", msg.job_id, e)

    async def _send(self, msg: m.Allocation | m.PreemptRequest) -> bool:
        """One signal-with-start; True once Temporal accepted it (or the workflow had closed)."""
        async with self._sem:
            try:
                labels = self.labels(msg.job_id)
                send = (
                    signal_allocation(self.client, self.settings, msg, labels)
                    if isinstance(msg, m.Allocation)
                    else signal_preempt(self.client, self.settings, msg, labels)
                )
                # bounded: a call that hangs (a frozen server) would hold its slot and, since
                # a job is not re-sent while its send is unanswered, the job for ever
                await asyncio.wait_for(send, self.settings.signal_timeout_s)
            except Exception as e:  # re-sent later
                log.warning("signal to %s failed: %s", msg.job_id, e)
                return False
        # accepted: recorded in the workflow's history (or the workflow has closed), so
        # re-sending would only load a busy server
        p = self.pending.get(msg.job_id)
        if p is not None and p.message is msg:
            del self.pending[msg.job_id]
        return True

    async def close(self) -> None:
        for t in list(self._in_flight):
            t.cancel()
        await asyncio.gather(*self._in_flight, return_exceptions=True)
