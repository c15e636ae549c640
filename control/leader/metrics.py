"""The control plane's Prometheus metrics (docs/design.md, Observability).

One ``ControlMetrics`` per control process, on its own registry, so two control processes
in one interpreter (the tests) never mix counts. Labels are bounded: team, priority class,
GPU type, size bucket, reason; never a job or node id.

Events (placements, preemptions, recoveries, takeovers) are counted where they happen.
The cluster's gauges are a snapshot the leader takes on the event loop after a cycle
(``observe_cycle``), at most every ``SNAPSHOT_EVERY_S``: the HTTP server scrapes from its
own thread and must never walk the leader's live state.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from placement.model import JobSpec, NodeHealth
from placement.state import ClusterState

SNAPSHOT_EVERY_S = 1.0
_WAIT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400)
_SHORT_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
SIZE_BUCKETS = ((1, "1"), (8, "2-8"), (64, "9-64"), (512, "65-512"), (None, "513+"))


def size_bucket(gpus: int) -> str:
    """A job's GPU count as a bounded label."""
    for top, name in SIZE_BUCKETS:
        if top is None or gpus <= top:
            return name
    raise AssertionError("unreachable")


def waited_since(spec: JobSpec) -> float:
    """When the job's current wait began: its submission, or its latest preemption."""
    return max([spec.submit_time, *spec.preemption_times])


@dataclass(frozen=True)
class ClusterSnapshot:
    """The cluster's gauges at one moment (label tuple -> value)."""

    healthy: dict[str, int] = field(default_factory=dict)  # gpu_type
    allocated: dict[tuple[str, str, str], int] = field(default_factory=dict)  # gpu_type, team, borrowed
    reserved: dict[str, int] = field(default_factory=dict)  # gpu_type: free GPUs held for a waiting gang
    hot_spare: dict[str, int] = field(default_factory=dict)  # gpu_type
    idle: dict[str, int] = field(default_factory=dict)  # gpu_type: healthy and unallocated
    idle_with_demand: dict[str, int] = field(default_factory=dict)  # gpu_type: free where queued work fits
    allocated_idle: dict[str, int] = field(default_factory=dict)  # team: GPUs of allocated-but-idle leases
    queued: dict[tuple[str, str], int] = field(default_factory=dict)  # priority_class, size
    guaranteed: dict[tuple[str, str], int] = field(default_factory=dict)  # team, gpu_type
    scheduler_idle_nodes: int = 0
    scheduler_idle_oldest_s: float = 0.0


class FreedNodeClock:
    """Scheduler-caused idle per freed node: from a node having free GPUs while queued work
    of its GPU type would fit them, to the next allocation on it.

    The clock starts at the last observation that did not see the node so (an upper bound:
    the node freed somewhere in between) and stops with an observation when an allocation
    lands; when the fitting work leaves the queue first, the clock is dropped unobserved.
    """

    def __init__(self) -> None:
        self.since: dict[str, float] = {}  # node -> start of its idle-with-demand spell
        self.free: dict[str, int] = {}  # node -> free GPUs at the last observation
        self.last_seen = 0.0

    def observe(self, cluster: ClusterState, queue_min_need: dict[str, int], now: float) -> list[float]:
        """One observation; returns the spells ended by an allocation (seconds)."""
        ended: list[float] = []
        prev = self.last_seen or now
        waiting: dict[str, float] = {}
        for nid, gpu_type, health, _size, free, spare_of in cluster.node_census():
            if health != NodeHealth.READY or spare_of is not None:
                continue
            need = queue_min_need.get(gpu_type)
            was = self.since.get(nid)
            if was is not None and free < self.free.get(nid, 0):  # an allocation landed on it
                ended.append(now - was)
                was = None
            if free and need is not None and free >= need:
                waiting[nid] = was if was is not None else prev
                self.free[nid] = free
            else:
                self.free.pop(nid, None)
        self.since = waiting
        self.last_seen = now
        return ended

    def oldest(self, now: float) -> float:
        return max((now - t for t in self.since.values()), default=0.0)


