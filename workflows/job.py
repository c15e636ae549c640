"""JobWorkflow: one job's life (docs/design.md, Job lifecycle). Workflow id = job id.

Orchestration only: every Postgres write is a (local) control activity, every rank
start/stop a short activity on the node's task queue. One run handles one attempt:

    QUEUED --allocated--> STARTING --every rank started--> RUNNING --all exited 0--> SUCCEEDED
    RUNNING --preempt--> PREEMPTING --ranks stopped, checkpoint kept--> QUEUED (attempt + 1)
    STARTING/RUNNING --a rank failed / never started--> QUEUED (attempt + 1, front of class)
                     (or FAILED after max_failed_attempts caused by the job in the window)
    any --cancel--> CANCELLING --ranks stopped--> CANCELLED;  RUNNING --max_runtime--> TIMED_OUT

A new attempt is a continue-as-new (``JobInput(job_id, attempt, resume_from)``); a long
running attempt continues-as-new with its state in ``JobInput.carry``. Signal handlers
are idempotent on (attempt, epoch): the first allocation per attempt wins, stale
reports (older attempt or epoch) are dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TypeVar

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

from common.contracts import (
    StartTask,
    StartTaskResult,
    StopTask,
    StopTaskResult,
    TaskState,
    TaskStatus,
    start_task,
    stop_task,
)
from placement.lifecycle import TERMINAL, JobState, allowed_change
from workflows import activity_interfaces as acts
from workflows import messages as m
from workflows import search_attributes

MAX_IN_FLIGHT = 400  # activities in flight per workflow stay under 500 (docs/design.md)
HISTORY_LIMIT = 3000  # continue-as-new well before ~4,096 events
CHECKPOINTS_KEPT = 32  # per rank: enough to find the newest checkpoint every rank has

A = TypeVar("A")
R = TypeVar("R")

# the control activities are local activities: short Postgres writes, retried
LOCAL_TIMEOUT = timedelta(seconds=15)
LOCAL_RETRY = RetryPolicy(initial_interval=timedelta(milliseconds=200), maximum_interval=timedelta(seconds=5))


class IllegalTransition(RuntimeError):
    """The workflow asked for a job state change that placement.lifecycle's table has no
    edge for: a bug. The workflow task fails (and is retried) rather than write it."""


class _NoUpdate:
    id = ""


_NO_UPDATE = _NoUpdate()

# outcomes that end an attempt without counting against the job; STOPPED here means a stop
# nobody in this workflow asked for (reconciliation, drain): ours happen only while stopping
_INFRA_OUTCOMES = (TaskState.FENCED, TaskState.LOST, TaskState.REJECTED, TaskState.STOPPED)


@dataclass
class _Rank:
    placement: m.RankPlacement
    started: bool = False
    exited: bool = False
    exit_code: int | None = None
    outcome: str = ""
    start_error: str | None = None
    restarts: int = 0
    restarting: bool = False
    restarted_at: datetime | None = None
    checkpoints: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        """Exited badly on its own (not because we stopped it)."""
        if self.start_error is not None:
            return True
        if not self.exited:
            return False
        if self.outcome in _INFRA_OUTCOMES:
            return True
        return self.outcome == TaskState.EXITED and self.exit_code != 0

    @property
    def job_fault(self) -> bool:
        return self.exited and self.outcome == TaskState.EXITED and self.exit_code not in (None, 0)


@dataclass
class _Inbox:
    statuses: list[TaskStatus] = field(default_factory=list)


# Not sandboxed: the sandbox's per-activation module proxies cost about a quarter of the
# job workers' CPU in a submit burst (bench/e2e.py). This module stays deterministic by
# construction (workflow.now(), no I/O, imports only workflows/ and common/contracts, an
# import-linter contract) and the committed histories replay in CI (tests/replay).
@workflow.defn(name=m.JOB_WORKFLOW, sandboxed=False)
class JobWorkflow:
    def __init__(self) -> None:
        self._job_id = ""
        self._snap: m.JobSnapshot | None = None
        self._state: str = JobState.QUEUED
        self._attempt = 0
        self._allocs: dict[int, m.Allocation] = {}
        self._alloc: m.Allocation | None = None
        self._preempts: dict[int, m.PreemptRequest] = {}
        self._cancel: m.CancelRequest | None = None
        self._earlier_success: m.EarlierAttemptSucceeded | None = None
        self._ranks: dict[int, _Rank] = {}
        self._by_lease: dict[str, _Rank] = {}
        self._inbox = _Inbox()
        self._early_node_failures: list[m.NodeFailed] = []  # arrived before the gang was known
        self._checkpoint: str | None = None
        self._running_since: datetime | None = None
        self._deadline: datetime | None = None
        self._extensions_used = 0
        self._stopping = False
        self._start_tasks: list[asyncio.Task] = []
        self._sem = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._labels: m.JobLabels | None = None
        self._shown: tuple[str, int] | None = None  # (state, attempt) in the search attributes

    # ------------------------------------------------------------------ handlers

    @workflow.signal(name=m.SIGNAL_ALLOCATED)
    def allocated(self, alloc: m.Allocation) -> None:
        if alloc.attempt in self._allocs:
            return  # first allocation per attempt wins; re-signals are no-ops
        if self._attempt and alloc.attempt < self._attempt:
            return
        self._allocs[alloc.attempt] = alloc

    @workflow.signal(name=m.SIGNAL_PREEMPT)
    def preempt(self, req: m.PreemptRequest) -> None:
        if self._attempt and req.attempt < self._attempt:
            return
        self._preempts.setdefault(req.attempt, req)

    @workflow.signal(name=m.SIGNAL_CANCEL)
    def cancel(self, req: m.CancelRequest) -> None:
        if self._cancel is None:
            self._cancel = req

    @workflow.signal(name=m.SIGNAL_EARLIER_SUCCESS)
    def earlier_attempt_succeeded(self, req: m.EarlierAttemptSucceeded) -> None:
        # this attempt's too: delivery sends it only when every rank's exit 0 is on record, and
        # the run may be ending the attempt for another reason (it would re-queue the work)
        if self._earlier_success is None and (not self._attempt or req.attempt <= self._attempt):
            self._earlier_success = req

    @workflow.signal(name=m.SIGNAL_TASK_STATUS)
    def task_status(self, batch: m.TaskStatusBatch) -> None:
        self._inbox.statuses.extend(batch.statuses)
        self._drain_statuses()

    @workflow.signal(name=m.SIGNAL_NODE_FAILED)
    def node_failed(self, req: m.NodeFailed) -> None:
        if not self._ranks:
            # a signal-with-start (the job had no workflow): applied once the gang is known
            self._early_node_failures.append(req)
            return
        if req.attempt != self._attempt:
            return
        failed = {req.node_id, *req.more_nodes}  # more_nodes: empty in signals sent before it
        for r in self._ranks.values():
            if r.placement.node_id in failed and not r.exited:
                r.exited, r.outcome, r.start_error = True, TaskState.LOST, None
                r.restarting = False

    @workflow.query(name=m.QUERY_STATUS)
    def status(self) -> m.JobStatus:
        return m.JobStatus(
            job_id=self._job_id,
            state=self._state,
            attempt=self._attempt,
            epoch=self._alloc.epoch if self._alloc else None,
            ranks_started=sum(1 for r in self._ranks.values() if r.started),
            ranks_total=len(self._ranks) or (self._snap.replicas if self._snap else 0),
            deadline=self._deadline,
            leases=[r.placement.lease_id for r in self._ranks.values()],
            checkpoint=self._checkpoint,
        )

    @workflow.update(name=m.UPDATE_EXTEND)
    async def extend(self, req: m.ExtendRequest) -> m.ExtendResult:
        if self._state != JobState.RUNNING or self._stopping or self._running_since is None:
            return m.ExtendResult(
                granted=False,
                code="not_running",
                message=f"job is {self._state}" + (" and stopping" if self._stopping else ""),
                extensions_used=self._extensions_used,
            )
        result: m.ExtendResult = await workflow.execute_local_activity(
            acts.extend_job,
            m.ExtendJob(
                job_id=self._job_id,
                attempt=self._attempt,
                seconds=req.seconds,
                actor=req.actor,
                reason=req.reason,
                running_since=self._running_since,
                request_id=(workflow.current_update_info() or _NO_UPDATE).id,
            ),
            start_to_close_timeout=LOCAL_TIMEOUT,
            retry_policy=LOCAL_RETRY,
        )
        self._extensions_used = result.extensions_used
        if result.granted and result.new_deadline is not None:
            self._deadline = result.new_deadline
        return result

    @extend.validator
    def _validate_extend(self, req: m.ExtendRequest) -> None:
        if not (req.seconds > 0 and req.seconds < 1e9):
            raise ValueError("seconds must be a positive number")

    # ------------------------------------------------------------------ main

    @workflow.run
    async def run(self, inp: m.JobInput) -> m.JobResult:
        self._job_id = inp.job_id
        self._attempt = inp.attempt
        self._labels = inp.labels
        if inp.labels is not None:  # what the starter (or the previous run) set
            sa = workflow.info().typed_search_attributes
            shown_state, shown_attempt = sa.get(search_attributes.STATE), sa.get(search_attributes.ATTEMPT)
            if shown_state is not None and shown_attempt is not None:
                self._shown = (shown_state, shown_attempt)
        if inp.cancel is not None and self._cancel is None:
            self._cancel = inp.cancel
        if inp.earlier_success is not None and self._earlier_success is None:
            self._earlier_success = inp.earlier_success
        if inp.allocation is not None:
            self._allocs.setdefault(inp.allocation.attempt, inp.allocation)
        if inp.carry is not None:  # answer queries sensibly while the snapshot loads
            self._state = JobState.RUNNING
            self._restore(inp.carry)
        snap = await self._local(acts.load_job, m.LoadJob(inp.job_id))
        self._snap = snap
        if not snap.exists:
            return m.JobResult(inp.job_id, "UNKNOWN", inp.attempt, reason="no such job")
        self._attempt = snap.attempt
        self._state = snap.state
        self._extensions_used = snap.extensions
        if snap.state in TERMINAL:
            return m.JobResult(inp.job_id, snap.state, snap.attempt, reason="already finished")
        self._show(snap.state)
        # drop anything that arrived for an older attempt before we knew ours
        if self._earlier_success is not None and self._earlier_success.attempt > self._attempt:
            self._earlier_success = None
        self._allocs = {a: x for a, x in self._allocs.items() if a >= self._attempt}
        self._preempts = {a: x for a, x in self._preempts.items() if a >= self._attempt}

        carry = inp.carry
        if (
            carry is not None
            and carry.attempt == snap.attempt
            and snap.state in (JobState.RUNNING, JobState.PREEMPTING, JobState.CANCELLING)
        ):
            return await self._supervise()  # restored above

        if snap.allocation is not None:
            self._allocs.setdefault(self._attempt, snap.allocation)
        if snap.state in (JobState.QUEUED, JobState.STARTING):
            await workflow.wait_condition(
                lambda: (
                    self._cancel is not None
                    or self._attempt in self._allocs
                    or self._attempt in self._preempts
                    or self._earlier_done()
                )
            )
            if self._earlier_done():
                return await self._finish_earlier_success()
            if self._attempt not in self._allocs:
                if self._cancel is not None:
                    return await self._finish(JobState.CANCELLED, self._cancel.reason, actor=self._cancel.actor)
                return await self._requeue("preempted", "preempted before its gang started", job_fault=False)
            return await self._start_gang()
        # A run that finds the job RUNNING / PREEMPTING / CANCELLING without its state
        # (the workflow was restarted by an operator): stop the gang and end the attempt.
        if snap.allocation is not None:
            self._begin(snap.allocation, assume_started=True)
        if snap.state == JobState.CANCELLING or self._cancel is not None:
            return await self._cancel_active()
        if snap.state == JobState.PREEMPTING:
            return await self._preempt()
        if snap.allocation is not None and workflow.patched("adopt-running-attempt"):
            # the job is RUNNING but had no workflow (it was never started, or it failed): keep
            # the gang running and supervise it; its reports may be waiting in the inbox
            return await self._adopt_running()
        return await self._fail_attempt("the job workflow was restarted mid-attempt", job_fault=False)

    # ------------------------------------------------------------------ phases

    async def _adopt_running(self) -> m.JobResult:
        snap = self._require_snap()
        self._state = JobState.RUNNING
        self._show(JobState.RUNNING)
        self._running_since = snap.started_at or workflow.now()
        self._deadline = self._running_since + timedelta(seconds=snap.max_runtime_s)
        self._checkpoint = snap.last_checkpoint
        workflow.logger.warning("job %s: adopted its running attempt %d", self._job_id, self._attempt)
        return await self._supervise()

    async def _start_gang(self) -> m.JobResult:
        snap = self._require_snap()
        alloc = self._allocs[self._attempt]
        self._begin(alloc)
        self._state = JobState.STARTING
        deadline = workflow.now() + timedelta(seconds=snap.gang_start_timeout_s)
        # The gang start timeout is carried by each StartTask's schedule-to-close (no timer:
        # one timer less per job in history and on the server). New snapshots say so, which
        # spares new runs the patch marker and its search-attribute upsert (a visibility
        # write per job); runs recorded before take the patched() path they recorded.
        no_timer = snap.gang_timeout_in_start or workflow.patched("gang-timeout-in-start-activities")
        for r in self._ranks.values():
            self._start_tasks.append(asyncio.create_task(self._start_rank(r, deadline if no_timer else None)))
        timed_out = False
        try:
            await workflow.wait_condition(
                lambda: (
                    self._cancel is not None
                    or self._attempt in self._preempts
                    or self._any_failed()
                    or self._all_started()
                    or self._earlier_done()
                ),
                timeout=None if no_timer else timedelta(seconds=snap.gang_start_timeout_s),
            )
        except TimeoutError:
            timed_out = True
        if self._cancel is not None:
            return await self._cancel_active()
        if self._earlier_done():
            return await self._finish_earlier_success()
        if self._attempt in self._preempts:
            return await self._preempt()
        if timed_out or self._any_failed():
            reason, fault = self._failure_reason(timed_out)
            return await self._fail_attempt(reason, job_fault=fault)

        self._expect(JobState.RUNNING)
        res = await self._local(
            acts.mark_running,
            m.JobTransition(self._job_id, self._attempt, JobState.RUNNING, "every rank started", epoch=alloc.epoch),
        )
        if res.state == JobState.PREEMPTING:
            return await self._preempt()
        if res.state != JobState.RUNNING:
            # e.g. the job was ended behind our back: make sure nothing keeps running
            await self._stop_all("job is " + res.state)
            self._show(res.state)
            return m.JobResult(self._job_id, res.state, res.attempt, reason="state changed during start")
        self._state = JobState.RUNNING
        self._show(JobState.RUNNING)
        self._running_since = workflow.now()
        self._deadline = self._running_since + timedelta(seconds=snap.max_runtime_s)
        return await self._supervise()

    async def _supervise(self) -> m.JobResult:
        snap = self._require_snap()
        serving = snap.priority_class == "prod-serving"
        self._state = JobState.RUNNING if self._state not in (JobState.PREEMPTING, JobState.CANCELLING) else self._state
        if self._state == JobState.CANCELLING:
            return await self._cancel_active()
        if self._state == JobState.PREEMPTING:
            return await self._preempt()
        while True:
            assert self._deadline is not None
            deadline = self._deadline
            remaining = (deadline - workflow.now()).total_seconds()
            if remaining <= 0:
                return await self._time_out()
            try:
                await workflow.wait_condition(
                    functools.partial(self._supervision_wakes, deadline), timeout=timedelta(seconds=remaining)
                )
            except TimeoutError:
                continue
            if self._cancel is not None:
                return await self._cancel_active()
            if self._earlier_done():
                return await self._finish_earlier_success()
            if self._attempt in self._preempts:
                return await self._preempt()
            if serving and self._crashed_replicas():
                self._restart_failed_replicas()
                continue
            if self._any_failed():
                reason, fault = self._failure_reason(False)
                return await self._fail_attempt(reason, job_fault=fault)
            if self._all_exited():
                if all(r.exit_code == 0 for r in self._ranks.values()):
                    return await self._finish(JobState.SUCCEEDED, "every rank exited 0", exit_code=0)
                reason, fault = self._failure_reason(False)
                return await self._fail_attempt(reason, job_fault=fault)
            if self._history_long() and not any(r.restarting for r in self._ranks.values()):
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(
                    m.JobInput(
                        self._job_id,
                        self._attempt,
                        snap.last_checkpoint,
                        carry=self._carry(),
                        cancel=self._cancel,
                        labels=self._labels,
                    )
                )

    async def _preempt(self) -> m.JobResult:
        self._expect(JobState.PREEMPTING)  # the leader marked it so (or it already was)
        self._state = JobState.PREEMPTING
        self._show(JobState.PREEMPTING)
        req = self._preempts.get(self._attempt)
        await self._stop_all(req.reason if req else "preempted")
        if self._cancel is not None:
            return await self._finish(JobState.CANCELLED, self._cancel.reason, actor=self._cancel.actor)
        if self._all_exited_ok() and workflow.patched("preempted-after-finishing"):
            # every rank had ended by itself with 0 before the stop reached it: the work is
            # done, a re-queue would run it again (a rank the stop ended is STOPPED, whatever
            # its code: the job helper exits 143 after its preemption checkpoint)
            return await self._finish(JobState.SUCCEEDED, "finished during its grace period", exit_code=0)
        return await self._requeue(
            "preempted", req.reason if req else "preempted", job_fault=False, epoch=req.epoch if req else None
        )

    def _earlier_done(self) -> bool:
        return self._earlier_success is not None and self._cancel is None

    async def _finish_earlier_success(self) -> m.JobResult:
        """Attempt N (recovered from a silent node) had finished: stop this attempt, succeed."""
        req = self._earlier_success
        assert req is not None
        reason = req.reason or f"attempt {req.attempt} had exited 0 on every rank (its reports came late)"
        if self._ranks:
            await self._stop_all(reason)
        return await self._finish(JobState.SUCCEEDED, reason, exit_code=0)

    async def _fail_attempt(self, reason: str, *, job_fault: bool) -> m.JobResult:
        workflow.logger.info("job %s attempt %d failed: %s", self._job_id, self._attempt, reason)
        await self._stop_all("attempt failed: " + reason)
        if self._cancel is not None:
            return await self._finish(JobState.CANCELLED, self._cancel.reason, actor=self._cancel.actor)
        return await self._requeue("failed", reason, job_fault=job_fault)

    async def _cancel_active(self) -> m.JobResult:
        req = self._cancel or m.CancelRequest(actor="system", reason="cancelled")
        if self._state != JobState.CANCELLING:
            self._expect(JobState.CANCELLING)
            await self._local(
                acts.mark_cancelling,
                m.JobTransition(self._job_id, self._attempt, JobState.CANCELLING, req.reason, actor=req.actor),
            )
            self._state = JobState.CANCELLING
        self._show(JobState.CANCELLING)
        await self._stop_all("cancelled: " + req.reason)
        return await self._finish(JobState.CANCELLED, req.reason, actor=req.actor)

    async def _time_out(self) -> m.JobResult:
        await self._stop_all("max_runtime reached")
        return await self._finish(JobState.TIMED_OUT, "max_runtime reached")

    # ------------------------------------------------------------------ ranks

    def _begin(self, alloc: m.Allocation, *, assume_started: bool = False) -> None:
        self._alloc = alloc
        self._ranks = {p.rank: _Rank(p, started=assume_started) for p in alloc.ranks}
        self._by_lease = {p.lease_id: self._ranks[p.rank] for p in alloc.ranks}
        self._drain_statuses()
        early, self._early_node_failures = self._early_node_failures, []
        if early and workflow.patched("apply-early-node-failures"):
            for req in early:
                self.node_failed(req)

    def _restore(self, carry: m.RunCarry) -> None:
        self._begin(carry.allocation)
        for rc in carry.ranks:
            r = self._ranks[rc.rank]
            r.started, r.exited, r.exit_code, r.outcome, r.restarts = (
                rc.started,
                rc.exited,
                rc.exit_code,
                rc.outcome,
                rc.restarts,
            )
            r.checkpoints = list(rc.checkpoints)
        self._running_since = carry.running_since
        self._deadline = carry.deadline
        self._checkpoint = carry.checkpoint
        self._drain_statuses()

    def _carry(self) -> m.RunCarry:
        assert self._alloc is not None and self._running_since is not None and self._deadline is not None
        return m.RunCarry(
            attempt=self._attempt,
            allocation=dataclasses.replace(self._alloc, ranks=[self._ranks[k].placement for k in sorted(self._ranks)]),
            running_since=self._running_since,
            deadline=self._deadline,
            ranks=[
                m.RankCarry(
                    r.placement.rank, r.started, r.exited, r.exit_code, str(r.outcome), r.restarts, r.checkpoints[-4:]
                )
                for r in self._ranks.values()
            ],
            checkpoint=self._checkpoint,
        )

    def _start_request(self, r: _Rank) -> StartTask:
        snap = self._require_snap()
        alloc = self._alloc
        assert alloc is not None
        env = dict(snap.env)
        if r.restarts:
            env["GPUFLEET_RESTART"] = str(r.restarts)
        return StartTask(
            lease_id=r.placement.lease_id,
            job_id=self._job_id,
            attempt=self._attempt,
            epoch=alloc.epoch,
            node_id=r.placement.node_id,
            rank=r.placement.rank,
            world_size=len(alloc.ranks),
            image=snap.image,
            command=list(snap.command),
            gpu_indices=list(r.placement.gpu_indices),
            master_addr=alloc.master_addr,
            master_port=alloc.master_port,
            env=env,
            checkpoint_dir=snap.checkpoint_dir,
            resume_from=self._checkpoint or snap.last_checkpoint,
            team=snap.team,
            team_rank_id=snap.team_rank_id,
            job_rank_id=snap.job_rank_id,
        )

    async def _start_rank(self, r: _Rank, deadline: datetime | None = None) -> None:
        snap = self._require_snap()
        async with self._sem:
            if self._stopping or r.exited:
                return
            budget = snap.gang_start_timeout_s
            if deadline is not None:
                budget = (deadline - workflow.now()).total_seconds()
                if budget <= 0:
                    r.start_error = "not started within the gang start timeout"
                    return
            try:
                res: StartTaskResult = await workflow.execute_activity(
                    start_task,
                    self._start_request(r),
                    task_queue=r.placement.task_queue,
                    start_to_close_timeout=timedelta(seconds=snap.start_task_timeout_s),
                    schedule_to_close_timeout=timedelta(seconds=budget),
                    retry_policy=RetryPolicy(
                        initial_interval=timedelta(milliseconds=500), maximum_interval=timedelta(seconds=10)
                    ),
                )
            except ActivityError as e:
                if not self._stopping:
                    r.start_error = f"start on {r.placement.node_id} failed: {e.cause or e}"
                return
        if res.accepted:
            r.started = True
        elif not self._stopping:
            r.start_error = f"start on {r.placement.node_id} refused: {res.reason or 'rejected'}"

    async def _stop_rank(self, r: _Rank, reason: str, grace: float) -> None:
        snap = self._require_snap()
        # A rank never seen started may sit on a silent node: do not wait long for its agent.
        pickup = snap.start_task_timeout_s if r.started else min(5.0, snap.start_task_timeout_s)
        async with self._sem:
            lost_skip = workflow.patched("stop-skips-lost-ranks")
            if lost_skip and r.outcome == TaskState.LOST:
                return  # its node failed while this stop waited for a slot: no agent will take it
            act = workflow.start_activity(
                stop_task,
                StopTask(
                    lease_id=r.placement.lease_id,
                    epoch=self._alloc.epoch if self._alloc else 0,
                    node_id=r.placement.node_id,
                    grace_seconds=grace,
                    reason=reason,
                ),
                task_queue=r.placement.task_queue,
                schedule_to_start_timeout=timedelta(seconds=pickup),
                start_to_close_timeout=timedelta(seconds=grace + snap.start_task_timeout_s),
                schedule_to_close_timeout=timedelta(seconds=grace + 3 * snap.start_task_timeout_s),
                retry_policy=RetryPolicy(
                    initial_interval=timedelta(milliseconds=500),
                    maximum_interval=timedelta(seconds=5),
                    maximum_attempts=3,
                ),
            )
            if lost_skip:
                # The rank's node is declared failed (``node_failed``) while the stop waits: its
                # agent will not pick the stop up, and waiting out the pickup timeout only delays
                # the gang's restart. The leases are released with the attempt; an agent that
                # comes back kills every rank whose lease it cannot confirm (worker_agent).
                await workflow.wait_condition(lambda: act.done() or r.outcome == TaskState.LOST)
                if not act.done():
                    act.cancel()
                    try:
                        await act
                    except (ActivityError, asyncio.CancelledError):
                        pass
                    return
            try:
                res: StopTaskResult = await act
            except ActivityError as e:
                workflow.logger.warning("stop of %s failed: %s", r.placement.lease_id, e.cause or e)
                return
        if res.checkpoint_uri:
            self._note_checkpoint(r.placement.rank, res.checkpoint_uri)
        if r.exited:
            return
        if res.exit_code is not None:
            outcome = TaskState.STOPPED
            if res.state == TaskState.EXITED.value and workflow.patched("stop-result-says-exited"):
                outcome = TaskState.EXITED  # it had ended by itself: its exit report is on its way
            r.exited, r.exit_code, r.outcome = True, res.exit_code, outcome
        elif not res.accepted or res.reason.startswith("unknown lease"):
            # the agent holds no such task (never started, or long gone): nothing to wait for
            r.exited, r.outcome = True, TaskState.STOPPED

    async def _stop_all(self, reason: str) -> None:
        """Stop every rank not known to have exited: SIGTERM, the grace period to
        checkpoint, SIGKILL at its end (the agent's part); then wait for the exit reports."""
        snap = self._require_snap()
        self._stopping = True
        for t in self._start_tasks:
            if not t.done():
                t.cancel()
        if self._start_tasks:
            await asyncio.gather(*self._start_tasks, return_exceptions=True)
        grace = snap.grace_s
        targets = [r for r in self._ranks.values() if not r.exited]
        if not targets:
            return
        await asyncio.gather(*(self._stop_rank(r, reason, grace) for r in targets))
        try:
            await workflow.wait_condition(
                lambda: all(r.exited for r in targets), timeout=timedelta(seconds=grace + snap.stop_margin_s)
            )
        except TimeoutError:
            workflow.logger.warning(
                "job %s: %d rank(s) sent no exit report after their stop",
                self._job_id,
                sum(1 for r in targets if not r.exited),
            )

    def _restart_failed_replicas(self) -> None:
        """prod-serving: a failed replica restarts alone (the others keep serving)."""
        for r in self._ranks.values():
            if r.job_fault and not r.restarting:
                r.restarts += 1
                r.restarting = True
                r.started = False
                r.exited = False
                r.exit_code = None
                r.outcome = ""
                r.start_error = None
                r.restarted_at = workflow.now()
                self._start_tasks = [t for t in self._start_tasks if not t.done()]
                self._start_tasks.append(asyncio.create_task(self._restart_rank(r)))

    async def _restart_rank(self, r: _Rank) -> None:
        try:
            res = await self._local(
                acts.restart_replica,
                m.RestartReplica(
                    self._job_id,
                    self._attempt,
                    r.placement.rank,
                    r.placement.lease_id,
                    f"replica {r.placement.rank} failed; restart {r.restarts}",
                ),
            )
            if not res.ok or res.placement is None:
                r.start_error = "the replica's lease is gone"
                return
            self._by_lease.pop(r.placement.lease_id, None)
            r.placement = res.placement
            self._by_lease[r.placement.lease_id] = r
            self._drain_statuses()
            await self._start_rank(r, workflow.now() + timedelta(seconds=self._require_snap().gang_start_timeout_s))
        finally:
            r.restarting = False

    # ------------------------------------------------------------------ status reports

    def _drain_statuses(self) -> None:
        keep: list[TaskStatus] = []
        for s in self._inbox.statuses:
            if self._attempt and s.attempt < self._attempt:
                continue  # a report about an earlier attempt
            r = self._by_lease.get(s.lease_id)
            if r is None or s.attempt != self._attempt:
                if not self._attempt or s.attempt >= self._attempt:
                    keep.append(s)  # for an allocation we have not seen yet
                continue
            if self._alloc is not None and s.epoch < self._alloc.epoch:
                continue  # stale epoch
            self._apply_status(r, s)
        self._inbox.statuses = keep[-1000:]

    def _apply_status(self, r: _Rank, s: TaskStatus) -> None:
        if s.checkpoint_uri:
            self._note_checkpoint(r.placement.rank, s.checkpoint_uri)
        state = TaskState(s.state)
        if state == TaskState.STARTED:
            if not r.exited:
                r.started = True
            return
        if r.exited:
            return
        r.started = r.started or state == TaskState.EXITED
        r.exited = True
        r.exit_code = s.exit_code
        r.outcome = state

    def _note_checkpoint(self, rank: int, uri: str) -> None:
        """The job's checkpoint is the newest one *every* rank reported (ranks stop at
        slightly different steps; resuming needs a step all of them saved). Ranks report
        the same URI for one gang checkpoint (``worker_agent.jobhelper``: the step dir)."""
        r = self._ranks.get(rank)
        if r is None:
            return
        if not r.checkpoints or r.checkpoints[-1] != uri:
            r.checkpoints.append(uri)
            del r.checkpoints[:-CHECKPOINTS_KEPT]
        ranks = [self._ranks[k] for k in sorted(self._ranks)]
        others = [set(x.checkpoints) for x in ranks[1:]]
        for candidate in reversed(ranks[0].checkpoints):
            if all(candidate in o for o in others):
                self._checkpoint = candidate
                return

    # ------------------------------------------------------------------ predicates

    def _all_started(self) -> bool:
        return bool(self._ranks) and all(r.started for r in self._ranks.values())

    def _all_exited(self) -> bool:
        return bool(self._ranks) and all(r.exited for r in self._ranks.values())

    def _all_exited_ok(self) -> bool:
        """Every rank ended by itself (not by a stop) with exit code 0."""
        return bool(self._ranks) and all(
            r.exited and r.outcome == TaskState.EXITED and r.exit_code == 0 for r in self._ranks.values()
        )

    def _any_failed(self) -> bool:
        return any(r.failed and not r.restarting for r in self._ranks.values())

    def _crashed_replicas(self) -> bool:
        """prod-serving: replicas whose process failed by itself (restarted alone)."""
        return any(r.job_fault and not r.restarting for r in self._ranks.values())

    def _failure_reason(self, timed_out: bool) -> tuple[str, bool]:
        for r in sorted(self._ranks.values(), key=lambda r: r.placement.rank):
            if r.job_fault:
                return f"rank {r.placement.rank} exited with code {r.exit_code}", True
        for r in sorted(self._ranks.values(), key=lambda r: r.placement.rank):
            if r.start_error:
                return f"rank {r.placement.rank} never started: {r.start_error}", False
            if r.failed:
                return f"rank {r.placement.rank} on {r.placement.node_id} was {str(r.outcome).lower()}", False
        if timed_out:
            missing = [r.placement.rank for r in self._ranks.values() if not r.started]
            return f"gang not started within the start timeout (ranks {missing[:10]} missing)", False
        return "ranks exited without all succeeding", True

    def _supervision_wakes(self, deadline: datetime) -> bool:
        """What a running attempt wakes up for (besides its deadline passing)."""
        return (
            self._cancel is not None
            or self._attempt in self._preempts
            or self._any_failed()
            or self._all_exited()
            or self._deadline != deadline
            or self._history_long()
            or self._earlier_done()
        )

    def _history_long(self) -> bool:
        info = workflow.info()
        return info.is_continue_as_new_suggested() or info.get_current_history_length() > HISTORY_LIMIT

    # ------------------------------------------------------------------ writes

    def _expect(self, to: str) -> None:
        """Every state change this workflow asks the store for is an edge of the job state
        table (``placement.lifecycle``); the store checks it again when it writes."""
        if to != self._state and not allowed_change(self._state, to):
            raise IllegalTransition(f"job {self._job_id}: {self._state} -> {to} is not an edge of the job state table")

    async def _finish(
        self, state: str, reason: str, *, exit_code: int | None = None, actor: str = "workflow"
    ) -> m.JobResult:
        self._expect(state)
        res = await self._local(
            acts.finish_job,
            m.JobTransition(
                self._job_id,
                self._attempt,
                state,
                reason,
                actor=actor,
                exit_code=exit_code,
                checkpoint_uri=self._checkpoint,
            ),
        )
        self._state = res.state
        if (
            not res.applied
            and res.state not in TERMINAL
            and res.attempt > self._attempt
            and workflow.patched("finish-ends-a-requeue-lost-from-history")
        ):
            # A re-queue of this run's went through in a workflow task that then failed (a
            # signal came in as it completed), so its result is not in the history and the
            # retried task took another path here.
            if res.state == JobState.QUEUED and allowed_change(JobState.QUEUED, state):
                self._attempt = res.attempt  # the later attempt never started: end it
                return await self._finish(state, reason, exit_code=exit_code, actor=actor)
            # placed meanwhile (or no edge from QUEUED): a run of its own ends it for what this
            # one was ending the job for (a cancel, an earlier success)
            workflow.continue_as_new(
                m.JobInput(
                    self._job_id,
                    res.attempt,
                    cancel=self._cancel,
                    earlier_success=self._earlier_success,
                    allocation=self._allocs.get(res.attempt),
                    labels=self._labels,
                )
            )
        self._show(res.state)
        return m.JobResult(self._job_id, res.state, res.attempt, exit_code=exit_code, reason=reason)

    async def _requeue(self, cause: str, reason: str, *, job_fault: bool, epoch: int | None = None) -> m.JobResult:
        if self._earlier_done():  # nothing to run again: an earlier attempt had finished
            return await self._finish_earlier_success()
        self._expect(JobState.QUEUED)
        res = await self._local(
            acts.requeue_job,
            m.RequeueJob(
                job_id=self._job_id,
                attempt=self._attempt,
                cause=cause,
                reason=reason,
                job_fault=job_fault,
                checkpoint_uri=self._checkpoint,
                epoch=epoch,
            ),
        )
        self._state = res.state
        if res.state == JobState.QUEUED and res.attempt > self._attempt:
            await workflow.wait_condition(workflow.all_handlers_finished)
            if self._earlier_done():  # every rank's exit 0 came while we re-queued: done, not re-run
                self._attempt = res.attempt
                return await self._finish_earlier_success()
            workflow.continue_as_new(
                m.JobInput(
                    self._job_id,
                    res.attempt,
                    res.resume_from,
                    cancel=self._cancel,
                    allocation=self._allocs.get(res.attempt),
                    labels=self._labels,
                )
            )
        self._show(res.state)  # e.g. FAILED: no attempts left
        return m.JobResult(self._job_id, res.state, res.attempt, reason=reason)

    def _show(self, state: str) -> None:
        """Keep the state and attempt search attributes current (runs started with labels only:
        the attributes are registered, and histories recorded before never upsert)."""
        if self._labels is None or self._shown == (state, self._attempt):
            return
        workflow.upsert_search_attributes(
            [search_attributes.STATE.value_set(state), search_attributes.ATTEMPT.value_set(self._attempt)]
        )
        self._shown = (state, self._attempt)

    async def _local(self, fn: Callable[[A], Awaitable[R]], arg: A) -> R:
        return await workflow.execute_local_activity(
            fn, arg, start_to_close_timeout=LOCAL_TIMEOUT, retry_policy=LOCAL_RETRY
        )

    def _require_snap(self) -> m.JobSnapshot:
        assert self._snap is not None
        return self._snap
