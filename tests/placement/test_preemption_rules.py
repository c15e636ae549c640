"""Preemption rules (docs/design.md, Placement: victims), one test per rule."""

from __future__ import annotations

from dataclasses import replace

from placement import ClusterState, JobQueue, JobSpec, PendingReason, Plan, Policy, PreemptReason, plan
from placement.engine import HELD_FOR_VICTIMS_WORK

from .helpers import HOUR, cluster, fill, nodes_of, occupy, queue_of, spec
from .helpers import cycle as checked_cycle

NOW = 10 * HOUR
# the requirements' victim rules alone: victims here ran for hours without a checkpoint, which
# ``class_preemption_max_lost_s`` would spare (its own test is the last one)
RULES = Policy(class_preemption_max_lost_s=None)


def cycle(st: ClusterState, q: JobQueue, now: float, policy: Policy | None = None, do_apply: bool = True) -> Plan:
    return checked_cycle(st, q, now, RULES if policy is None else policy, do_apply)


def victims(p) -> list[str]:
    return sorted(pr.victim for pr in p.preemptions)


def test_victims_only_from_lower_classes() -> None:
    st = cluster(blocks=1, nodes=2)
    st.set_quota("hi", "h100", 100)
    fill(st, ["b0n0"], team="r", cls="research", prefix="res")
    fill(st, ["b0n1"], team="b", cls="prod-batch", prefix="batch")
    p = cycle(st, queue_of(spec("x", team="hi", cls="prod-batch", gpr=8)), NOW)
    assert victims(p) == ["res-b0n0"]
    assert p.preemptions[0].reason is PreemptReason.PRIORITY
    assert p.reason("x") is PendingReason.PREEMPTING


def test_the_wait_before_reclaiming_higher_classes_counts_per_team_when_asked() -> None:
    """``reclaim_wait_per_team``: a job queued 10 s ago, whose team's other job has been queued
    for 300 s (a 4-node job that no capacity holds), reclaims a small borrowed prod-batch job;
    per job (the default) it does not yet. A team without an older job waits its own 300 s,
    and so does one whose older job does not fit its guarantee (it would run borrowed: the
    team is not kept from its guarantee by it)."""
    cases = [
        # per team, an older job queued, my guarantee, reclaimed
        (True, True, 100, True),
        (False, True, 100, False),
        (True, False, 100, False),
        (True, True, 16, False),  # the 32-GPU older job does not fit 16: it does not count
    ]
    for per_team, older, guarantee, reclaimed in cases:
        st = cluster(blocks=1, nodes=2)
        st.set_quota("me", "h100", guarantee, 100)
        st.set_quota("b", "h100", 0, 100)
        occupy(st, spec("v", team="b", cls="prod-batch", gpr=8), ["b0n0"], borrowed=True)
        fill(st, ["b0n1"], team="g", cls="prod-batch")
        jobs = [spec("x", team="me", cls="research", gpr=8, submit=NOW - 10)]
        if older:
            jobs.append(spec("old", team="me", cls="research", replicas=4, gpr=8, submit=NOW - 300))
        pol = Policy(reserve_min_gpus=64, reclaim_wait_per_team=per_team, reclaim_max_lost_s=None)
        p = cycle(st, queue_of(*jobs), NOW, pol)
        assert (victims(p) == ["v"]) is reclaimed, (per_team, older, guarantee)
        assert p.preemptions == () or p.preemptions[0].beneficiary == "x"


def test_same_class_victims_only_if_borrowed() -> None:
    st = cluster(blocks=1, nodes=2)
    st.set_quota("me", "h100", 100)
    st.set_quota("lender", "h100", 0, 100)
    fill(st, ["b0n0"], team="g", cls="research", prefix="guar")
    fill(st, ["b0n1"], team="lender", cls="research", prefix="borr", borrowed=True)
    p = cycle(st, queue_of(spec("x", team="me", cls="research", gpr=8)), NOW)
    assert victims(p) == ["borr-b0n1"]
    assert p.preemptions[0].reason is PreemptReason.RECLAIM


def test_small_higher_class_borrowed_jobs_return_to_a_team_that_waited_within_its_guarantee() -> None:
    """(victim, the preemptor's guarantee, its wait, the knob) -> reclaimed?
    docs/design.md's rule alone never takes a higher class. With ``reclaim_small_borrowed_after_s``
    a job within its team's guarantee that has waited takes back another team's borrowed job
    of a higher class if it is smaller than ``reserve_min_gpus``; never a gang, guaranteed
    work, prod-serving, its own team's work, and never for a borrowing preemptor."""
    pol_on = Policy(reserve_min_gpus=16)  # the victim below is a 2-node, 16-GPU gang when "big"
    pol_off = Policy(reserve_min_gpus=16, reclaim_small_borrowed_after_s=None)
    cases = [
        # victim class, victim borrowed, victim nodes, preemptor's guarantee, waited s, policy, reclaimed
        ("prod-batch", True, 1, 100, 300, pol_on, True),
        ("prod-batch", True, 1, 100, 300, pol_off, False),
        ("prod-batch", True, 1, 100, 299, pol_on, False),  # not waited long enough yet
        ("prod-batch", True, 2, 100, 300, pol_on, False),  # a gang: never across classes
        ("prod-batch", False, 1, 100, 300, pol_on, False),  # guaranteed higher class: never
        ("prod-serving", True, 1, 100, 300, pol_on, False),  # prod-serving: never a victim
        ("prod-batch", True, 1, 0, 300, pol_on, False),  # the preemptor borrows
    ]
    for vcls, vborrowed, vnodes, guarantee, waited, pol, reclaimed in cases:
        st = cluster(blocks=1, nodes=2)
        st.set_quota("me", "h100", guarantee, 100)
        st.set_quota("b", "h100", 0 if vborrowed else 100, 100)
        where = ["b0n0", "b0n1"][:vnodes]
        occupy(st, spec("v", team="b", cls=vcls, replicas=vnodes, gpr=8), where, borrowed=vborrowed)
        if vnodes == 1:
            fill(st, ["b0n1"], team="g", cls="prod-batch")  # guaranteed: the other node stays busy
        q = queue_of(spec("x", team="me", cls="research", gpr=8, submit=NOW - waited))
        p = cycle(st, q, NOW, pol)
        case = (vcls, vborrowed, vnodes, guarantee, waited, pol is pol_on)
        if reclaimed:
            assert victims(p) == ["v"], case
            assert p.preemptions[0].reason is PreemptReason.RECLAIM, case
        else:
            assert p.preemptions == (), case
    # its own team's borrowed work of a higher class is not taken back for it: the team's
    # 16-GPU prod-batch job is borrowed (beyond the 8-GPU guarantee), its 8-GPU research job fits
    st = cluster(blocks=1, nodes=2)
    st.set_quota("me", "h100", 8, 100)
    occupy(st, spec("own", team="me", cls="prod-batch", replicas=2, gpr=8), ["b0n0", "b0n1"], borrowed=True)
    p = cycle(st, queue_of(spec("x", team="me", cls="research", gpr=8)), NOW, Policy(reserve_min_gpus=64))
    assert st.running("own").borrowed and p.preemptions == ()


