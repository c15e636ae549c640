"""The engine's victims against a brute-force optimum on small random clusters.

The rules' order (docs/design.md, Placement: victims): fewest jobs preempted (for whole
nodes, with ``Policy.victim_excess_cost``, plus every node the victims hold beyond the
need), then least lost work (GPU-seconds since each victim's last checkpoint, or since
its start if it cannot checkpoint). Every subset of the eligible jobs is tried here; the
plan's choice must cost exactly the optimum, for a priority preemption and for a reclaim
(a team below its guarantee taking back borrowed GPUs).
"""

from __future__ import annotations

import os
from itertools import combinations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from placement import ClusterState, Policy, PreemptReason, plan

from .helpers import HOUR, occupy, queue_of, spec

NOW = 20 * HOUR
GPUS = 8
CLASS_RANK = {"prod-serving": 0, "prod-batch": 1, "research": 2, "preemptible": 3}
RESERVE_MIN = 8  # Policy.reserve_min_gpus here: a whole node is a gang, and 2-node gangs are larger than 1

PROPS = settings(
    max_examples=int(os.environ.get("GPUFLEET_PLACEMENT_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class World:
    def __init__(self) -> None:
        self.st = ClusterState()
        self.nodes: dict[str, str] = {}  # node -> block
        self.jobs: dict[str, dict] = {}  # job -> {cls, team, borrowed, lost, held: {node: gpus}}


@st.composite
def worlds(draw, classes: list[str]) -> World:
    w = World()
    blocks = draw(st.integers(1, 3))
    per = draw(st.integers(2, 4))
    order = []
    for b in range(blocks):
        for n in range(per):
            nid = f"b{b}n{n}"
            w.st.add_node(nid, f"b{b}", "h100", GPUS)
            w.nodes[nid] = f"b{b}"
            order.append(nid)
    taken: set[str] = set()
    seq = 0

    def job(where: dict[str, tuple[int, ...]], gpr: int, replicas: int) -> None:
        nonlocal seq
        seq += 1
        jid = f"j{seq}"
        cls = draw(st.sampled_from(classes))
        team = draw(st.sampled_from(["a", "b"]))
        borrowed = draw(st.booleans())
        started = NOW - draw(st.sampled_from([1, 2, 3, 5, 8])) * HOUR
        can_ckpt = draw(st.booleans())
        after = draw(st.sampled_from([None, 600.0, 1800.0, 3000.0]))
        ckpt_at = None if after is None else min(started + after, NOW - 1)
        s = spec(jid, team=team, cls=cls, replicas=replicas, gpr=gpr, preemptible=can_ckpt, last_checkpoint_at=ckpt_at)
        occupy(w.st, s, where, started_at=started, borrowed=borrowed, now=NOW)
        charge = sum(len(g) for g in where.values())
        since = max(ckpt_at, started) if (can_ckpt and ckpt_at is not None) else started
        w.jobs[jid] = {
            "cls": cls,
            "team": team,
            "borrowed": borrowed,
            "lost": charge * (NOW - since),
            "held": {n: len(g) for n, g in where.items()},
        }

    for i, nid in enumerate(order):
        if nid in taken:
            continue
        kind = draw(st.sampled_from(["free", "whole", "whole", "small", "small", "gang"]))
        if kind == "free":
            continue
        if kind == "whole":
            job({nid: tuple(range(GPUS))}, GPUS, 1)
        elif kind == "gang" and i + 1 < len(order) and order[i + 1] not in taken:
            nxt = order[i + 1]  # may cross into the next block
            taken.add(nxt)
            job({nid: tuple(range(GPUS)), nxt: tuple(range(GPUS))}, GPUS, 2)
        else:
            used = 0
            for _ in range(draw(st.integers(1, 4))):
                g = draw(st.sampled_from([1, 2, 2, 4]))
                if used + g > GPUS:
                    break
                job({nid: tuple(range(used, used + g))}, g, 1)
                used += g
        taken.add(nid)
    # quotas that keep every drawn flag: the guarantee is exactly each team's guaranteed use
    for team in ("a", "b"):
        gused = sum(sum(j["held"].values()) for j in w.jobs.values() if j["team"] == team and not j["borrowed"])
        w.st.set_quota(team, "h100", gused, 100_000)
    return w


def eligible(j: dict, rank: int, upto: int | None = None) -> bool:
    """The victims of a preemptor of class ``rank`` within its team's guarantee (team "me").
    ``upto`` (past ``reclaim_small_borrowed_after_s``): borrowed jobs of higher classes too,
    small ones (< ``RESERVE_MIN`` GPUs) and gangs of at most ``upto`` GPUs."""
    r = CLASS_RANK[j["cls"]]
    if r == 0:
        return False
    if r > rank or (j["borrowed"] and r == rank):
        return True
    gpus = sum(j["held"].values())
    return upto is not None and j["borrowed"] and (gpus < RESERVE_MIN or gpus <= upto)


def best_whole(w: World, k: int, rank: int, excess: bool, upto: int | None = None) -> tuple | None:
    """The optimum over every block that could hold ``k`` nodes and every victim subset."""
    best = None
    for b in sorted(set(w.nodes.values())):
        nodes = [n for n, bb in w.nodes.items() if bb == b]
        on = {n: [j for j, d in w.jobs.items() if n in d["held"]] for n in nodes}
        free = sum(1 for n in nodes if not on[n])
        need = k - free
        if need <= 0:
            continue
        cands = sorted({j for n in nodes for j in on[n] if eligible(w.jobs[j], rank, upto)})
        for size in range(len(cands) + 1):
            for vs in combinations(cands, size):
                v = set(vs)
                freed = sum(1 for n in nodes if on[n] and all(j in v for j in on[n]))
                if freed < need:
                    continue
                key = cost_whole(w, v, need, excess)
                if best is None or key < best:
                    best = key
    return best


def cost_whole(w: World, v: set[str], need: int, excess: bool) -> tuple:
    held = sum(len(w.jobs[j]["held"]) for j in v)
    cost = len(v) + (max(0, held - need) if excess else 0)
    return cost, round(sum(w.jobs[j]["lost"] for j in v), 6)


def best_small(w: World, gpus: int, rank: int, upto: int | None = None) -> tuple | None:
    best = None
    for n in w.nodes:
        on = {j: d["held"][n] for j, d in w.jobs.items() if n in d["held"]}
        free = GPUS - sum(on.values())
        cands = sorted(j for j in on if eligible(w.jobs[j], rank, upto))
        for size in range(1, len(cands) + 1):
            for vs in combinations(cands, size):
                if free + sum(on[j] for j in vs) >= gpus:
                    key = (size, round(sum(w.jobs[j]["lost"] for j in vs), 6))
                    if best is None or key < best:
                        best = key
    return best


def _check(
    w: World, preemptor_cls: str, shape: str, size: int, excess: bool, reclaim: bool, waited: bool = False
) -> None:
    rank = CLASS_RANK[preemptor_cls]
    w.st.set_quota("me", "h100", 10_000, 0)
    # the rules' choice alone (class_preemption_max_lost_s only decides whether to take it)
    policy = Policy(
        reservations=False,
        victim_excess_cost=excess,
        reserve_min_gpus=RESERVE_MIN,
        reclaim_higher_borrowed_gangs=True,
        class_preemption_max_lost_s=None,
        reclaim_max_lost_s=None,
    )
    submit = NOW - 300 if waited else NOW  # 300 s: reclaim_small_borrowed_after_s
    if shape == "whole":
        job = spec(
            "x", team="me", cls=preemptor_cls, replicas=size, gpr=GPUS, pack="block", max_blocks=1, submit=submit
        )
    else:
        job = spec("x", team="me", cls=preemptor_cls, gpr=size, submit=submit)
    # past the wait: small higher-class borrowed jobs, and for a gang (whole nodes, at least
    # RESERVE_MIN GPUs) higher-class borrowed gangs no larger than itself
    upto = None
    if waited:
        upto = size * GPUS if shape == "whole" and size * GPUS >= RESERVE_MIN else 0
    p = plan(w.st, queue_of(job), policy, NOW)
    if p.placement("x") is not None:
        return  # it fits on free capacity: no victims to judge
    if shape == "whole":
        want = best_whole(w, size, rank, excess, upto)
    else:
        want = best_small(w, size, rank, upto)
    if want is None:
        assert p.preemptions == (), p.preemptions
        return
    assert p.preemptions, f"no victims, optimum {want}"
    got = {pr.victim for pr in p.preemptions}
    assert all(eligible(w.jobs[j], rank, upto) for j in got)
    if reclaim:
        assert all(pr.reason is PreemptReason.RECLAIM and pr.victim_borrowed for pr in p.preemptions)
    if shape == "whole":
        (res,) = [r for r in p.reservations if r.job_id == "x"]
        (b,) = res.blocks
        nodes = [n for n, bb in w.nodes.items() if bb == b]
        free = sum(1 for n in nodes if not any(n in d["held"] for d in w.jobs.values()))
        assert cost_whole(w, got, size - free, excess) == want
    else:
        key = (len(got), round(sum(w.jobs[j]["lost"] for j in got), 6))
        assert key == want


def _draw(data, classes: list[str]) -> tuple[World, str, int, bool]:
    """A world of these classes, the preemptor's shape and size, and victim_excess_cost."""
    w = data.draw(worlds(classes))
    shape = data.draw(st.sampled_from(["whole", "small"]))
    size = data.draw(st.integers(1, 3)) if shape == "whole" else data.draw(st.integers(1, GPUS - 1))
    return w, shape, size, data.draw(st.booleans())


@PROPS
@given(data=st.data())
def test_priority_victims_are_the_optimum(data) -> None:
    w, shape, size, excess = _draw(data, ["prod-serving", "prod-batch", "research", "preemptible"])
    _check(w, "prod-batch", shape, size, excess, reclaim=False)


@PROPS
@given(data=st.data())
def test_reclaim_victims_are_the_optimum(data) -> None:
    # the preemptor (research, within its guarantee) may take only borrowed research work of
    # other teams: guaranteed research and every prod class are out of reach
    w, shape, size, excess = _draw(data, ["prod-serving", "prod-batch", "research", "research"])
    _check(w, "research", shape, size, excess, reclaim=True)


@PROPS
@given(data=st.data())
def test_reclaim_victims_past_the_wait_are_the_optimum(data) -> None:
    # past reclaim_small_borrowed_after_s the research preemptor may also take other teams'
    # borrowed prod-batch work: small jobs, and (a gang itself) gangs no larger than itself
    w, shape, size, excess = _draw(data, ["prod-serving", "prod-batch", "research", "research"])
    _check(w, "research", shape, size, excess, reclaim=True, waited=True)


def test_a_better_block_past_the_six_with_most_free_nodes_is_found() -> None:
    """Blocks with free nodes whose victims cost more must not hide a block with none free
    whose one victim frees it (the search once tried only six blocks, most free nodes first)."""
    from .helpers import cluster, fill

    st_ = cluster(blocks=8, nodes=4)
    st_.set_quota("me", "h100", 10_000)
    for b in range(7):
        # one free node, three single-node victims each: 3 victims for 4 nodes
        fill(st_, [f"b{b}n1", f"b{b}n2", f"b{b}n3"], team="low", cls="preemptible", prefix=f"s{b}")
    occupy(
        st_,
        spec("gang", team="low", cls="preemptible", replicas=4, gpr=8),
        ["b7n0", "b7n1", "b7n2", "b7n3"],
        started_at=0.0,
    )
    x = spec("x", team="me", cls="prod-batch", replicas=4, gpr=8, pack="block", max_blocks=1)
    p = plan(st_, queue_of(x), Policy(reservations=False, class_preemption_max_lost_s=None), NOW)
    assert sorted(pr.victim for pr in p.preemptions) == ["gang"]
