"""Less churn by design: borrowed starts that would lose all their work to a likely reclaim wait."""

from __future__ import annotations

import pytest

from placement import PendingReason, Policy
from placement.forecast import DemandForecast, DemandWindow
from placement.model import PRESETS

from .helpers import cluster, cycle, fill, nodes_of, occupy, queue_of, spec

NOW = 10_000.0


def test_unsaved_borrowed_starts_leave_room_for_guaranteed_demand_expected_back() -> None:
    """(job checkpoints, lender's recent peak, lender's use, guard) -> the borrowed job starts?

    One node of 8 GPUs is free; "lender" holds a 16-GPU guarantee it is not using in full.
    A borrowed job of "b" that cannot checkpoint starts only if the free GPUs left after it
    cover guard x (lender's recent peak within its guarantee - its use now)."""
    pol = Policy(unsaved_borrow_guard=1.0)
    half = Policy(unsaved_borrow_guard=0.5)
    off = Policy()
    cases = [
        # preemptible (checkpoints), lender's peak, lender busy GPUs, policy, job GPUs, starts
        (False, 16, 8, pol, 4, False),  # 8 GPUs expected back, 4 left after it: waits
        (True, 16, 8, pol, 4, True),  # checkpoints: borrows as before
        (False, 16, 8, off, 4, True),  # the field off: as before
        (False, 8, 8, pol, 4, True),  # the lender uses all it asked for lately: nothing expected back
        (False, 0, 8, pol, 4, True),  # no forecast: nothing expected back
        (False, 12, 8, pol, 4, True),  # 4 expected back, 4 left after it
        (False, 12, 8, pol, 8, False),  # 4 expected back, 0 left after it
        (False, 16, 8, half, 4, True),  # half of 8 expected back: 4 left covers it
        (False, 16, 8, half, 8, False),
        (False, 64, 8, pol, 4, False),  # a peak above the guarantee counts up to the guarantee
    ]
    for preemptible, peak, lender_busy, policy, gpus, starts in cases:
        st = cluster(blocks=1, nodes=2)
        st.set_quota("lender", "h100", 16, 0)
        st.set_quota("b", "h100", 0, 100)
        fill(st, ["b0n0"][: lender_busy // 8], team="lender")
        st.set_quota("lender", "h100", 16, 0)  # fill() raised it
        st.set_demand_forecast({("lender", "h100"): peak})
        q = queue_of(spec("x", team="b", gpr=gpus, preemptible=preemptible))
        p = cycle(st, q, NOW, policy)
        case = (preemptible, peak, lender_busy, policy.unsaved_borrow_guard, gpus)
        assert ([pl.job_id for pl in p.placements] == ["x"]) is starts, case
        if not starts:
            assert p.reason_for(q.get("x")) is PendingReason.CAPACITY, case


def test_the_guard_leaves_guaranteed_and_gang_starts_alone() -> None:
    """Only borrowed jobs below ``reserve_min_gpus`` are held back: the team's own guaranteed
    work, and whole-node gangs (which reserve and drain), start as before."""
    pol = Policy(unsaved_borrow_guard=1.0, reserve_min_gpus=16, borrowed_gang_guard=None)
    st = cluster(blocks=1, nodes=4)
    st.set_quota("lender", "h100", 32, 0)
    st.set_quota("g", "h100", 8, 0)
    st.set_quota("b", "h100", 0, 100)
    st.set_demand_forecast({("lender", "h100"): 32})
    q = queue_of(
        spec("guaranteed", team="g", gpr=8, preemptible=False),
        spec("gang", team="b", replicas=2, gpr=8, preemptible=False, submit=1),
        spec("small", team="b", gpr=8, preemptible=False, submit=2),
    )
    p = cycle(st, q, NOW, pol)
    assert sorted(pl.job_id for pl in p.placements) == ["gang", "guaranteed"]
    assert p.reason_for(q.get("small")) is PendingReason.CAPACITY


def test_the_guard_counts_this_cycles_guaranteed_starts() -> None:
    """The lender's own work placed earlier in the cycle takes back part of what was expected."""
    pol = Policy(unsaved_borrow_guard=1.0)
    st = cluster(blocks=1, nodes=3)
    st.set_quota("lender", "h100", 16, 0)
    st.set_quota("b", "h100", 0, 100)
    st.set_demand_forecast({("lender", "h100"): 16})
    q = queue_of(
        spec("mine", team="lender", cls="prod-batch", gpr=8),
        spec("x", team="b", gpr=8, preemptible=False, submit=1),
    )
    p = cycle(st, q, NOW, pol)
    # after "mine" 8 GPUs of the lender's 16 are expected back; 16 free - 8 for x = 8: x starts
    assert sorted(pl.job_id for pl in p.placements) == ["mine", "x"]


def test_demand_window_keeps_recent_peaks() -> None:
    w = DemandWindow(window_s=1800, bucket_s=300)
    w.observe(0, {("a", "h100"): 64, ("b", "h100"): 8})
    w.observe(100, {("a", "h100"): 16})
    w.observe(600, {("a", "h100"): 32})
    assert w.peaks(600) == {("a", "h100"): 64, ("b", "h100"): 8}
    assert w.peaks(1800) == {("a", "h100"): 64, ("b", "h100"): 8}  # bucket 0 still in the window
    assert w.peaks(2100) == {("a", "h100"): 32}  # bucket 0 has left it; 32 still holds
    w.observe(2400, {("a", "h100"): 4})
    assert w.peaks(4200) == {("a", "h100"): 32}  # 32 held into the bucket of 2400
    assert w.peaks(4500) == {("a", "h100"): 4}  # the latest observation holds until the next
    with pytest.raises(ValueError):
        DemandWindow(window_s=0)


def test_demand_window_carries_a_demand_that_held_without_observations() -> None:
    """A team that held 32 GPUs from 0 to 1200 s with no cycle in between, then dropped to 0:
    its peak stays in the window until 1200 s is more than a window ago."""
    w = DemandWindow(window_s=1800, bucket_s=300)
    w.observe(0, {("a", "h100"): 32})
    w.observe(1200, {})
    assert w.peaks(2100) == {("a", "h100"): 32}
    assert w.peaks(3300) == {}


def test_the_baselines_keep_the_guard_off() -> None:
    from placement import PRESETS

    for name in ("fifo_first_fit", "no_topology_no_reservation", "easy_backfill"):
        assert PRESETS[name].unsaved_borrow_guard is None, name


def test_demand_of_counts_use_and_queued_lanes() -> None:
    """What the leader feeds the window: GPUs in use plus each queued lane's size floor x length."""
    from placement.forecast import demand_of

    st = cluster(blocks=1, nodes=2)
    st.set_quota("a", "h100", 16, 0)
    fill(st, ["b0n0"], team="a")
    st.set_quota("a", "h100", 16, 0)
    q = queue_of(spec("x", team="a", gpr=8), spec("y", team="a", gpr=8, submit=1), spec("z", team="b", gpr=1))
    d = demand_of(st, q)
    assert d[("a", "h100")] == 8 + 16
    assert d[("b", "h100")] == 1


def test_borrowed_gangs_leave_room_for_guaranteed_demand_expected_back() -> None:
    """(lender's recent peak, guard, reserve_min_gpus, gang nodes) -> the gang starts?

    One block of 6 nodes (48 GPUs): "lender" (16-GPU guarantee) uses one node, "b" (8-GPU
    guarantee) uses all of its guarantee with a prod-batch job placed first; 32 GPUs stay
    free. A whole-node research gang of "b", borrowed, starts only if the free GPUs left
    after it cover guard x (lender's peak within its guarantee - its use, 8 GPUs here)."""
    on = Policy(borrowed_gang_guard=1.0, reserve_min_gpus=16)
    half = Policy(borrowed_gang_guard=0.5, reserve_min_gpus=16)
    off = Policy(reserve_min_gpus=16, borrowed_gang_guard=None)
    big_min = Policy(borrowed_gang_guard=1.0, reserve_min_gpus=64)
    cases = [
        # lender's peak, policy, gang nodes, starts
        (16, on, 3, True),  # 8 expected back, 32 - 24 = 8 left after it
        (16, on, 4, False),  # 8 expected back, 0 left: waits
        (16, off, 4, True),  # the field off: as before
        (16, half, 3, True),  # 4 expected back, 8 left
        (16, half, 4, False),  # 4 expected back, 0 left
        (8, on, 4, True),  # the lender uses all it asked for lately: nothing expected back
        (0, on, 4, True),  # no forecast: nothing expected back
        (64, on, 4, False),  # a peak above the guarantee counts up to it
        (16, big_min, 4, True),  # 32 GPUs is below reserve_min_gpus=64: not a gang it holds back
    ]
    for peak, policy, nodes, starts in cases:
        st = cluster(blocks=1, nodes=6)
        fill(st, ["b0n0"], team="lender")
        st.set_quota("lender", "h100", 16, 0)  # fill() raised it
        st.set_quota("b", "h100", 8, 100)
        st.set_demand_forecast({("lender", "h100"): peak, ("b", "h100"): 400})
        q = queue_of(
            spec("own", team="b", gpr=8, cls="prod-batch"),
            spec("gang", team="b", replicas=nodes, gpr=8, pack="block", submit=1),
        )
        p = cycle(st, q, NOW, policy)
        case = (peak, policy.borrowed_gang_guard, policy.reserve_min_gpus, nodes)
        placed = {pl.job_id for pl in p.placements}
        assert "own" in placed, case
        assert ("gang" in placed) is starts, (case, placed)
        if not starts:
            assert p.reason_for(q.get("gang")) is PendingReason.CAPACITY, case
            assert not p.preemptions and q.get("gang") is not None, case
            assert all(r.job_id != "gang" for r in p.reservations), case


def test_the_gang_guard_never_holds_back_a_team_below_its_guarantee() -> None:
    """A team using less than its guarantee starts its gang even if it runs borrowed (part of
    it is the team's own unused guarantee); guaranteed gangs are never held back."""
    pol = Policy(borrowed_gang_guard=1.0, reserve_min_gpus=16)
    for b_guarantee, gang_nodes in ((8, 4), (32, 4)):  # borrowed (8 + 32 > 8) / guaranteed
        st = cluster(blocks=1, nodes=6)
        fill(st, ["b0n0"], team="lender")
        st.set_quota("lender", "h100", 48, 0)
        st.set_quota("b", "h100", b_guarantee, 100)
        st.set_demand_forecast({("lender", "h100"): 48})  # 40 expected back: more than is free
        q = queue_of(spec("gang", team="b", replicas=gang_nodes, gpr=8, pack="block"))
        p = cycle(st, q, NOW, pol)
        assert [pl.job_id for pl in p.placements] == ["gang"], b_guarantee


def test_reads_demand_forecast_and_baselines_keep_the_gang_guard_off() -> None:
    from placement import PRESETS

    assert Policy().borrowed_gang_guard == 0.5  # on in gpufleet (sim/README.md has the runs)
    assert Policy().reads_demand_forecast
    assert not Policy(borrowed_gang_guard=None, borrowed_restart_backoff_s=None).reads_demand_forecast
    assert Policy(
        borrowed_gang_guard=None, borrowed_restart_backoff_s=None, unsaved_borrow_guard=1.0
    ).reads_demand_forecast
    assert Policy(borrowed_gang_guard=None, borrowed_restart_backoff_s=600.0).reads_demand_forecast
    assert Policy(
        borrowed_gang_guard=None, borrowed_restart_backoff_s=None, serving_idle_guard=1.0
    ).reads_demand_forecast
    for name in ("fifo_first_fit", "no_topology_no_reservation", "easy_backfill"):
        assert PRESETS[name].borrowed_gang_guard is None, name
        assert PRESETS[name].borrowed_restart_backoff_s is None, name
        assert PRESETS[name].pooled_demand_forecast is False, name


def test_spread_before_preempt_runs_a_guaranteed_job_wider_instead_of_reclaiming() -> None:
    """(field, block limit soft, job borrowed) -> the job is placed spread / reclaims / waits.

    Two blocks of 4 nodes; in each, 2 nodes are free. In b0 the other 2 run another team's
    borrowed work; in b1 guaranteed work. A 4-node job that asks for one block fits only by
    reclaiming b0's borrowed work, or by running across both blocks on the 4 free nodes."""
    cases = [
        # spread_before_preempt, max_blocks_wait_s, team "g"'s guarantee, outcome
        (True, 300.0, 32, "spread"),  # soft limit, runs guaranteed: spreads, nobody preempted
        (False, 300.0, 32, "reclaim"),  # the field off: reclaims b0's borrowed work, as before
        (True, None, 32, "reclaim"),  # a hard limit is kept
        (True, 300.0, 0, "waits"),  # borrowed: it would not reclaim, and keeps to its limit
    ]
    for field, wait_s, guarantee, outcome in cases:
        st = cluster(blocks=2, nodes=4)
        st.set_quota("lender", "h100", 0, 100)
        fill(st, ["b0n2", "b0n3"], team="lender", borrowed=True)
        fill(st, ["b1n2", "b1n3"], team="owner", prefix="o")
        st.set_quota("g", "h100", guarantee, 100)
        job = spec("x", team="g", replicas=4, gpr=8, pack="block", max_blocks=1, max_blocks_wait_s=wait_s, submit=NOW)
        q = queue_of(job)
        pol = Policy(spread_before_preempt=field)
        p = cycle(st, q, NOW, pol)
        case = (field, wait_s, guarantee)
        if outcome == "spread":
            assert [pl.job_id for pl in p.placements] == ["x"], case
            assert {n.node_id[:2] for n in p.placements[0].nodes} == {"b0", "b1"}, case
            assert not p.preemptions, case
        elif outcome == "reclaim":
            assert not p.placements, case
            assert sorted(pr.victim for pr in p.preemptions) == ["f-b0n2", "f-b0n3"], case
        else:
            assert not p.placements and not p.preemptions, case


def test_within_its_patience_a_job_stops_only_work_that_loses_little() -> None:
    """(class, GPUs, waited, victims' work since their checkpoint, patience) -> preempts now?

    Both nodes run another team's borrowed work that checkpointed ``since`` seconds ago;
    "owner" has a 16-GPU guarantee and nothing running. Within ``preempt_patience_s`` of its
    submit its job stops only work that would lose at most ``patience_max_lost_s`` (300 s)
    per GPU; otherwise it waits (``capacity``) for jobs to end. Past its patience it
    reclaims as before. prod-serving, and prod-batch jobs within one node, never wait."""
    cases = [
        # class, GPUs (8 per node), waited (s), victims' work since checkpoint (s), patience, preempts
        ("research", 16, 10.0, 1800.0, 120.0, False),  # costly victims, within its patience
        ("research", 16, 119.0, 1800.0, 120.0, False),
        ("research", 16, 120.0, 1800.0, 120.0, True),  # waited the patience: reclaims
        ("research", 16, 10.0, 200.0, 120.0, True),  # victims that just checkpointed: at once
        ("research", 16, 10.0, 300.0, 120.0, True),  # at the bound
        ("research", 16, 10.0, 1800.0, None, True),  # the field off: reclaims at once
        ("research", 8, 10.0, 1800.0, 120.0, False),  # a one-node research job waits too
        ("preemptible", 8, 10.0, 1800.0, 120.0, False),
        ("prod-batch", 16, 10.0, 1800.0, 120.0, False),  # a multi-node prod-batch job waits
        ("prod-batch", 8, 10.0, 1800.0, 120.0, True),  # a small prod job: the 2-minute p95 wait
        ("prod-serving", 16, 10.0, 1800.0, 120.0, True),
    ]
    for cls, gpus, waited, since, patience, preempts in cases:
        st = cluster(blocks=1, nodes=2)
        st.set_quota("b", "h100", 0, 100)
        for jid in fill(st, ["b0n0", "b0n1"], team="b", borrowed=True, started_at=NOW - 7200.0, preemptible=True):
            st.set_checkpoint(jid, NOW - since)
        st.set_quota("owner", "h100", 16, 0)
        q = queue_of(spec("x", team="owner", cls=cls, gpr=8, replicas=gpus // 8, submit=NOW - waited))
        p = cycle(st, q, NOW, Policy(preempt_patience_s=patience))
        case = (cls, gpus, waited, since, patience)
        assert bool(p.preemptions) is preempts, case
        assert not p.placements, case
        if preempts:
            assert {pr.victim_borrowed for pr in p.preemptions} == {True}, case
        else:
            assert p.reason_for(q.get("x")) is PendingReason.CAPACITY, case


def test_a_patient_job_takes_capacity_an_ending_job_frees() -> None:
    """The point of waiting: a job ends within the patience, the waiting job starts there,
    and nobody's work is stopped."""
    st = cluster(blocks=1, nodes=2)
    st.set_quota("b", "h100", 0, 100)
    fill(st, ["b0n0", "b0n1"], team="b", borrowed=True)
    st.set_quota("owner", "h100", 16, 0)
    q = queue_of(spec("x", team="owner", gpr=8, submit=NOW))
    pol = Policy(preempt_patience_s=120.0)
    assert not cycle(st, q, NOW, pol).preemptions
    st.release("f-b0n1", NOW + 30.0)
    p = cycle(st, q, NOW + 31.0, pol)
    assert not p.preemptions
    assert nodes_of(p, "x") == ["b0n1"]


def test_patience_is_counted_from_the_teams_oldest_queued_job() -> None:
    """A team whose jobs keep arriving is not held back one patience after another: a new
    job of a team that has had work queued for longer than the patience reclaims at once."""
    for oldest_waited, preempts in ((60.0, False), (600.0, True)):
        st = cluster(blocks=1, nodes=2)
        st.set_quota("b", "h100", 0, 100)
        for jid in fill(st, ["b0n0", "b0n1"], team="b", borrowed=True, started_at=NOW - 7200.0, preemptible=True):
            st.set_checkpoint(jid, NOW - 1800.0)
        st.set_quota("owner", "h100", 16, 0)
        q = queue_of(
            spec("old", team="owner", gpr=8, replicas=3, submit=NOW - oldest_waited),  # over its guarantee
            spec("new", team="owner", gpr=8, replicas=2, submit=NOW - 5.0),
        )
        p = cycle(st, q, NOW, Policy(preempt_patience_s=300.0))
        assert [pr.beneficiary for pr in p.preemptions] == (["new", "new"] if preempts else []), oldest_waited


@pytest.mark.parametrize(
    ("apart", "borrowed", "want"),
    [
        (False, True, "b0n0"),  # best fit: the node with 4 free, beside guaranteed work
        (True, True, "b0n1"),  # apart: beside the borrowed job, though 6 are free there
        (True, False, "b0n0"),  # guaranteed work beside guaranteed work (also the best fit)
        (False, False, "b0n0"),
    ],
)
def test_borrowed_small_jobs_go_beside_borrowed_work_when_apart(apart: bool, borrowed: bool, want: str) -> None:
    """(borrowed_apart, is the new job borrowed?) -> its node. b0n0 runs "g"'s guaranteed
    job (4 free), b0n1 "l"'s borrowed job (6 free), b0n2 is free. Kept apart, a reclaim of
    the borrowed jobs frees b0n1 whole; beside guaranteed work it frees no node."""
    st = cluster(blocks=1, nodes=3)
    st.set_quota("g", "h100", 8, 8)
    st.set_quota("l", "h100", 0, 16)
    st.set_quota("new", "h100", 0 if borrowed else 8, 16)
    occupy(st, spec("g1", team="g", gpr=4), {"b0n0": (0, 1, 2, 3)}, started_at=NOW - 600)
    occupy(st, spec("l1", team="l", gpr=2), {"b0n1": (0, 1)}, started_at=NOW - 600, borrowed=True)
    p = cycle(st, queue_of(spec("x", team="new", gpr=2, submit=NOW)), NOW, Policy(borrowed_apart=apart))
    assert p.placement("x").borrowed is borrowed
    assert nodes_of(p, "x") == [want]


def test_the_baselines_keep_borrowed_work_in_best_fit() -> None:
    assert Policy().borrowed_apart is False
    assert all(not p.borrowed_apart for p in PRESETS.values())


@pytest.mark.parametrize(
    ("align", "runtime", "want"),
    [
        (False, 1_000.0, "b0n0"),  # best fit: 4 free on b0n0 (ends at NOW + 1,400), 6 on b0n1
        (False, 20_000.0, "b0n0"),
        (True, 1_000.0, "b0n0"),  # ends before both nodes' jobs: best fit
        (True, 5_000.0, "b0n1"),  # within b0n1's end (NOW + 9,400) only
        (True, 20_000.0, "b0n1"),  # past both: the node it keeps busy the least longer
        (True, 90_000.0, "b0n1"),
    ],
)
def test_small_jobs_go_where_their_end_keeps_no_node_busy_longer(align: bool, runtime: float, want: str) -> None:
    """(align_node_ends, the new job's max_runtime) -> its node. b0n0 runs a 4-GPU job
    expected to end at NOW + 1,400 s, b0n1 a 2-GPU job expected to end at NOW + 9,400 s
    (start + max_runtime), b0n2 is free. Aligned, a job goes where it does not hold a node
    past the jobs already there, so the node comes free whole sooner."""
    st = cluster(blocks=1, nodes=3)
    st.set_quota("t", "h100", 24, 0)
    occupy(st, spec("short", gpr=4, runtime=2_000.0), {"b0n0": (0, 1, 2, 3)}, started_at=NOW - 600)
    occupy(st, spec("long", gpr=2, runtime=10_000.0), {"b0n1": (0, 1)}, started_at=NOW - 600)
    p = cycle(st, queue_of(spec("x", gpr=2, submit=NOW, runtime=runtime)), NOW, Policy(align_node_ends=align))
    assert nodes_of(p, "x") == [want]


def test_the_aligned_search_falls_back_to_a_free_node() -> None:
    """No partly used node fits: a whole free node, as best fit would choose."""
    st = cluster(blocks=1, nodes=2)
    st.set_quota("t", "h100", 16, 0)
    occupy(st, spec("a", gpr=6, runtime=2_000.0), {"b0n0": tuple(range(6))}, started_at=NOW - 600)
    p = cycle(st, queue_of(spec("x", gpr=4, submit=NOW)), NOW, Policy(align_node_ends=True))
    assert nodes_of(p, "x") == ["b0n1"]


def test_the_presets_place_small_jobs_by_best_fit_alone() -> None:
    assert Policy().align_node_ends is False
    assert all(not p.align_node_ends for p in PRESETS.values())


def test_a_job_preempted_lately_backs_off_before_it_starts_borrowed_again() -> None:
    """(backoff, its preemption times, its team's guarantee, demand expected back) -> an
    8-GPU job starts on one of two free nodes?

    ``borrowed_restart_backoff_s``: after ``n`` preemptions within ``preemption_window_s``
    a job waits ``n`` x the backoff from the last one before it starts borrowed (told
    ``capacity``), while the GPUs free after it would not cover the guaranteed demand
    expected back; within its team's guarantee it starts at once; off, nothing waits."""
    day = 86_400.0
    now = 2 * day
    cases = [
        # backoff, preemption times, guarantee, lender's recent peak, starts
        (600.0, (now - 100,), 0, 16, False),  # borrowed, 100 s after its preemption
        (600.0, (now - 600,), 0, 16, True),  # the backoff has passed
        (600.0, (now - 2000, now - 700), 0, 16, False),  # twice: 1,200 s from the last
        (600.0, (now - 2000, now - 1200), 0, 16, True),
        (600.0, (now - day - 10, now - 700), 0, 16, True),  # the first is outside the window: once
        (600.0, (now - 100,), 8, 16, True),  # runs within its team's guarantee: never held
        (600.0, (now - 100,), 0, 8, True),  # 8 GPUs expected back, 8 free after it: a reclaim is unlikely
        (600.0, (), 0, 16, True),  # never preempted
        (None, (now - 100,), 0, 16, True),  # the field off (the baselines)
    ]
    assert Policy().borrowed_restart_backoff_s == 1800.0  # on in gpufleet (sim/README.md has the runs)
    for backoff, times, guarantee, peak, starts in cases:
        st = cluster(blocks=1, nodes=2)
        st.set_quota("lender", "h100", 16, 0)
        st.set_demand_forecast({("lender", "h100"): peak})
        st.set_quota("b", "h100", guarantee, 100)
        job = spec("x", team="b", gpr=8, submit=now - 3 * day, preemption_times=times)
        p = cycle(st, queue_of(job), now, Policy(borrowed_restart_backoff_s=backoff))
        case = (backoff, times, guarantee, peak)
        assert (p.placement("x") is not None) is starts, case
        if not starts:
            assert p.reason("x") is PendingReason.CAPACITY, case
            assert "backs off" in p.pending[0].detail, case


def test_the_pooled_forecast_expects_back_the_teams_combined_peak() -> None:
    """Teams "x" and "y" (16-GPU guarantees) each asked for 16 GPUs in the last half hour, but
    one after the other: their own peaks sum to 32, their combined peak within guarantees is
    16 (``DemandForecast``). "x" uses 8 now, so 24 GPUs are expected back summed, 8 pooled."""
    st = cluster(blocks=1, nodes=6)
    st.set_quota("x", "h100", 16, 0)
    st.set_quota("y", "h100", 16, 0)
    st.set_quota("z", "h100", 0, 100)  # a borrower: no guarantee, none of its demand comes back
    f = DemandForecast(window_s=1800, bucket_s=300)
    f.observe(0, st, {("x", "h100"): 16, ("y", "h100"): 0, ("z", "h100"): 64})
    f.observe(600, st, {("x", "h100"): 0, ("y", "h100"): 16, ("z", "h100"): 64})
    f.observe(1200, st, {("x", "h100"): 8, ("y", "h100"): 0, ("z", "h100"): 64})
    f.apply(st, 1200)
    assert (st.demand_forecast("x", "h100"), st.demand_forecast("y", "h100")) == (16, 16)
    occupy(st, spec("xs", team="x", gpr=8), ["b0n0"])
    assert st.returning_demand("h100") == 8 + 16
    assert st.returning_demand("h100", pooled=True) == 16 - 8
    # never more than the sum: "x" back at its guarantee and "y" idle expect nothing
    occupy(st, spec("xs2", team="x", gpr=8), ["b0n1"])
    assert st.returning_demand("h100") == 16 and st.returning_demand("h100", pooled=True) == 0


def test_gpus_reserved_for_a_team_count_as_its_use_only_under_the_field() -> None:
    """``returning_demand_less_reserved``: "x" (16-GPU guarantee, peak 16) uses 8 and has 8
    GPUs reserved for a queued job of its own; the reservation already holds room for that
    demand, so with the field "x" expects nothing more back. "y" (peak 16, uses none) still
    expects its 16; a reservation of another type counts for nothing."""
    from placement import Reservation, ReservationKind

    st = cluster(blocks=1, nodes=6)
    st.set_quota("x", "h100", 16, 0)
    st.set_quota("y", "h100", 16, 0)
    st.set_demand_forecast({("x", "h100"): 16, ("y", "h100"): 16}, pooled={"h100": 32})
    occupy(st, spec("xs", team="x", gpr=8), ["b0n0"])
    st.add_reservation(Reservation("xr", "h100", ReservationKind.PREEMPTION, (), ("b0n1",), 1, 8, 2, NOW, NOW, "x"))
    st.add_reservation(Reservation("xa", "a100", ReservationKind.PREEMPTION, (), ("b0n2",), 1, 8, 2, NOW, NOW, "x"))
    cases = [
        # less_reserved, pooled, expected back
        (False, False, 8 + 16),
        (True, False, 0 + 16),
        (False, True, 32 - 8),  # the combined peak less the use within guarantees
        (True, True, 32 - 16),
    ]
    for less_reserved, pooled, back in cases:
        assert st.returning_demand("h100", pooled=pooled, less_reserved=less_reserved) == back, (less_reserved, pooled)
    assert Policy().returning_demand_less_reserved is False  # off in gpufleet (tried, sim/README.md)


def test_a_borrowed_gang_the_summed_forecast_holds_starts_under_the_pooled_one() -> None:
    """The same two lenders, 8 GPUs of "x" in use: 32 GPUs free, a 3-node borrowed gang of
    "b" would leave 8. Summed, 24 GPUs are expected back and the gang guard (1.0) holds it;
    pooled, 8 are, and it starts."""
    for pooled, starts in ((False, False), (True, True)):
        st = cluster(blocks=1, nodes=6)
        st.set_quota("x", "h100", 16, 0)
        st.set_quota("y", "h100", 16, 0)
        st.set_quota("b", "h100", 8, 100)
        occupy(st, spec("xs", team="x", gpr=8), ["b0n0"])
        st.set_demand_forecast({("x", "h100"): 16, ("y", "h100"): 16, ("b", "h100"): 400}, pooled={"h100": 16})
        q = queue_of(
            spec("own", team="b", gpr=8, cls="prod-batch"),
            spec("gang", team="b", replicas=3, gpr=8, pack="block", submit=1),
        )
        pol = Policy(borrowed_gang_guard=1.0, reserve_min_gpus=16, pooled_demand_forecast=pooled)
        p = cycle(st, q, NOW, pol)
        assert (p.placement("gang") is not None) is starts, pooled
    assert Policy().pooled_demand_forecast is True  # on in gpufleet


def test_the_gang_guard_reaches_a_gang_holding_its_own_reservation_only_under_its_field() -> None:
    """``gang_guard_reserved``: a borrowed gang whose head-of-line reservation is ready passes
    the guard by default; with the field it waits like any borrowed gang and gives the
    reservation up, so its nodes do not sit reserved for a start the guard forbids."""
    from placement import Reservation, ReservationKind

    for guard_reserved, starts in ((False, True), (True, False)):
        pol = Policy(borrowed_gang_guard=1.0, reserve_min_gpus=16, gang_guard_reserved=guard_reserved)
        st = cluster(blocks=1, nodes=6)
        fill(st, ["b0n0"], team="lender")
        st.set_quota("lender", "h100", 16, 0)  # fill() raised it
        st.set_quota("b", "h100", 8, 100)
        st.set_demand_forecast({("lender", "h100"): 16, ("b", "h100"): 400})  # 8 GPUs expected back
        st.add_reservation(
            Reservation("gang", "h100", ReservationKind.HEAD_OF_LINE, ("b0",), (), 4, 32, 2, NOW, NOW - 600, "b")
        )
        q = queue_of(
            spec("own", team="b", gpr=8, cls="prod-batch"),
            spec("gang", team="b", replicas=4, gpr=8, pack="block", submit=1),
        )
        p = cycle(st, q, NOW, pol)
        placed = {pl.job_id for pl in p.placements}
        assert "own" in placed, guard_reserved
        assert ("gang" in placed) is starts, (guard_reserved, placed)
        if not starts:
            assert p.reason_for(q.get("gang")) is PendingReason.CAPACITY
            assert all(r.job_id != "gang" for r in p.reservations)


def test_the_guard_reaches_small_borrowed_jobs_only_under_its_field() -> None:
    """(borrowed_guard_min_gpus, guard, b's guarantee, job GPUs) -> the job starts?

    Two nodes of 8 GPUs: "lender" (16-GPU guarantee, recent peak 16) uses one, so 8 GPUs are
    free and 8 expected back. A research job of "b" within one node starts, unless the guard
    covers its size and the free GPUs left after it fall short of guard x 8."""
    cases = [
        # min GPUs, guard, b's guarantee, job GPUs, starts
        (None, 1.0, 0, 4, True),  # without the field the guard holds back gangs only
        (1, 1.0, 0, 4, False),  # 4 left after it, 8 expected back: waits
        (4, 1.0, 0, 4, False),  # exactly the minimum: covered
        (5, 1.0, 0, 4, True),  # below the minimum: starts as before
        (1, 0.5, 0, 4, True),  # half of 8 expected back: the 4 left cover it
        (1, 0.5, 0, 6, False),  # 2 left, 4 expected back
        (1, 1.0, 4, 4, True),  # within b's guarantee: runs guaranteed, never held back
        (1, 1.0, 2, 4, True),  # borrowed, but b is below its guarantee: its own unused share
        (1, None, 0, 4, True),  # the guard off: nothing to extend
    ]
    for small_min, guard, b_guarantee, gpus, starts in cases:
        # unbounded by pool share or a prod hold (the next test has those)
        pol = Policy(
            borrowed_gang_guard=guard,
            borrowed_guard_min_gpus=small_min,
            borrowed_guard_max_share=None,
            borrowed_guard_prod_hold_s=None,
        )
        st = cluster(blocks=1, nodes=2)
        fill(st, ["b0n0"], team="lender")
        st.set_quota("lender", "h100", 16, 0)  # fill() raised it
        st.set_quota("b", "h100", b_guarantee, 100)
        st.set_demand_forecast({("lender", "h100"): 16})
        q = queue_of(spec("x", team="b", gpr=gpus))
        p = cycle(st, q, NOW, pol)
        case = (small_min, guard, b_guarantee, gpus)
        assert (p.placement("x") is not None) is starts, case
        if not starts:
            assert p.reason_for(q.get("x")) is PendingReason.CAPACITY, case
            assert not p.preemptions, case
    assert Policy().borrowed_guard_min_gpus == 1  # on in gpufleet, bounded (sim/README.md has the runs)
    for name in PRESETS:
        if name != "gpufleet":
            assert PRESETS[name].borrowed_guard_min_gpus is None, name


def test_the_small_job_guard_spares_jobs_large_for_the_pool_and_prod_batch_that_waited() -> None:
    """(borrowed_guard_max_share, borrowed_guard_prod_hold_s, class, waited s) -> starts?

    The world of the test above: 8 GPUs free of 16, 8 expected back, a 4-GPU borrowed job of
    "b" held back by ``borrowed_guard_min_gpus=1``, unless it is more than the share of the
    type's GPUs (on a small pool one held job idles a visible part of it) or a prod-batch
    job that has waited the hold (the 2-minute p95 for small prod jobs)."""
    cases = [
        (None, None, "research", 0, False),  # the guard as above
        (0.25, None, "research", 0, False),  # 4 of 16 GPUs: within the share, held
        (0.2, None, "research", 0, True),  # past the share: not the guard's
        (None, 60.0, "prod-batch", 30, False),  # prod-batch within its hold
        (None, 60.0, "prod-batch", 90, True),  # prod-batch past its hold
        (None, 60.0, "research", 90, False),  # the hold is prod-batch's only
        (None, None, "prod-batch", 90, False),  # no hold: held as any class
    ]
    for share, hold, cls, waited, starts in cases:
        pol = Policy(
            borrowed_gang_guard=1.0,
            borrowed_guard_min_gpus=1,
            borrowed_guard_max_share=share,
            borrowed_guard_prod_hold_s=hold,
        )
        st = cluster(blocks=1, nodes=2)
        fill(st, ["b0n0"], team="lender")
        st.set_quota("lender", "h100", 16, 0)
        st.set_quota("b", "h100", 0, 100)
        st.set_demand_forecast({("lender", "h100"): 16})
        q = queue_of(spec("x", team="b", gpr=4, cls=cls, submit=NOW - waited))
        p = cycle(st, q, NOW, pol)
        case = (share, hold, cls, waited)
        assert (p.placement("x") is not None) is starts, case
        if not starts:
            assert p.reason_for(q.get("x")) is PendingReason.CAPACITY, case
    assert (Policy().borrowed_guard_max_share, Policy().borrowed_guard_prod_hold_s) == (0.01, 60.0)  # gpufleet
    for name in PRESETS:
        if name != "gpufleet":
            assert PRESETS[name].borrowed_guard_max_share is None, name


def test_serving_takes_idle_gpus_only_under_its_guard_and_only_those_not_expected_back() -> None:
    """``serving_idle_guard``: prod-serving beyond its guarantee (never a victim) takes idle
    GPUs only if the free GPUs left after it cover guard x the demand expected back; by
    default it never takes idle capacity (docs/design.md).

    Three 8-GPU nodes, "lender" uses one of them; two (16 GPUs) are free."""
    cases = [
        # lender's guarantee (and recent peak), policy, starts
        (16, Policy(serving_idle_guard=1.0), True),  # 8 expected back, 8 left after it
        (24, Policy(serving_idle_guard=1.0), False),  # 16 expected back, 8 left: waits
        (24, Policy(serving_idle_guard=0.5), True),  # half of 16 expected back
        (16, Policy(), False),  # the default: never idle capacity
    ]
    for lender_g, pol, starts in cases:
        st = cluster(blocks=1, nodes=3)
        fill(st, ["b0n0"], team="lender")
        st.set_quota("lender", "h100", lender_g, 0)  # fill() raised it
        st.set_quota("svc", "h100", 0, 100)
        st.set_demand_forecast({("lender", "h100"): lender_g})
        q = queue_of(spec("s", team="svc", cls="prod-serving", gpr=8))
        p = cycle(st, q, NOW, pol)
        case = (lender_g, pol.serving_idle_guard)
        pl = p.placement("s")
        assert (pl is not None) is starts, case
        if pl is not None:
            assert pl.borrowed, case
        else:
            assert p.preemptions == (), case


def test_a_team_at_its_guarantee_in_use_does_not_reclaim_for_a_job_labelled_guaranteed() -> None:
    """``preempt_within_team_use``: (a's guarantee, the new job's class, field) -> preempts?

    One block of 4 nodes, all busy. "lender" (no guarantee) borrows n0 with a research job.
    Team a runs a 16-GPU research gang on n1-n2; with a guarantee of 8 the gang does not fit
    it, so it stays borrowed and a's guaranteed use is 0. a's new 8-GPU job fits that
    guaranteed use, so it is labelled guaranteed, though a's whole use (16) is past the
    guarantee already. A filler's guaranteed research job holds n3."""
    cases = [
        # a's guarantee, new job's class, field, preempts lender's job
        (8, "research", False, True),  # by default the label decides: it reclaims
        (8, "research", True, False),  # a's use (16) + 8 > 8: it waits as work beyond it does
        (24, "research", True, True),  # the gang runs guaranteed: 16 + 8 <= 24, it reclaims
        (8, "prod-serving", True, True),  # prod-serving keeps its guarantee's rights
    ]
    for a_guarantee, cls, field, preempts in cases:
        pol = Policy(preempt_within_team_use=field)
        st = cluster(blocks=1, nodes=4)
        st.set_quota("lender", "h100", 0, 100)
        st.set_quota("a", "h100", a_guarantee, 100)
        occupy(st, spec("lent", team="lender", gpr=8), ["b0n0"], borrowed=True)
        occupy(st, spec("gang", team="a", replicas=2, gpr=8), ["b0n1", "b0n2"], borrowed=a_guarantee < 16)
        fill(st, ["b0n3"], team="filler")
        q = queue_of(spec("x", team="a", cls=cls, gpr=8, submit=NOW - 600))
        p = cycle(st, q, NOW, pol)
        case = (a_guarantee, cls, field)
        assert ([pr.victim for pr in p.preemptions] == ["lent"]) is preempts, case
        if not preempts:
            assert p.reason_for(q.get("x")) is PendingReason.CAPACITY, case
    assert Policy().preempt_within_team_use is False
