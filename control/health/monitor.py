"""The leader's health monitor (docs/design.md, Health): the shell around ``node_states``.

    monitor = HealthMonitor(pool, client, settings, state=leader_state,
                            table=lambda: heartbeat_server.table, forward_status=forwarder.submit)
    await monitor.take_over(epoch)      # on takeover: empty memory, the quiet period starts
    server = HeartbeatServer(..., on_heartbeat=monitor.on_heartbeat,
                             leases_to_stop=monitor.reconciler.stops_for)
    monitor.drop()                      # leadership lost

While this process leads it decides per node with the pure ``node_states.decide``
(heartbeat age, fatal faults, hangs, live leases) on every fresh heartbeat and every
``health_sweep_s``, and writes only state *changes* (``store.nodes.set_node_state``:
epoch-checked, audited, compare-and-set); the placement cycle sees them through the
``changes`` sequence (no new placements on a node that is not ready). The node's
actions are carried out by its neighbours in this package: recovery of its gangs
(``recovery``), burn-in (``burn_in``) and reconciliation of its agent's report against
the store (``reconcile``). A node out of service (down / cordoned) stays out until its
agent is back, reports no rank left and no live lease remains (or the self-fence window
``unconfirmed_kill_s x fence_margin`` has passed), then it burns in.

Silence is judged from this leader's own takeover (``node_states.silence``), and every sweep
first counts the silent nodes for the mass-silence guard (``silence_guard``): while so many
are silent at once that the fault is likely the control plane's or the network's, no node is
marked down and no job recovered for silence. The guard's changes are logged, audited
(``health_guard``) and exported (``gpufleet_health_guard_engaged``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from temporalio.client import Client

from common.contracts import TaskStatus
from common.settings import Settings
from control.health.burn_in import BurnIns, is_burn_in
from control.health.gpu_use import GpuUse
from control.health.metrics import HEALTH_GUARD, HOT_SPARES, NODE_TRANSITIONS, NODES, SILENT_NODES
from control.health.node_states import (
    Action,
    Decision,
    Event,
    GpuView,
    HealthParams,
    NodeObservation,
    NodeState,
    RankView,
    decide,
)
from control.health.reconcile import Reconciler, rank_views
from control.health.recovery import Recoveries
from control.health.silence_guard import GuardVerdict, SilenceCensus, count_silence, hold, judge
from control.leader.metrics import ControlMetrics
from control.leader.state import LeaderState
from store import node_blame, nodes
from store.audit import write_audit
from store.errors import StaleEpoch, StoreError
from store.leadership import check_epoch
from store.tx import Pool, transaction

log = logging.getLogger("gpufleet.control.health")

GUARD_RECHECK_S = 0.5  # a census older than this is taken again before a node is marked down for silence


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
        mass_silence_fraction=s.health_mass_silence_fraction,
        mass_silence_min_nodes=s.health_mass_silence_min_nodes,
    )


class HealthMonitor:
    def __init__(
        self,
        pool: Pool,
        client: Client,
        settings: Settings,
        *,
        state: LeaderState,
        table: Callable[[], Any],  # -> control.agent_link.HeartbeatTable | None
        forward_status: Callable[[TaskStatus], None] | None = None,
        actor: str = "health",
        metrics: ControlMetrics | None = None,
        idle_victims_first: bool = True,
    ) -> None:
        self.pool = pool
        self.client = client
        self.settings = settings
        self.state = state
        self._table = table
        self.actor = actor
        self.params = params_from_settings(settings)
        self.epoch: int | None = None
        self.took_over_at = 0.0
        self.took_over_wall = 0.0
        self.states: dict[str, NodeState] = {}
        self.drain_evict: dict[str, bool] = {}
        self.silent_since: dict[str, float] = {}
        self.agent_addrs: dict[str, str | None] = {}  # node -> nodes.agent_addr as known written
        self.decisions: list[tuple[str, str, str, str]] = []  # (node, from, event, to) written (tests)
        self.guard_engaged = False  # the mass-silence guard holds (silence_guard)
        self.guard_since: float | None = None  # monotonic, while engaged
        self.census = SilenceCensus(0, 0)
        self._census_at = float("-inf")  # monotonic: when self.census was taken
        self.guard_changes: list[tuple[float, bool, str]] = []  # (wall time, engaged, why) (tests, bench)
        self._guard_unaudited: list[tuple[GuardVerdict, SilenceCensus, float | None]] = []
        self._dirty: set[str] = set()
        self._kick = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._next_sweep = 0.0
        self.blamed: dict[str, str] = {}  # node -> why the jobs' record blames it (store.node_blame)
        self._next_blame = 0.0
        self._bg: set[asyncio.Task] = set()
        self.burn_ins = BurnIns(
            client, settings, self.params, node_info=state.nodes.get, kick=self.kick, spawn=self._spawn
        )
        self.metrics = metrics
        self.recoveries = Recoveries(pool, client, settings, actor=actor, on_failure=self._failure_lost)
        self.gpu_use = GpuUse(pool, settings, state, table, metrics=metrics, idle_victims_first=idle_victims_first)
        self.reconciler = Reconciler(
            pool, settings, state, self.burn_ins, actor=actor, forward_status=forward_status, spawn=self._spawn
        )

    @property
    def restarts(self) -> list:
        return self.recoveries.restarts

    # ------------------------------------------------------------------ leadership

    async def take_over(self, epoch: int) -> None:
        """A new leadership: forget everything, read the node states, start the quiet period."""
        self.drop()
        self.epoch = epoch
        self.took_over_at = time.monotonic()
        self.took_over_wall = time.time()
        rows = await nodes.node_rows(self.pool)
        self.states = {n: NodeState(r.state) for n, r in rows.items()}
        self.drain_evict = {n: r.drain_evict for n, r in rows.items()}
        self.agent_addrs = await nodes.agent_addrs(self.pool)
        self.blamed, self._next_blame = {}, 0.0
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
        self.agent_addrs.clear()
        self._dirty.clear()
        self.guard_engaged = False
        self.guard_since = None
        self._census_at = float("-inf")
        self._guard_unaudited.clear()
        HEALTH_GUARD.set(0)
        NODES.clear()  # a follower exports no node census (the new leader's is the one)
        HOT_SPARES.set(0)
        self.burn_ins.drop()
        self.recoveries.drop()
        self.reconciler.drop()
        self.gpu_use.drop()

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
        self.kick(entry.node_id)

    def kick(self, node_id: str) -> None:
        self._dirty.add(node_id)
        self._kick.set()

    def confirmed_leases(self, node_id: str) -> list[str]:
        """What the node's heartbeat ack confirms: its live leases, and its burn-in rank."""
        if self.state.epoch is None:
            return []
        return sorted(self.state.node_leases.get(node_id, ())) + self.burn_ins.confirmed(node_id)

    def on_task_status(self, status: TaskStatus) -> bool:
        """True when the report is a burn-in rank's (the monitor's, not a job's)."""
        return self.burn_ins.on_task_status(status)

    # ------------------------------------------------------------------ the loop

    async def _loop(self, epoch: int) -> None:
        while self.epoch == epoch:
            try:
                await asyncio.wait_for(self._kick.wait(), timeout=self.settings.health_sweep_s)
            except TimeoutError:
                pass
            self._kick.clear()
            try:
                await self._pass(epoch)
            except asyncio.CancelledError:
                raise
            except StaleEpoch:
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
            await self._read_blame(now)
            await self._judge_guard(epoch, now)
            todo = set(self.states)
        else:
            todo = set(self._dirty)
        self._dirty.clear()
        try:
            for node_id in sorted(todo):
                if node_id not in self.states:
                    continue
                await self._node(epoch, node_id, time.monotonic())
        finally:
            self.recoveries.flush()  # one node_failed per job for the nodes this pass found
        if sweep:
            await self._resignal_recoveries()
            await self.recoveries.measure_restarts()
            await self._evict_drained(epoch)
            await self.gpu_use.pass_(self.took_over_at)
            self._gauges()

    async def _read_admin_changes(self) -> None:
        """Drains and returns are written by the API: re-read the (few) nodes not ready."""
        rows = await nodes.not_ready_rows(self.pool)
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

    async def _read_blame(self, now: float) -> None:
        """Every ``node_blame_check_s``: the ready nodes the jobs' own record blames, which
        ``observe`` adds to what their agents report (the health table's ``unfit``)."""
        s = self.settings
        if s.node_blame_min_jobs is None or now < self._next_blame:
            return
        self._next_blame = now + s.node_blame_check_s
        try:
            blamed = await node_blame.nodes_failing_jobs(
                self.pool, window_s=s.node_blame_window_s, ran_s=s.node_blame_ran_s,
                min_jobs=s.node_blame_min_jobs, min_teams=s.node_blame_min_teams,
            )  # fmt: skip
        except (OSError, StoreError) as e:
            # an extra source of evidence: its failure must not stop the pass (silence, faults)
            log.warning("health monitor: cannot read the jobs' record of failing nodes: %s", e)
            return
        for n, why in blamed.items():
            if n not in self.blamed:
                log.warning("node %s: %s", n, why)
        self.blamed = blamed

    # ------------------------------------------------------------------ one node

    def _entry(self, node_id: str) -> Any:
        table = self._table()
        e = table.get(node_id) if table is not None else None
        if e is None or e.received_at < self.took_over_at:
            return None  # heard by an earlier leadership of this process: not evidence now
        return e

    def _live(self, node_id: str) -> set[str]:
        return {lid for lid in self.state.node_leases.get(node_id, ()) if not is_burn_in(lid)}

    def observe(self, node_id: str, now: float) -> NodeObservation:
        entry = self._entry(node_id)
        gpus: tuple[GpuView, ...] = ()
        running: tuple[RankView, ...] = ()
        node_faults: tuple[str, ...] = ()
        if entry is not None:
            rep = entry.report()
            gpus = tuple(
                GpuView(g.index, g.health, g.sm_util, g.ecc_dbe, tuple(g.xids), tuple(g.faults)) for g in rep.gpus
            )
            running = tuple(r for r in rank_views(rep) if not is_burn_in(r.lease_id))
            node_faults = rep.node_faults
        if node_id in self.blamed and self.states[node_id] in (NodeState.READY, NodeState.SUSPECT):
            node_faults = (*node_faults, self.blamed[node_id])
        return NodeObservation(
            node_id=node_id,
            state=self.states[node_id],
            last_heartbeat_at=entry.received_at if entry is not None else None,
            took_over_at=self.took_over_at,
            gpus=gpus,
            running=running,
            live_leases=frozenset(self._live(node_id)),
            silent_since=self.silent_since.get(node_id),
            node_faults=node_faults,
        )

    async def _node(self, epoch: int, node_id: str, now: float) -> None:
        await self._record_agent_addr(epoch, node_id)
        obs = self.observe(node_id, now)
        d = decide(obs, self.params, now)
        if (
            d is not None
            and d.event == Event.LOST
            and not self.guard_engaged
            and now - self._census_at >= GUARD_RECHECK_S
        ):
            # a pass can take minutes (thousands of writes after a mass event): a node is not
            # marked down on the census taken at its start
            await self._judge_guard(epoch, now)
        d = hold(d, engaged=self.guard_engaged)
        if obs.last_heartbeat_at is not None and now - obs.last_heartbeat_at < self.params.suspect_after_s:
            await self.reconciler.release_missing(node_id, obs, now)
        if self.states[node_id] == NodeState.BURN_IN:
            entry = self._entry(node_id)
            d = self.burn_ins.progress(epoch, node_id, obs, d, now, entry.report() if entry is not None else None)
        if d is None:
            return
        if d.changes:
            ok = await self._write(epoch, node_id, d, obs)
            if not ok:
                return
        for action in d.transition.actions:
            if action == Action.RECOVER:
                await self._recover(node_id, d, obs)
            elif action == Action.BURN_IN:
                pass  # started by burn_ins.progress on the next pass (the node is burn_in now)

    async def _record_agent_addr(self, epoch: int, node_id: str) -> None:
        """The agent advertises where it serves rank logs in every heartbeat; write it to
        nodes.agent_addr when it differs (a new agent, a restart on another port), so the API
        can proxy logs and the leader knows the host for a job's rendezvous."""
        entry = self._entry(node_id)
        addr = entry.agent_addr if entry is not None else ""
        if not addr or self.agent_addrs.get(node_id) == addr:
            return
        await nodes.set_agent_addr(self.pool, scope=self.settings.leader_scope, epoch=epoch, node_id=node_id, addr=addr)
        self.agent_addrs[node_id] = addr
        log.info("%s: agent at %s", node_id, addr)

    async def _write(self, epoch: int, node_id: str, d: Decision, obs: NodeObservation) -> bool:
        to = d.transition.to
        reason = f"{d.event.value}: {d.detail or d.transition.why}"
        ok = await nodes.set_node_state(
            self.pool, scope=self.settings.leader_scope, epoch=epoch, node_id=node_id, expect=(d.frm.value,),
            to=to.value, reason=reason[:500], actor=self.actor, detail={"event": d.event.value, "why": d.transition.why},
        )  # fmt: skip
        if not ok:
            row = await nodes.node_row(self.pool, node_id)
            if row is not None:
                self.states[node_id] = NodeState(row.state)
                self.drain_evict[node_id] = row.drain_evict
            return False
        log.warning("node %s: %s -> %s (%s)", node_id, d.frm, to, reason) if to != NodeState.READY else log.info(
            "node %s: %s -> %s (%s)", node_id, d.frm, to, reason
        )
        NODE_TRANSITIONS.labels(d.frm.value, to.value, d.event.value).inc()
        self.decisions.append((node_id, d.frm.value, d.event.value, to.value))
        del self.decisions[:-1000]
        self.states[node_id] = to
        if to not in (NodeState.READY, NodeState.SUSPECT):
            self.blamed.pop(node_id, None)  # a new state: only what happens from now on is evidence
        if to in (NodeState.SUSPECT, NodeState.DOWN) and node_id not in self.silent_since:
            self.silent_since[node_id] = (
                obs.last_heartbeat_at if obs.last_heartbeat_at is not None else self.took_over_at
            )
        elif to == NodeState.READY:
            self.silent_since.pop(node_id, None)
            self.burn_ins.passed(node_id)
        if to != NodeState.BURN_IN:
            self.burn_ins.node_left_burn_in(node_id, to.value)
        return True

    async def _recover(self, node_id: str, d: Decision, obs: NodeObservation) -> None:
        if d.event == Event.HANG:
            lease_ids = {r.lease_id for r in d.hung} & set(obs.live_leases)
        else:
            lease_ids = set(obs.live_leases)
        if not lease_ids:
            return
        rows = await self.state.lease_rows(lease_ids)
        if d.event == Event.LOST:  # the last heartbeat ever heard, else the takeover
            table = self._table()
            last = table.get(node_id) if table is not None else None
            failed_at = last.received_wall if last is not None else self.took_over_wall
        else:  # the heartbeat that reported the fault
            entry = self._entry(node_id)
            failed_at = entry.received_wall if entry is not None else time.time()
        self.recoveries.recover(node_id, d, rows.values(), failed_at)

    async def _resignal_recoveries(self) -> None:
        live: set[str] = set()
        for node_id in self.recoveries.nodes_recovering():
            live |= self._live(node_id)
        if live:
            rows = await self.state.lease_rows(live)
            self.recoveries.resignal(rows.values())

    async def _evict_drained(self, epoch: int) -> None:
        for node_id, st in self.states.items():
            if st == NodeState.DRAINING and self.drain_evict.get(node_id):
                rows = await self.state.lease_rows(self._live(node_id))
                await self.recoveries.evict_drained(epoch, node_id, rows.values())

    # ------------------------------------------------------------------ the mass-silence guard

    def _last_heard(self, node_id: str) -> float | None:
        entry = self._entry(node_id)
        return entry.received_at if entry is not None else None

    async def _judge_guard(self, epoch: int, now: float) -> None:
        """Count the silent nodes; engage or release the guard (logged, audited, exported)."""
        census = count_silence(
            ((st, self._last_heard(n)) for n, st in self.states.items()), self.took_over_at, self.params, now
        )
        self.census = census
        self._census_at = now
        SILENT_NODES.set(census.silent)
        verdict = judge(self.guard_engaged, census, self.params)
        if verdict.changed:
            held_s = now - self.guard_since if self.guard_since is not None else None
            self.guard_engaged = verdict.engaged  # in memory first: holding is the safe side
            self.guard_since = now if verdict.engaged else None
            self.guard_changes.append((time.time(), verdict.engaged, verdict.why))
            del self.guard_changes[:-100]
            if verdict.engaged:
                log.warning("mass-silence guard engaged: %s", verdict.why)
            else:
                log.warning("mass-silence guard released after %.1fs: %s", held_s or 0.0, verdict.why)
            self._guard_unaudited.append((verdict, census, held_s))
        HEALTH_GUARD.set(1 if self.guard_engaged else 0)
        while self._guard_unaudited:
            try:
                await self._audit_guard(epoch, *self._guard_unaudited[0])
            except StaleEpoch:
                raise
            except Exception as e:  # retried at the next sweep; the guard acts meanwhile
                log.warning("mass-silence guard change not audited yet: %s", e)
                return
            self._guard_unaudited.pop(0)

    async def _audit_guard(self, epoch: int, v: GuardVerdict, c: SilenceCensus, held_s: float | None) -> None:
        detail = {
            "engaged": v.engaged, "silent": c.silent, "in_service": c.in_service,
            "fraction": round(c.fraction, 4), "threshold": self.params.mass_silence_fraction, "epoch": epoch,
            **({"held_s": round(held_s, 1)} if held_s is not None else {}),
        }  # fmt: skip
        reason = ("engaged: " if v.engaged else "released: ") + v.why
        async with transaction(self.pool) as conn:
            await check_epoch(conn, self.settings.leader_scope, epoch)
            await write_audit(conn, self.actor, "health_guard", "cluster", reason[:500], detail)

    # ------------------------------------------------------------------ misc

    def _gauges(self) -> None:
        counts = {s: 0 for s in NodeState}
        for st in self.states.values():
            counts[st] += 1
        for s, n in counts.items():
            NODES.labels(s.value).set(n)
        cluster = self.state.cluster
        if cluster is not None:
            HOT_SPARES.set(sum(len(cluster.spares(j)) for j in cluster.spare_owners()))

    def _failure_lost(self, cause: str, job_id: str, failed_at: float) -> None:
        """Count the work a node failure threw away: the job's GPUs since its last checkpoint."""
        cluster = self.state.cluster
        rj = cluster.get_running(job_id) if cluster is not None else None
        if rj is not None and self.metrics is not None:
            self.metrics.failed(cause, rj.charge * max(0.0, failed_at - rj.lost_since))

    def _spawn(self, coro: Any) -> None:
        t = asyncio.create_task(coro)
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    def stats(self) -> dict[str, Any]:
        return {
            "states": {s.value: sum(1 for x in self.states.values() if x == s) for s in NodeState},
            "guard": {
                "engaged": self.guard_engaged,
                "silent": self.census.silent,
                "in_service": self.census.in_service,
            },
            "recovering": self.recoveries.pending(),
            "restarts": [(r.job_id, r.cause, round(r.seconds, 2)) for r in self.recoveries.restarts[-20:]],
        }


__all__ = ["HealthMonitor", "params_from_settings"]