def test_a_guaranteed_gang_that_waited_takes_back_borrowed_gangs_of_higher_classes_no_larger() -> None:
    """``reclaim_higher_borrowed_gangs``: a 2-node research gang within its team's guarantee,
    past ``reclaim_small_borrowed_after_s`` since its submit and since its own last preemption,
    reclaims another team's borrowed prod-batch gang of at most its own size; never a larger
    gang, guaranteed work, prod-serving, nor for a gang beyond its guarantee."""
    on = Policy(reserve_min_gpus=16, reclaim_higher_borrowed_gangs=True)
    off = Policy(reserve_min_gpus=16)  # the default: off
    cases = [
        # victim class, victim borrowed, victim nodes, preemptor's guarantee, waited s,
        # preempted s ago (None: never), policy, reclaimed
        ("prod-batch", True, 2, 100, 300, None, on, True),
        ("prod-batch", True, 2, 100, 300, None, off, False),
        ("prod-batch", True, 2, 100, 299, None, on, False),  # not waited long enough yet
        ("prod-batch", True, 3, 100, 300, None, on, False),  # larger than the preemptor
        ("prod-batch", True, 2, 100, 900, 100, on, False),  # preempted itself 100 s ago
        ("prod-batch", True, 2, 100, 900, 300, on, True),  # ... 300 s ago: settled
        ("prod-batch", False, 2, 100, 300, None, on, False),  # guaranteed higher class: never
        ("prod-serving", True, 2, 100, 300, None, on, False),  # prod-serving: never a victim
        ("prod-batch", True, 2, 0, 300, None, on, False),  # the preemptor borrows
    ]
    for vcls, vborrowed, vnodes, guarantee, waited, preempted_ago, pol, reclaimed in cases:
        st = cluster(blocks=1, nodes=3)
        st.set_quota("me", "h100", guarantee, 100)
        st.set_quota("b", "h100", 0 if vborrowed else 100, 100)
        where = ["b0n0", "b0n1", "b0n2"][:vnodes]
        occupy(st, spec("v", team="b", cls=vcls, replicas=vnodes, gpr=8), where, borrowed=vborrowed)
        if vnodes < 3:
            fill(st, ["b0n2"], team="g", cls="prod-batch")  # guaranteed: the third node stays busy
        times = () if preempted_ago is None else (NOW - preempted_ago,)
        gang = spec("x", team="me", cls="research", replicas=2, gpr=8, submit=NOW - waited, preemption_times=times)
        p = cycle(st, queue_of(gang), NOW, pol)
        case = (vcls, vborrowed, vnodes, guarantee, waited, preempted_ago, pol is on)
        if reclaimed:
            assert victims(p) == ["v"], case
            assert p.preemptions[0].reason is PreemptReason.RECLAIM, case
        else:
            assert p.preemptions == (), case


def test_same_class_guaranteed_is_not_a_victim() -> None:
    st = cluster(blocks=1, nodes=1)
    st.set_quota("me", "h100", 100)
    fill(st, ["b0n0"], team="g", cls="research")
    p = cycle(st, queue_of(spec("x", team="me", cls="research", gpr=8)), NOW)
    assert p.preemptions == ()


def test_prod_serving_never_a_victim() -> None:
    st = cluster(blocks=1, nodes=2)
    st.set_quota("me", "h100", 100)
    st.set_quota("svc", "h100", 0, 100)
    fill(st, ["b0n0", "b0n1"], team="svc", cls="prod-serving", borrowed=True)
    for cls in ("prod-serving", "prod-batch"):
        p = cycle(st, queue_of(spec("x", team="me", cls=cls, gpr=8)), NOW)
        assert p.preemptions == ()


def test_prod_serving_beyond_guarantee_takes_only_borrowed_allocations() -> None:
    st = cluster(blocks=1, nodes=3)
    st.set_quota("svc", "h100", 0, 100)
    st.set_quota("lender", "h100", 0, 100)
    fill(st, ["b0n0"], team="low", cls="preemptible", prefix="low")  # guaranteed, lower class
    fill(st, ["b0n1"], team="lender", cls="research", prefix="borr", borrowed=True)
    q = queue_of(spec("s", team="svc", cls="prod-serving", gpr=8))
    # b0n2 is idle, yet prod-serving beyond its guarantee does not take idle capacity
    p = cycle(st, q, NOW)
    assert victims(p) == ["borr-b0n1"]
    assert all(pr.victim_borrowed for pr in p.preemptions)
    assert p.placements == ()
    # the victim stops: the reclaimed node goes to the serving job, not the idle one
    st.release("borr-b0n1", NOW + 30)
    p = cycle(st, q, NOW + 31)
    pl = p.placement("s")
    assert pl is not None and pl.borrowed
    assert [n.node_id for n in pl.nodes] == ["b0n1"]


