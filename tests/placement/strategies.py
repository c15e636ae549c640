"""Hypothesis strategies: random clusters, quotas, running jobs, queues, and state snapshots."""

from __future__ import annotations

import random as _random
from dataclasses import dataclass, field

from hypothesis import strategies as st

from placement import (
    ClusterState,
    JobQueue,
    JobSpec,
    NodeGpus,
    NodeHealth,
    Pack,
    Placement,
    Policy,
    ReplicaSlot,
    Topology,
    apply,
    plan,
)

CLASSES = ["prod-serving", "prod-batch", "research", "preemptible"]
HOUR = 3600.0


@dataclass
class Scenario:
    nodes: list[tuple[str, str, str, int, NodeHealth]] = field(default_factory=list)
    quotas: list[tuple[str, str, int, int]] = field(default_factory=list)
    usage: list[tuple[str, str, float]] = field(default_factory=list)
    teams: list[str] = field(default_factory=list)
    types: dict[str, int] = field(default_factory=dict)


@st.composite
def scenarios(draw) -> Scenario:
    sc = Scenario()
    ntypes = draw(st.integers(1, 2))
    types = [("h100", 8), ("a100", 4)][:ntypes]
    for t, g in types:
        sc.types[t] = g
        for b in range(draw(st.integers(1, 3))):
            for n in range(draw(st.integers(1, 4))):
                health = draw(st.sampled_from([NodeHealth.READY] * 8 + [NodeHealth.SUSPECT, NodeHealth.DOWN]))
                sc.nodes.append((f"{t}-b{b}-n{n}", f"{t}-b{b}", t, g, health))
    sc.teams = [f"team{i}" for i in range(draw(st.integers(1, 4)))]
    for team in sc.teams:
        for t, _ in types:
            guarantee = draw(st.sampled_from([0, 8, 16, 16, 32, 64, 64]))
            sc.quotas.append((team, t, guarantee, draw(st.sampled_from([0, 8, 32, 1000, 1000]))))
            sc.usage.append((team, t, draw(st.floats(0, 500))))
    return sc


