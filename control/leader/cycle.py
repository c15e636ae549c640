"""The leader's placement cycle: the shell around the pure engine (docs/design.md, Placement).

``PlacementCycles.run(epoch)`` runs while this process leads: a cycle every
``placement_cycle_s``, at once when ``wake()`` is called (Postgres notified a change)
or when the last cycle left placeable work, never two within ``placement_wake_min_s``.
One cycle (``run_cycle``):

1. refresh the in-memory state from the change feed; ``engine.plan`` on it;
2. write relabels; commit each gang in its own transaction under the epoch
   (``store.allocations.commit_gang``); mark each victim PREEMPTING under the epoch;
3. ``engine.apply`` what committed;
4. signal the job workflows (``allocated`` with signal-with-start, ``preempt``), and
   re-signal those Temporal has not accepted yet (``JobSignals``);
5. publish queue positions, pending reasons, expected starts, reservations and the hot
   spares held for large gangs (changed rows only, or only when the set changed).

Jobs that lack a workflow get one from ``control.leader.workflows``, beside the cycles:
a cycle never waits on Temporal.

Every write checks the epoch in its transaction; ``StaleEpoch`` ends the cycles and
drops the in-memory state (this process is no longer the leader).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from temporalio.client import Client

import placement as engine
from common.gc_hold import cyclic_gc_held
from control.leader.metrics import ControlMetrics
from control.leader.signals import JobSignals
from control.leader.state import KnownJob, LeaderState, policy_from_settings
from placement import Placement, Plan, Policy, Preemption, iter_order
from placement.forecast import DemandForecast, demand_of
from placement.lifecycle import JobState
from store import allocations, job_states, publications, task_reports
from store.allocations import GangPlacement
from store.errors import AllocationConflict, EarlierAttemptSucceeded, StaleEpoch, StoreError, UnknownSubject
from workflows import messages as m

log = logging.getLogger("gpufleet.control.leader")

PRUNE_EVERY_S = 60.0
CHANGES_KEPT_S = 600.0


class NotLeader(Exception):
    """This process does not hold the epoch the cycle was asked to run under."""


@dataclass
class CycleStats:
    epoch: int
    placed: int = 0
    preempted: int = 0
    resignalled: int = 0
    queued: int = 0
    published: int = 0
    failed_commits: int = 0
    duration_ms: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def more(self) -> bool:
        """Something may still be placeable: run again without waiting."""
        return self.placed > 0 and self.queued > 0


class PlacementCycles:
    """The leader's cycles over ``LeaderState`` (one per control process)."""

    def __init__(
        self,
        state: LeaderState,
        signals: JobSignals,
        client: Client,
        *,
        actor: str = "placement",
        policy: Policy | None = None,
        on_cycle: Callable[[CycleStats], None] = lambda _: None,
        metrics: ControlMetrics | None = None,
    ) -> None:
        self.state = state
        self.signals = signals
        self.client = client
        self.settings = state.settings
        self.pool = state.pool
        self.policy = policy or policy_from_settings(self.settings)
        self.scope = self.settings.leader_scope
        self.actor = actor
        self.on_cycle = on_cycle
        self.metrics = metrics
        self.cycles = 0
        self.last: CycleStats | None = None
        self._wake = asyncio.Event()
        self._next_prune = time.monotonic() + PRUNE_EVERY_S
        # what was last written, so each cycle writes only what changed
        self.published: dict[str, tuple[int | None, str | None, str | None, datetime | None]] = {}
        self.published_res: tuple | None = None
        self.published_spares: dict[str, str] | None = None  # node -> job (None: not yet)
        # each team's recent peak demand, kept only for a policy that reads it (the borrow guards)
        self.demand = DemandForecast() if self.policy.reads_demand_forecast else None

    def forget_publications(self) -> None:
        """A new leadership re-publishes everything once."""
        self.published.clear()
        self.published_res = None
        self.published_spares = None

    def wake(self) -> None:
        """Run a cycle now (a change was recorded): at most one per ``placement_wake_min_s``."""
        self._wake.set()

    async def run(self, epoch: int) -> None:
        """Cycle until this process no longer leads under ``epoch`` (or the task is cancelled)."""
        s = self.settings
        while self.state.is_leader(epoch):
            self._wake.clear()
            started = time.monotonic()
            try:
                stats = await self.run_cycle(epoch)
            except (NotLeader, StaleEpoch):
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if not self.state.is_leader(epoch):
                    # leadership ended under it (a stop closes the pool while a cycle runs):
                    # the stop's doing, not a fault; its writes were epoch-fenced
                    log.info("placement cycle under epoch %d ended with the leadership: %s", epoch, e)
                    return
                log.exception("placement cycle under epoch %d failed", epoch)
                stats = None
            if stats is None or not stats.more:
                try:
                    await asyncio.wait_for(self._wake.wait(), s.placement_cycle_s)
                except TimeoutError:
                    pass
            pause = started + s.placement_wake_min_s - time.monotonic()
            if pause > 0:
                await asyncio.sleep(pause)

    async def run_cycle(self, epoch: int) -> CycleStats:
        state = self.state
        if not state.is_leader(epoch):
            raise NotLeader(f"this process does not lead under epoch {epoch} (it holds {state.epoch})")
        async with state.lock:
            if not state.is_leader(epoch):
                raise NotLeader(f"leadership changed before the cycle (epoch {epoch})")
            t0 = time.perf_counter()
            try:
                stats = await self._cycle(epoch)
            except StaleEpoch:
                log.warning("epoch %s is stale: dropping the leader state", epoch)
                state.drop()
                raise
            self.cycles += 1
            stats.duration_ms = (time.perf_counter() - t0) * 1000
            stats.queued = len(state.queue)
            self.last = stats
            if self.metrics is not None and state.cluster is not None:
                self.metrics.observe_cycle(state.cluster, state.queue, stats.duration_ms / 1000, time.time())
        self.on_cycle(stats)
        return stats

    async def _cycle(self, epoch: int) -> CycleStats:
        state = self.state
        cluster = state.cluster
        assert cluster is not None
        stats = CycleStats(epoch)
        if state.needs_rebuild:
            state.needs_rebuild = False
            await state.rebuild_in_place()
            cluster = state.cluster
            assert cluster is not None
        await state.refresh()
        now = time.time()
        if self.metrics is not None:
            self.metrics.before_plan(cluster, state.queue, now)
        if self.demand is not None:
            self.demand.observe(now, cluster, demand_of(cluster, state.queue))
            self.demand.apply(cluster, now)
        with cyclic_gc_held():
            plan = engine.plan(cluster, state.queue, self.policy, now)

        await allocations.relabel_jobs(
            self.pool, scope=self.scope, epoch=epoch, relabels=[(rl.job_id, rl.borrowed) for rl in plan.relabels]
        )

        committed: set[str] = set()
        allocated: list[m.Allocation] = []
        commits = [p for p in plan.placements if not p.replacement]
        results = await asyncio.gather(*(self._commit(epoch, p) for p in commits), return_exceptions=True)
        finished: dict[str, int] = {}  # jobs an earlier attempt of which had finished: not started
        for p, res in zip(commits, results, strict=True):
            if isinstance(res, StaleEpoch):
                raise res
            if isinstance(res, EarlierAttemptSucceeded):
                known = state.jobs.get(p.job_id)
                if known is not None:
                    finished[p.job_id] = known.attempt
            if isinstance(res, BaseException):
                stats.failed_commits += 1
                stats.errors.append(str(res))
                continue
            if res is not None:
                committed.add(res.job_id)
                allocated.append(res)
        if self.metrics is not None:
            backfill = {p.job_id: p.backfill for p in plan.placements}
            for a in allocated:
                self.metrics.placed(state.jobs[a.job_id].spec, backfill.get(a.job_id, False), now)
        finished.update(await self._finished_beneficiaries(plan, finished))
        # the cycle's victims are marked in one transaction (one round trip per statement, not
        # per victim): a cycle that stops a hundred jobs does not wait on a hundred transactions
        marked: list[tuple[Preemption, KnownJob, float]] = []
        for pr in plan.preemptions:
            job = state.jobs.get(pr.victim)
            if job is None or pr.beneficiary in finished:
                continue
            victim = cluster.get_running(pr.victim)
            lost_gpu_s = victim.charge * max(0.0, now - victim.lost_since) if victim is not None else 0.0
            marked.append((pr, job, lost_gpu_s))
        outcomes = await job_states.mark_preempting_many(
            self.pool,
            scope=self.scope,
            epoch=epoch,
            marks=[
                job_states.PreemptMark(
                    pr.victim, job.attempt, f"{pr.reason.value}: for {pr.beneficiary}", pr.beneficiary
                )
                for pr, job, _ in marked
            ],
        )
        preempts: list[m.PreemptRequest] = []
        for (pr, job, lost_gpu_s), o in zip(marked, outcomes, strict=True):
            if o.applied:
                committed.add(pr.victim)
                job.state = JobState.PREEMPTING
                if self.metrics is not None:
                    self.metrics.preempted(pr.reason.value, job.spec, lost_gpu_s, pr.beneficiary, now)
                preempts.append(m.PreemptRequest(pr.victim, job.attempt, epoch, f"{pr.reason.value}", pr.beneficiary))
        try:
            with cyclic_gc_held():
                engine.apply(cluster, plan, state.queue, now, committed=committed)
        except Exception as e:  # memory disagrees with what committed: rebuild before the next plan
            log.error("applying the cycle's plan failed (%s): the leader state will be rebuilt", e)
            state.needs_rebuild = True
        for job_id, attempt in finished.items():
            state.hold_finished(job_id, attempt)
        stats.placed = len(allocated)
        stats.preempted = len(preempts)

        mono = time.monotonic()
        for a in allocated:
            state.jobs[a.job_id].state = JobState.STARTING
        stats.resignalled = self.signals.resend_due(mono)
        sent: list[m.Allocation | m.PreemptRequest] = [*allocated, *preempts]
        for msg in sent:
            self.signals.send(msg, mono)
        stats.published = await self._publish(epoch, plan, now)
        if mono >= self._next_prune:
            self._next_prune = mono + PRUNE_EVERY_S
            await state.feed.prune(self.pool, kept_s=CHANGES_KEPT_S)
        return stats

    async def _finished_beneficiaries(self, plan: Plan, known: dict[str, int]) -> dict[str, int]:
        """The re-runs this plan preempts for, without placing them yet, whose earlier attempt
        had exited 0 on every rank (job -> attempt): no work is stopped for them. A placed
        one learns it from its refused commit; these would learn it only when the victims
        had gone."""
        placed = {p.job_id for p in plan.placements}
        asks: list[tuple[str, int, int]] = []
        for job_id in sorted({pr.beneficiary for pr in plan.preemptions} - placed - known.keys()):
            job = self.state.jobs.get(job_id)
            if job is not None and job.attempt > 1:
                asks.append((job_id, job.attempt, job.spec.replicas))
        done = await task_reports.succeeded_attempts(self.pool, asks)  # one query for them all
        return {job_id: attempt for job_id, attempt, _ in asks if job_id in done}

    async def _commit(self, epoch: int, p: Placement) -> m.Allocation | None:
        state = self.state
        job = state.jobs.get(p.job_id)
        if job is None or job.state != JobState.QUEUED:
            return None
        gang = [
            GangPlacement(rank=s.replica, node_id=s.node_id, gpu_indices=tuple(s.gpus), borrowed=p.borrowed)
            for s in sorted(p.slots, key=lambda s: s.replica)
        ]
        try:
            await allocations.commit_gang(
                self.pool,
                scope=self.scope,
                epoch=epoch,
                job_id=p.job_id,
                attempt=job.attempt,
                placements=gang,
                actor=self.actor,
                reason="backfill" if p.backfill else "scheduled",
            )
        except StaleEpoch:
            raise
        except StoreError as e:
            log.warning("commit of %s failed: %s", p.job_id, e)
            # our view is stale: re-read the job next refresh, or rebuild when GPUs disagree
            state.mark_dirty(p.job_id)
            if isinstance(e, (AllocationConflict, UnknownSubject)):
                state.needs_rebuild = True
            raise
        for g in gang:
            state.node_leases.setdefault(g.node_id, set()).add(allocations.lease_id_for(p.job_id, job.attempt, g.rank))
        rank0 = state.nodes.get(gang[0].node_id)
        return m.Allocation(
            job_id=p.job_id,
            attempt=job.attempt,
            epoch=epoch,
            ranks=[
                m.RankPlacement(
                    rank=g.rank,
                    node_id=g.node_id,
                    gpu_indices=list(g.gpu_indices),
                    lease_id=allocations.lease_id_for(p.job_id, job.attempt, g.rank),
                    task_queue=self.settings.node_task_queue(
                        g.node_id, state.nodes[g.node_id].task_queue if g.node_id in state.nodes else None
                    ),
                )
                for g in gang
            ],
            master_addr=m.rendezvous_host(rank0.agent_addr if rank0 else None),
            master_port=m.rendezvous_port(p.job_id, job.attempt),
        )

    async def _publish(self, epoch: int, plan: Plan, now: float) -> int:
        state = self.state
        cluster = state.cluster
        assert cluster is not None
        reasons = {p.job_id: p for p in plan.pending}
        reservations = {r.job_id: r for r in cluster.reservations()}
        rows: list[publications.Publication] = []
        listed: set[str] = set()
        limit = self.policy.lookahead
        for i, spec in enumerate(iter_order(state.queue, cluster, self.policy, now)):
            if i >= limit:
                break
            jid = spec.job_id
            listed.add(jid)
            p = reasons.get(jid)
            res = reservations.get(jid)
            start = None
            if res is not None and math.isfinite(res.expected_start):
                start = datetime.fromtimestamp(res.expected_start, UTC)
            if p is not None:
                reason, detail = p.reason.value, p.detail or None
            else:  # not evaluated: its lane may have been skipped for want of quota room
                reason, detail = _unevaluated_reason(plan, spec)
                if reason == engine.PendingReason.LOOKAHEAD.value:
                    reason, detail = None, None  # within the published top: no reason yet
            value: tuple[int | None, str | None, str | None, datetime | None] = (i + 1, reason, detail, start)
            if self.published.get(jid) != value:
                self.published[jid] = value
                rows.append(publications.Publication(jid, *value))
        for jid in [j for j in self.published if j not in listed and j in state.queue]:
            reason, detail = _unevaluated_reason(plan, state.queue.get(jid))
            if reason == engine.PendingReason.LOOKAHEAD.value:
                detail = f"beyond the top {limit} considered"
            value = (None, reason, detail, None)
            if self.published[jid] != value:
                self.published[jid] = value
                rows.append(publications.Publication(jid, *value))
        for jid in [j for j in self.published if j not in state.queue]:
            del self.published[jid]
        written = 0
        if rows:
            written = await publications.publish_positions(self.pool, scope=self.scope, epoch=epoch, rows=rows)
        res_rows = tuple(
            sorted(
                (
                    r.job_id,
                    r.expected_start if math.isfinite(r.expected_start) else None,
                    tuple(sorted(cluster.reservation_nodes(r))),
                    tuple(r.blocks),
                )
                for r in reservations.values()
            )
        )
        if res_rows != self.published_res:
            await publications.publish_reservations(
                self.pool,
                scope=self.scope,
                epoch=epoch,
                rows=[
                    publications.ReservationRow(
                        jid, datetime.fromtimestamp(es, UTC) if es is not None else None, nodes, blocks
                    )
                    for jid, es, nodes, blocks in res_rows
                ],
            )
            self.published_res = res_rows
        spares = {nid: owner for owner in cluster.spare_owners() for nid in cluster.spares(owner)}
        if spares != self.published_spares:
            await publications.publish_hot_spares(self.pool, scope=self.scope, epoch=epoch, spares=spares)
            self.published_spares = spares
        return written


def _unevaluated_reason(plan: Plan, spec: Any) -> tuple[str, str | None]:
    """Why a job the cycle did not evaluate waits: ``quota`` when its team's lane for
    its size was skipped for want of quota room, else ``lookahead``."""
    reason = plan.reason_for(spec) if spec is not None else None
    if reason is engine.PendingReason.QUOTA:
        return reason.value, "the team has no quota room for a job of this size"
    return engine.PendingReason.LOOKAHEAD.value, None
