"""The leader's health monitor (DESIGN.md, Health): the shell around ``control.node_states``.

    monitor = HealthMonitor(pool, client, settings, leader=leader_state,
                            table=lambda: heartbeat_server.table, forward_status=forwarder.submit)
    await monitor.take_over(epoch)      # on takeover: empty memory, the quiet period starts
    server = HeartbeatServer(..., on_heartbeat=monitor.on_heartbeat)
    monitor.stops_for(entry)            # extra reconciliation stops (ranks on the wrong GPUs)
    monitor.drop()                      # leadership lost

What it does while this process leads:

* decides per node with the pure ``node_states.decide`` (heartbeat age, fatal faults, hangs,
  live leases) on every fresh heartbeat and every ``health_sweep_s``; writes only state
  *changes* (``activities.health_store.set_node_state``: epoch-checked, audited, compare-and-set);
  the placement cycle sees them through the ``changes`` sequence (no new placements on a node
  that is not ready);
* recovery: every job with a live lease on a lost / faulty node (or the hung gangs) gets the
  ``node_failed`` signal: the job workflow stops all its ranks, releases the attempt and
  re-queues it ahead of its class (its hot spares kept); re-sent every ``recovery_resignal_s``
  while the lease is still live. The node stays out of service (down / cordoned) until its
  agent is back, reports no rank left and no live lease remains (or the self-fence window
  ``unconfirmed_kill_s x fence_margin`` has passed), then it burns in;
* reconciliation per heartbeat: a rank on other GPUs than its lease is stopped and audited; a
  live lease of a running job whose rank the agent no longer reports for
  ``missing_task_release_s`` is released (epoch-checked) and its job told the rank was LOST
  (tasks without a live lease are stopped by ``ControlProcess._leases_to_stop``);
* drain with ``evict``: the node's jobs are preempted now (checkpoint, re-queue);
* burn-in: nodes in ``burn_in`` run ``BurnInWorkflow`` (the burn-in test on the node); it
  passes when the test exits 0, the GPUs were busy during it and no fatal fault showed;
* failure -> restart time per recovered job (failure: the last heartbeat of a lost node, or
  the heartbeat that reported the fault; restart: the next attempt RUNNING), exported as the
  ``gpufleet_failure_to_restart_seconds`` histogram and kept in ``restarts`` (tests).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
from prometheus_client import Counter, Gauge, Histogram
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from activities import health_store, job_signals, job_store, store
from common.contracts import StartTaskResult, TaskState, TaskStatus
from common.settings import Settings
from control.node_states import (
    Action,
    Decision,
    Event,
    GpuView,
    HealthParams,
    LeaseView,
    NodeObservation,
    NodeState,
    RankView,
    decide,
    reconcile,
)
from workflows import messages as m

log = logging.getLogger("gpufleet.control.health")

BURN_IN_PREFIX = "burnin-"
BURN_IN_SCRIPT = Path(__file__).with_name("burn_in_check.py")

FAILURE_TO_RESTART = Histogram(
    "gpufleet_failure_to_restart_seconds",
    "From a node failure (last heartbeat of a lost node, fault report, hang) to the job RUNNING again",
    ["cause"],
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600),
)
NODE_TRANSITIONS = Counter("gpufleet_node_transitions_total", "Node state changes written", ["from_state", "to_state", "event"])
NODES = Gauge("gpufleet_nodes", "Nodes per health state (leader's view)", ["state"])
RECOVERIES = Counter("gpufleet_gang_recoveries_total", "Jobs ended by a node failure and re-queued", ["cause"])
RECONCILE = Counter("gpufleet_reconciliation_total", "Reconciliation actions", ["action"])
HOT_SPARES = Gauge("gpufleet_hot_spare_nodes", "Nodes held free as hot spares for restarts of large gangs")


def params_from_settings(s: Settings) -> HealthParams:
    return HealthParams(
        suspect_after_s=s.suspect_after_s,
        down_after_s=s.down_after_s,
        takeover_quiet_s=s.takeover_quiet_s,
        hang_after_s=s.hang_after_s,
        unconfirmed_kill_s=s.unconfirmed_kill_s,
        fence_margin=s.fence_margin,
        fatal_xids=frozenset(s.fatal_xids),
        ib_flap_threshold=s.ib_flap_threshold,
        idle_util_pct=s.hang_idle_util_pct,
    )


@dataclass
class _Recovery:
    job_id: str
    attempt: int
    node_id: str
    cause: str
    failed_at: float  # wall clock
    next_signal: float = 0.0  # monotonic
    measured: bool = False


@dataclass(frozen=True)
class RestartSample:
    job_id: str
    failed_attempt: int
    node_id: str
    cause: str
    seconds: float


@dataclass
class _BurnIn:
    lease_id: str
    started: float  # monotonic
    busy: set[int] = field(default_factory=set)  # GPUs seen busy during the test
    exit_code: int | None = None
    done: bool = False
    failed: str = ""


class HealthMonitor:
    def __init__(
        self,
        pool: asyncpg.Pool,
        client: Client,
        settings: Settings,
        *,
        leader: Any,  # activities.placement_cycle.LeaderState
        table: Callable[[], Any],  # -> control.agent_link.HeartbeatTable | None
        forward_status: Callable[[TaskStatus], None] | None = None,
        actor: str = "health",
    ) -> None:
        self.pool = pool
        self.client = client
        self.settings = settings
        self.leader = leader
        self._table = table
        self.forward_status = forward_status
        self.actor = actor
        self.params = params_from_settings(settings)
        self.epoch: int | None = None
        self.took_over_at = 0.0
        self.states: dict[str, NodeState] = {}
        self.drain_evict: dict[str, bool] = {}
        self.silent_since: dict[str, float] = {}
        self.leases: dict[str, health_store.LeaseRow] = {}
        self.missing_since: dict[str, float] = {}
        self.recovering: dict[tuple[str, int], _Recovery] = {}
        self.restarts: list[RestartSample] = []
        self.burn_ins: dict[str, _BurnIn] = {}
        self.burn_in_retry_at: dict[str, float] = {}
        self.burn_in_seq = 0
        self.evicted: set[tuple[str, int]] = set()
        self.wrong_gpus: set[str] = set()
        self.agent_addrs: dict[str, str | None] = {}  # node -> nodes.agent_addr as known written
        self.decisions: list[tuple[str, str, str, str]] = []  # (node, from, event, to) written (tests)
        self._dirty: set[str] = set()
        self._kick = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._next_sweep = 0.0
        self._bg: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ leadership

    async def take_over(self, epoch: int) -> None:
        """A new leadership: forget everything, read the node states, start the quiet period."""
        self.drop()
        self.epoch = epoch
        self.took_over_at = time.monotonic()
        rows = await health_store.node_rows(self.pool)
        self.states = {n: NodeState(r.state) for n, r in rows.items()}
        self.drain_evict = {n: r.drain_evict for n, r in rows.items()}
        self.agent_addrs = await health_store.agent_addrs(self.pool)
        self._task = asyncio.create_task(self._loop(epoch), name="health-monitor")

    def drop(self) -> None:
        self.epoch = None
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._task = None
        for t in list(self._bg):
            t.cancel()
        self.states.clear()
        self.drain_evict.clear()
        self.silent_since.clear()
        self.leases.clear()
        self.missing_since.clear()
        self.recovering.clear()
        self.burn_ins.clear()
        self.burn_in_retry_at.clear()
        self.evicted.clear()
        self.wrong_gpus.clear()
        self.agent_addrs.clear()
        self._dirty.clear()

    async def stop(self) -> None:
        task = self._task
        self.drop()
        if task is not None:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass

    # ------------------------------------------------------------------ agent callbacks

    def on_heartbeat(self, entry: Any) -> None:
        """A fresh heartbeat is in the table: decide for its node soon (never blocks the stream)."""
        if self.epoch is None:
            return
        self._dirty.add(entry.node_id)
        self._kick.set()

    def stops_for(self, entry: Any) -> list[tuple[str, int, str]]:
        """Ranks on other GPUs than their live lease holds: stop them (audited once)."""
        if self.epoch is None:
            return []
        live = self._live_views(entry.node_id)
        if not live:
            return []
        rec = reconcile(self._ranks(entry.report()), live)
        for lease_id, _, _ in rec.kill_wrong_gpus:
            if lease_id not in self.wrong_gpus:
                self.wrong_gpus.add(lease_id)
                RECONCILE.labels("kill_wrong_gpus").inc()
                rank = next(r for r in entry.report().running if r.lease_id == lease_id)
                lz = self.leases[lease_id]
                log.warning("%s: rank of %s runs on GPUs %s, its lease holds %s: stopping it",
                            entry.node_id, lease_id, list(rank.gpu_indices), list(lz.gpu_indices))  # fmt: skip
                self._spawn(health_store.audit_wrong_gpus(
                    self.pool, node_id=entry.node_id, lease_id=lease_id, job_id=lz.job_id,
                    reported=rank.gpu_indices, held=lz.gpu_indices, actor=self.actor,
                ))  # fmt: skip
        return list(rec.kill_wrong_gpus)

    def confirmed_extra(self, node_id: str) -> list[str]:
        b = self.burn_ins.get(node_id)
        return [b.lease_id] if b is not None and not b.done else []

    def is_burn_in(self, lease_id: str) -> bool:
        return lease_id.startswith(BURN_IN_PREFIX)

    def on_task_status(self, status: TaskStatus) -> bool:
        """Take a burn-in rank's report (True: it is ours, not a job's)."""
        if not self.is_burn_in(status.lease_id):
            return False
        b = self.burn_ins.get(status.node_id)
        if b is not None and b.lease_id == status.lease_id and status.state != TaskState.STARTED:
            b.exit_code = status.exit_code if status.state == TaskState.EXITED else -1
            b.done = True
            self._dirty.add(status.node_id)
            self._kick.set()
        return True

    # ------------------------------------------------------------------ the loop

    async def _loop(self, epoch: int) -> None:
        while self.epoch == epoch:
            try:
                await asyncio.wait_for(self._kick.wait(), timeout=self.settings.health_sweep_s)
            except asyncio.TimeoutError:
                pass
            self._kick.clear()
            try:
                await self._pass(epoch)
            except asyncio.CancelledError:
                raise
            except store.StaleEpoch:
                log.warning("health monitor: epoch %s is stale", epoch)
                return
            except Exception:
                log.exception("health monitor pass failed")

    async def _pass(self, epoch: int) -> None:
        now = time.monotonic()
        sweep = now >= self._next_sweep
        if sweep:
            self._next_sweep = now + self.settings.health_sweep_s
            await self._read_admin_changes()
            nodes = set(self.states)
        else:
            nodes = set(self._dirty)
        self._dirty.clear()
        for node_id in sorted(nodes):
            if node_id not in self.states:
                continue
            await self._node(epoch, node_id, time.monotonic())
        if sweep:
            await self._resignal_recoveries(epoch)
            await self._measure_restarts()
            await self._evict_drained(epoch)
            self._gauges()

    async def _read_admin_changes(self) -> None:
        """Drains and returns are written by the API: re-read the (few) nodes not ready."""
        rows = await health_store.not_ready_rows(self.pool)
        for n in list(self.states):
            r = rows.get(n)
            st = NodeState(r.state) if r is not None else NodeState.READY
            if st != self.states[n]:
                log.info("node %s is %s (written elsewhere)", n, st)
            self.states[n] = st
            self.drain_evict[n] = bool(r.drain_evict) if r is not None else False
        for n, r in rows.items():
            if n not in self.states:
                self.states[n] = NodeState(r.state)

    # ------------------------------------------------------------------ one node

    def _entry(self, node_id: str) -> Any:
        table = self._table()
        e = table.get(node_id) if table is not None else None
        if e is None or e.received_at < self.took_over_at:
            return None  # heard by an earlier leadership of this process: not evidence now
        return e

    @staticmethod
    def _ranks(report: Any) -> tuple[RankView, ...]:
        return tuple(
            RankView(r.lease_id, r.job_id, r.epoch, r.attempt, r.step, r.step_age_s, tuple(r.gpu_indices))
            for r in report.running
        )

    def _live(self, node_id: str) -> set[str]:
        if self.leader is None:
            return set()
        return {lid for lid in self.leader.node_leases.get(node_id, ()) if not self.is_burn_in(lid)}

    def _live_views(self, node_id: str) -> dict[str, LeaseView]:
        out = {}
        for lid in self._live(node_id):
            lz = self.leases.get(lid)
            if lz is not None:
                out[lid] = LeaseView(lid, lz.job_id, lz.attempt, lz.epoch, lz.gpu_indices, 0.0)
        return out

    async def _lease_rows(self, lease_ids: set[str]) -> dict[str, health_store.LeaseRow]:
        unknown = [lid for lid in lease_ids if lid not in self.leases]
        if unknown:
            self.leases.update(await health_store.leases(self.pool, unknown))
            if len(self.leases) > 200_000:
                self.leases = {k: v for k, v in list(self.leases.items())[-100_000:]}
        return {lid: self.leases[lid] for lid in lease_ids if lid in self.leases}

    def observe(self, node_id: str, now: float) -> NodeObservation:
        entry = self._entry(node_id)
        gpus: tuple[GpuView, ...] = ()
        running: tuple[RankView, ...] = ()
        if entry is not None:
            rep = entry.report()
            gpus = tuple(GpuView(g.index, g.health, g.sm_util, g.ecc_dbe, tuple(g.xids), tuple(g.faults)) for g in rep.gpus)
            running = tuple(r for r in self._ranks(rep) if not self.is_burn_in(r.lease_id))
        return NodeObservation(
            node_id=node_id,
            state=self.states[node_id],
            last_heartbeat_at=entry.received_at if entry is not None else None,
            took_over_at=self.took_over_at,
            gpus=gpus,
            running=running,
            live_leases=frozenset(self._live(node_id)),
            silent_since=self.silent_since.get(node_id),
        )

    async def _node(self, epoch: int, node_id: str, now: float) -> None:
        await self._record_agent_addr(epoch, node_id)
        obs = self.observe(node_id, now)
        d = decide(obs, self.params, now)
        if obs.last_heartbeat_at is not None and now - obs.last_heartbeat_at < self.params.suspect_after_s:
            await self._reconcile_missing(epoch, node_id, obs, now)
        if self.states[node_id] == NodeState.BURN_IN:
            d = await self._burn_in_progress(epoch, node_id, obs, d, now)
        if d is None:
            return
        if d.changes:
            ok = await self._write(epoch, node_id, d, obs)
            if not ok:
                return
        for action in d.transition.actions:
            if action == Action.RECOVER:
                await self._recover(epoch, node_id, d, obs)
            elif action == Action.BURN_IN:
                pass  # started by _burn_in_progress on the next pass (the node is burn_in now)

    async def _record_agent_addr(self, epoch: int, node_id: str) -> None:
        """The agent advertises where it serves rank logs in every heartbeat; write it to
        nodes.agent_addr when it differs (a new agent, a restart on another port), so the API
        can proxy logs and the leader knows the host for a job's rendezvous."""
        entry = self._entry(node_id)
        addr = entry.agent_addr if entry is not None else ""
        if not addr or self.agent_addrs.get(node_id) == addr:
            return
        await health_store.set_agent_addr(
            self.pool, scope=self.settings.leader_scope, epoch=epoch, node_id=node_id, addr=addr
        )
        self.agent_addrs[node_id] = addr
        log.info("%s: agent at %s", node_id, addr)

    async def _write(self, epoch: int, node_id: str, d: Decision, obs: NodeObservation) -> bool:
        to = d.transition.to
        reason = f"{d.event.value}: {d.detail or d.transition.why}"
        ok = await health_store.set_node_state(
            self.pool, scope=self.settings.leader_scope, epoch=epoch, node_id=node_id, expect=(d.frm.value,),
            to=to.value, reason=reason[:500], actor=self.actor, detail={"event": d.event.value, "why": d.transition.why},
        )  # fmt: skip
        if not ok:
            row = await self.pool.fetchrow("SELECT state, drain_evict FROM nodes WHERE node_id = $1", node_id)
            if row is not None:
                self.states[node_id] = NodeState(row["state"])
                self.drain_evict[node_id] = row["drain_evict"]
            return False
        log.warning("node %s: %s -> %s (%s)", node_id, d.frm, to, reason) if to != NodeState.READY else log.info(
            "node %s: %s -> %s (%s)", node_id, d.frm, to, reason
        )
        NODE_TRANSITIONS.labels(d.frm.value, to.value, d.event.value).inc()
        self.decisions.append((node_id, d.frm.value, d.event.value, to.value))
        del self.decisions[:-1000]
        self.states[node_id] = to
        if to in (NodeState.SUSPECT, NodeState.DOWN) and node_id not in self.silent_since:
            self.silent_since[node_id] = obs.last_heartbeat_at if obs.last_heartbeat_at is not None else self.took_over_at
        elif to == NodeState.READY:
            self.silent_since.pop(node_id, None)
            self.burn_in_retry_at.pop(node_id, None)
        if to != NodeState.BURN_IN:
            b = self.burn_ins.pop(node_id, None)
            if b is not None and not b.done:
                self._spawn(self._stop_burn_in(node_id, b, "burn-in abandoned: node " + to.value))
        return True

    # ------------------------------------------------------------------ recovery

    async def _recover(self, epoch: int, node_id: str, d: Decision, obs: NodeObservation) -> None:
        if d.event == Event.HANG:
            lease_ids = {r.lease_id for r in d.hung} & set(obs.live_leases)
        else:
            lease_ids = set(obs.live_leases)
        if not lease_ids:
            return
        rows = await self._lease_rows(lease_ids)
        entry = self._entry(node_id)
        wall = time.time()
        failed_at = wall
        if d.event == Event.LOST:
            table = self._table()
            last = table.get(node_id) if table is not None else None
            failed_at = last.received_wall if last is not None else wall - (time.monotonic() - self.took_over_at)
        elif entry is not None:
            failed_at = entry.received_wall
        cause = {Event.LOST: "node_down", Event.FATAL: "fatal_fault", Event.HANG: "hang"}.get(d.event, d.event.value)
        for lz in rows.values():
            key = (lz.job_id, lz.attempt)
            rec = self.recovering.get(key)
            if rec is None:
                rec = _Recovery(lz.job_id, lz.attempt, node_id, cause, failed_at)
                self.recovering[key] = rec
                RECOVERIES.labels(cause).inc()
                log.warning("recovering job %s attempt %d: node %s %s (%s)", lz.job_id, lz.attempt, node_id, cause, d.detail)
            await self._signal_failed(rec, f"node {node_id}: {cause}: {d.detail}"[:300])

    async def _signal_failed(self, rec: _Recovery, reason: str) -> None:
        now = time.monotonic()
        if now < rec.next_signal:
            return
        rec.next_signal = now + self.settings.recovery_resignal_s
        try:
            await self.client.get_workflow_handle(rec.job_id).signal(
                m.SIGNAL_NODE_FAILED, m.NodeFailed(rec.job_id, rec.attempt, rec.node_id, reason)
            )
        except RPCError as e:
            if e.status != RPCStatusCode.NOT_FOUND:
                log.warning("node_failed to %s not delivered: %s", rec.job_id, e)

    async def _resignal_recoveries(self, epoch: int) -> None:
        """Keep telling jobs whose lease on a failed node is still live (a lost signal)."""
        pending = [r for r in self.recovering.values() if not r.measured]
        if not pending:
            return
        for r in pending:
            if any(
                lz.job_id == r.job_id and lz.attempt == r.attempt
                for lid in self._live(r.node_id)
                if (lz := self.leases.get(lid)) is not None
            ):
                await self._signal_failed(r, f"node {r.node_id}: {r.cause} (re-sent)")

    async def _measure_restarts(self) -> None:
        pending = [r for r in self.recovering.values() if not r.measured]
        if not pending:
            return
        jobs = await health_store.job_attempts(self.pool, sorted({r.job_id for r in pending}))
        for r in pending:
            j = jobs.get(r.job_id)
            if j is None:
                r.measured = True
                continue
            state, attempt, started_at = j
            if attempt > r.attempt and state == "RUNNING" and started_at is not None:
                r.measured = True
                secs = max(0.0, started_at.timestamp() - r.failed_at)
                FAILURE_TO_RESTART.labels(r.cause).observe(secs)
                self.restarts.append(RestartSample(r.job_id, r.attempt, r.node_id, r.cause, secs))
                del self.restarts[:-1000]
                log.info("job %s restarted %.1fs after its node %s failed (%s)", r.job_id, secs, r.node_id, r.cause)
            elif state in m.TERMINAL_STATES:
                r.measured = True
        if len(self.recovering) > 10_000:
            self.recovering = {k: v for k, v in self.recovering.items() if not v.measured}

    # ------------------------------------------------------------------ reconciliation

    async def _reconcile_missing(self, epoch: int, node_id: str, obs: NodeObservation, now: float) -> None:
        """A live lease of a RUNNING job whose rank the agent does not report: released after
        ``missing_task_release_s`` (epoch-checked), and its job told the rank is LOST."""
        reported = {r.lease_id for r in obs.running}
        for lid in reported:
            self.missing_since.pop(lid, None)
        candidates = set(obs.live_leases) - reported
        if not candidates:
            return
        rows = await self._lease_rows(candidates)
        for lid, lz in rows.items():
            job = self.leader.jobs.get(lz.job_id) if self.leader is not None else None
            if job is None or job.state != "RUNNING" or job.attempt != lz.attempt:
                self.missing_since.pop(lid, None)  # not started yet, or being stopped: not missing
                continue
            since = self.missing_since.setdefault(lid, now)
            if now - since < self.settings.missing_task_release_s:
                continue
            self.missing_since.pop(lid, None)
            released = await store.release_lease(
                self.pool, lid, reason=f"reconciliation: task missing for {now - since:.0f}s",
                actor=self.actor, epoch=lz.epoch,
            )  # fmt: skip
            if released:
                RECONCILE.labels("release_missing").inc()
                log.warning("%s: lease %s released: its task is missing for %.0fs", node_id, lid, now - since)
                if self.forward_status is not None:
                    self.forward_status(TaskStatus(
                        node_id=node_id, lease_id=lid, job_id=lz.job_id, attempt=lz.attempt, epoch=lz.epoch,
                        rank=lz.rank, state=TaskState.LOST, at=datetime.now(UTC),
                    ))  # fmt: skip

    # ------------------------------------------------------------------ drain

    async def _evict_drained(self, epoch: int) -> None:
        """``POST /v1/nodes/{id}:drain {"evict": true}``: preempt the node's jobs now."""
        for node_id, st in self.states.items():
            if st != NodeState.DRAINING or not self.drain_evict.get(node_id):
                continue
            rows = await self._lease_rows(self._live(node_id))
            for lz in rows.values():
                key = (lz.job_id, lz.attempt)
                if key in self.evicted:
                    continue
                o = await job_store.mark_preempting(
                    self.pool, scope=self.settings.leader_scope, epoch=epoch, job_id=lz.job_id, attempt=lz.attempt,
                    reason=f"node {node_id} drained (evict)", by_job=None, actor=self.actor,
                )  # fmt: skip
                self.evicted.add(key)
                if o.applied:
                    await job_signals.signal_preempt(
                        self.client, m.PreemptRequest(lz.job_id, lz.attempt, epoch, f"node {node_id} drained", None)
                    )

    # ------------------------------------------------------------------ burn-in

    async def _burn_in_progress(self, epoch: int, node_id: str, obs: NodeObservation, d: Decision | None,
                                now: float) -> Decision | None:  # fmt: skip
        """Start, watch and judge the node's burn-in; returns the decision to apply."""
        from control.node_states import transition

        if d is not None and d.event in (Event.LOST, Event.FATAL, Event.HANG):
            return d  # the table fails the burn-in
        b = self.burn_ins.get(node_id)
        if b is None:
            fresh = obs.last_heartbeat_at is not None and now - obs.last_heartbeat_at < self.params.suspect_after_s
            if not fresh or obs.live_leases or obs.running or now < self.burn_in_retry_at.get(node_id, 0.0):
                return None
            self.burn_in_seq += 1
            lease_id = f"{BURN_IN_PREFIX}{node_id}-{epoch}-{self.burn_in_seq}"
            b = _BurnIn(lease_id, now)
            self.burn_ins[node_id] = b
            log.info("node %s: burn-in %s starts", node_id, lease_id)
            self._spawn(self._start_burn_in(epoch, node_id, b))
            return None
        entry = self._entry(node_id)
        if entry is not None:
            rep = entry.report()
            mine = next((r for r in rep.running if r.lease_id == b.lease_id), None)
            if mine is not None:
                util = {g.index: g.sm_util for g in rep.gpus}
                b.busy |= {i for i in mine.gpu_indices if (util.get(i) or 0.0) > self.params.idle_util_pct}
        verdict: Event | None = None
        why = ""
        if b.failed:
            verdict, why = Event.BURN_IN_FAILED, b.failed
        elif b.done:
            gpus = self._node_gpus(node_id)
            if b.exit_code != 0:
                verdict, why = Event.BURN_IN_FAILED, f"burn-in exited with {b.exit_code}"
            elif len(b.busy) < gpus:
                verdict, why = Event.BURN_IN_FAILED, f"GPUs never busy during burn-in: {sorted(set(range(gpus)) - b.busy)}"
            else:
                verdict, why = Event.BURN_IN_PASSED, "burn-in passed on every GPU"
        elif now - b.started > self.settings.burn_in_timeout_s:
            verdict, why = Event.BURN_IN_FAILED, f"burn-in not done in {self.settings.burn_in_timeout_s:.0f}s"
        if verdict is None:
            return None
        if verdict == Event.BURN_IN_FAILED:
            self.burn_in_retry_at[node_id] = now + self.settings.burn_in_retry_s
            if not b.done:
                self._spawn(self._stop_burn_in(node_id, b, why))
        self.burn_ins.pop(node_id, None)
        return Decision(obs.state, verdict, transition(obs.state, verdict), why)

    def _node_gpus(self, node_id: str) -> int:
        n = self.leader.nodes.get(node_id) if self.leader is not None else None
        return n.gpus if n is not None else self.settings.demo_gpus_per_node

    async def _start_burn_in(self, epoch: int, node_id: str, b: _BurnIn) -> None:
        from activities.job_activities import node_queue
        from workflows.burn_in import BURN_IN_WORKFLOW, BurnInInput

        s = self.settings
        node = self.leader.nodes.get(node_id) if self.leader is not None else None
        env = {"GPUFLEET_BURN_IN_MODE": "simulated"} if s.agent_nvml_backend == "simulated" else {}
        inp = BurnInInput(
            node_id=node_id,
            lease_id=b.lease_id,
            epoch=epoch,
            task_queue=node_queue(s, node_id, node.task_queue if node is not None else None),
            gpu_indices=list(range(self._node_gpus(node_id))),
            command=[sys.executable, str(BURN_IN_SCRIPT), "--seconds", str(s.burn_in_seconds)],
            start_timeout_s=s.start_task_timeout_s,
            env=env,
        )
        try:
            res = await self.client.execute_workflow(
                BURN_IN_WORKFLOW, inp, id=b.lease_id, task_queue=s.control_task_queue, result_type=StartTaskResult
            )
            if not res.accepted:
                b.failed = f"burn-in refused by the agent: {res.reason}"
        except asyncio.CancelledError:
            raise
        except Exception as e:
            b.failed = f"burn-in could not start: {str(e)[:200]}"
        if b.failed:
            self._dirty.add(node_id)
            self._kick.set()

    async def _stop_burn_in(self, node_id: str, b: _BurnIn, reason: str) -> None:
        """Nothing to call directly: an unconfirmed burn-in rank is stopped by reconciliation
        (no live lease) or fences itself; just log it."""
        log.info("node %s: burn-in %s ends: %s", node_id, b.lease_id, reason)

    # ------------------------------------------------------------------ misc

    def _gauges(self) -> None:
        counts = {s: 0 for s in NodeState}
        for st in self.states.values():
            counts[st] += 1
        for s, n in counts.items():
            NODES.labels(s.value).set(n)
        cluster = getattr(self.leader, "cluster", None)
        if cluster is not None:
            HOT_SPARES.set(sum(len(cluster.spares(j)) for j in cluster.spare_owners()))

    def _spawn(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    def stats(self) -> dict[str, Any]:
        return {
            "states": {s.value: sum(1 for x in self.states.values() if x == s) for s in NodeState},
            "recovering": sum(1 for r in self.recovering.values() if not r.measured),
            "restarts": [(r.job_id, r.cause, round(r.seconds, 2)) for r in self.restarts[-20:]],
        }


__all__ = ["BURN_IN_PREFIX", "FAILURE_TO_RESTART", "HealthMonitor", "RestartSample", "params_from_settings"]
