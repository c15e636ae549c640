"""``gpufleet bench placement``: placement cycle time at cluster scale, against a naive baseline.

Builds the seed cluster (``gpus / 8`` nodes of 8 GPUs in 32-node blocks; one block
in eight holds a100, the rest h100), fills it to about 90% with a realistic mix
(90% of jobs <= 8 GPUs, a few 1,024-8,192-GPU gangs holding most GPU-hours; classes
prod-serving 5%, prod-batch 20%, research 50%, preemptible 25%; 40 teams with
guarantees summing to 95% of each type), queues ``queue`` jobs, then runs ``cycles``
placement cycles of 10 simulated seconds with churn: jobs ending (exponential
durations capped by max_runtime), arrivals (~0.5/s with bursts of 50/s), node
failures and recoveries, victims stopping after their grace and re-queued.

A cycle is ``plan`` + ``apply`` (the engine's work); churn is not timed. ``cycle_ms_*``
are wall-clock; ``cycle_cpu_ms_*`` are this thread's CPU time over the same span (the
figure to compare when other work shares the machine's two cores). As in the leader, the
cyclic GC is held off within a cycle (``common.gc_hold``): the collections a cycle's
allocations call for run after it, and ``gc_ms_per_cycle_*`` reports their time (with the
untimed churn's own), beside the cycle's. The naive
baseline (``_naive_plan``: sort the whole queue by the same key, rescan every node
for every job, first fit, no reservations or preemption) runs on a fresh copy of
the same world for ``baseline_cycles`` cycles in the same process.
"""

from __future__ import annotations

import gc
import heapq
import math
import random
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from common.gc_hold import cyclic_gc_held
from placement import (
    ClusterState,
    JobQueue,
    JobSpec,
    NodeGpus,
    NodeHealth,
    Pack,
    Placement,
    Plan,
    Policy,
    ReplicaSlot,
    Topology,
    apply,
    fail_node,
    plan,
    requeue_spec,
)

DT = 10.0  # simulated seconds per cycle
HOUR = 3600.0
NODE_GPUS = 8
BLOCK_NODES = 32
TEAMS = 40
CLASS_MIX = [("prod-serving", 0.05), ("prod-batch", 0.20), ("research", 0.50), ("preemptible", 0.25)]


def _pick(rnd: random.Random, table: list[tuple[Any, float]]) -> Any:
    x = rnd.random()
    acc = 0.0
    for v, w in table:
        acc += w
        if x < acc:
            return v
    return table[-1][0]


