"""The leader's in-memory placement state (docs/design.md, Leadership and Placement).

``LeaderState`` keeps the engine's ``ClusterState`` and ``JobQueue`` in memory, built
in full on takeover (``take_over``: one repeatable-read snapshot of the store) and
refreshed incrementally from the ``changes`` sequence (``refresh``: only the rows named
by new changes are read). It also keeps what the health monitor and reconciliation ask
the leader: each job's state and attempt, each node's row, the live leases per node.

A job that reaches STARTING or PREEMPTING without this leader's signal (another
leader's commit, or a cycle that failed after committing) is handed to ``JobSignals``
to be signalled; on takeover every such job is.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass
from typing import Any

import placement as engine
from common.settings import Settings
from control.leader.signals import JobSignals
from placement import ClusterState, JobQueue, JobSpec, NodeGpus, NodeHealth, Placement, Policy, ReplicaSlot, Topology
from placement.lifecycle import ACTIVE, TERMINAL, JobState
from store import allocations, job_spec, leader_view
from store.allocations import LeaseRow
from store.change_feed import ChangeFeed
from store.tx import Pool
from workflows import messages as m

log = logging.getLogger("gpufleet.control.leader")


def policy_from_settings(settings: Settings) -> Policy:
    return Policy(
        lookahead=settings.placement_lookahead,
        hot_spare_fraction=settings.hot_spare_fraction,
        preemption_protect_s=settings.preemption_protect_s,
        daily_preemption_budget=settings.preemption_daily_budget,
        claim_borrowed_reservations_after_s=settings.claim_borrowed_reservations_after_s,
        reclaim_small_borrowed_after_s=settings.reclaim_small_borrowed_after_s,
        spares_yield_after_s=settings.spares_yield_after_s,
        borrowed_gang_guard=settings.borrowed_gang_guard,
        borrowed_restart_backoff_s=settings.borrowed_restart_backoff_s,
        pooled_demand_forecast=settings.pooled_demand_forecast,
    )


def _ts(dt: Any) -> float | None:
    return dt.timestamp() if dt is not None else None


def spec_from_row(row: Any, default_grace_s: float) -> JobSpec:
    spec = job_spec.parse_spec(row["spec"])
    topo = spec.get("topology") or {}
    ck = job_spec.spec_checkpoint(spec)
    return JobSpec(
        job_id=row["job_id"],
        team=row["team"],
        priority=row["priority_class"],
        gpu_type=row["gpu_type"],
        replicas=row["replicas"],
        gpus_per_replica=row["gpus_per_replica"],
        topology=Topology(
            pack=topo.get("pack", "any"),
            max_blocks=topo.get("max_blocks"),
            max_blocks_wait_s=topo.get("max_blocks_wait_seconds"),
        ),
        max_runtime_s=float(row["max_runtime_s"]),
        preemptible=bool(ck.get("preemptible", False)),
        grace_s=job_spec.spec_grace_s(spec, default_grace_s),
        submit_time=row["submitted_at"].timestamp(),
        attempt=row["attempt"],
        started_at=_ts(row["started_at"]),
        last_checkpoint_at=_ts(row["last_checkpoint_at"]),
        preemption_times=tuple(t.timestamp() for t in (row["preempted_at"] or ())),
        front=bool(row["front_of_class"]),
        avoid_nodes=frozenset(row["avoid_nodes"] or ()),
    )


@dataclass
class KnownJob:
    """A job that is not terminal, as the leader knows it."""

    state: str
    attempt: int
    spec: JobSpec


@dataclass
class KnownNode:
    block: str
    gpu_type: str
    gpus: int
    state: str
    task_queue: str | None
    agent_addr: str | None


class LeaderState:
    """The leader's in-memory placement state (one per control process)."""

    def __init__(self, pool: Pool, settings: Settings, signals: JobSignals) -> None:
        self.pool = pool
        self.settings = settings
        self.signals = signals
        self.epoch: int | None = None
        self.cluster: ClusterState | None = None
        self.queue = JobQueue()
        self.jobs: dict[str, KnownJob] = {}
        self.nodes: dict[str, KnownNode] = {}
        self.node_leases: dict[str, set[str]] = {}  # live lease ids per node (heartbeat acks confirm them)
        self.feed = ChangeFeed()
        self.lock = asyncio.Lock()
        self._dirty_jobs: set[str] = set()
        self._adopt: list[tuple[str, str, int]] = []
        self.needs_rebuild = False
        self.lease_cache: dict[str, LeaseRow] = {}  # lease rows read so far (rows never change but for state)
        # job -> the attempt whose start the store refused: an earlier attempt had finished
        # (store.errors.EarlierAttemptSucceeded); kept out of the queue until its row moves on
        self.finished_earlier: dict[str, int] = {}

    def labels_of(self, job_id: str) -> m.JobLabels | None:
        """What its workflow's search attributes say about the job (None: not known here)."""
        job = self.jobs.get(job_id)
        if job is None:
            return None
        spec = job.spec
        return m.JobLabels(spec.team, str(spec.priority), spec.gpu_type, spec.total_gpus, spec.submit_time)

    def is_leader(self, epoch: int) -> bool:
        return self.epoch is not None and self.epoch == epoch and self.cluster is not None

    def drop(self) -> None:
        """Forget everything (leadership lost); the next takeover rebuilds."""
        self.epoch = None
        self.cluster = None
        self.queue = JobQueue()
        self.jobs.clear()
        self.nodes.clear()
        self.node_leases = {}
        self._adopt = []
        self._dirty_jobs.clear()
        self.lease_cache.clear()
        self.finished_earlier.clear()
        self.signals.clear()

    async def take_over(self, epoch: int) -> None:
        """Rebuild from the store, then re-signal every gang and victim in flight once (they
        may have been committed by the previous leader and their signal lost)."""
        async with self.lock:
            self.drop()
            await self.rebuild()
            self.epoch = epoch
            now = time.monotonic()
            for job_id, j in self.jobs.items():
                if j.state in (JobState.STARTING, JobState.PREEMPTING):
                    await self.signals.adopt(job_id, j.state, j.attempt, epoch, now)

    async def lease_rows(self, lease_ids: set[str]) -> dict[str, LeaseRow]:
        """The rows of these leases (read once, then cached)."""
        unknown = [lid for lid in lease_ids if lid not in self.lease_cache]
        if unknown:
            self.lease_cache.update(await allocations.lease_rows(self.pool, unknown))
            if len(self.lease_cache) > 200_000:
                self.lease_cache = dict(list(self.lease_cache.items())[-100_000:])
        return {lid: self.lease_cache[lid] for lid in lease_ids if lid in self.lease_cache}

    def hold_finished(self, job_id: str, attempt: int) -> None:
        """Stop planning a job whose ``attempt`` the store refused to start because an earlier
        one had finished: report delivery tells its workflow, which ends the job; until its
        row changes, placing it (or preempting for it) would only be refused again."""
        self.finished_earlier[job_id] = attempt
        self.queue.remove(job_id)

    def mark_dirty(self, job_id: str) -> None:
        """Re-read this job at the next refresh (a commit found the view stale)."""
        self._dirty_jobs.add(job_id)

    def note_checkpoint(self, job_id: str, attempt: int) -> None:
        """An agent reported a completed checkpoint: less work is lost if this job is
        preempted now (victim choice). In memory only; Postgres records the checkpoint
        when the attempt ends."""
        job = self.jobs.get(job_id)
        if self.cluster is None or job is None or job.attempt != attempt or not self.cluster.is_running(job_id):
            return
        if self.cluster.tentative:
            return
        engine.apply_event(self.cluster, engine.Checkpointed(job_id, time.time()), time.time())

    # ------------------------------------------------------------------ rebuild

    async def rebuild(self) -> None:
        t0 = time.perf_counter()
        gc.unfreeze()  # let a previous state be collected
        half_life_s = self.settings.fair_share_half_life_h * 3600.0
        cluster = ClusterState(usage_half_life_s=half_life_s)
        snap = await leader_view.snapshot(self.pool, half_life_s=half_life_s)
        self.feed = snap.feed
        now = time.time()
        for n in snap.nodes:
            self.nodes[n["node_id"]] = KnownNode(
                n["block_id"], n["gpu_type"], n["gpus"], n["state"], n["task_queue"], n["agent_addr"]
            )
            cluster.add_node(n["node_id"], n["block_id"], n["gpu_type"], n["gpus"], NodeHealth.READY)
        for q in snap.quotas:
            cluster.set_quota(q["team"], q["gpu_type"], q["guaranteed"], q["borrow_limit"])
        for u in snap.usage:
            cluster.set_usage(u["team"], u["gpu_type"], float(u["gpu_h"] or 0.0), now)
        by_job: dict[str, list[Any]] = {}
        node_leases: dict[str, set[str]] = {}
        for lz in snap.leases:
            by_job.setdefault(lz["job_id"], []).append(lz)
            node_leases.setdefault(lz["node_id"], set()).add(lz["lease_id"])
        self.node_leases = node_leases
        for row in snap.jobs:
            spec = spec_from_row(row, self.settings.default_grace_s)
            self.jobs[row["job_id"]] = KnownJob(row["state"], row["attempt"], spec)
            if row["state"] == JobState.QUEUED:
                self.queue.push(spec)
            elif row["state"] in ACTIVE:
                mine = [lz for lz in by_job.get(row["job_id"], ()) if lz["attempt"] == row["attempt"]]
                self._allocate_from_leases(cluster, spec, mine, now)
        self.cluster = cluster
        for node_id, n in self.nodes.items():
            if n.state != "ready":
                cluster.set_node_health(node_id, NodeHealth(n.state))
        for row in snap.jobs:
            if row["state"] == JobState.PREEMPTING and cluster.is_running(row["job_id"]):
                if cluster.running(row["job_id"]).preempting_for is None:
                    cluster.mark_preempting(row["job_id"], "")
        gc.collect()
        gc.freeze()  # long-lived state out of the cyclic GC's way (a cycle's p99)
        log.info(
            "leader state rebuilt: %d nodes, %d queued, %d running in %.0f ms",
            len(self.nodes), len(self.queue), len(cluster), (time.perf_counter() - t0) * 1000,
        )  # fmt: skip

    async def rebuild_in_place(self) -> None:
        """Full rebuild while leading (memory disagreed with a commit); signals kept."""
        self.cluster, self.queue = None, JobQueue()
        self.node_leases = {}
        self.jobs.clear()
        self.nodes.clear()
        await self.rebuild()

    def _allocate_from_leases(self, cluster: ClusterState, spec: JobSpec, leases: list[Any], now: float) -> None:
        if not leases:
            return
        held: dict[str, set[int]] = {}
        for lz in leases:
            held.setdefault(lz["node_id"], set()).update(lz["gpu_indices"])
        placement = Placement(
            job_id=spec.job_id,
            gpu_type=spec.gpu_type,
            nodes=tuple(NodeGpus(n, tuple(sorted(g))) for n, g in sorted(held.items())),
            slots=tuple(ReplicaSlot(lz["rank"], lz["node_id"], tuple(lz["gpu_indices"])) for lz in leases),
            blocks=tuple(sorted({self.nodes[n].block for n in held if n in self.nodes})),
            borrowed=any(bool(lz["borrowed"]) for lz in leases),
            gpus=sum(len(g) for g in held.values()),
        )
        try:
            cluster.allocate(spec, placement, now, started_at=spec.started_at or now)
        except Exception as e:  # an inconsistent row must not stop the leader
            log.error("cannot record running job %s: %s", spec.job_id, e)

    # ------------------------------------------------------------------ refresh

    async def refresh(self) -> int:
        """Apply the changes recorded since the last refresh; return how many."""
        assert self.cluster is not None
        rows = await self.feed.read(self.pool)
        if not rows and not self._dirty_jobs:
            return 0
        kinds: dict[str, set[str]] = {"job": set(self._dirty_jobs), "node": set(), "allocation": set(), "quota": set()}
        self._dirty_jobs.clear()
        for r in rows:
            kinds.setdefault(r["kind"], set()).add(r["subject"])
        now = time.time()
        if kinds["node"]:
            await self._refresh_nodes(kinds["node"])
        if kinds["quota"]:
            for q in await leader_view.quotas_by_key(self.pool, sorted(kinds["quota"])):
                self.cluster.set_quota(q["team"], q["gpu_type"], q["guaranteed"], q["borrow_limit"])
        if kinds["job"]:
            await self._refresh_jobs(kinds["job"], now)
        if kinds["allocation"]:
            touched = sorted({subj.rsplit("/", 1)[0] for subj in kinds["allocation"]})
            self.node_leases.update(await leader_view.live_leases_on_nodes(self.pool, touched))
        return len(rows)

    async def _refresh_nodes(self, node_ids: set[str]) -> None:
        assert self.cluster is not None
        for n in await leader_view.nodes_by_id(self.pool, sorted(node_ids)):
            nid = n["node_id"]
            old = self.nodes.get(nid)
            self.nodes[nid] = KnownNode(
                n["block_id"], n["gpu_type"], n["gpus"], n["state"], n["task_queue"], n["agent_addr"]
            )
            if old is None:
                self.cluster.add_node(nid, n["block_id"], n["gpu_type"], n["gpus"], NodeHealth(n["state"]))
            elif old.state != n["state"]:
                engine.apply_event(self.cluster, engine.NodeHealthChanged(nid, NodeHealth(n["state"])), time.time())

    async def _refresh_jobs(self, job_ids: set[str], now: float) -> None:
        assert self.cluster is not None
        rows = await leader_view.jobs_by_id(self.pool, sorted(job_ids))
        seen = set()
        need_leases: list[tuple[JobSpec, int]] = []
        for row in rows:
            jid = row["job_id"]
            seen.add(jid)
            state, attempt = row["state"], row["attempt"]
            known = self.jobs.get(jid)
            running = self.cluster.is_running(jid)
            held = self.finished_earlier.pop(jid, None)
            if state in TERMINAL:
                self.queue.remove(jid)
                if running:
                    engine.apply_event(self.cluster, engine.JobEnded(jid), now)
                self.jobs.pop(jid, None)
                self.signals.forget(jid)
                continue
            spec = spec_from_row(row, self.settings.default_grace_s)
            if state == JobState.QUEUED:
                if running:
                    engine.apply_event(self.cluster, engine.JobEnded(jid, keep_spares=spec.front), now)
                if held == attempt:
                    self.finished_earlier[jid] = attempt  # still the refused attempt: not planned
                else:
                    self.queue.push(spec)
                self.signals.forget(jid)
            else:
                self.queue.remove(jid)
                if not running or (known is not None and known.attempt != attempt):
                    if running:
                        engine.apply_event(self.cluster, engine.JobEnded(jid), now)
                    need_leases.append((spec, attempt))
                elif spec.last_checkpoint_at is not None and (
                    (self.cluster.running(jid).last_checkpoint_at or 0.0) < spec.last_checkpoint_at
                ):
                    engine.apply_event(self.cluster, engine.Checkpointed(jid, spec.last_checkpoint_at), now)
                pending = self.signals.keep_if(jid, state, attempt)
                if (
                    not pending
                    and state in (JobState.STARTING, JobState.PREEMPTING)
                    and (known is None or known.state != state)
                ):
                    # a gang or a victim this leader has not signalled: signal it from the next cycle on
                    self._adopt.append((jid, state, attempt))
            self.jobs[jid] = KnownJob(state, attempt, spec)
        for jid in job_ids - seen:  # deleted rows
            self.queue.remove(jid)
            if self.cluster.is_running(jid):
                engine.apply_event(self.cluster, engine.JobEnded(jid), now)
            self.jobs.pop(jid, None)
        if self._adopt and self.epoch is not None:
            adopt, self._adopt = self._adopt, []
            mono = time.monotonic()
            for jid, state, attempt in adopt:
                await self.signals.adopt(jid, state, attempt, self.epoch, mono)
        if need_leases:
            by_job: dict[str, list[Any]] = {}
            for lz in await leader_view.live_leases_of_jobs(self.pool, [s.job_id for s, _ in need_leases]):
                by_job.setdefault(lz["job_id"], []).append(lz)
            for spec, attempt in need_leases:
                mine = [lz for lz in by_job.get(spec.job_id, ()) if lz["attempt"] == attempt]
                self._allocate_from_leases(self.cluster, spec, mine, now)