def test_prod_serving_beyond_guarantee_without_borrowed_victims_waits_for_quota() -> None:
    st = cluster(blocks=1, nodes=2)
    st.set_quota("svc", "h100", 0, 100)
    fill(st, ["b0n0"], team="low", cls="preemptible")
    p = cycle(st, queue_of(spec("s", team="svc", cls="prod-serving", gpr=8)), NOW)
    assert p.preemptions == () and p.placements == ()
    assert p.reason("s") is PendingReason.QUOTA


def test_no_victim_within_30_minutes_of_its_start() -> None:
    st = cluster(blocks=1, nodes=1)
    st.set_quota("me", "h100", 100)
    fill(st, ["b0n0"], team="low", cls="preemptible", started_at=NOW - 1700)
    p = cycle(st, queue_of(spec("x", team="me", cls="prod-batch", gpr=8)), NOW)
    assert p.preemptions == ()
    p = cycle(st, queue_of(spec("x", team="me", cls="prod-batch", gpr=8)), NOW + 101)
    assert victims(p) == ["f-b0n0"]


def test_after_3_preemptions_in_a_day_only_borrowed_capacity_is_lost() -> None:
    st = cluster(blocks=1, nodes=2)
    st.set_quota("me", "h100", 100)
    st.set_quota("lender", "h100", 0, 100)
    hist = (NOW - 3 * HOUR, NOW - 2 * HOUR, NOW - HOUR)
    fill(st, ["b0n0"], team="low", cls="preemptible", prefix="tired", preemption_times=hist)
    p = cycle(st, queue_of(spec("x", team="me", cls="prod-batch", gpr=8)), NOW, do_apply=False)
    assert p.preemptions == ()
    fill(st, ["b0n1"], team="lender", cls="preemptible", prefix="tiredborrowed", borrowed=True, preemption_times=hist)
    p = cycle(st, queue_of(spec("x", team="me", cls="prod-batch", gpr=8)), NOW, do_apply=False)
    assert victims(p) == ["tiredborrowed-b0n1"]
    # preemptions older than a day do not count
    st2 = cluster(blocks=1, nodes=1)
    st2.set_quota("me", "h100", 100)
    fill(st2, ["b0n0"], team="low", cls="preemptible", preemption_times=(NOW - 30 * HOUR,) * 3)
    p = cycle(st2, queue_of(spec("x", team="me", cls="prod-batch", gpr=8)), NOW)
    assert victims(p) == ["f-b0n0"]
    # a negative budget is no budget: the tired job is a victim, and check_plan agrees
    st3 = cluster(blocks=1, nodes=1)
    st3.set_quota("me", "h100", 100)
    fill(st3, ["b0n0"], team="low", cls="preemptible", prefix="tired", preemption_times=hist)
    p = cycle(st3, queue_of(spec("x", team="me", cls="prod-batch", gpr=8)), NOW, Policy(daily_preemption_budget=-1))
    assert victims(p) == ["tired-b0n0"]


def test_fewest_victims() -> None:
    st = cluster(blocks=1, nodes=2)
    st.set_quota("me", "h100", 100)
    st.set_quota("low", "h100", 100)
    # node 0: two 2-GPU jobs (recent checkpoints: little lost work); node 1: one 4-GPU job
    occupy(st, spec("a", team="low", cls="preemptible", gpr=2, last_checkpoint_at=NOW - 10), {"b0n0": (0, 1)})
    occupy(st, spec("b", team="low", cls="preemptible", gpr=2, last_checkpoint_at=NOW - 10), {"b0n0": (2, 3)})
    occupy(st, spec("c", team="low", cls="preemptible", gpr=4), {"b0n1": (0, 1, 2, 3)})
    occupy(st, spec("keep0", team="low", cls="prod-batch", gpr=4), {"b0n0": (4, 5, 6, 7)})
    occupy(st, spec("keep1", team="low", cls="prod-batch", gpr=4), {"b0n1": (4, 5, 6, 7)})
    p = cycle(st, queue_of(spec("x", team="me", cls="prod-batch", gpr=4)), NOW)
    assert victims(p) == ["c"]


def test_fewest_victims_for_a_gang() -> None:
    st = cluster(blocks=2, nodes=2)
    st.set_quota("me", "h100", 100)
    fill(st, ["b0n0", "b0n1"], team="low", cls="preemptible", prefix="one-node")  # two victims needed in b0
    occupy(st, spec("two-node", team="low", cls="preemptible", replicas=2, gpr=8), ["b1n0", "b1n1"])
    p = cycle(st, queue_of(spec("x", team="me", cls="prod-batch", replicas=2, gpr=8, pack="block", max_blocks=1)), NOW)
    assert victims(p) == ["two-node"]


def test_least_lost_work_most_recent_checkpoint() -> None:
    st = cluster(blocks=1, nodes=2)
    st.set_quota("me", "h100", 100)
    fill(st, ["b0n0"], team="low", cls="preemptible", prefix="old-ckpt", last_checkpoint_at=NOW - 2 * HOUR)
    fill(st, ["b0n1"], team="low", cls="preemptible", prefix="new-ckpt", last_checkpoint_at=NOW - 60)
    p = cycle(st, queue_of(spec("x", team="me", cls="prod-batch", gpr=8)), NOW)
    assert victims(p) == ["new-ckpt-b0n1"]