class _Snapshot(Collector):
    def __init__(self, metrics: ControlMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterable[Any]:
        m = self.m
        snap = m.snapshot
        leader = GaugeMetricFamily(
            "gpufleet_control_is_leader", "1 while this control process holds the placement lease", labels=["holder"]
        )
        leader.add_metric([m.holder], 1.0 if m.epoch else 0.0)
        yield leader
        yield GaugeMetricFamily("gpufleet_leader_epoch", "The epoch this process leads under (0: a follower)", m.epoch)
        if not m.epoch:
            return  # a follower knows no cluster: the API's gauges answer from Postgres
        yield from _family("gpufleet_gpus_healthy", "Healthy GPUs (schedulable or not)", ["gpu_type"], snap.healthy)
        yield from _family(
            "gpufleet_gpus_allocated",
            "GPUs held by live leases, guaranteed or borrowed",
            ["gpu_type", "team", "borrowed"],
            snap.allocated,
        )
        ratio = GaugeMetricFamily(
            "gpufleet_gpus_allocated_ratio", "Allocated GPUs over healthy GPUs (0..1)", labels=["gpu_type"]
        )
        for t, h in sorted(snap.healthy.items()):
            used = sum(v for (gt, _, _), v in snap.allocated.items() if gt == t)
            ratio.add_metric([t], used / h if h else 0.0)
        yield ratio
        yield from _family(
            "gpufleet_gpus_reserved", "Free GPUs held for a waiting gang (reservations)", ["gpu_type"], snap.reserved
        )
        yield from _family(
            "gpufleet_gpus_hot_spare", "Free GPUs held as hot spares for large gangs", ["gpu_type"], snap.hot_spare
        )
        yield from _family("gpufleet_gpus_idle", "Healthy GPUs no lease holds", ["gpu_type"], snap.idle)
        yield from _family(
            "gpufleet_gpus_idle_with_demand",
            "Idle GPUs on nodes where queued work of their type would fit (the scheduler's idle)",
            ["gpu_type"],
            snap.idle_with_demand,
        )
        price = m.gpu_hour_usd
        yield GaugeMetricFamily(
            "gpufleet_idle_gpu_cost_usd_per_hour",
            "What the idle GPUs cost per hour at gpu_hour_usd",
            sum(snap.idle.values()) * price,
        )
        yield GaugeMetricFamily(
            "gpufleet_idle_with_demand_gpu_cost_usd_per_hour",
            "What the idle GPUs that queued work would fit cost per hour",
            sum(snap.idle_with_demand.values()) * price,
        )
        yield from _family(
            "gpufleet_allocated_idle_gpus",
            "GPUs of leases whose SM use stayed below idle_gpu_util_pct for idle_gpu_after_s",
            ["team"],
            snap.allocated_idle,
        )
        cost = GaugeMetricFamily(
            "gpufleet_allocated_idle_gpu_cost_usd_per_hour",
            "What allocated-but-idle GPUs cost per hour",
            labels=["team"],
        )
        for team, n in sorted(snap.allocated_idle.items()):
            cost.add_metric([team], n * price)
        yield cost
        yield from _family(
            "gpufleet_queued_jobs", "Jobs waiting, by class and size", ["priority_class", "size"], snap.queued
        )
        yield from _family(
            "gpufleet_quota_guaranteed_gpus", "Each team's guaranteed GPUs", ["team", "gpu_type"], snap.guaranteed
        )
        yield GaugeMetricFamily(
            "gpufleet_scheduler_idle_nodes",
            "Nodes with free GPUs that queued work would fit, not yet allocated",
            snap.scheduler_idle_nodes,
        )
        yield GaugeMetricFamily(
            "gpufleet_scheduler_idle_oldest_seconds",
            "How long the longest-waiting such node has been idle",
            snap.scheduler_idle_oldest_s,
        )


def _family(name: str, doc: str, labels: list[str], values: dict[Any, int]) -> Iterator[GaugeMetricFamily]:
    g = GaugeMetricFamily(name, doc, labels=labels)
    for key, v in sorted(values.items()):
        g.add_metric(list(key) if isinstance(key, tuple) else [key], float(v))
    yield g


class ControlMetrics:
    def __init__(self, holder: str, gpu_hour_usd: float) -> None:
        self.holder = holder
        self.gpu_hour_usd = gpu_hour_usd
        self.registry = CollectorRegistry()
        self.epoch = 0
        self.snapshot = ClusterSnapshot()
        self._snapshot_at = float("-inf")
        self.freed = FreedNodeClock()
        self.allocated_idle_leases: dict[str, tuple[str, int]] = {}  # lease -> (team, GPUs), from GPU use
        r = self.registry
        self.cycle_seconds = Histogram(
            "gpufleet_placement_cycle_duration_seconds",
            "One placement cycle: refresh, plan, commit, publish",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.placements = Counter(
            "gpufleet_placements_total", "Gangs allocated", ["priority_class", "kind"], registry=r
        )
        self.queue_wait = Histogram(
            "gpufleet_queue_wait_seconds",
            "From submission (or the latest preemption) to allocation",
            ["priority_class", "size"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self.preemptions = Counter(
            "gpufleet_preemptions_total", "Jobs preempted", ["reason", "priority_class"], registry=r
        )
        self.preempted_lost = Counter(
            "gpufleet_preemption_lost_gpu_hours_total",
            "GPU-hours of work since the victims' last checkpoint (or start), thrown away by preemption",
            ["reason"],
            registry=r,
        )
        self.failure_lost = Counter(
            "gpufleet_failure_lost_gpu_hours_total",
            "GPU-hours of work since the last checkpoint (or start) of jobs ended by a node failure",
            ["cause"],
            registry=r,
        )
        self.reclaim_seconds = Histogram(
            "gpufleet_reclaim_seconds",
            "From preempting borrowed work for a job within its guarantee to that job's allocation",
            buckets=_SHORT_BUCKETS,
            registry=r,
        )
        self.takeovers = Counter(
            "gpufleet_leader_takeovers_total", "Times this process took the placement lease", registry=r
        )
        self.scheduler_idle = Histogram(
            "gpufleet_scheduler_idle_seconds",
            "Per freed node: from free GPUs with fitting work queued to the next allocation on it",
            buckets=(0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800),
            registry=r,
        )
        r.register(_Snapshot(self))
        self._reclaim_started: dict[str, float] = {}  # beneficiary -> first reclaim preemption for it
        self._min_need: dict[str, int] = {}  # gpu type -> fewest GPUs per replica a queued job needs

    # ------------------------------------------------------------------ events

    def took_over(self, epoch: int) -> None:
        self.takeovers.inc()
        self.epoch = epoch
        self.freed = FreedNodeClock()
        self._reclaim_started.clear()
        self._snapshot_at = float("-inf")

    def lost(self) -> None:
        self.epoch = 0
        self.snapshot = ClusterSnapshot()

    def placed(self, spec: JobSpec, backfill: bool, now: float) -> None:
        cls = str(spec.priority)
        self.placements.labels(cls, "backfill" if backfill else "scheduled").inc()
        self.queue_wait.labels(cls, size_bucket(spec.total_gpus)).observe(max(0.0, now - waited_since(spec)))
        started = self._reclaim_started.pop(spec.job_id, None)
        if started is not None:
            self.reclaim_seconds.observe(max(0.0, now - started))

    def preempted(self, reason: str, victim: JobSpec, lost_gpu_s: float, beneficiary: str, now: float) -> None:
        self.preemptions.labels(reason, str(victim.priority)).inc()
        self.preempted_lost.labels(reason).inc(lost_gpu_s / 3600.0)
        if reason == "reclaim":
            self._reclaim_started.setdefault(beneficiary, now)

    def failed(self, cause: str, lost_gpu_s: float) -> None:
        self.failure_lost.labels(cause).inc(lost_gpu_s / 3600.0)

    # ------------------------------------------------------------------ the snapshot

    def before_plan(self, cluster: ClusterState, queued: Iterable[JobSpec], now: float) -> None:
        """Look at the nodes before the cycle places anything: a node freed since the last
        cycle and re-allocated by this one is caught between the two observations."""
        min_need: dict[str, int] = {}
        for spec in queued:
            if spec.gpus_per_replica < min_need.get(spec.gpu_type, 1 << 30):
                min_need[spec.gpu_type] = spec.gpus_per_replica
        self._min_need = min_need
        self._observe_nodes(cluster, now)

    def _observe_nodes(self, cluster: ClusterState, now: float) -> None:
        for d in self.freed.observe(cluster, self._min_need, now):
            self.scheduler_idle.observe(d)

    def observe_cycle(
        self, cluster: ClusterState, queued: Iterable[JobSpec], duration_s: float, now: float, *, force: bool = False
    ) -> None:
        self.cycle_seconds.observe(duration_s)
        self._observe_nodes(cluster, now)
        mono = time.monotonic()
        if not force and mono - self._snapshot_at < SNAPSHOT_EVERY_S:
            return
        self._snapshot_at = mono
        queued = list(queued)
        waiting = {spec.job_id for spec in queued}
        for j in [j for j in self._reclaim_started if j not in waiting]:
            del self._reclaim_started[j]  # cancelled before it was placed
        q: dict[tuple[str, str], int] = {}
        for spec in queued:
            key = (str(spec.priority), size_bucket(spec.total_gpus))
            q[key] = q.get(key, 0) + 1
        self.snapshot = take_snapshot(cluster, q, self.allocated_idle_leases, self.freed, now, self._min_need)


def take_snapshot(
    cluster: ClusterState,
    queued: dict[tuple[str, str], int],
    allocated_idle_leases: dict[str, tuple[str, int]],
    freed: FreedNodeClock,
    now: float,
    min_need: dict[str, int],
) -> ClusterSnapshot:
    healthy: dict[str, int] = {}
    idle: dict[str, int] = {}
    with_demand: dict[str, int] = {}
    reserved: dict[str, int] = {}
    spare: dict[str, int] = {}
    for t in cluster.gpu_types():
        healthy[t] = cluster.healthy_gpus(t)
    for nid, t, health, size, free, spare_of in cluster.node_census():
        if health != NodeHealth.READY:
            continue
        if spare_of is not None:  # a hot spare's GPUs are held, not free
            held = size - sum(len(g) for g in cluster.node_jobs(nid).values())
            spare[t] = spare.get(t, 0) + held
            idle[t] = idle.get(t, 0) + held
            continue
        idle[t] = idle.get(t, 0) + free
        need = min_need.get(t)
        if free and need is not None and free >= need:
            with_demand[t] = with_demand.get(t, 0) + free
        if free and cluster.node_reservation(nid):
            reserved[t] = reserved.get(t, 0) + free
    allocated: dict[tuple[str, str, str], int] = {}
    for rj in cluster.running_jobs():
        key = (rj.gpu_type, rj.team, "true" if rj.borrowed else "false")
        allocated[key] = allocated.get(key, 0) + sum(m.bit_count() for m in rj.held.values())
    idle_by_team: dict[str, int] = {}
    for team, gpus in allocated_idle_leases.values():
        idle_by_team[team] = idle_by_team.get(team, 0) + gpus
    guaranteed = {(team, t): q.guaranteed for (team, t), q in cluster.quotas().items()}
    return ClusterSnapshot(
        healthy=healthy,
        allocated=allocated,
        reserved=reserved,
        hot_spare=spare,
        idle=idle,
        idle_with_demand=with_demand,
        allocated_idle=idle_by_team,
        queued=queued,
        guaranteed=guaranteed,
        scheduler_idle_nodes=len(freed.since),
        scheduler_idle_oldest_s=freed.oldest(now),
    )
