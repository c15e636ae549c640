"""Builders for placement tests: small clusters, job specs, direct occupation, checked cycles."""

from __future__ import annotations

from placement import (
    ClusterState,
    JobQueue,
    JobSpec,
    NodeGpus,
    Pack,
    Placement,
    Plan,
    Policy,
    ReplicaSlot,
    Topology,
    apply,
    check_plan,
    check_state,
    plan,
)

HOUR = 3600.0


def cluster(blocks: int = 2, nodes: int = 4, gpus: int = 8, gpu_type: str = "h100", prefix: str = "") -> ClusterState:
    """``blocks`` blocks of ``nodes`` nodes; node ids ``{prefix}b{block}n{node}``."""
    st = ClusterState()
    add_blocks(st, blocks, nodes, gpus, gpu_type, prefix)
    return st


def add_blocks(
    st: ClusterState, blocks: int, nodes: int, gpus: int = 8, gpu_type: str = "h100", prefix: str = ""
) -> None:
    for b in range(blocks):
        for n in range(nodes):
            st.add_node(f"{prefix}b{b}n{n}", f"{prefix}b{b}", gpu_type, gpus)


def spec(
    jid: str,
    team: str = "t",
    cls: str = "research",
    replicas: int = 1,
    gpr: int = 1,
    gpu_type: str = "h100",
    pack: str = "any",
    max_blocks: int | None = None,
    submit: float = 0.0,
    runtime: float = 10 * HOUR,
    max_blocks_wait_s: float | None = None,
    **kw,
) -> JobSpec:
    return JobSpec(
        job_id=jid,
        team=team,
        priority=cls,
        gpu_type=gpu_type,
        replicas=replicas,
        gpus_per_replica=gpr,
        topology=Topology(Pack(pack), max_blocks, max_blocks_wait_s),
        max_runtime_s=runtime,
        submit_time=submit,
        **kw,
    )


def occupy(
    st: ClusterState,
    job: JobSpec,
    where: dict[str, tuple[int, ...]] | list[str],
    started_at: float = 0.0,
    borrowed: bool = False,
    now: float | None = None,
) -> None:
    """Put a running job on given nodes (a list: whole nodes; a dict: node -> GPU indices)."""
    if isinstance(where, list):
        size = st.node_size(where[0])
        where = {n: tuple(range(size)) for n in where}
    slots = []
    r = 0
    gpr = job.gpus_per_replica
    for n, gpus in sorted(where.items()):
        for i in range(0, len(gpus), gpr):
            if r < job.replicas and len(gpus[i : i + gpr]) == gpr:
                slots.append(ReplicaSlot(r, n, tuple(gpus[i : i + gpr])))
                r += 1
    assert r == job.replicas, f"{job.job_id}: placed {r} of {job.replicas} replicas"
    total = sum(len(g) for g in where.values())
    p = Placement(
        job_id=job.job_id,
        gpu_type=job.gpu_type,
        nodes=tuple(NodeGpus(n, tuple(g)) for n, g in sorted(where.items())),
        slots=tuple(slots),
        blocks=tuple(sorted({st.node_block(n) for n in where})),
        borrowed=borrowed,
        gpus=total,
    )
    st.allocate(job, p, now if now is not None else started_at, started_at=started_at)


def fill(
    st: ClusterState,
    node_ids: list[str],
    team: str = "filler",
    cls: str = "research",
    started_at: float = 0.0,
    borrowed: bool = False,
    prefix: str = "f",
    **kw,
) -> list[str]:
    """One whole-node job per node (the team gets a large quota if it has none)."""
    for t in st.gpu_types():
        if st.quota(team, t).guaranteed == 0 and not borrowed:
            st.set_quota(team, t, 100_000, 100_000)
    out = []
    for n in node_ids:
        jid = f"{prefix}-{n}"
        occupy(
            st, spec(jid, team=team, cls=cls, gpr=st.node_size(n), **kw), [n], started_at=started_at, borrowed=borrowed
        )
        out.append(jid)
    return out


def queue_of(*jobs: JobSpec) -> JobQueue:
    q = JobQueue()
    for j in jobs:
        q.push(j)
    return q


def cycle(st: ClusterState, q: JobQueue, now: float, policy: Policy | None = None, do_apply: bool = True) -> Plan:
    """plan + invariant checks + apply + state checks."""
    policy = policy or Policy()
    p = plan(st, q, policy, now)
    errs = check_plan(st, p, q, policy, respect_topology=policy.topology)
    assert not errs, errs
    if do_apply:
        apply(st, p, q, now)
        errs = check_state(st, soft_limits_lapse=policy.spread_before_preempt)
        assert not errs, errs
    return p


def nodes_of(p: Plan, jid: str) -> list[str]:
    pl = p.placement(jid)
    assert pl is not None, f"{jid} not placed: {p.reason(jid)}"
    return [n.node_id for n in pl.nodes]


def blocks_of(p: Plan, jid: str) -> tuple[str, ...]:
    pl = p.placement(jid)
    assert pl is not None, f"{jid} not placed: {p.reason(jid)}"
    return pl.blocks


def big_quota(st: ClusterState, *teams: str, gpu_type: str = "h100") -> None:
    for t in teams:
        st.set_quota(t, gpu_type, 10_000, 10_000)