def test_job_that_cannot_checkpoint_loses_everything_since_start() -> None:
    st = cluster(blocks=1, nodes=2)
    st.set_quota("me", "h100", 100)
    fill(
        st,
        ["b0n0"],
        team="low",
        cls="preemptible",
        prefix="nockpt",
        preemptible=False,
        last_checkpoint_at=NOW - 60,
        started_at=NOW - 5 * HOUR,
    )
    fill(
        st,
        ["b0n1"],
        team="low",
        cls="preemptible",
        prefix="ckpt",
        last_checkpoint_at=NOW - HOUR,
        started_at=NOW - 5 * HOUR,
    )
    p = cycle(st, queue_of(spec("x", team="me", cls="prod-batch", gpr=8)), NOW)
    assert victims(p) == ["ckpt-b0n1"]


def test_team_furthest_over_its_share_breaks_ties() -> None:
    st = cluster(blocks=1, nodes=3)
    st.set_quota("me", "h100", 100)
    st.set_quota("fair", "h100", 16, 0)
    st.set_quota("greedy", "h100", 4, 100)
    fill(st, ["b0n0"], team="fair", cls="preemptible", prefix="fair")
    fill(st, ["b0n1"], team="greedy", cls="preemptible", prefix="greedy", borrowed=True)
    fill(st, ["b0n2"], team="x", cls="prod-batch", prefix="x")
    p = cycle(st, queue_of(spec("x", team="me", cls="prod-batch", gpr=8)), NOW)
    assert victims(p) == ["greedy-b0n1"]


def test_prefer_victims_in_the_target_blocks() -> None:
    st = cluster(blocks=2, nodes=2)
    st.set_quota("me", "h100", 100)
    # b0: one free node + one victim; b1: a cheaper victim, but next to a node nobody may take
    fill(st, ["b0n0"], team="low", cls="preemptible", prefix="in-target")
    fill(st, ["b1n0"], team="low", cls="preemptible", prefix="cheap", last_checkpoint_at=NOW - 1)
    fill(st, ["b1n1"], team="svc", cls="prod-serving", prefix="svc")
    p = cycle(st, queue_of(spec("x", team="me", cls="prod-batch", replicas=2, gpr=8, pack="block", max_blocks=1)), NOW)
    assert victims(p) == ["in-target-b0n0"]
    assert [r.nodes for r in p.reservations if r.job_id == "x"] == [("b0n0", "b0n1")]


def test_reclaim_of_borrowed_gpus_is_planned_in_the_first_cycle() -> None:
    st = cluster(blocks=2, nodes=4)
    st.set_quota("owner", "h100", 16)  # below its guarantee (uses nothing)
    st.set_quota("borrower", "h100", 0, 1000)
    fill(st, [f"b{b}n{n}" for b in range(2) for n in range(4)], team="borrower", cls="research", borrowed=True)
    # many jobs of other teams ahead in submit order, and a small lookahead
    others = [spec(f"o{i}", team=f"other{i}", cls="research", gpr=8, submit=i) for i in range(20)]
    for i in range(20):
        st.set_quota(f"other{i}", "h100", 0, 8)
    q = queue_of(*others, spec("mine", team="owner", cls="research", replicas=2, gpr=8, submit=1000))
    p = cycle(st, q, NOW, Policy(lookahead=5))
    mine = [pr for pr in p.preemptions if pr.beneficiary == "mine"]
    assert len(mine) >= 1 and all(pr.reason is PreemptReason.RECLAIM for pr in mine)


def test_reclaim_is_planned_in_the_first_cycle_even_beyond_the_lookahead() -> None:
    st = cluster(blocks=2, nodes=4)
    st.set_quota("owner", "h100", 16)
    st.set_quota("borrower", "h100", 0, 1000)
    fill(st, [f"b{b}n{n}" for b in range(2) for n in range(4)], team="borrower", cls="research", borrowed=True)
    # higher-class jobs that cannot run (borrowing: no preemption) fill the lookahead
    st.set_quota("busy", "h100", 0, 1000)
    ahead = [spec(f"hi{i}", team="busy", cls="prod-batch", gpr=8, submit=i) for i in range(20)]
    q = queue_of(*ahead, spec("mine", team="owner", cls="research", gpr=8, submit=1000))
    p = cycle(st, q, NOW, Policy(lookahead=5, max_victim_searches_per_cycle=0, max_preemptions_per_cycle=0))
    assert [pr.beneficiary for pr in p.preemptions] == ["mine"]
    assert p.preemptions[0].reason is PreemptReason.RECLAIM


def test_borrowing_job_does_not_preempt() -> None:
    st = cluster(blocks=1, nodes=1)
    st.set_quota("me", "h100", 0, 100)
    fill(st, ["b0n0"], team="low", cls="preemptible")
    p = cycle(st, queue_of(spec("x", team="me", cls="prod-batch", gpr=8)), NOW)
    assert p.preemptions == ()


def test_reclaimed_nodes_are_held_for_the_beneficiary() -> None:
    st = cluster(blocks=1, nodes=2)
    st.set_quota("me", "h100", 100)
    st.set_quota("low", "h100", 100)
    fill(st, ["b0n0", "b0n1"], team="low", cls="preemptible")
    q = queue_of(spec("x", team="me", cls="prod-batch", gpr=8))
    p = cycle(st, q, NOW)
    (v,) = victims(p)
    assert st.awaiting("x") == (v,)
    # while the victim stops: no new preemption for x, and a lower class job cannot take the node
    q.push(spec("later", team="low", cls="preemptible", gpr=8, submit=NOW))
    p = cycle(st, q, NOW + 1)
    assert p.preemptions == () and p.reason("x") is PendingReason.PREEMPTING
    st.release(v, NOW + 20)
    p = cycle(st, q, NOW + 21)
    assert p.placement("x") is not None
    assert p.reason("later") is not None and p.placement("later") is None
    assert st.reservation("x") is None


def test_preemption_disabled() -> None:
    st = cluster(blocks=1, nodes=1)
    st.set_quota("me", "h100", 100)
    fill(st, ["b0n0"], team="low", cls="preemptible")
    p = cycle(st, queue_of(spec("x", team="me", cls="prod-batch", gpr=8)), NOW, Policy(preemption=False))
    assert p.preemptions == ()