@dataclass
class World:
    rnd: random.Random
    state: ClusterState
    queue: JobQueue
    types: dict[str, int]  # gpu type -> GPUs
    now: float = 0.0
    seq: int = 0
    ends: list[tuple[float, str, float]] = field(default_factory=list)  # (end, job, started_at)
    stopping: list[tuple[float, str]] = field(default_factory=list)  # (release at, victim)
    down: list[tuple[float, str]] = field(default_factory=list)  # (recover at, node)
    node_ids: list[str] = field(default_factory=list)
    placed: int = 0
    preempted: int = 0
    failures: int = 0

    # ------------------------------------------------------------------ jobs

    def new_job(self, submit: float, large_ok: bool = True) -> JobSpec:
        rnd = self.rnd
        self.seq += 1
        t = "a100" if rnd.random() < self.types.get("a100", 0) / sum(self.types.values()) else "h100"
        r = rnd.random()
        if r < 0.40:
            reps, gpr = 1, 1
        elif r < 0.55:
            reps, gpr = 1, 2
        elif r < 0.70:
            reps, gpr = 1, 4
        elif r < 0.90:
            reps, gpr = 1, 8
        elif r < 0.97:
            reps, gpr = rnd.choice([2, 4, 8]), 8
        elif r < 0.997 or not large_ok:
            reps, gpr = rnd.choice([16, 32, 64]), 8
        else:
            reps, gpr = rnd.choice([128, 256, 512, 1024]), 8
        cls = _pick(rnd, CLASS_MIX)
        total = reps * gpr
        if total >= 1024:
            cls = rnd.choice(["prod-batch", "research"])
        if total >= NODE_GPUS:
            nodes = math.ceil(reps * gpr / NODE_GPUS)
            topo = Topology(Pack.BLOCK, math.ceil(nodes / BLOCK_NODES) + rnd.choice([0, 1, 2]))
        else:
            topo = Topology(rnd.choice([Pack.ANY, Pack.NODE]))
        if cls == "prod-serving":
            runtime = 7 * 24 * HOUR
        elif total >= 1024:
            runtime = rnd.choice([24, 48, 72]) * HOUR
        else:
            runtime = rnd.choice([1, 2, 4, 8, 24]) * HOUR
        return JobSpec(
            job_id=f"j{self.seq:07d}",
            team=f"team{min(int(rnd.paretovariate(1.2)) - 1, TEAMS - 1):02d}",
            priority=cls,
            gpu_type=t,
            replicas=reps,
            gpus_per_replica=gpr,
            topology=topo,
            max_runtime_s=runtime,
            preemptible=rnd.random() < 0.8,
            grace_s=rnd.choice([30.0, 60.0, 300.0]),
            submit_time=submit,
        )

    def duration(self, job: JobSpec) -> float:
        mean = 8 * HOUR if job.total_gpus >= 512 else 2 * HOUR
        return min(job.max_runtime_s, self.rnd.expovariate(1 / mean) + 60.0)

    # ------------------------------------------------------------------ churn (untimed)

    def churn(self) -> None:
        rnd, st, now = self.rnd, self.state, self.now
        while self.ends and self.ends[0][0] <= now:
            _, jid, started = heapq.heappop(self.ends)
            rj = st.get_running(jid)
            if rj is not None and rj.started_at == started and rj.preempting_for is None:
                st.release(jid, now)
        while self.stopping and self.stopping[0][0] <= now:
            _, jid = heapq.heappop(self.stopping)
            if st.is_running(jid):
                rj = st.release(jid, now)
                self.queue.push(requeue_spec(rj.spec, now, preempted=True, checkpoint_at=rj.last_checkpoint_at))
        while self.down and self.down[0][0] <= now:
            _, nid = heapq.heappop(self.down)
            st.set_node_health(nid, NodeHealth.READY)
        n = _poisson(rnd, 0.46 * DT)
        if rnd.random() < 0.005:
            n += 500  # a burst: 50/s for 10 s
        for _ in range(n):
            self.queue.push(self.new_job(now))
        if rnd.random() < 0.05:
            nid = rnd.choice(self.node_ids)
            if st.node_health(nid) is NodeHealth.READY:
                self.failures += 1
                _fail_node(self, nid)
                heapq.heappush(self.down, (now + rnd.uniform(100, 300) * DT, nid))

    def after_apply(self, p: Plan, committed_now: float) -> None:
        st = self.state
        for pl in p.placements:
            if pl.replacement:
                continue
            rj = st.get_running(pl.job_id)
            if rj is not None:
                self.placed += 1
                heapq.heappush(self.ends, (self.now + self.duration(rj.spec), pl.job_id, rj.started_at))
        for pr in p.preemptions:
            self.preempted += 1
            heapq.heappush(self.stopping, (self.now + pr.grace_s, pr.victim))


def _poisson(rnd: random.Random, lam: float) -> int:
    limit, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rnd.random()
        if p <= limit:
            return k
        k += 1


def _fail_node(world: World, nid: str) -> None:
    st, now = world.state, world.now
    specs = {j: st.running(j).spec for j in st.node_jobs(nid)}
    res = fail_node(st, nid, now)
    for jid in res.released:
        world.queue.push(requeue_spec(specs[jid], now, front=True))


