"""Agents' reports reach their job's workflow at least once (docs/design.md, Reports).

    reports = ReportDelivery(pool, client, settings)
    await reports.store(status)        # durable in Postgres: only then is the agent acknowledged
    reports.submit(status)             # the control plane's own reports (LOST), stored in the background
    task = asyncio.create_task(reports.run(lambda: process.is_leader))   # the leader delivers

The leader reads undelivered reports in the order they arrived, sends each job's as one
``task_status`` signal and marks them delivered once Temporal accepted it; a report that
was delivered twice (control died between the signal and the mark) is a no-op in the
workflow (handlers are idempotent on lease, epoch and state). Nothing is given up:

* the job's workflow is not found: Postgres decides. A job that ended needs no report
  (``job_finished``); an active job gets its workflow started with the reports as the
  start signal (it adopts its gang, ``workflows/job.py``);
* Temporal is unreachable or slow: that job's reports wait (back-off doubling to
  ``MAX_BACKOFF_S``) and go when it answers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime
from typing import Any

from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from common.contracts import TaskState, TaskStatus
from common.settings import Settings
from control.leader.signals import start_with_signal
from placement.lifecycle import TERMINAL
from store import jobs, task_reports
from store.tx import Pool
from workflows import messages as m
from workflows.job import JobWorkflow

log = logging.getLogger("gpufleet.control.reports")

MAX_BATCH = 500
FETCH = 2000
IN_FLIGHT = 32
MAX_BACKOFF_S = 30.0
PRUNE_EVERY_S = 600.0
KEPT_S = 24 * 3600.0


def report_json(s: TaskStatus) -> dict[str, Any]:
    return {
        "node_id": s.node_id,
        "lease_id": s.lease_id,
        "job_id": s.job_id,
        "attempt": s.attempt,
        "epoch": s.epoch,
        "rank": s.rank,
        "state": str(s.state),
        "at": s.at.isoformat(),
        "exit_code": s.exit_code,
        "checkpoint_uri": s.checkpoint_uri,
        "step": s.step,
        "boot_id": s.boot_id,
        "seq": s.seq,
        "signal": s.signal,
        "stderr_tail": s.stderr_tail,
        "reason": s.reason,
    }


def status_from_json(d: dict[str, Any]) -> TaskStatus:
    # the cause (signal, stderr tail, reason) stays in task_reports: the workflow needs none of it
    return TaskStatus(
        node_id=d["node_id"],
        lease_id=d["lease_id"],
        job_id=d["job_id"],
        attempt=int(d["attempt"]),
        epoch=int(d["epoch"]),
        rank=int(d["rank"]),
        state=TaskState(d["state"]),
        at=datetime.fromisoformat(d["at"]),
        exit_code=d.get("exit_code"),
        checkpoint_uri=d.get("checkpoint_uri"),
        step=d.get("step"),
        boot_id=d.get("boot_id") or "",
        seq=int(d.get("seq") or 0),
    )


def worth_delivering(status: TaskStatus) -> bool:
    """A plain STARTED tells the job nothing new (it learns of every start from StartTask's
    result); STARTED with a checkpoint, and every end, are delivered."""
    return not (status.state == TaskState.STARTED and not status.checkpoint_uri)


class ReportDelivery:
    def __init__(self, pool: Pool, client: Client, settings: Settings) -> None:
        self.pool = pool
        self.client = client
        self.settings = settings
        self._wake = asyncio.Event()
        self._sem = asyncio.Semaphore(IN_FLIGHT)
        self._in_flight: set[str] = set()  # jobs being delivered now
        self._backoff: dict[str, tuple[float, float]] = {}  # job -> (retry at, interval)
        self._bg: set[asyncio.Task] = set()
        self._next_prune = 0.0
        self.stored = 0
        self.delivered = 0
        self.finished_jobs = 0
        self.skipped = 0

    # ------------------------------------------------------------------ intake

    async def store(self, status: TaskStatus) -> None:
        """Make ``status`` durable (raises when Postgres is unreachable: the agent retries)."""
        if not worth_delivering(status):
            self.skipped += 1
            return
        if await task_reports.store(self.pool, report_json(status)):
            self.stored += 1
        self._wake.set()

    def submit(self, status: TaskStatus) -> None:
        """A report the control plane makes itself (a rank it found LOST): stored in the
        background, retried until Postgres takes it."""
        t = asyncio.create_task(self._store_until_taken(status))
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    def submit_once(self, status: TaskStatus) -> None:
        """Stored in the background, once, losing it on failure: only the deliberately broken
        build (``test_faults: ack_before_durable``) does this."""
        t = asyncio.create_task(self.store(status))
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    async def _store_until_taken(self, status: TaskStatus) -> None:
        delay = 0.2
        while True:
            try:
                await self.store(status)
                return
            except Exception as e:
                log.warning("report about %s not stored yet: %s", status.lease_id, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)

    def wake(self) -> None:
        self._wake.set()

    # ------------------------------------------------------------------ delivery

    async def run(self, leading: Callable[[], bool]) -> None:
        """Deliver while ``leading()`` (the leader's job), until cancelled."""
        poll = self.settings.report_delivery_poll_s
        while True:
            self._wake.clear()
            more = False
            if leading():
                try:
                    more = await self.deliver_once()
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # Postgres unreachable: try again
                    log.warning("report delivery: %s", e)
            if not more:
                try:
                    await asyncio.wait_for(self._wake.wait(), poll)
                except TimeoutError:
                    pass

    async def deliver_once(self) -> bool:
        """Send what is undelivered (jobs in back-off or in flight wait); True when more may be waiting."""
        now = time.monotonic()
        if now >= self._next_prune:
            self._next_prune = now + PRUNE_EVERY_S
            await task_reports.prune(self.pool, older_than_s=KEPT_S)
        waiting = [j for j, (at, _) in self._backoff.items() if at > now]
        rows = await task_reports.undelivered(self.pool, skip_jobs=[*self._in_flight, *waiting], limit=FETCH)
        by_job: dict[str, list[task_reports.StoredReport]] = defaultdict(list)
        for r in rows:
            by_job[r.job_id].append(r)
        tasks = []
        for job_id, reports in by_job.items():
            self._in_flight.add(job_id)
            tasks.append(asyncio.create_task(self._deliver(job_id, reports[:MAX_BATCH])))
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        return len(rows) >= FETCH

    async def _deliver(self, job_id: str, reports: list[task_reports.StoredReport]) -> None:
        try:
            batch = m.TaskStatusBatch(statuses=[status_from_json(r.report) for r in reports])
            async with self._sem:
                outcome = await self._send(job_id, batch)
            if outcome == "delivered":
                await self._earlier_successes(job_id, batch.statuses)  # before the mark: retried with it
            await task_reports.mark(self.pool, [r.id for r in reports], outcome)
            self._backoff.pop(job_id, None)
            if outcome == "delivered":
                self.delivered += len(reports)
            else:
                self.finished_jobs += 1
        except Exception as e:
            _, interval = self._backoff.get(job_id, (0.0, 0.25))
            interval = min(interval * 2, MAX_BACKOFF_S)
            self._backoff[job_id] = (time.monotonic() + interval, interval)
            log.warning("reports for %s not delivered yet (retry in %.1fs): %s", job_id, interval, e)
        finally:
            self._in_flight.discard(job_id)

    async def _earlier_successes(self, job_id: str, statuses: list[TaskStatus]) -> None:
        """Late exits of an attempt already ended (recovered from a silent node, or re-queued
        while its exits were on their way): when every one of its ranks exited 0, the job had
        finished and its next attempt must not run it again. Exits stored before the re-queue
        are caught by the re-queue itself (``store.job_states.requeue_job``)."""
        attempts = {s.attempt for s in statuses if s.state == TaskState.EXITED and s.exit_code == 0}
        if not attempts:
            return
        job = await jobs.get_job(self.pool, job_id)
        if job is None or job["state"] in TERMINAL:
            return
        for attempt in sorted(a for a in attempts if a < job["attempt"]):
            if await task_reports.ranks_exited_ok(self.pool, job_id, attempt) >= job["replicas"]:
                reason = (
                    f"attempt {attempt} had exited 0 on every rank; its reports arrived after the attempt"
                    " was recovered from a silent node"
                )
                log.warning("job %s: %s: stopping attempt %d", job_id, reason, job["attempt"])
                await asyncio.wait_for(
                    start_with_signal(
                        self.client,
                        self.settings,
                        job_id,
                        m.SIGNAL_EARLIER_SUCCESS,
                        m.EarlierAttemptSucceeded(job_id, attempt, reason),
                    ),
                    self.settings.api_temporal_timeout_s,
                )
                return

    async def _send(self, job_id: str, batch: m.TaskStatusBatch) -> str:
        timeout = self.settings.api_temporal_timeout_s
        try:
            await asyncio.wait_for(
                self.client.get_workflow_handle(job_id).signal(JobWorkflow.task_status, batch), timeout
            )
            return "delivered"
        except RPCError as e:
            if e.status != RPCStatusCode.NOT_FOUND:
                raise
        # no running workflow: Postgres decides (NOT_FOUND never means "finished" by itself)
        job = await jobs.get_job(self.pool, job_id)
        if job is None or job["state"] in TERMINAL:
            return "job_finished"
        await asyncio.wait_for(
            start_with_signal(self.client, self.settings, job_id, m.SIGNAL_TASK_STATUS, batch), timeout
        )
        log.warning("job %s (%s) had no running workflow: started it with its reports", job_id, job["state"])
        return "delivered"

    async def close(self) -> None:
        for t in list(self._bg):
            t.cancel()
        await asyncio.gather(*self._bg, return_exceptions=True)