def test_victim_of_another_gpu_type_is_never_chosen() -> None:
    from .helpers import add_blocks

    st = cluster(blocks=1, nodes=1, gpu_type="a100", prefix="a")
    add_blocks(st, 1, 1, gpu_type="h100", prefix="h")
    st.set_quota("me", "h100", 100)
    fill(st, ["ab0n0"], team="low", cls="preemptible", prefix="a100job", gpu_type="a100")
    fill(st, ["hb0n0"], team="low", cls="preemptible", prefix="h100job")
    p = plan(st, queue_of(spec("x", team="me", cls="prod-batch", gpr=8)), Policy(), NOW)
    assert victims(p) == ["h100job-hb0n0"]


def test_borrowed_job_just_started_is_reclaimed_for_a_team_below_its_guarantee() -> None:
    # the borrower started 60 s ago: the 30-minute protection is for guaranteed work only,
    # borrowed capacity is reclaimable at once (grace + 2 cycles)
    st = cluster(blocks=1, nodes=1)
    st.set_quota("owner", "h100", 8)
    st.set_quota("borrower", "h100", 0, 100)
    fill(st, ["b0n0"], team="borrower", cls="research", borrowed=True, started_at=NOW - 60)
    p = cycle(st, queue_of(spec("mine", team="owner", cls="research", gpr=8)), NOW)
    assert victims(p) == ["f-b0n0"]
    assert p.preemptions[0].reason is PreemptReason.RECLAIM and p.preemptions[0].victim_borrowed


def test_guaranteed_job_just_started_is_still_protected_from_priority_preemption() -> None:
    st = cluster(blocks=1, nodes=1)
    st.set_quota("me", "h100", 100)
    fill(st, ["b0n0"], team="low", cls="preemptible", started_at=NOW - 60)
    p = cycle(st, queue_of(spec("x", team="me", cls="prod-batch", gpr=8)), NOW)
    assert p.preemptions == ()


def test_a_large_enough_preemptor_may_stop_a_first_run_within_its_protection() -> None:
    """``first_runs_unprotected_min_gpus`` reads "not preempted *again* within 30 minutes of
    starting": a preemptor of at least that many GPUs may stop a guaranteed job 60 s into its
    first run; a job started again after a preemption keeps its 30 minutes, and so does
    every job against a smaller preemptor. Off (the default), all are protected. The state
    is built before the first plan, so the engine must list the first runs when it starts."""
    for restarted in (False, True):
        for min_gpus, expect_first_run_victim in ((None, False), (8, True), (16, False)):
            st = cluster(blocks=1, nodes=1)
            st.set_quota("me", "h100", 100)
            st.set_quota("low", "h100", 8)  # the victim runs guaranteed
            low = spec("low", team="low", cls="preemptible", gpr=8)
            if restarted:
                low = replace(low, preemption_times=(NOW - 4 * HOUR,))
            occupy(st, low, ["b0n0"], started_at=NOW - 60)
            pol = replace(RULES, first_runs_unprotected_min_gpus=min_gpus)
            p = cycle(st, queue_of(spec("x", team="me", cls="prod-batch", gpr=8)), NOW, pol)
            expected = ["low"] if expect_first_run_victim and not restarted else []
            assert victims(p) == expected, (restarted, min_gpus)
    assert Policy().first_runs_unprotected_min_gpus is None  # off in gpufleet (tried, sim/README.md)


def test_a_team_never_reclaims_its_own_borrowed_work() -> None:
    # the team's guaranteed 8-GPU job may not take its own borrowed gang's node: it would
    # only trade its work for its work. Another team's borrowed job of the class is fair game.
    st = cluster(blocks=1, nodes=3)
    st.set_quota("me", "h100", 8, 100)
    st.set_quota("other", "h100", 0, 100)
    occupy(st, spec("mygang", team="me", cls="research", replicas=2, gpr=8), ["b0n0", "b0n1"], borrowed=True)
    q = queue_of(spec("x", team="me", cls="research", gpr=8))
    p = cycle(st, q, NOW, do_apply=False)
    assert p.placement("x") is not None  # b0n2 is free
    fill(st, ["b0n2"], team="other", cls="research", borrowed=True, prefix="theirs")
    p = cycle(st, q, NOW, do_apply=False)
    assert victims(p) == ["theirs-b0n2"]
    st.release("theirs-b0n2", NOW)
    fill(st, ["b0n2"], team="g", cls="research", prefix="guar")  # guaranteed, same class
    p = cycle(st, q, NOW, do_apply=False)
    assert p.preemptions == ()
    # its own lower-class work is still a priority victim
    st.release("guar-b0n2", NOW)
    st.set_quota("me", "h100", 16, 100)
    fill(st, ["b0n2"], team="me", cls="preemptible", prefix="mylow", started_at=-1.0)
    p = cycle(st, q, NOW, do_apply=False)
    assert victims(p) == ["mylow-b0n2"] and p.preemptions[0].reason is PreemptReason.PRIORITY


def test_a_gang_is_not_preempted_to_free_one_node_when_single_node_victims_exist() -> None:
    # a 2-node job needs two nodes of one block. b0: a borrowed 4-node gang of another team
    # (same class: a reclaim victim); b1: three single-node preemptible jobs and a free node.
    st = cluster(blocks=2, nodes=4)
    st.set_quota("me", "h100", 100)
    st.set_quota("other", "h100", 0, 100)
    occupy(
        st,
        spec("gang", team="other", cls="prod-batch", replicas=4, gpr=8),
        ["b0n0", "b0n1", "b0n2", "b0n3"],
        borrowed=True,
        started_at=NOW - 100,
    )
    fill(st, ["b1n0", "b1n1", "b1n2"], team="low", cls="preemptible", prefix="small")
    x = spec("x", team="me", cls="prod-batch", replicas=2, gpr=8, pack="block", max_blocks=1)
    p = cycle(st, queue_of(x), NOW, do_apply=False)
    assert victims(p) == ["small-b1n0"]  # one node victim + the free b1n3
    # without the excess cost, the gang (one victim, but 4 nodes for 2) would do
    p = cycle(st, queue_of(x), NOW, replace(RULES, victim_excess_cost=False), do_apply=False)
    assert victims(p) == ["gang"]