def build_world(gpus: int, queue: int, seed: int) -> World:
    rnd = random.Random(seed)
    st = ClusterState()
    nodes = max(1, gpus // NODE_GPUS)
    types: dict[str, int] = {}
    ids = []
    for i in range(nodes):
        b = i // BLOCK_NODES
        t = "a100" if b % 8 == 7 else "h100"
        nid = f"n{i:06d}"
        st.add_node(nid, f"blk{b:04d}", t, NODE_GPUS)
        types[t] = types.get(t, 0) + NODE_GPUS
        ids.append(nid)
    w = World(rnd, st, JobQueue(), types, node_ids=ids)
    # quotas: guarantees sum to 95% of each type, a long tail of teams
    weights = [1.0 / (i + 1) ** 0.8 for i in range(TEAMS)]
    total_w = sum(weights)
    for t, cap in types.items():
        for i, wt in enumerate(weights):
            g = int(0.95 * cap * wt / total_w)
            st.set_quota(f"team{i:02d}", t, g, g // 2 + 256)
    # fill to ~90%: a few large gangs first, then the mix; started in the past
    target = 0.90 * sum(types.values())
    fill_q = JobQueue()
    large_gpus = 0.0
    while large_gpus < 0.35 * sum(types.values()):
        j = w.new_job(0.0)
        if j.total_gpus >= 512 and j.priority.value != "prod-serving":
            fill_q.push(j)
            large_gpus += j.total_gpus
    policy = Policy(lookahead=1_000_000, preemption=False, reservations=False, hot_spare_min_gpus=10**9)
    for _ in range(60):
        allocated = st.allocated_gpus()
        if allocated >= target:
            break
        need = target - allocated
        added = 0.0
        while added < need * 1.3:
            j = w.new_job(0.0, large_ok=False)
            fill_q.push(j)
            added += j.total_gpus
        # temporarily lift borrow limits so the fill is not quota-bound
        saved = st.quotas()
        for (team, t), q in saved.items():
            st.set_quota(team, t, q.guaranteed, 10**9)
        p = plan(st, fill_q, policy, 0.0)
        for pl in p.placements:
            spec = fill_q.remove(pl.job_id)
            if spec is None:
                continue
            if st.allocated_gpus() + pl.gpus > target:
                continue
            ran = rnd.uniform(0.0, 0.8) * min(spec.max_runtime_s, 12 * HOUR)
            ckpt = -rnd.uniform(0, min(ran, HOUR)) if spec.preemptible else None
            spec = JobSpec(**{**{f: getattr(spec, f) for f in spec.__dataclass_fields__}, "last_checkpoint_at": ckpt})
            st.allocate(spec, pl, 0.0, started_at=-ran)
            heapq.heappush(w.ends, (w.duration(spec), spec.job_id, -ran))
        for (team, t), q in saved.items():
            st.set_quota(team, t, q.guaranteed, q.borrow_limit)
        fill_q = JobQueue()
    # the queue: submitted over the last two days
    for _ in range(queue):
        w.queue.push(w.new_job(-rnd.uniform(0, 48 * HOUR)))
    return w


# ---------------------------------------------------------------------- naive baseline


def _naive_plan(st: ClusterState, q: JobQueue, policy: Policy, now: float) -> Plan:
    """Full rescan: sort the whole queue, rescan every node for every job, first fit."""
    from placement.ordering import fair_share_positions

    jobs = list(q)
    pos = fair_share_positions(st, tuple(sorted({j.team for j in jobs})), now)
    step = policy.aging_step_per_hour / 3600.0

    def key(j: JobSpec) -> tuple:
        below = 0 if st.used(j.team, j.gpu_type) < st.quota(j.team, j.gpu_type).guaranteed else 1
        return (j.rank, 0 if j.front else 1, below, pos[j.team] - step * (now - j.submit_time), j.submit_time, j.job_id)

    jobs.sort(key=key)
    free: dict[str, list[int]] = {}
    node_type: dict[str, str] = {}
    for nid in st.node_ids():  # the rescan
        if st.node_health(nid) is NodeHealth.READY and st.node_spare_of(nid) is None:
            free[nid] = list(st.node_free(nid))
            node_type[nid] = st.node_type(nid)
    order = sorted(free)
    gused: dict[tuple[str, str], int] = {}
    bused: dict[tuple[str, str], int] = {}
    placements = []
    for j in jobs[: policy.lookahead]:
        total = j.total_gpus
        whole = total >= NODE_GPUS
        charge = math.ceil(total / NODE_GPUS) * NODE_GPUS if whole else total
        k = (j.team, j.gpu_type)
        qt = st.quota(*k)
        g = st.guaranteed_used(*k) + gused.get(k, 0)
        b = st.borrowed_used(*k) + bused.get(k, 0)
        if g + charge <= qt.guaranteed:
            borrowed = False
        elif b + charge <= qt.borrow_limit:
            borrowed = True
        else:
            continue
        chosen: list[tuple[str, tuple[int, ...]]] = []
        if whole:
            per = NODE_GPUS // j.gpus_per_replica
            need = math.ceil(j.replicas / per)
            for nid in order:
                if node_type[nid] == j.gpu_type and len(free[nid]) == NODE_GPUS:
                    chosen.append((nid, tuple(range(NODE_GPUS))))
                    if len(chosen) == need:
                        break
            if len(chosen) < need:
                continue
            slots = [
                ReplicaSlot(
                    r,
                    chosen[r // per][0],
                    tuple(range((r % per) * j.gpus_per_replica, (r % per + 1) * j.gpus_per_replica)),
                )
                for r in range(j.replicas)
            ]
        else:
            for nid in order:
                if node_type[nid] == j.gpu_type and len(free[nid]) >= total:
                    chosen.append((nid, tuple(free[nid][:total])))
                    break
            if not chosen:
                continue
            nid, gp = chosen[0]
            slots = [
                ReplicaSlot(r, nid, gp[r * j.gpus_per_replica : (r + 1) * j.gpus_per_replica])
                for r in range(j.replicas)
            ]
        for nid, gp in chosen:
            free[nid] = [x for x in free[nid] if x not in gp]
        (bused if borrowed else gused)[k] = (bused if borrowed else gused).get(k, 0) + charge
        placements.append(
            Placement(
                job_id=j.job_id,
                gpu_type=j.gpu_type,
                nodes=tuple(NodeGpus(n, gp) for n, gp in sorted(chosen)),
                slots=tuple(slots),
                blocks=tuple(sorted({st.node_block(n) for n, _ in chosen})),
                borrowed=borrowed,
                gpus=charge,
            )
        )
    return Plan(now=now, placements=tuple(placements), considered=min(len(jobs), policy.lookahead))


# ---------------------------------------------------------------------- the run


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    i = min(len(s) - 1, max(0, math.ceil(p / 100.0 * len(s)) - 1))
    return s[i]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class _GcClock:
    """The cyclic GC's time, per cycle, wherever it runs (within the cycle or after it)."""

    def __init__(self) -> None:
        self.started = 0.0
        self.ms = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self.started) * 1000


def _run_cycles(w: World, cycles: int, policy: Policy, planner: Any) -> dict[str, Any]:
    times, cpu, plan_t, apply_t, placed, considered, afresh, gc_t = [], [], [], [], [], [], [], []
    st = w.state
    clock = _GcClock()
    gc.callbacks.append(clock)
    try:
        for i in range(cycles):
            if i:
                # the collections the previous cycle's allocations called for ran after it
                # (with the churn's own): charged to that cycle
                gc_t.append(clock.ms)
                clock.ms = 0.0
            w.now += DT
            w.churn()
            c0 = time.thread_time()
            t0 = time.perf_counter()
            with cyclic_gc_held():  # as the leader plans and applies
                p = planner(st, w.queue, policy, w.now)
                t1 = time.perf_counter()
                apply(st, p, w.queue, w.now)
            t2 = time.perf_counter()
            cpu.append((time.thread_time() - c0) * 1000)
            w.after_apply(p, w.now)
            times.append((t2 - t0) * 1000)
            plan_t.append((t1 - t0) * 1000)
            apply_t.append((t2 - t1) * 1000)
            placed.append(sum(1 for x in p.placements if not x.replacement))
            considered.append(p.considered)
            afresh.append(p.decided_afresh)
        if cycles:
            gc_t.append(clock.ms)
    finally:
        gc.callbacks.remove(clock)
    return {
        "cycles": cycles,
        "cycle_ms_p50": round(statistics.median(times), 3) if times else 0.0,
        "cycle_ms_p99": round(_pct(times, 99), 3),
        "cycle_ms_max": round(max(times), 3) if times else 0.0,
        "cycle_ms_mean": round(statistics.fmean(times), 3) if times else 0.0,
        "cycle_cpu_ms_p50": round(statistics.median(cpu), 3) if cpu else 0.0,
        "cycle_cpu_ms_p99": round(_pct(cpu, 99), 3),
        "plan_ms_p99": round(_pct(plan_t, 99), 3),
        "apply_ms_p99": round(_pct(apply_t, 99), 3),
        "placed_per_cycle": round(statistics.fmean(placed), 3) if placed else 0.0,
        "considered_per_cycle": round(statistics.fmean(considered), 1) if considered else 0.0,
        # the rest repeated an equal job's answer (Plan.decided_afresh); 0 for the baseline
        "decided_afresh_per_cycle": round(statistics.fmean(afresh), 1) if afresh else 0.0,
        # not in cycle_ms: the cyclic GC is held off within a cycle (common.gc_hold)
        "gc_ms_per_cycle_mean": round(statistics.fmean(gc_t), 3) if gc_t else 0.0,
        "gc_ms_per_cycle_max": round(max(gc_t), 3) if gc_t else 0.0,
    }


def run(gpus: int = 24_000, cycles: int = 1000, queue: int = 50_000, baseline_cycles: int = 50, seed: int = 1) -> dict:
    policy = Policy()
    t0 = time.perf_counter()
    w = build_world(gpus, queue, seed)
    st = w.state
    setup_s = time.perf_counter() - t0
    occ0 = st.allocated_gpus() / st.total_gpus()
    gc.collect()
    gc.freeze()  # the long-lived state: keep the cyclic GC off it (docs/design.md, Known pitfalls)
    stats = _run_cycles(w, cycles, policy, plan)
    rss_engine = _rss_mb()
    result: dict[str, Any] = {
        "gpus": st.total_gpus(),
        "nodes": len(st.node_ids()),
        "blocks": len(st.block_ids()),
        "gpu_types": {t: st.total_gpus(t) for t in st.gpu_types()},
        "queued": queue,
        "queued_end": len(w.queue),
        "lookahead": policy.lookahead,
        **stats,
        "peak_rss_mb": round(rss_engine, 1),
        "occupancy_start": round(occ0, 4),
        "occupancy_end": round(st.allocated_gpus() / st.total_gpus(), 4),
        "running_end": len(st),
        "preemptions": w.preempted,
        "node_failures": w.failures,
        "simulated_s": cycles * DT,
        "setup_s": round(setup_s, 2),
        "seed": seed,
    }
    del w, st
    gc.unfreeze()
    gc.collect()
    if baseline_cycles > 0:
        b = build_world(gpus, queue, seed)
        gc.collect()
        gc.freeze()
        bstats = _run_cycles(b, baseline_cycles, policy, _naive_plan)
        gc.unfreeze()
        result["baseline"] = {"name": "naive full rescan (sort whole queue, scan every node, first fit)", **bstats}
        result["baseline_ratio_p50"] = round(bstats["cycle_ms_p50"] / max(result["cycle_ms_p50"], 1e-9), 1)
        result["baseline_ratio_p99"] = round(bstats["cycle_ms_p99"] / max(result["cycle_ms_p99"], 1e-9), 1)
    result["peak_rss_mb_process"] = round(_rss_mb(), 1)
    return result