@st.composite
def job_specs(draw, sc: Scenario, prefix: str, submit_max: float = 4 * HOUR) -> JobSpec:
    t = draw(st.sampled_from(sorted(sc.types)))
    g = sc.types[t]
    kind = draw(st.sampled_from(["tiny", "small", "node", "gang", "odd"]))
    if kind == "tiny":
        gpr, reps = draw(st.sampled_from([1, 2])), draw(st.integers(1, 3))
    elif kind == "small":
        gpr, reps = draw(st.sampled_from([1, 2, g // 2])), draw(st.integers(1, 2))
    elif kind == "node":
        gpr, reps = g, 1
    elif kind == "gang":
        gpr, reps = g, draw(st.integers(2, 6))
    else:
        gpr, reps = draw(st.sampled_from([3, g // 2, g])), draw(st.integers(1, 5))
    pack = draw(st.sampled_from([Pack.ANY, Pack.BLOCK, Pack.BLOCK, Pack.NODE]))
    max_blocks = draw(st.sampled_from([None, 1, 2])) if pack is Pack.BLOCK else None
    blocks_wait = draw(st.sampled_from([None, None, 0.0, 900.0])) if max_blocks else None
    n_pre = draw(st.integers(0, 4))
    return JobSpec(
        job_id=f"{prefix}{draw(st.integers(0, 10**6))}",
        team=draw(st.sampled_from(sc.teams)),
        priority=draw(st.sampled_from(CLASSES)),
        gpu_type=t,
        replicas=reps,
        gpus_per_replica=gpr,
        topology=Topology(pack, max_blocks, blocks_wait),
        max_runtime_s=draw(st.sampled_from([600.0, HOUR, 4 * HOUR, 48 * HOUR])),
        preemptible=draw(st.booleans()),
        grace_s=draw(st.sampled_from([0.0, 30.0, 300.0])),
        submit_time=draw(st.floats(0, submit_max)),
        preemption_times=tuple(draw(st.floats(0, 4 * HOUR)) for _ in range(n_pre)),
        front=draw(st.booleans()) and draw(st.booleans()),
    )


def unique(jobs: list[JobSpec]) -> list[JobSpec]:
    seen: set[str] = set()
    out = []
    for j in jobs:
        if j.job_id not in seen:
            seen.add(j.job_id)
            out.append(j)
    return out


def build(sc: Scenario) -> ClusterState:
    stt = ClusterState()
    for nid, bid, t, g, h in sc.nodes:
        stt.add_node(nid, bid, t, g, h)
    for team, t, gq, b in sc.quotas:
        stt.set_quota(team, t, gq, b)
    for team, t, u in sc.usage:
        stt.set_usage(team, t, u, 0.0)
    return stt


def populate(stt: ClusterState, jobs: list[JobSpec], times: list[float], policy: Policy | None = None) -> None:
    """Start jobs with the engine itself at several times (so start times differ).

    Quotas are lifted while they start and restored after, so clusters fill up and the
    next plan has borrowed flags to re-check.
    """
    policy = policy or Policy(preemption=False, reservations=False)
    saved = stt.quotas()
    for (team, t), q in saved.items():
        stt.set_quota(team, t, q.guaranteed, 10_000)
    chunks = max(1, len(times))
    for i, now in enumerate(times):
        q = JobQueue(jobs[i::chunks])
        p = plan(stt, q, policy, now)
        apply(stt, p, q, now)
    for (team, t), q in saved.items():
        stt.set_quota(team, t, q.guaranteed, q.borrow_limit)


def snapshot(stt: ClusterState) -> dict:
    """Everything needed to rebuild an equal state (in any order)."""
    nodes = [(n, stt.node_block(n), stt.node_type(n), stt.node_size(n), stt.node_health(n)) for n in stt.node_ids()]
    running = []
    for rj in stt.running_jobs():
        p = Placement(
            job_id=rj.job_id,
            gpu_type=rj.gpu_type,
            nodes=tuple(NodeGpus(n, stt.node_jobs(n)[rj.job_id]) for n in sorted(rj.held)),
            slots=tuple(ReplicaSlot(r, n, g) for r, (n, g) in sorted(rj.slots.items())),
            blocks=rj.blocks,
            borrowed=rj.borrowed,
            gpus=rj.charge,
        )
        running.append(
            (rj.spec, p, rj.started_at, rj.last_checkpoint_at, rj.preempting_for, stt.missing_replicas(rj.job_id))
        )
    return {
        "nodes": nodes,
        "quotas": sorted((k[0], k[1], q.guaranteed, q.borrow_limit) for k, q in stt.quotas().items()),
        "running": running,
        "spares": [(o, stt.spares(o)) for o in stt.spare_owners()],
        "reservations": list(stt.reservations()),
        "dirty": stt.quota_dirty(),
    }


def rebuild(snap: dict, seed: int, usage: list[tuple[str, str, float]], now: float) -> ClusterState:
    rnd = _random.Random(seed)
    stt = ClusterState()
    nodes = list(snap["nodes"])
    rnd.shuffle(nodes)
    for nid, bid, t, g, _h in nodes:
        stt.add_node(nid, bid, t, g, NodeHealth.READY)
    quotas = list(snap["quotas"])
    rnd.shuffle(quotas)
    for team, t, g, b in quotas:
        stt.set_quota(team, t, g, b)
    running = list(snap["running"])
    rnd.shuffle(running)
    for spec, p, started, ckpt, _, _ in running:
        stt.allocate(spec, p, now, started_at=started)
        if ckpt is not None and ckpt != spec.last_checkpoint_at:
            stt.set_checkpoint(spec.job_id, ckpt)
    for _spec, _p, _, _, _, missing in running:
        if missing:
            raise AssertionError("rebuild of degraded jobs is not supported here")
    for nid, _, _, _, h in nodes:
        if h is not NodeHealth.READY:
            stt.set_node_health(nid, h)
    for spec, _, _, _, ben, _ in running:
        if ben is not None:
            stt.mark_preempting(spec.job_id, ben)
    spares = list(snap["spares"])
    rnd.shuffle(spares)
    for owner, ns in spares:
        for n in ns:
            stt.hold_spare(n, owner)
    res = list(snap["reservations"])
    rnd.shuffle(res)
    for r in res:
        stt.add_reservation(r)
    stt.mark_quota_checked([k for k in stt.quota_dirty() if k not in snap["dirty"]])
    for team, t, u in usage:
        stt.set_usage(team, t, u, now)
    return stt