def test_a_higher_class_does_not_take_nodes_cleared_for_a_lower_class_beneficiary() -> None:
    # "x" (preemptible, below its guarantee) reclaims the borrowed node b0n1; when the victim
    # is gone, a research job arriving meanwhile must not take that node (x would have to
    # preempt again and its reclaim would overrun grace + 2 cycles): it preempts for itself
    st = cluster(blocks=1, nodes=2)
    st.set_quota("me", "h100", 8)
    st.set_quota("r", "h100", 100)
    st.set_quota("o", "h100", 0, 100)
    fill(st, ["b0n0"], team="o", cls="preemptible", borrowed=True, prefix="keep", started_at=NOW - 3600)
    fill(st, ["b0n1"], team="o", cls="preemptible", borrowed=True, prefix="v", started_at=NOW - 60)
    q = queue_of(spec("x", team="me", cls="preemptible", gpr=8, submit=NOW))
    pol = Policy(reclaim_max_lost_s=None)  # keep-b0n0's hour of work would hold hi's reclaim back
    p = cycle(st, q, NOW, pol)
    assert victims(p) == ["v-b0n1"]
    q.push(spec("hi", team="r", cls="research", gpr=8, submit=NOW + 10))
    p = cycle(st, q, NOW + 10, pol)
    assert victims(p) == ["keep-b0n0"]  # hi preempts for itself, not from x's held node
    st.release("v-b0n1", NOW + 30)
    p = cycle(st, q, NOW + 31, pol)
    assert p.placement("x") is not None and [n.node_id for n in p.placement("x").nodes] == ["b0n1"]
    assert p.placement("hi") is None


def test_free_gpus_a_reclaim_counts_on_are_not_given_to_a_like_job_in_the_same_cycle() -> None:
    # "x" (a whole node, below its guarantee) finds the one free node held for gang "g", then
    # reclaims b0n0: its 4 free GPUs plus those of borrowed "v". "y", of the same class and
    # max_runtime as x (equal jobs share reservation exclusions within a cycle), is looked at
    # after x and must not take b0n0's free GPUs: x would preempt again and overrun its bound
    st = cluster(blocks=1, nodes=3)
    st.set_quota("me", "h100", 8)
    st.set_quota("other", "h100", 8)
    st.set_quota("o", "h100", 0, 100)
    st.set_quota("w", "h100", 8)
    st.set_quota("big", "h100", 0, 100)
    occupy(
        st,
        spec("v", team="o", cls="preemptible", gpr=4, runtime=100 * HOUR),
        {"b0n0": (0, 1, 2, 3)},
        started_at=NOW - 60,
        borrowed=True,
    )
    occupy(st, spec("w", team="w", cls="prod-batch", gpr=8, runtime=2 * HOUR), ["b0n2"], started_at=NOW - HOUR)
    # g reserves, never preempts (borrowed_gang_guard would keep it from reserving at all)
    policy = Policy(reserve_min_gpus=16, borrowed_gangs_reclaim_lower=False, borrowed_gang_guard=None)
    q = queue_of(spec("g", team="big", cls="prod-batch", replicas=2, gpr=8, pack="block", submit=NOW))
    cycle(st, q, NOW, policy)
    assert st.reservation("g") is not None and "b0n1" in st.reservation("g").nodes
    q.push(spec("x", team="me", cls="preemptible", gpr=8, submit=NOW + 1, runtime=24 * HOUR))
    q.push(spec("y", team="other", cls="preemptible", gpr=4, submit=NOW + 2, runtime=24 * HOUR))
    p = cycle(st, q, NOW + 3, policy)
    assert victims(p) == ["v"]
    assert p.placement("y") is None
    st.release("v", NOW + 33)
    p = cycle(st, q, NOW + 34, policy)
    assert nodes_of(p, "x") == ["b0n0"]


def test_a_borrowing_gang_reclaims_only_borrowed_work_of_lower_classes() -> None:
    # "gang" (prod-batch, 2 nodes, beyond its guarantee) may take back borrowed research
    # work, never guaranteed lower-class work nor borrowed prod-batch work of another team
    st = cluster(blocks=2, nodes=2)
    st.set_quota("me", "h100", 0, 100)
    st.set_quota("lender", "h100", 0, 100)
    fill(st, ["b0n0"], team="low", cls="research", prefix="guar", started_at=NOW - 2 * HOUR)
    fill(st, ["b0n1"], team="lender", cls="prod-batch", prefix="same", borrowed=True)
    fill(st, ["b1n0", "b1n1"], team="lender", cls="research", prefix="borr", borrowed=True)
    q = queue_of(spec("gang", team="me", cls="prod-batch", replicas=2, gpr=8, pack="block", max_blocks=1))
    p = cycle(st, q, NOW, Policy(reserve_min_gpus=16, borrowed_gang_guard=None))
    assert victims(p) == ["borr-b1n0", "borr-b1n1"]
    assert all(pr.victim_borrowed and pr.reason is PreemptReason.RECLAIM for pr in p.preemptions)
    # with the refinement off, a borrowing gang never preempts
    st2 = cluster(blocks=2, nodes=2)
    st2.set_quota("me", "h100", 0, 100)
    st2.set_quota("lender", "h100", 0, 100)
    fill(st2, ["b1n0", "b1n1"], team="lender", cls="research", prefix="borr", borrowed=True)
    fill(st2, ["b0n0", "b0n1"], team="lender", cls="research", prefix="b2", borrowed=True)
    p = cycle(
        st2,
        queue_of(spec("gang", team="me", cls="prod-batch", replicas=2, gpr=8)),
        NOW,
        Policy(reserve_min_gpus=16, borrowed_gangs_reclaim_lower=False, borrowed_gang_guard=None),
    )
    assert p.preemptions == ()


