"""Recovery of the gangs on a failed node, and eviction from a drained one (docs/design.md,
Health).

* ``recover``: every job with a live lease on a lost / faulty node (or the hung gangs)
  gets the ``node_failed`` signal naming that node, and every other node of its attempt
  found failed in the same pass of the monitor (``flush``):
  its workflow stops all ranks, releases the attempt and re-queues it ahead of its class
  (its hot spares kept). Re-sent every ``recovery_resignal_s`` while the lease on that
  node is still live (a lost signal).
* failure -> restart time per recovered job (failure: the last heartbeat of a lost node,
  or the heartbeat that reported the fault; restart: the next attempt RUNNING), exported
  as ``gpufleet_failure_to_restart_seconds`` and kept in ``restarts`` (tests).
* ``evict_drained``: ``POST /v1/nodes/{id}:drain {"evict": true}`` preempts the node's
  jobs now (checkpoint, re-queue).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from temporalio.client import Client

from common.settings import Settings
from control.health.metrics import FAILURE_TO_RESTART, RECOVERIES
from control.health.node_states import Decision, Event
from control.leader.signals import signal_preempt, start_with_signal
from placement.lifecycle import TERMINAL, JobState
from store import job_states, jobs
from store.allocations import LeaseRow
from store.tx import Pool
from workflows import messages as m

log = logging.getLogger("gpufleet.control.health")

SIGNALS_IN_FLIGHT = 8  # as the leader's signals: the embedded server has one SQLite writer


@dataclass
class _Recovery:
    job_id: str
    attempt: int
    node_id: str  # the first failed node (the restart sample's)
    cause: str
    failed_at: float  # wall clock
    # every failed node of the attempt -> (its cause, when its signal may be sent again
    # (monotonic)). A gang on several failed nodes is told of each: a rank on a node it was
    # not told of is stopped as if alive, and its workflow waits out the stop's pickup timeout.
    nodes: dict[str, tuple[str, float]] = field(default_factory=dict)
    due: dict[str, str] = field(default_factory=dict)  # nodes (-> reason) for the next send
    measured: bool = False


@dataclass(frozen=True)
class RestartSample:
    job_id: str
    failed_attempt: int
    node_id: str
    cause: str
    seconds: float


class Recoveries:
    """The jobs this leader is recovering from node failures, and the drains it evicts."""

    def __init__(
        self,
        pool: Pool,
        client: Client,
        settings: Settings,
        *,
        actor: str,
        on_failure: Callable[[str, str, float], None] = lambda cause, job_id, failed_at: None,
    ) -> None:
        self.pool = pool
        self.on_failure = on_failure  # (cause, job id, failed at): counts the work it lost
        self.client = client
        self.settings = settings
        self.actor = actor
        self.recovering: dict[tuple[str, int], _Recovery] = {}
        self.restarts: list[RestartSample] = []
        self.evicted: set[tuple[str, int]] = set()
        # node_failed sends run beside the monitor's pass, a few at a time: a block failure
        # is hundreds of (job, node) signals, and the pass would otherwise mark the block's
        # later nodes down only after the earlier nodes' signals (seconds, at 3,008 nodes)
        self._slots = asyncio.Semaphore(SIGNALS_IN_FLIGHT)
        self._sending: set[asyncio.Task] = set()
        self._due: set[tuple[str, int]] = set()  # recoveries with nodes to name (``flush``)

    def drop(self) -> None:
        self.recovering.clear()
        self.evicted.clear()
        for t in list(self._sending):
            t.cancel()  # a new leadership re-derives what to tell from the store
        self._sending.clear()
        self._due.clear()

    async def sent(self) -> None:
        """Wait for the node_failed sends in flight (tests: the monitor never waits on them)."""
        while self._sending:
            await asyncio.gather(*list(self._sending), return_exceptions=True)

    def pending(self) -> int:
        return sum(1 for r in self.recovering.values() if not r.measured)

    def recover(self, node_id: str, d: Decision, leases: Iterable[LeaseRow], failed_at: float) -> None:
        """Tell every job of ``leases`` (live on ``node_id``) that the node failed, at the next
        ``flush``: the monitor flushes once a pass, so a gang on several nodes found failed in
        one pass (a block's) gets one signal naming all of them."""
        cause = {Event.LOST: "node_down", Event.FATAL: "fatal_fault", Event.HANG: "hang"}.get(d.event, d.event.value)
        seen: set[tuple[str, int]] = set()
        for lz in leases:
            key = (lz.job_id, lz.attempt)
            if key in seen:
                continue  # another rank of the gang on this node: one signal names the node
            seen.add(key)
            rec = self.recovering.get(key)
            if rec is None:
                rec = _Recovery(lz.job_id, lz.attempt, node_id, cause, failed_at)
                self.recovering[key] = rec
                RECOVERIES.labels(cause).inc()
                self.on_failure(cause, lz.job_id, failed_at)
                log.warning(
                    "recovering job %s attempt %d: node %s %s (%s)", lz.job_id, lz.attempt, node_id, cause, d.detail
                )
            elif node_id not in rec.nodes:
                log.warning("recovering job %s attempt %d: node %s %s too", lz.job_id, lz.attempt, node_id, cause)
            if node_id not in rec.nodes:
                rec.nodes[node_id] = (cause, 0.0)
            self._signal_failed(rec, node_id, f"node {node_id}: {cause}: {d.detail}"[:300])

    def _signal_failed(self, rec: _Recovery, node_id: str, reason: str) -> None:
        cause, next_signal = rec.nodes[node_id]
        now = time.monotonic()
        if now < next_signal:
            return
        rec.nodes[node_id] = (cause, now + self.settings.recovery_resignal_s)
        rec.due[node_id] = reason
        self._due.add((rec.job_id, rec.attempt))

    def flush(self) -> None:
        """Send what ``recover`` and ``resignal`` found: one ``node_failed`` per job's attempt,
        naming every node due (the first, and ``more_nodes``)."""
        for key in sorted(self._due):
            rec = self.recovering.get(key)
            if rec is None or not rec.due:
                continue
            (first, reason), *more = rec.due.items()
            if more:
                reason = f"{reason} (and {len(more)} more node(s))"[:300]
            req = m.NodeFailed(rec.job_id, rec.attempt, first, reason, tuple(n for n, _ in more))
            rec.due.clear()
            task = asyncio.create_task(self._send(req))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        self._due.clear()

    async def _send(self, req: m.NodeFailed) -> None:
        async with self._slots:
            try:
                # signal-with-start: a job whose workflow is missing still gets its gang stopped
                await start_with_signal(self.client, self.settings, req.job_id, m.SIGNAL_NODE_FAILED, req)
            except Exception as e:  # re-sent every recovery_resignal_s while the lease is live
                log.warning("node_failed to %s not delivered: %s", req.job_id, e)

    def resignal(self, still_live: Iterable[LeaseRow]) -> None:
        """Keep telling jobs whose lease on a failed node is still live (a lost signal), once
        per such node. ``still_live``: the live leases on the nodes being recovered."""
        live = {(lz.job_id, lz.attempt, lz.node_id) for lz in still_live}
        for r in [r for r in self.recovering.values() if not r.measured]:
            for node_id, (cause, _) in list(r.nodes.items()):
                if (r.job_id, r.attempt, node_id) in live:
                    self._signal_failed(r, node_id, f"node {node_id}: {cause} (re-sent)")
        self.flush()

    def nodes_recovering(self) -> set[str]:
        return {n for r in self.recovering.values() if not r.measured for n in r.nodes}

    async def measure_restarts(self) -> None:
        pending = [r for r in self.recovering.values() if not r.measured]
        if not pending:
            return
        attempts = await jobs.job_attempts(self.pool, sorted({r.job_id for r in pending}))
        for r in pending:
            j = attempts.get(r.job_id)
            if j is None:
                r.measured = True
                continue
            state, attempt, started_at = j
            if attempt > r.attempt and state == JobState.RUNNING and started_at is not None:
                r.measured = True
                secs = max(0.0, started_at.timestamp() - r.failed_at)
                FAILURE_TO_RESTART.labels(r.cause).observe(secs)
                self.restarts.append(RestartSample(r.job_id, r.attempt, r.node_id, r.cause, secs))
                del self.restarts[:-1000]
                log.info("job %s restarted %.1fs after its node %s failed (%s)", r.job_id, secs, r.node_id, r.cause)
            elif state in TERMINAL:
                r.measured = True
        if len(self.recovering) > 10_000:
            self.recovering = {k: v for k, v in self.recovering.items() if not v.measured}

    async def evict_drained(self, epoch: int, node_id: str, leases: Iterable[LeaseRow]) -> None:
        """Preempt the jobs of a node drained with ``evict`` (once per attempt), marked in one
        transaction."""
        keys: list[tuple[str, int]] = []
        for lz in leases:
            key = (lz.job_id, lz.attempt)
            if key not in self.evicted and key not in keys:
                keys.append(key)
        reason = f"node {node_id} drained (evict)"
        outcomes = await job_states.mark_preempting_many(
            self.pool,
            scope=self.settings.leader_scope,
            epoch=epoch,
            marks=[job_states.PreemptMark(job_id, attempt, reason, None) for job_id, attempt in keys],
            actor=self.actor,
        )
        self.evicted.update(keys)
        for (job_id, attempt), o in zip(keys, outcomes, strict=True):
            if o.applied:
                await signal_preempt(
                    self.client,
                    self.settings,
                    m.PreemptRequest(job_id, attempt, epoch, f"node {node_id} drained", None),
                )


__all__ = ["Recoveries", "RestartSample"]
