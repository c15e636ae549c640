"""Quota rules: guarantees, borrowing from idle capacity only, re-checks every cycle."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as hs

from placement import PendingReason, Policy, check_state, plan, quota
from placement.topology import job_shape

from .helpers import HOUR, cluster, cycle, fill, occupy, queue_of, spec


def test_guaranteed_usage_never_above_the_guarantee() -> None:
    st = cluster(blocks=1, nodes=4)
    st.set_quota("t", "h100", guaranteed=16, borrow_limit=16)
    p = cycle(st, queue_of(spec("a", gpr=8), spec("b", gpr=8, submit=1), spec("c", gpr=8, submit=2)), 100)
    flags = {pl.job_id: pl.borrowed for pl in p.placements}
    assert flags == {"a": False, "b": False, "c": True}
    assert st.guaranteed_used("t", "h100") == 16
    assert st.borrowed_used("t", "h100") == 8


def test_borrowing_up_to_the_borrow_limit() -> None:
    st = cluster(blocks=1, nodes=4)
    st.set_quota("t", "h100", guaranteed=8, borrow_limit=8)
    p = cycle(st, queue_of(spec("a", gpr=8), spec("b", gpr=8, submit=1), spec("c", gpr=8, submit=2)), 100)
    assert {pl.job_id for pl in p.placements} == {"a", "b"}
    assert p.reason_for(spec("c", gpr=8)) is PendingReason.QUOTA  # its lane was skipped: no room left


def test_no_borrowing_when_disabled() -> None:
    st = cluster(blocks=1, nodes=4)
    st.set_quota("t", "h100", guaranteed=8, borrow_limit=100)
    p = cycle(st, queue_of(spec("a", gpr=8), spec("b", gpr=8, submit=1)), 100, Policy(borrowing=False))
    assert {pl.job_id for pl in p.placements} == {"a"}
    assert p.reason_for(spec("b", gpr=8)) is PendingReason.QUOTA


def test_borrowing_only_from_idle_capacity_never_preempts() -> None:
    st = cluster(blocks=1, nodes=2)
    st.set_quota("t", "h100", guaranteed=0, borrow_limit=100)
    fill(st, ["b0n0", "b0n1"], team="low", cls="preemptible")
    p = cycle(st, queue_of(spec("b", team="t", cls="prod-batch", gpr=8)), 10 * HOUR)
    assert p.preemptions == ()
    assert p.reason("b") is PendingReason.CAPACITY


def test_lowering_a_guarantee_relabels_the_newest_allocations_as_borrowed() -> None:
    st = cluster(blocks=1, nodes=4)
    st.set_quota("t", "h100", guaranteed=32, borrow_limit=32)
    for i, n in enumerate(["b0n0", "b0n1", "b0n2"]):
        occupy(st, spec(f"j{i}", gpr=8), [n], started_at=float(i))
    st.set_quota("t", "h100", guaranteed=8, borrow_limit=32)
    p = plan(st, queue_of(), Policy(), 100)
    assert sorted((r.job_id, r.borrowed) for r in p.relabels) == [("j1", True), ("j2", True)]
    assert ("t", "h100") in p.quota_checked
    cycle(st, queue_of(), 100)
    assert st.guaranteed_used("t", "h100") == 8
    assert not st.running("j0").borrowed and st.running("j2").borrowed


def test_borrowed_allocations_become_guaranteed_when_room_frees() -> None:
    st = cluster(blocks=1, nodes=4)
    st.set_quota("t", "h100", guaranteed=16, borrow_limit=16)
    cycle(st, queue_of(spec("a", gpr=8), spec("b", gpr=8, submit=1), spec("c", gpr=8, submit=2)), 100)
    assert st.running("c").borrowed
    st.release("a", 200)
    p = cycle(st, queue_of(), 201)
    assert [(r.job_id, r.borrowed) for r in p.relabels] == [("c", False)]
    assert st.guaranteed_used("t", "h100") == 16 and st.borrowed_used("t", "h100") == 0


def test_quotas_are_per_gpu_type() -> None:
    st = cluster(blocks=1, nodes=2, gpu_type="a100", prefix="a")
    from .helpers import add_blocks

    add_blocks(st, 1, 2, gpu_type="h100", prefix="h")
    st.set_quota("t", "h100", guaranteed=8)
    p = cycle(st, queue_of(spec("h", gpr=8, gpu_type="h100"), spec("a", gpr=8, gpu_type="a100", submit=1)), 100)
    assert p.placement("h") is not None
    assert p.reason_for(spec("a", gpr=8, gpu_type="a100")) is PendingReason.QUOTA


def test_stale_guaranteed_flag_from_the_store_is_rechecked() -> None:
    st = cluster(blocks=1, nodes=2)
    st.set_quota("t", "h100", guaranteed=8, borrow_limit=8)
    occupy(st, spec("a", gpr=8), ["b0n0"], started_at=0)
    occupy(st, spec("b", gpr=8), ["b0n1"], started_at=1)  # written as guaranteed: over the guarantee
    assert check_state(st)  # the violation is visible
    p = cycle(st, queue_of(), 100)
    assert [(r.job_id, r.borrowed) for r in p.relabels] == [("b", True)]


def test_a_gang_that_fits_the_guarantee_but_for_small_jobs_runs_guaranteed() -> None:
    # the team's guarantee is 32 GPUs; two 8-GPU jobs of its own hold 16 of it. Its 32-GPU gang
    # would be borrowed (16 + 32 > 32): the two small jobs are marked borrowed instead
    from placement import Relabel

    st = cluster(blocks=1, nodes=6)
    st.set_quota("t", "h100", 32, 100)
    occupy(st, spec("s1", gpr=8), ["b0n0"], started_at=0.0)
    occupy(st, spec("s2", gpr=8), ["b0n1"], started_at=10.0)
    pol = Policy(reserve_min_gpus=32)
    p = cycle(st, queue_of(spec("gang", replicas=4, gpr=8, pack="block")), 100, pol)
    pl = p.placement("gang")
    assert pl is not None and not pl.borrowed
    assert sorted(p.relabels, key=lambda r: r.job_id) == [Relabel("s1", True), Relabel("s2", True)]
    assert st.guaranteed_used("t", "h100") == 32 and st.borrowed_used("t", "h100") == 16


def test_gang_stays_borrowed_when_the_guarantee_cannot_hold_it() -> None:
    st = cluster(blocks=1, nodes=6)
    st.set_quota("t", "h100", 24, 100)
    occupy(st, spec("s1", gpr=8), ["b0n0"])
    p = cycle(st, queue_of(spec("gang", replicas=4, gpr=8, pack="block")), 100, Policy(reserve_min_gpus=32))
    assert p.placement("gang").borrowed and p.relabels == ()
    # and the baselines do not move flags
    st2 = cluster(blocks=1, nodes=6)
    st2.set_quota("t", "h100", 32, 100)
    occupy(st2, spec("s1", gpr=8), ["b0n0"])
    pol = Policy(reserve_min_gpus=32, guarantee_gangs_first=False)
    p = cycle(st2, queue_of(spec("gang", replicas=4, gpr=8, pack="block")), 100, pol)
    assert p.placement("gang").borrowed and p.relabels == ()


@given(
    jobs=hs.lists(
        hs.tuples(
            hs.sampled_from(["a", "b", "c"]),  # team
            hs.integers(1, 8),  # GPUs per replica
            hs.integers(1, 3),  # replicas
            hs.integers(0, 50),  # submit
            hs.booleans(),  # re-queued at the front of its class
        ),
        max_size=25,
    ),
    guarantees=hs.tuples(hs.integers(0, 12), hs.integers(0, 12), hs.integers(0, 40)),
    a_used=hs.integers(0, 2),  # whole nodes team a runs
)
@settings(max_examples=200, deadline=None)
def test_the_oldest_job_within_the_guarantee_is_what_a_full_scan_finds(
    jobs: list[tuple[str, int, int, int, bool]], guarantees: tuple[int, int, int], a_used: int
) -> None:
    """``quota.within_guarantee_since`` skips lanes and stops early; a full scan judges every
    queued job by its charge against what is left of its team's guarantee (whole use)."""
    cl = cluster(blocks=1, nodes=4)
    for team, g in zip("abc", guarantees, strict=True):
        cl.set_quota(team, "h100", g, 100)
    if a_used:
        occupy(cl, spec("run", team="a", replicas=a_used, gpr=8), [f"b0n{i}" for i in range(a_used)], borrowed=True)
    q = queue_of(
        *(spec(f"j{i}", team=t, gpr=g, replicas=r, submit=float(s), front=f) for i, (t, g, r, s, f) in enumerate(jobs))
    )
    want: dict[tuple[str, str], float] = {}
    for j in q:
        shape = job_shape(j, 8)
        key = (j.team, j.gpu_type)
        room = cl.quota(*key).guaranteed - cl.used(*key)
        if not isinstance(shape, str) and shape.charge <= room:
            want[key] = min(want.get(key, math.inf), j.submit_time)
    assert quota.within_guarantee_since(cl, q) == want