def test_a_borrowing_small_job_never_preempts() -> None:
    st = cluster(blocks=1, nodes=1)
    st.set_quota("me", "h100", 0, 100)
    st.set_quota("lender", "h100", 0, 100)
    fill(st, ["b0n0"], team="lender", cls="preemptible", borrowed=True)
    p = cycle(st, queue_of(spec("x", team="me", cls="prod-batch", gpr=8)), NOW)
    assert p.preemptions == ()


def test_an_idle_borrowed_job_is_the_cheapest_victim() -> None:
    """Policy.idle_victims_first: of two borrowed jobs, the one whose GPUs the agents read idle
    goes first, though it started earlier (more work lost by the clock); marked idle and then
    busy again, the clock decides."""

    def reclaim(marks: list[bool]) -> list[str]:
        st = cluster(blocks=1, nodes=2)
        st.set_quota("owner", "h100", 8)
        st.set_quota("borrower", "h100", 0, 100)
        fill(st, ["b0n0"], team="borrower", cls="research", borrowed=True, started_at=NOW - 3600, prefix="old")
        fill(st, ["b0n1"], team="borrower", cls="research", borrowed=True, started_at=NOW - 4 * 3600, prefix="idle")
        for idle in marks:
            st.set_idle("idle-b0n1", idle)
        return victims(cycle(st, queue_of(spec("mine", team="owner", cls="research", gpr=8)), NOW))

    assert reclaim([True]) == ["idle-b0n1"]
    assert reclaim([]) == reclaim([True, False]) == ["old-b0n0"]


def test_an_idle_job_within_its_guarantee_keeps_its_place_among_victims() -> None:
    """Only borrowed idle work is cheap: guaranteed work keeps the lost-work order."""
    st = cluster(blocks=1, nodes=2)
    st.set_quota("me", "h100", 100)
    fill(st, ["b0n0"], team="r", cls="research", started_at=NOW - 3600, prefix="recent")
    fill(st, ["b0n1"], team="r", cls="research", started_at=NOW - 4 * 3600, prefix="idle")
    st.set_idle("idle-b0n1", True)
    p = cycle(st, queue_of(spec("x", team="me", cls="prod-batch", gpr=8)), NOW)
    assert victims(p) == ["recent-b0n0"]


