"""The leader's placement cycle: the shell around the pure engine (DESIGN.md, Placement).

``LeaderState`` lives in the leader's control process. It keeps the engine's
``ClusterState`` and ``JobQueue`` in memory, built in full on takeover
(``rebuild``) and refreshed incrementally from the ``changes`` sequence
(``refresh``: only the rows named by new changes are read). ``run_cycle``:

1. refresh; ``engine.plan`` on the in-memory state;
2. write relabels; commit each gang in its own transaction under the epoch
   (``store.commit_gang``); mark each victim PREEMPTING under the epoch;
3. ``engine.apply`` what committed;
4. signal the job workflows (``allocated`` with signal-with-start, ``preempt``),
   and re-signal allocations / preemptions a job has not acted on yet (a lost
   signal, or a commit by a previous leader), with backoff;
5. publish queue positions, pending reasons, expected starts, reservations and
   the hot spares held for large gangs (changed rows only, or only when the set
   changed); start workflows for QUEUED jobs that lack one.

Every write checks the epoch in its transaction; ``StaleEpoch`` ends the cycle and
drops the in-memory state (this process is no longer the leader).

The engine's public names used here: ``ClusterState``, ``JobQueue``, ``JobSpec``,
``Topology``, ``Placement``/``NodeGpus``/``ReplicaSlot``, ``NodeHealth``, ``Policy``,
``plan``, ``apply``, ``apply_event`` with ``JobEnded`` / ``NodeHealthChanged`` /
``Checkpointed``, and ``iter_order``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import asyncpg
from temporalio.client import Client

from activities import job_signals, job_store, store
from activities.change_feed import ChangeFeed
from activities.job_activities import master_addr_for, master_port_for, node_queue
from activities.store import GangPlacement, StaleEpoch
from common.settings import Settings
import placement as engine
from placement import (
    ClusterState,
    JobQueue,
    JobSpec,
    NodeGpus,
    NodeHealth,
    Placement,
    Policy,
    ReplicaSlot,
    Topology,
    iter_order,
)
from workflows import messages as m

log = logging.getLogger(__name__)

ACTIVE = ("STARTING", "RUNNING", "PREEMPTING", "CANCELLING")
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT")
JOB_COLUMNS = (
    "job_id, team, priority_class, gpu_type, replicas, gpus_per_replica, spec, state, attempt, submitted_at,"
    " started_at, max_runtime_s, last_checkpoint_at, preempted_at, front_of_class"
)
MAX_RESIGNAL_S = 60.0
UNSTARTED_SWEEP_S = 5.0
PRUNE_EVERY_S = 60.0
CHANGES_KEPT_S = 600.0


class NotLeader(Exception):
    """This process does not hold the epoch the cycle was asked to run under."""


def policy_from_settings(settings: Settings) -> Policy:
    return Policy(
        lookahead=settings.placement_lookahead,
        hot_spare_fraction=settings.hot_spare_fraction,
        preemption_protect_s=settings.preemption_protect_s,
        daily_preemption_budget=settings.preemption_daily_budget,
        claim_borrowed_reservations_after_s=settings.claim_borrowed_reservations_after_s,
        reclaim_small_borrowed_after_s=settings.reclaim_small_borrowed_after_s,
    )


def _ts(dt: datetime | None) -> float | None:
    return dt.timestamp() if dt is not None else None


def spec_from_row(row: Any, default_grace_s: float) -> JobSpec:
    spec = job_store.parse_spec(row["spec"])
    topo = spec.get("topology") or {}
    ck = job_store.spec_checkpoint(spec)
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
        grace_s=job_store.spec_grace_s(spec, default_grace_s),
        submit_time=row["submitted_at"].timestamp(),
        attempt=row["attempt"],
        started_at=_ts(row["started_at"]),
        last_checkpoint_at=_ts(row["last_checkpoint_at"]),
        preemption_times=tuple(t.timestamp() for t in (row["preempted_at"] or ())),
        front=bool(row["front_of_class"]),
    )


@dataclass
class _Job:
    state: str
    attempt: int
    spec: JobSpec
    checkpoint_at: float | None = None


@dataclass
class _Resignal:
    kind: str  # "alloc" | "preempt"
    attempt: int
    message: Any
    due: float
    interval: float


@dataclass
class _Node:
    block: str
    gpu_type: str
    gpus: int
    state: str
    task_queue: str | None
    agent_addr: str | None


@dataclass
class CycleStats:
    placed: int = 0
    preempted: int = 0
    resignalled: int = 0
    published: int = 0
    failed_commits: int = 0
    started_workflows: int = 0
    errors: list[str] = field(default_factory=list)


class LeaderState:
    """The leader's in-memory placement state and its cycle (one per control process)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        client: Client,
        settings: Settings,
        *,
        policy: Policy | None = None,
        actor: str = "placement",
    ) -> None:
        self.pool = pool
        self.client = client
        self.settings = settings
        self.policy = policy or policy_from_settings(settings)
        self.actor = actor
        self.scope = settings.leader_scope
        self.epoch: int | None = None
        self.cluster: ClusterState | None = None
        self.queue = JobQueue()
        self.jobs: dict[str, _Job] = {}
        self.nodes: dict[str, _Node] = {}
        self.node_leases: dict[str, set[str]] = {}  # live lease ids per node (heartbeat acks confirm them)
        self.feed = ChangeFeed()
        self.resignal: dict[str, _Resignal] = {}
        self.published: dict[str, tuple] = {}
        self.published_res: tuple | None = None
        self.published_spares: dict[str, str] | None = None  # node -> job, as last written (None: not yet)
        self.lock = asyncio.Lock()
        self.cycles = 0
        self.last_cycle_ms = 0.0
        self._next_sweep = 0.0
        self._next_prune = time.monotonic() + PRUNE_EVERY_S
        # signals in flight: a burst of concurrent writes overruns the embedded server's single
        # SQLite writer (persistence deadlines, then retries seconds later); a few at a time flow
        self._sem = asyncio.Semaphore(8)
        self._dirty_jobs: set[str] = set()
        self._needs_rebuild = False
        self._signals_in_flight: set[asyncio.Task] = set()
        self._adopt_signal: list[tuple[str, str, int]] = []
        # for the waker: a change after refresh_started_at needs another cycle
        self.cycle_running = False
        self.refresh_started_at = 0.0
        self.cycle_done = asyncio.Event()
        self.cycle_done.set()
        # batched cycles (run_cycles): a change wakes the running batch in-process
        self.batch_running = False
        self.wake_event = asyncio.Event()

    # ------------------------------------------------------------------ leadership

    def is_leader(self, epoch: int) -> bool:
        return self.epoch is not None and self.epoch == epoch and self.cluster is not None

    def drop(self) -> None:
        """Forget everything (leadership lost); the next takeover rebuilds."""
        self.epoch = None
        self.wake_event.set()  # a running batch ends at once (its next cycle is refused)
        self.cluster = None
        self.queue = JobQueue()
        self.jobs.clear()
        self.nodes.clear()
        self.node_leases = {}
        self.resignal.clear()
        self._adopt_signal = []
        self.published.clear()
        self.published_res = None
        self.published_spares = None

    async def take_over(self, epoch: int) -> None:
        async with self.lock:
            self.drop()
            await self._rebuild()
            self.epoch = epoch
            now = time.monotonic()
            # a new leader re-signals every gang and victim in flight once (they may have
            # been committed by the previous leader and their signal lost)
            for job_id, j in self.jobs.items():
                if j.state == "STARTING":
                    alloc = await job_signals.allocation_for(self.pool, self.settings, job_id, j.attempt)
                    if alloc is not None:
                        self.resignal[job_id] = _Resignal("alloc", j.attempt, alloc, now, self.settings.allocation_resignal_s)
                elif j.state == "PREEMPTING":
                    req = m.PreemptRequest(job_id, j.attempt, epoch, "preempted (re-signalled by a new leader)")
                    self.resignal[job_id] = _Resignal("preempt", j.attempt, req, now, self.settings.allocation_resignal_s)

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

    async def _rebuild(self) -> None:
        t0 = time.perf_counter()
        gc.unfreeze()  # let a previous state be collected
        cluster = ClusterState(usage_half_life_s=self.settings.fair_share_half_life_h * 3600.0)
        async with self.pool.acquire() as conn:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                self.feed = await ChangeFeed.start(conn)
                nodes = await conn.fetch(
                    "SELECT n.node_id, n.block_id, n.gpu_type, n.gpus, n.state, n.task_queue, n.agent_addr"
                    " FROM nodes n ORDER BY n.node_id"
                )
                quotas = await conn.fetch("SELECT team, gpu_type, guaranteed, borrow_limit FROM quotas")
                jobs = await conn.fetch(
                    f"SELECT {JOB_COLUMNS} FROM jobs WHERE state NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'TIMED_OUT')"
                )
                leases = await conn.fetch(
                    "SELECT l.lease_id, l.job_id, l.rank, l.node_id, l.gpu_indices, l.attempt,"
                    " bool_or(a.borrowed) AS borrowed"
                    " FROM leases l LEFT JOIN allocations a ON a.lease_id = l.lease_id"
                    " WHERE l.state = 'live' GROUP BY l.lease_id ORDER BY l.job_id, l.rank"
                )
                usage = await conn.fetch(
                    "SELECT j.team, j.gpu_type,"
                    " sum(cardinality(l.gpu_indices) * extract(epoch FROM coalesce(l.released_at, now()) - l.created_at)"
                    "     / 3600.0 * power(0.5, extract(epoch FROM now() - coalesce(l.released_at, now())) / $1)) AS gpu_h"
                    " FROM leases l JOIN jobs j USING (job_id)"
                    " WHERE coalesce(l.released_at, now()) > now() - interval '7 days'"
                    " GROUP BY j.team, j.gpu_type",
                    self.settings.fair_share_half_life_h * 3600.0,
                )
        now = time.time()
        for n in nodes:
            self.nodes[n["node_id"]] = _Node(
                n["block_id"], n["gpu_type"], n["gpus"], n["state"], n["task_queue"], n["agent_addr"]
            )
            cluster.add_node(n["node_id"], n["block_id"], n["gpu_type"], n["gpus"], NodeHealth.READY)
        for q in quotas:
            cluster.set_quota(q["team"], q["gpu_type"], q["guaranteed"], q["borrow_limit"])
        for u in usage:
            cluster.set_usage(u["team"], u["gpu_type"], float(u["gpu_h"] or 0.0), now)
        by_job: dict[str, list[Any]] = {}
        node_leases: dict[str, set[str]] = {}
        for lz in leases:
            by_job.setdefault(lz["job_id"], []).append(lz)
            node_leases.setdefault(lz["node_id"], set()).add(lz["lease_id"])
        self.node_leases = node_leases
        for row in jobs:
            spec = spec_from_row(row, self.settings.default_grace_s)
            self.jobs[row["job_id"]] = _Job(row["state"], row["attempt"], spec, spec.last_checkpoint_at)
            if row["state"] == "QUEUED":
                self.queue.push(spec)
            elif row["state"] in ACTIVE:
                mine = [lz for lz in by_job.get(row["job_id"], ()) if lz["attempt"] == row["attempt"]]
                self._allocate_from_leases(cluster, spec, mine, now)
        self.cluster = cluster
        for node_id, n in self.nodes.items():
            if n.state != "ready":
                cluster.set_node_health(node_id, NodeHealth(n.state))
        for row in jobs:
            if row["state"] == "PREEMPTING" and cluster.is_running(row["job_id"]):
                if cluster.running(row["job_id"]).preempting_for is None:
                    cluster.mark_preempting(row["job_id"], "")
        gc.collect()
        gc.freeze()  # DESIGN.md pitfall: long-lived state out of the cyclic GC's way
        log.info(
            "leader state rebuilt: %d nodes, %d queued, %d running in %.0f ms",
            len(self.nodes), len(self.queue), len(cluster), (time.perf_counter() - t0) * 1000,
        )

    async def _rebuild_in_place(self) -> None:
        """Full rebuild keeping the leader's bookkeeping (re-signals, publications)."""
        resignal, published, published_res = self.resignal, self.published, self.published_res
        published_spares = self.published_spares
        self.cluster, self.queue = None, JobQueue()
        self.node_leases = {}
        self.jobs.clear()
        self.nodes.clear()
        await self._rebuild()
        self.resignal, self.published, self.published_res = resignal, published, published_res
        self.published_spares = published_spares

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
            for q in await self.pool.fetch(
                "SELECT team, gpu_type, guaranteed, borrow_limit FROM quotas WHERE team || '/' || gpu_type = ANY($1::text[])",
                list(kinds["quota"]),
            ):
                self.cluster.set_quota(q["team"], q["gpu_type"], q["guaranteed"], q["borrow_limit"])
        if kinds["job"]:
            await self._refresh_jobs(kinds["job"], now)
        if kinds["allocation"]:
            touched = sorted({subj.rsplit("/", 1)[0] for subj in kinds["allocation"]})
            live: dict[str, set[str]] = {n: set() for n in touched}
            for lz in await self.pool.fetch(
                "SELECT node_id, lease_id FROM leases WHERE state = 'live' AND node_id = ANY($1::text[])", touched
            ):
                live[lz["node_id"]].add(lz["lease_id"])
            self.node_leases.update(live)
        return len(rows)

    async def _refresh_nodes(self, node_ids: set[str]) -> None:
        assert self.cluster is not None
        for n in await self.pool.fetch(
            "SELECT node_id, block_id, gpu_type, gpus, state, task_queue, agent_addr FROM nodes WHERE node_id = ANY($1::text[])",
            list(node_ids),
        ):
            nid = n["node_id"]
            old = self.nodes.get(nid)
            self.nodes[nid] = _Node(n["block_id"], n["gpu_type"], n["gpus"], n["state"], n["task_queue"], n["agent_addr"])
            if old is None:
                self.cluster.add_node(nid, n["block_id"], n["gpu_type"], n["gpus"], NodeHealth(n["state"]))
            elif old.state != n["state"]:
                engine.apply_event(self.cluster, engine.NodeHealthChanged(nid, NodeHealth(n["state"])), time.time())

    async def _refresh_jobs(self, job_ids: set[str], now: float) -> None:
        assert self.cluster is not None
        rows = await self.pool.fetch(f"SELECT {JOB_COLUMNS} FROM jobs WHERE job_id = ANY($1::text[])", list(job_ids))
        seen = set()
        need_leases: list[tuple[JobSpec, int]] = []
        for row in rows:
            jid = row["job_id"]
            seen.add(jid)
            state, attempt = row["state"], row["attempt"]
            known = self.jobs.get(jid)
            running = self.cluster.is_running(jid)
            if state in TERMINAL:
                self.queue.remove(jid)
                if running:
                    engine.apply_event(self.cluster, engine.JobEnded(jid), now)
                self.jobs.pop(jid, None)
                self.resignal.pop(jid, None)
                self.published.pop(jid, None)
                continue
            spec = spec_from_row(row, self.settings.default_grace_s)
            if state == "QUEUED":
                if running:
                    engine.apply_event(self.cluster, engine.JobEnded(jid, keep_spares=spec.front), now)
                self.queue.push(spec)
                self.resignal.pop(jid, None)
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
                r = self.resignal.get(jid)
                if r is not None and not (
                    (r.kind == "alloc" and state == "STARTING") or (r.kind == "preempt" and state == "PREEMPTING")
                ) or (r is not None and r.attempt != attempt):
                    self.resignal.pop(jid, None)
                    r = None
                if r is None and state in ("STARTING", "PREEMPTING") and (known is None or known.state != state):
                    # a gang or a victim this leader has not signalled (another leader's commit, or
                    # a cycle that failed after committing): signal it from the next cycle on
                    self._adopt_signal.append((jid, state, attempt))
            self.jobs[jid] = _Job(state, attempt, spec, spec.last_checkpoint_at)
        for jid in job_ids - seen:  # deleted rows
            self.queue.remove(jid)
            if self.cluster.is_running(jid):
                engine.apply_event(self.cluster, engine.JobEnded(jid), now)
            self.jobs.pop(jid, None)
        if self._adopt_signal:
            adopt, self._adopt_signal = self._adopt_signal, []
            mono = time.monotonic()
            for jid, state, attempt in adopt:
                if state == "STARTING":
                    alloc = await job_signals.allocation_for(self.pool, self.settings, jid, attempt)
                    if alloc is not None:
                        self.resignal[jid] = _Resignal("alloc", attempt, alloc, mono, self.settings.allocation_resignal_s)
                elif self.epoch is not None:
                    req = m.PreemptRequest(jid, attempt, self.epoch, "preempted (re-signalled)")
                    self.resignal[jid] = _Resignal("preempt", attempt, req, mono, self.settings.allocation_resignal_s)
        if need_leases:
            leases = await self.pool.fetch(
                "SELECT l.job_id, l.rank, l.node_id, l.gpu_indices, l.attempt, bool_or(a.borrowed) AS borrowed"
                " FROM leases l LEFT JOIN allocations a ON a.lease_id = l.lease_id"
                " WHERE l.state = 'live' AND l.job_id = ANY($1::text[]) GROUP BY l.lease_id ORDER BY l.job_id, l.rank",
                [s.job_id for s, _ in need_leases],
            )
            by_job: dict[str, list[Any]] = {}
            for lz in leases:
                by_job.setdefault(lz["job_id"], []).append(lz)
            for spec, attempt in need_leases:
                mine = [lz for lz in by_job.get(spec.job_id, ()) if lz["attempt"] == attempt]
                self._allocate_from_leases(self.cluster, spec, mine, now)

    # ------------------------------------------------------------------ the cycle

    async def run_cycle(self, epoch: int) -> m.CycleResult:
        if not self.is_leader(epoch):
            raise NotLeader(f"this process does not lead under epoch {epoch} (it holds {self.epoch})")
        async with self.lock:
            if not self.is_leader(epoch):
                raise NotLeader(f"leadership changed before the cycle (epoch {epoch})")
            t0 = time.perf_counter()
            self.cycle_running = True
            self.cycle_done.clear()
            self.refresh_started_at = time.monotonic()
            try:
                stats = await self._cycle(epoch)
            except StaleEpoch:
                log.warning("epoch %s is stale: dropping the leader state", epoch)
                self.drop()
                raise
            finally:
                self.cycle_running = False
                self.cycle_done.set()
            self.cycles += 1
            self.last_cycle_ms = (time.perf_counter() - t0) * 1000
            return m.CycleResult(
                epoch=epoch,
                placed=stats.placed,
                preempted=stats.preempted,
                resignalled=stats.resignalled,
                queued=len(self.queue),
                published=stats.published,
                failed_commits=stats.failed_commits,
                duration_ms=self.last_cycle_ms,
                more=stats.placed > 0 and len(self.queue) > 0,
            )

    async def run_cycles(
        self, epoch: int, run_for_s: float, cycle_s: float, heartbeat: Callable[..., None] = lambda *_: None
    ) -> m.CycleResult:
        """Cycle for ``run_for_s``: every ``cycle_s``, at once while placeable work is left
        or when ``wake()`` is called (at most one per ``placement_wake_min_s``). Each cycle
        is the same as ``run_cycle`` (epoch-checked writes); ``heartbeat`` gets each result.
        Returns the last cycle's figures with ``cycles`` and the total ``placed``."""
        deadline = time.monotonic() + run_for_s
        cycles = placed = preempted = 0
        last: m.CycleResult | None = None
        self.batch_running = True
        try:
            while True:
                self.wake_event.clear()
                started = time.monotonic()
                last = await self.run_cycle(epoch)
                cycles += 1
                placed += last.placed
                preempted += last.preempted
                heartbeat(last)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                if not last.more:
                    try:
                        await asyncio.wait_for(self.wake_event.wait(), min(cycle_s, remaining))
                    except asyncio.TimeoutError:
                        pass
                pause = started + self.settings.placement_wake_min_s - time.monotonic()
                if pause > 0:
                    await asyncio.sleep(pause)
        finally:
            self.batch_running = False
        assert last is not None
        return dataclasses.replace(last, cycles=cycles, placed=placed, preempted=preempted)

    def wake(self) -> bool:
        """Wake a running batch of cycles; False when none runs (signal the workflow instead)."""
        if not self.batch_running:
            return False
        self.wake_event.set()
        return True

    async def _cycle(self, epoch: int) -> CycleStats:
        cluster = self.cluster
        assert cluster is not None
        stats = CycleStats()
        if self._needs_rebuild:
            self._needs_rebuild = False
            await self._rebuild_in_place()
        await self.refresh()
        now = time.time()
        plan = engine.plan(cluster, self.queue, self.policy, now)

        for rl in plan.relabels:
            await job_store.relabel_job(self.pool, scope=self.scope, epoch=epoch, job_id=rl.job_id, borrowed=rl.borrowed)

        committed: set[str] = set()
        allocations: list[m.Allocation] = []
        results = await asyncio.gather(
            *(self._commit(epoch, p) for p in plan.placements if not p.replacement), return_exceptions=True
        )
        for res in results:
            if isinstance(res, StaleEpoch):
                raise res
            if isinstance(res, BaseException):
                stats.failed_commits += 1
                stats.errors.append(str(res))
                continue
            if res is not None:
                committed.add(res.job_id)
                allocations.append(res)
        preempts: list[m.PreemptRequest] = []
        for pr in plan.preemptions:
            job = self.jobs.get(pr.victim)
            if job is None:
                continue
            o = await job_store.mark_preempting(
                self.pool,
                scope=self.scope,
                epoch=epoch,
                job_id=pr.victim,
                attempt=job.attempt,
                reason=f"{pr.reason.value}: for {pr.beneficiary}",
                by_job=pr.beneficiary,
            )
            if o.applied:
                committed.add(pr.victim)
                job.state = "PREEMPTING"
                preempts.append(m.PreemptRequest(pr.victim, job.attempt, epoch, f"{pr.reason.value}", pr.beneficiary))
        try:
            engine.apply(cluster, plan, self.queue, now, committed=committed)
        except Exception as e:  # memory disagrees with what committed: rebuild before the next plan
            log.error("applying the cycle's plan failed (%s): the leader state will be rebuilt", e)
            self._needs_rebuild = True
        stats.placed = len(allocations)
        stats.preempted = len(preempts)

        mono = time.monotonic()
        first = self.settings.allocation_resignal_s
        for a in allocations:
            self.jobs[a.job_id].state = "STARTING"
            self.resignal[a.job_id] = _Resignal("alloc", a.attempt, a, mono + first, first)
        for p in preempts:
            self.resignal[p.job_id] = _Resignal("preempt", p.attempt, p, mono + first, first)
        due = [r for r in self.resignal.values() if r.due <= mono]
        for r in due:
            r.interval = min(r.interval * 2, MAX_RESIGNAL_S)
            r.due = mono + r.interval
        stats.resignalled = len(due)
        # Signals go out in the background: the cycle (and the next one) does not wait for
        # Temporal round trips; a signal lost with this process is re-sent by the next leader.
        for msg in [*allocations, *preempts, *(r.message for r in due)]:
            t = asyncio.create_task(self._signal(msg))
            self._signals_in_flight.add(t)
            t.add_done_callback(self._signals_in_flight.discard)
        stats.published = await self._publish(epoch, plan, now)
        if mono >= self._next_sweep:
            self._next_sweep = mono + UNSTARTED_SWEEP_S
            stats.started_workflows = await self._start_missing_workflows()
        if mono >= self._next_prune:
            self._next_prune = mono + PRUNE_EVERY_S
            # the change sequence is read only forward (a new leader starts from its max):
            # keep a margin for slow readers, drop the rest
            await self.pool.execute(
                "DELETE FROM changes WHERE seq <= $1 AND at < now() - make_interval(secs => $2)"
                " AND seq <> ALL($3::bigint[])",  # a gap's row, committed late, is still to be read
                self.feed.cursor,
                CHANGES_KEPT_S,
                list(self.feed.gaps),
            )
        return stats

    async def _commit(self, epoch: int, p: Placement) -> m.Allocation | None:
        job = self.jobs.get(p.job_id)
        if job is None or job.state != "QUEUED":
            return None
        gang = [
            GangPlacement(rank=s.replica, node_id=s.node_id, gpu_indices=tuple(s.gpus), borrowed=p.borrowed)
            for s in sorted(p.slots, key=lambda s: s.replica)
        ]
        try:
            await store.commit_gang(
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
        except store.StoreError as e:
            log.warning("commit of %s failed: %s", p.job_id, e)
            # our view is stale: re-read the job next refresh, or rebuild when GPUs disagree
            self._dirty_jobs.add(p.job_id)
            if isinstance(e, (store.AllocationConflict, store.UnknownSubject)):
                self._needs_rebuild = True
            raise
        for g in gang:
            self.node_leases.setdefault(g.node_id, set()).add(store.lease_id_for(p.job_id, job.attempt, g.rank))
        rank0 = self.nodes.get(gang[0].node_id)
        return m.Allocation(
            job_id=p.job_id,
            attempt=job.attempt,
            epoch=epoch,
            ranks=[
                m.RankPlacement(
                    rank=g.rank,
                    node_id=g.node_id,
                    gpu_indices=list(g.gpu_indices),
                    lease_id=store.lease_id_for(p.job_id, job.attempt, g.rank),
                    task_queue=node_queue(
                        self.settings, g.node_id, self.nodes[g.node_id].task_queue if g.node_id in self.nodes else None
                    ),
                )
                for g in gang
            ],
            master_addr=master_addr_for(rank0.agent_addr if rank0 else None),
            master_port=master_port_for(p.job_id, job.attempt),
        )

    async def _signal(self, msg: m.Allocation | m.PreemptRequest) -> None:
        async with self._sem:
            try:
                if isinstance(msg, m.Allocation):
                    await job_signals.signal_allocation(self.client, self.settings, msg)
                else:
                    await job_signals.signal_preempt(self.client, msg)
            except Exception as e:  # re-signalled later
                log.warning("signal to %s failed: %s", msg.job_id, e)
                return
            # Accepted by Temporal means recorded in the workflow's history (or the workflow
            # has closed): nothing is lost, so re-sending would only load a busy server.
            r = self.resignal.get(msg.job_id)
            if r is not None and r.message is msg:
                del self.resignal[msg.job_id]

    async def _publish(self, epoch: int, plan: Any, now: float) -> int:
        cluster = self.cluster
        assert cluster is not None
        reasons = {p.job_id: p for p in plan.pending}
        reservations = {r.job_id: r for r in cluster.reservations()}
        rows: list[job_store.Publication] = []
        listed: set[str] = set()
        limit = self.policy.lookahead
        for i, spec in enumerate(iter_order(self.queue, cluster, self.policy, now)):
            if i >= limit:
                break
            jid = spec.job_id
            listed.add(jid)
            p = reasons.get(jid)
            res = reservations.get(jid)
            start = None
            if res is not None and math.isfinite(res.expected_start):
                start = datetime.fromtimestamp(res.expected_start, timezone.utc)
            if p is not None:
                reason, detail = p.reason.value, p.detail or None
            else:  # not evaluated: its lane may have been skipped for want of quota room
                reason, detail = _unevaluated_reason(plan, spec)
                if reason == engine.PendingReason.LOOKAHEAD.value:
                    reason, detail = None, None  # within the published top: no reason yet
            value = (i + 1, reason, detail, start)
            if self.published.get(jid) != value:
                self.published[jid] = value
                rows.append(job_store.Publication(jid, *value))
        for jid in [j for j in self.published if j not in listed and j in self.queue]:
            reason, detail = _unevaluated_reason(plan, self.queue.get(jid))
            if reason == engine.PendingReason.LOOKAHEAD.value:
                detail = f"beyond the top {limit} considered"
            value = (None, reason, detail, None)
            if self.published[jid] != value:
                self.published[jid] = value
                rows.append(job_store.Publication(jid, *value))
        for jid in [j for j in self.published if j not in self.queue]:
            del self.published[jid]
        written = 0
        if rows:
            written = await job_store.publish_positions(self.pool, scope=self.scope, epoch=epoch, rows=rows)
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
            await job_store.publish_reservations(
                self.pool,
                scope=self.scope,
                epoch=epoch,
                rows=[
                    job_store.ReservationRow(
                        jid, datetime.fromtimestamp(es, timezone.utc) if es is not None else None, nodes, blocks
                    )
                    for jid, es, nodes, blocks in res_rows
                ],
            )
            self.published_res = res_rows
        spares = {nid: owner for owner in cluster.spare_owners() for nid in cluster.spares(owner)}
        if spares != self.published_spares:
            await job_store.publish_hot_spares(self.pool, scope=self.scope, epoch=epoch, spares=spares)
            self.published_spares = spares
        return written

    async def _start_missing_workflows(self) -> int:
        ids = await job_store.unstarted_queued_jobs(self.pool, older_than_s=UNSTARTED_SWEEP_S)
        started: list[str] = []
        for jid in ids:
            try:
                if await job_signals.start_job_workflow(self.client, self.settings, jid):
                    started.append(jid)
            except Exception as e:
                log.warning("cannot start the workflow of %s: %s", jid, e)
        await job_store.mark_workflow_started(self.pool, started)
        return len(started)


__all__ = ["LeaderState", "NotLeader", "policy_from_settings", "spec_from_row"]


def _unevaluated_reason(plan: Any, spec: Any) -> tuple[str, str | None]:
    """Why a job the cycle did not evaluate waits: ``quota`` when its team's lane for
    its size was skipped for want of quota room, else ``lookahead``."""
    reason = plan.reason_for(spec) if spec is not None else None
    if reason is engine.PendingReason.QUOTA:
        return reason.value, "the team has no quota room for a job of this size"
    return engine.PendingReason.LOOKAHEAD.value, None