def _one_gang_victim(
    vcls: str, vborrowed: bool, lost_s: float, cls: str, gpus: int, waited: float
) -> tuple[ClusterState, JobSpec]:
    """One block of 4 nodes run by team low's 32-GPU gang ``v`` (borrowed or not; ``lost_s`` of
    work since its checkpoint, or since its start when it cannot checkpoint), and team me's
    job ``x`` of ``gpus`` GPUs queued ``waited`` seconds."""
    st = cluster(blocks=1, nodes=4)
    st.set_quota("me", "h100", 100)
    st.set_quota("low", "h100", 0 if vborrowed else 100, 100)
    v = spec("v", team="low", cls=vcls, replicas=4, gpr=8, preemptible=lost_s < HOUR)
    v = replace(v, last_checkpoint_at=NOW - lost_s if lost_s < HOUR else None)
    occupy(st, v, [f"b0n{i}" for i in range(4)], started_at=NOW - max(lost_s, HOUR), borrowed=vborrowed)
    return st, spec("x", team="me", cls=cls, replicas=gpus // 8, gpr=8, pack="block", submit=NOW - waited)


def test_a_class_preemption_that_would_throw_away_much_guaranteed_work_waits() -> None:
    """``class_preemption_max_lost_s``: the guaranteed victims stopped for the job's class lose
    at most that many seconds of the job's GPUs in work; otherwise the job waits (a gang
    reserves), for ``class_preemption_hold_s`` (300 s) at most. Borrowed victims (reclaimed,
    or of a lower class), and a prod job within one node, are not held back.

    (victim's class, victim borrowed, work since its checkpoint or start, job's class and
    GPUs, cap, job's wait) -> the victim is stopped?"""
    cap = 1800.0
    cases = [
        ("research", False, 2 * HOUR, "prod-batch", 32, cap, 10.0, False),  # 64 GPU-h lost > 16 GPU-h
        ("research", False, 2 * HOUR, "prod-batch", 32, None, 10.0, True),  # the field off: as before
        ("research", False, 2 * HOUR, "prod-batch", 32, cap, 300.0, True),  # held back 300 s at most
        ("research", False, 600.0, "prod-batch", 32, cap, 10.0, True),  # checkpointed 10 min ago
        ("research", False, 1700.0, "prod-batch", 32, cap, 10.0, True),  # just under 32 x 1,800 GPU-s
        ("research", False, 1900.0, "prod-batch", 32, cap, 10.0, False),  # just over it
        ("research", False, 2 * HOUR, "prod-batch", 8, cap, 10.0, True),  # a prod job within one node
        ("research", True, 2 * HOUR, "research", 32, cap, 10.0, True),  # a reclaim of borrowed work
        ("preemptible", True, 2 * HOUR, "prod-batch", 32, cap, 10.0, True),  # borrowed: always preemptible
    ]
    for vcls, vborrowed, lost_s, cls, gpus, limit, waited, stopped in cases:
        st, job = _one_gang_victim(vcls, vborrowed, lost_s, cls, gpus, waited)
        pol = Policy(reserve_min_gpus=32, class_preemption_max_lost_s=limit)
        p = cycle(st, queue_of(job), NOW, pol)
        case = (vcls, vborrowed, lost_s, cls, gpus, limit, waited)
        assert (victims(p) == ["v"]) is stopped, case
        if not stopped:
            assert p.reason("x") is PendingReason.RESERVED, case


def test_a_reclaim_that_would_throw_away_much_borrowed_work_waits() -> None:
    """``reclaim_max_lost_s``: the borrowed victims of a job lose at most that many seconds of
    the job's GPUs in work; otherwise the job waits (a gang reserves), for ``reclaim_hold_s``
    (300 s) at most. Guaranteed victims are ``class_preemption_max_lost_s``'s to judge, and a
    prod job within one node is not held back. The victim is another team's 32-GPU gang.

    (victim's class, victim borrowed, work since its checkpoint or start, job's class and
    GPUs, cap, job's wait) -> the victim is stopped?"""
    cap = 1800.0
    cases = [
        ("research", True, 600.0, "research", 8, cap, 10.0, False),  # 32 x 600 > 8 x 1,800 GPU-s
        ("research", True, 400.0, "research", 8, cap, 10.0, True),  # 32 x 400 < 8 x 1,800
        ("research", True, 600.0, "research", 8, None, 10.0, True),  # the field off: as before
        ("research", True, 600.0, "research", 8, cap, 300.0, True),  # held back 300 s at most
        ("research", True, 1700.0, "research", 32, cap, 10.0, True),  # a gang of its size: under
        ("research", True, 1900.0, "research", 32, cap, 10.0, False),  # just over
        ("research", True, 2 * HOUR, "prod-batch", 8, cap, 10.0, True),  # a prod job within one node
        ("research", True, 2 * HOUR, "prod-batch", 32, cap, 10.0, False),  # borrowed, of a lower class
        ("research", False, 2 * HOUR, "prod-batch", 32, cap, 10.0, True),  # guaranteed: not this rule's
    ]
    for vcls, vborrowed, lost_s, cls, gpus, limit, waited, stopped in cases:
        st, job = _one_gang_victim(vcls, vborrowed, lost_s, cls, gpus, waited)
        pol = Policy(
            reserve_min_gpus=32,
            class_preemption_max_lost_s=None,
            reclaim_max_lost_s=limit,
            reclaim_hold_small_only=False,  # gangs held too
        )
        p = cycle(st, queue_of(job), NOW, pol)
        case = (vcls, vborrowed, lost_s, cls, gpus, limit, waited)
        assert (victims(p) == ["v"]) is stopped, case
        if not stopped and gpus == 32:
            assert p.reason("x") is PendingReason.RESERVED, case
        elif not stopped:  # told why it waits beside work it could have stopped
            assert p.reason("x") is PendingReason.CAPACITY, case
            assert [x.detail for x in p.pending] == [HELD_FOR_VICTIMS_WORK], case


def test_the_hold_on_a_dear_reclaim_counts_per_team_when_asked() -> None:
    """``reclaim_hold_per_team``: a job queued 10 s ago, whose team's other job (too large for
    the cluster) has been queued for 300 s, takes the dear reclaim that per job
    (``reclaim_max_lost_s`` alone) still waits for."""
    for per_team, older, stopped in [(False, True, False), (True, True, True), (True, False, False)]:
        st, job = _one_gang_victim("research", True, 600.0, "research", 8, 10.0)
        jobs = [job]
        if older:
            jobs.append(spec("big", team="me", replicas=8, gpr=8, submit=NOW - 300.0))
        pol = Policy(class_preemption_max_lost_s=None, reclaim_max_lost_s=1800.0, reclaim_hold_per_team=per_team)
        p = cycle(st, queue_of(*jobs), NOW, pol)
        assert ("v" in victims(p)) is stopped, (per_team, older)


def test_the_hold_on_a_dear_reclaim_spares_gangs_when_asked() -> None:
    """``reclaim_hold_small_only``: a 32-GPU gang takes the dear reclaim that the bound alone
    holds it back from, while a job within one node still waits."""
    for small_only, gpus, lost_s, stopped in [
        (False, 32, 1900.0, False),
        (True, 32, 1900.0, True),
        (True, 8, 600.0, False),
    ]:
        st, job = _one_gang_victim("research", True, lost_s, "research", gpus, 10.0)
        pol = Policy(
            reserve_min_gpus=32,
            class_preemption_max_lost_s=None,
            reclaim_max_lost_s=1800.0,
            reclaim_hold_small_only=small_only,
        )
        p = cycle(st, queue_of(job), NOW, pol)
        assert (victims(p) == ["v"]) is stopped, (small_only, gpus)


def test_the_hold_on_a_dear_reclaim_reaches_a_job_that_would_stop_a_much_larger_gang() -> None:
    """``reclaim_hold_gang_victims_ratio``: with ``reclaim_hold_small_only``, a job beyond one
    node is held back too when its borrowed victims hold at least that many times its GPUs.
    Here the victim is one 32-GPU gang: a ratio of 2 holds a 16-GPU job back, 4 does not, and
    a 32-GPU gang taking the same victim is not held.

    (ratio, job's GPUs) -> the victim is stopped?"""
    for ratio, gpus, stopped in [(None, 16, True), (2.0, 16, False), (4.0, 16, True), (2.0, 32, True)]:
        st, job = _one_gang_victim("research", True, 1900.0, "research", gpus, 10.0)
        pol = Policy(
            reserve_min_gpus=32,
            class_preemption_max_lost_s=None,
            reclaim_max_lost_s=1800.0,
            reclaim_hold_gang_victims_ratio=ratio,
        )
        p = cycle(st, queue_of(job), NOW, pol)
        assert (victims(p) == ["v"]) is stopped, (ratio, gpus)
        if not stopped:  # a job below reserve_min_gpus does not reserve: told why it waits
            assert p.reason("x") is PendingReason.CAPACITY, (ratio, gpus)
            assert [x.detail for x in p.pending] == [HELD_FOR_VICTIMS_WORK], (ratio, gpus)
