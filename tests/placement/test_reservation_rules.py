"""Reservation and backfill rules, one test per rule."""

from __future__ import annotations

from placement import PendingReason, Policy, ReservationKind, check_plan, plan

from .helpers import HOUR, blocks_of, cluster, cycle, fill, nodes_of, queue_of, spec

POL = Policy(reserve_min_gpus=32)


def setup():
    """b0: 2 free nodes, jobs ending at 1000 and 3000; b1: full, jobs ending 5000..8000."""
    st = cluster(blocks=2, nodes=4)
    st.set_quota("t", "h100", 1000)
    fill(st, ["b0n0"], team="run", runtime=1000, prefix="e1000")
    fill(st, ["b0n1"], team="run", runtime=3000, prefix="e3000")
    for i, n in enumerate(["b1n0", "b1n1", "b1n2", "b1n3"]):
        fill(st, [n], team="run", runtime=5000 + 1000 * i, prefix=f"e{5000 + 1000 * i}")
    return st


def gang(**kw):
    return spec("gang", team="t", replicas=4, gpr=8, pack="block", max_blocks=1, **kw)


def test_head_of_line_large_gang_reserves_the_blocks_it_will_use() -> None:
    st = setup()
    p = cycle(st, queue_of(gang()), 100, POL)
    assert p.reason("gang") is PendingReason.RESERVED
    (res,) = p.reservations
    assert res.job_id == "gang" and res.kind is ReservationKind.HEAD_OF_LINE
    assert res.blocks == ("b0",)
    assert res.expected_start == 3000  # from running jobs' max_runtime


def test_only_jobs_ending_before_the_expected_start_backfill() -> None:
    st = setup()
    q = queue_of(
        gang(),
        spec("short", team="t", gpr=8, runtime=1000, submit=1),
        spec("long", team="t", gpr=8, runtime=10 * HOUR, submit=2),
    )
    p = cycle(st, q, 100, POL)
    assert p.placement("short") is not None and p.placement("short").backfill
    assert p.placement("short").blocks == ("b0",)
    assert p.reason("long") is PendingReason.RESERVATION


def test_no_backfill_keeps_reserved_blocks_closed() -> None:
    st = setup()
    q = queue_of(gang(), spec("short", team="t", gpr=8, runtime=1000, submit=1))
    p = cycle(st, q, 100, Policy(reserve_min_gpus=32, backfill=False))
    assert p.reason("short") is PendingReason.RESERVATION


def test_reservation_survives_cycles_and_is_released_when_the_job_places() -> None:
    st = setup()
    q = queue_of(gang())
    p1 = cycle(st, q, 100, POL)
    p2 = cycle(st, q, 200, POL)
    assert [r.blocks for r in p2.reservations] == [r.blocks for r in p1.reservations] == [("b0",)]
    assert st.reservation("gang") is not None
    st.release("e1000-b0n0", 1000)
    st.release("e3000-b0n1", 3000)
    p3 = cycle(st, q, 3000, POL)
    assert p3.placement("gang") is not None and p3.placement("gang").blocks == ("b0",)
    assert p3.reservations == () and st.reservation("gang") is None


def test_reservation_released_when_the_job_leaves() -> None:
    st = setup()
    q = queue_of(gang())
    cycle(st, q, 100, POL)
    q.remove("gang")
    p = cycle(st, q, 200, POL)
    assert p.reservations == () and st.reservation("gang") is None


def test_expected_start_follows_running_jobs() -> None:
    st = setup()
    q = queue_of(gang())
    cycle(st, q, 100, POL)
    st.release("e3000-b0n1", 500)  # ended early: only the 1000 s job is left in the way
    p = cycle(st, q, 600, POL)
    assert p.reservations[0].expected_start == 1000


def test_only_the_head_of_line_gang_reserves() -> None:
    st = setup()
    q = queue_of(gang(), spec("gang2", team="t", replicas=4, gpr=8, pack="block", max_blocks=1, submit=5))
    p = cycle(st, q, 100, POL)
    assert [r.job_id for r in p.reservations] == ["gang"]
    assert p.reason("gang2") in (PendingReason.RESERVATION, PendingReason.CAPACITY)


def test_small_jobs_do_not_reserve() -> None:
    st = setup()
    p = cycle(
        st,
        queue_of(spec("mid", team="t", replicas=3, gpr=8, pack="block", max_blocks=1)),
        100,
        Policy(reserve_min_gpus=64),
    )
    assert p.reservations == ()


def test_higher_class_may_use_reserved_blocks_and_displace_the_reservation() -> None:
    st = setup()
    st.set_quota("hi", "h100", 1000)
    q = queue_of(gang())
    cycle(st, q, 100, POL)
    q.push(spec("hi1", team="hi", cls="prod-batch", gpr=8, runtime=10 * HOUR, submit=200))
    p = cycle(st, q, 200, POL)
    assert p.placement("hi1") is not None and p.placement("hi1").blocks == ("b0",)
    q.push(
        spec(
            "higang",
            team="hi",
            cls="prod-batch",
            replicas=4,
            gpr=8,
            pack="block",
            max_blocks=1,
            runtime=10 * HOUR,
            submit=300,
        )
    )
    p = cycle(st, q, 300, Policy(reserve_min_gpus=32, preemption=False))
    assert [r.job_id for r in p.reservations] == ["higang"]


def test_reservations_disabled() -> None:
    st = setup()
    p = cycle(st, queue_of(gang()), 100, Policy(reserve_min_gpus=32, reservations=False))
    assert p.reservations == () and p.reason("gang") is PendingReason.CAPACITY


def test_a_backfill_jobs_preemption_keeps_the_gangs_reservation() -> None:
    # prod-batch work fills 7 nodes, a preemptible job the 8th; the gang (prod-batch, 8 nodes)
    # cannot preempt same-class guaranteed work, so it reserves; a short research job may
    # backfill there and preempts the preemptible job: the gang keeps its reservation
    st = cluster(blocks=2, nodes=4)
    st.set_quota("q", "h100", 56)
    st.set_quota("e", "h100", 0, 64)
    st.set_quota("p", "h100", 64)
    st.set_quota("w", "h100", 8)
    nodes = [f"b{b}n{n}" for b in range(2) for n in range(4)]
    fill(st, nodes[:7], team="q", cls="prod-batch", runtime=2 * HOUR)
    fill(st, nodes[7:], team="e", cls="preemptible", runtime=24 * HOUR, borrowed=True, prefix="e")
    q = queue_of(spec("L", team="p", cls="prod-batch", replicas=8, gpr=8, pack="block", runtime=2 * HOUR, submit=3500))
    pol = Policy(reserve_min_gpus=32, reclaim_max_lost_s=None)  # R's reclaim is dear: not held here
    p = cycle(st, q, 3500, pol)
    assert p.reason("L") is PendingReason.RESERVED
    q.push(spec("R", team="w", cls="research", gpr=8, runtime=600, submit=3650))
    p = cycle(st, q, 3650, pol)
    assert [(pr.victim, pr.beneficiary) for pr in p.preemptions] == [("e-b1n3", "R")]
    assert {r.job_id for r in p.reservations} == {"L", "R"}
    assert st.reservation("L").blocks == ("b0", "b1")
    # R backfills on the reclaimed node; L's reservation is still there
    st.release("e-b1n3", 3680)
    p = cycle(st, q, 3681, pol)
    assert p.placement("R") is not None and p.placement("R").backfill
    assert st.reservation("L") is not None


def tight_setup():
    """b0: nodes busy until 1000, 2000, 9000, 9000; b1: until 1500, 1600, 1700, 9000."""
    st = cluster(blocks=2, nodes=4)
    st.set_quota("t", "h100", 1000)
    for n, end in zip(
        ["b0n0", "b0n1", "b0n2", "b0n3", "b1n0", "b1n1", "b1n2", "b1n3"],
        [1000, 2000, 9000, 9000, 1500, 1600, 1700, 9000],
        strict=True,
    ):
        fill(st, [n], team="run", runtime=end, prefix=f"e{end}")
    return st


def test_reservation_holds_only_the_nodes_it_needs_in_the_fewest_blocks() -> None:
    st = tight_setup()
    gang3 = spec("gang", team="t", replicas=3, gpr=8, pack="block")  # 3 nodes: one block is enough
    p = cycle(st, queue_of(gang3), 100, Policy(reserve_min_gpus=24))
    (res,) = p.reservations
    assert res.blocks == ("b1",) and res.nodes == ("b1n0", "b1n1", "b1n2")
    assert res.expected_start == 1700
    # the fourth node of the block is not held: it is not in the set at all
    assert st.node_reservation("b1n3") == ()


def test_backfill_onto_reserved_nodes_only_when_it_ends_before_the_expected_start() -> None:
    st = tight_setup()
    pol = Policy(reserve_min_gpus=24)
    q = queue_of(spec("gang", team="t", replicas=3, gpr=8, pack="block"))
    cycle(st, q, 100, pol)
    st.release("e1500-b1n0", 1500)  # a reserved node comes free early
    st.release("e1000-b0n0", 1500)  # and an unreserved one
    q.push(spec("long", team="t", gpr=8, runtime=10 * HOUR, submit=1500))
    q.push(spec("short", team="t", gpr=8, runtime=100, submit=1501))
    p = cycle(st, q, 1501, pol)
    assert nodes_of(p, "long") == ["b0n0"]  # anywhere but the gang's nodes
    assert nodes_of(p, "short") == ["b1n0"] and p.placement("short").backfill  # ends by 1700
    assert p.reason("gang") is PendingReason.RESERVED


def test_check_plan_refuses_a_placement_the_reservation_rules_forbid() -> None:
    """The invariant checker judges placements on reserved nodes by the same rules: the plan
    that backfills "short" onto the gang's node is refused once "short" would run past the
    gang's expected start, and a node cleared by preemption belongs to its beneficiary."""
    from dataclasses import replace

    from placement import check_plan, plan

    st = tight_setup()
    pol = Policy(reserve_min_gpus=24)
    q = queue_of(spec("gang", team="t", replicas=3, gpr=8, pack="block"))
    cycle(st, q, 100, pol)
    st.release("e1500-b1n0", 1500)
    q.push(spec("short", team="t", gpr=8, runtime=100, submit=1501))
    p = plan(st, q, pol, 1501)
    assert nodes_of(p, "short") == ["b1n0"] and check_plan(st, p, q, pol) == []
    q.remove("short")
    q.push(spec("short", team="t", gpr=8, runtime=10 * HOUR, submit=1501))
    assert check_plan(st, p, q, pol) == ["short: uses b1n0, reserved for gang from 1700"]
    # the same node, held for another job's reclaim instead
    st.add_reservation(replace(st.reservation("gang"), job_id="x", kind=ReservationKind.PREEMPTION))
    st.remove_reservation("gang")
    p = replace(p, reservations=tuple(st.reservations()))
    assert check_plan(st, p, q, pol) == ["short: uses b1n0, cleared by preemption for x"]


def test_a_node_of_the_block_that_comes_free_first_joins_the_reservation() -> None:
    st = tight_setup()
    pol = Policy(reserve_min_gpus=24)
    q = queue_of(spec("gang", team="t", replicas=3, gpr=8, pack="block"))
    cycle(st, q, 100, pol)
    st.release("e9000-b1n3", 200)  # ended far earlier than its max_runtime
    p = cycle(st, q, 201, pol)
    (res,) = p.reservations
    assert res.nodes == ("b1n0", "b1n1", "b1n3") and res.expected_start == 1600


def test_nodes_cleared_for_a_job_stay_its_own_when_a_gangs_reservation_picks_them() -> None:
    # x reclaims the borrowed node b0n0; the gang G (borrowing: it may not preempt) reserves
    # the 2 nodes that free soonest, b0n0 (stopping) and b0n1; when the victim is gone x still
    # starts on b0n0 (it does not preempt again), and G's reservation moves to b0n1 and b0n2
    st = cluster(blocks=1, nodes=4)
    st.set_quota("me", "h100", 8)
    st.set_quota("o", "h100", 0, 100)
    st.set_quota("g", "h100", 0, 100)
    fill(st, ["b0n0"], team="o", cls="preemptible", borrowed=True, prefix="v")
    for n, end in (("b0n1", 1000), ("b0n2", 2000), ("b0n3", 3000)):
        fill(st, [n], team="run", runtime=end, prefix=f"e{end}")
    pol = Policy(reserve_min_gpus=16, borrowed_gang_guard=None)
    q = queue_of(spec("x", team="me", cls="preemptible", gpr=8, submit=100))
    p = cycle(st, q, 100, pol)
    assert [pr.victim for pr in p.preemptions] == ["v-b0n0"]
    q.push(spec("G", team="g", replicas=2, gpr=8, pack="block", submit=110))
    p = cycle(st, q, 110, pol)
    assert p.reason("G") is PendingReason.RESERVED
    assert st.reservation("G").nodes == ("b0n0", "b0n1")
    st.release("v-b0n0", 130)
    p = cycle(st, q, 131, pol)
    assert nodes_of(p, "x") == ["b0n0"] and p.preemptions == ()
    p = cycle(st, q, 132, pol)
    assert st.reservation("G").nodes == ("b0n1", "b0n2") and st.reservation("G").expected_start == 2000


def test_borrowed_work_of_another_team_backfills_evictably_and_is_stopped_when_the_owner_is_ready() -> None:
    st = setup()
    st.set_quota("o", "h100", 0, 1000)  # borrows only
    st.set_quota("w", "h100", 8)  # guaranteed
    q = queue_of(
        gang(),
        spec("bf", team="o", gpr=8, runtime=10 * HOUR, submit=1),
        spec("g2", team="w", gpr=8, runtime=10 * HOUR, submit=2),
    )
    p = cycle(st, q, 100, POL)
    # long borrowed work of another team runs on a reserved node; long guaranteed work does not
    assert p.placement("bf") is not None and p.placement("bf").backfill and p.placement("bf").borrowed
    assert p.placement("bf").blocks == ("b0",)
    assert p.reason("g2") is PendingReason.RESERVATION
    st.release("e1000-b0n0", 1000)
    st.release("e3000-b0n1", 3000)
    p = cycle(st, q, 3001, POL)
    # the rest of its nodes are free: the owner stops the backfill (a reclaim) and holds the nodes
    assert [(pr.victim, pr.beneficiary, pr.reason.value) for pr in p.preemptions] == [("bf", "gang", "reclaim")]
    assert p.reason("gang") is PendingReason.PREEMPTING
    assert st.reservation("gang").kind is ReservationKind.PREEMPTION
    p = cycle(st, q, 3010, POL)
    assert p.placement("g2") is None or "b0" not in p.placement("g2").blocks
    st.release("bf", 3031)
    p = cycle(st, q, 3032, POL)
    assert p.placement("gang") is not None and p.placement("gang").blocks == ("b0",)


def test_evictable_backfill_only_while_the_owners_expected_start_is_far_enough_off() -> None:
    """``evictable_backfill_min_s``: the gang's expected start is 3000 (its nodes' jobs' ends);
    at 100 borrowed work backfills evictably only if that is more than the field away
    (``cycle`` runs ``check_plan``, which judges by the same rule)."""
    for min_s, placed in ((None, True), (0.0, True), (2800.0, True), (2900.0, False), (5000.0, False)):
        st = setup()
        st.set_quota("o", "h100", 0, 1000)  # borrows only
        q = queue_of(gang(), spec("bf", team="o", gpr=8, runtime=10 * HOUR, submit=1))
        pol = Policy(reserve_min_gpus=32, evictable_backfill_min_s=min_s)
        p = cycle(st, q, 100, pol)
        assert st.reservation("gang").expected_start == 3000
        if placed:
            assert p.placement("bf") is not None and p.placement("bf").backfill, min_s
        else:
            assert p.reason("bf") is PendingReason.RESERVATION, min_s


def test_evictable_backfill_only_for_jobs_that_save_and_are_small_enough() -> None:
    """``evictable_backfill_saving_only`` keeps out jobs that cannot checkpoint;
    ``evictable_backfill_max_gpus`` jobs of more GPUs. The gang reserves b0, whose two free
    nodes are all a long borrowed job could run on (``cycle`` runs ``check_plan`` too)."""
    cases = [
        # (saving_only, max_gpus, replicas, preemptible, placed)
        (False, None, 2, False, True),
        (True, None, 1, False, False),
        (True, None, 1, True, True),
        (False, 8, 2, True, False),
        (False, 16, 2, True, True),
        (False, 8, 1, False, True),
    ]
    for saving_only, max_gpus, replicas, preemptible, placed in cases:
        st = setup()
        st.set_quota("o", "h100", 0, 1000)  # borrows only
        bf = spec("bf", team="o", replicas=replicas, gpr=8, runtime=10 * HOUR, submit=1, preemptible=preemptible)
        pol = Policy(
            reserve_min_gpus=32, evictable_backfill_saving_only=saving_only, evictable_backfill_max_gpus=max_gpus
        )
        p = cycle(st, queue_of(gang(), bf), 100, pol)
        case = (saving_only, max_gpus, replicas, preemptible)
        if placed:
            assert p.placement("bf") is not None and p.placement("bf").backfill, case
        else:
            assert p.reason("bf") is PendingReason.RESERVATION, case


def test_a_job_kept_from_evictable_backfill_does_not_keep_out_one_of_its_shape_that_saves() -> None:
    """The engine remembers a shape's failed search within a cycle: whether the job may
    backfill evictably is part of what it remembers."""
    st = setup()
    st.set_quota("o", "h100", 0, 1000)
    q = queue_of(
        gang(),
        spec("unsaved", team="o", gpr=8, runtime=10 * HOUR, submit=1, preemptible=False),
        spec("saves", team="o", gpr=8, runtime=10 * HOUR, submit=2),
    )
    p = cycle(st, q, 100, Policy(reserve_min_gpus=32, evictable_backfill_saving_only=True))
    assert p.reason("unsaved") is PendingReason.RESERVATION
    assert p.placement("saves") is not None and p.placement("saves").backfill


def test_without_evictable_backfill_long_borrowed_work_waits() -> None:
    st = setup()
    st.set_quota("o", "h100", 0, 1000)
    q = queue_of(gang(), spec("bf", team="o", gpr=8, runtime=10 * HOUR, submit=1))
    p = cycle(st, q, 100, Policy(reserve_min_gpus=32, evictable_backfill=False))
    assert p.reason("bf") is PendingReason.RESERVATION


def test_a_guaranteed_gang_takes_the_slot_of_a_borrowing_gang_of_its_class() -> None:
    """One head-of-line slot per type: a gang beyond its team's guarantee holds it until a
    same-class gang that runs guaranteed needs it; the borrowing gang never takes it back."""
    for on in (True, False):
        pol = Policy(
            reserve_min_gpus=32,
            guaranteed_gangs_reserve_first=on,
            guaranteed_gangs_outrank_borrowed=False,
            borrowed_gang_guard=None,
        )
        st = setup()
        st.set_quota("over", "h100", 0, 1000)  # everything it runs is borrowed
        q = queue_of(spec("bgang", team="over", replicas=4, gpr=8, pack="block", max_blocks=1))
        assert [r.job_id for r in cycle(st, q, 100, pol).reservations] == ["bgang"]
        q.push(gang(submit=150))
        p = cycle(st, q, 200, pol)
        assert [r.job_id for r in p.reservations] == (["gang"] if on else ["bgang"])
        p = cycle(st, q, 300, pol)
        assert [r.job_id for r in p.reservations] == (["gang"] if on else ["bgang"])
        assert p.reason("bgang" if on else "gang") is not PendingReason.RESERVED


def test_a_guaranteed_gang_takes_the_slot_of_a_borrowing_gang_of_a_higher_class() -> None:
    """``guaranteed_gangs_outrank_borrowed``: a prod-batch gang beyond its team's guarantee
    holds the one slot; a research gang that runs guaranteed takes it, and the prod-batch gang
    does not take it back (without the field the class rule would, every cycle). Without the
    field the research gang never gets it."""
    for on in (True, False):
        pol = Policy(reserve_min_gpus=32, guaranteed_gangs_outrank_borrowed=on, borrowed_gang_guard=None)
        st = setup()
        st.set_quota("over", "h100", 0, 1000)  # everything it runs is borrowed
        q = queue_of(spec("bgang", team="over", cls="prod-batch", replicas=4, gpr=8, pack="block", max_blocks=1))
        assert [r.job_id for r in cycle(st, q, 100, pol).reservations] == ["bgang"]
        q.push(gang(submit=150))
        for now in (200, 300, 400):
            p = cycle(st, q, now, pol)
            assert [r.job_id for r in p.reservations] == (["gang"] if on else ["bgang"]), now
        # the research gang has held it since 200; the prod-batch gang no longer reserves
        assert [r.created_at for r in p.reservations] == ([200] if on else [100])
        assert p.reason("gang") is (PendingReason.RESERVED if on else PendingReason.CAPACITY)
        assert p.reason("bgang") is (PendingReason.CAPACITY if on else PendingReason.RESERVED)


def test_a_borrowing_gang_keeps_its_slot_against_a_guaranteed_gang_of_a_lower_class_that_borrows_too() -> None:
    """The field moves the slot only towards guarantees: a research gang that would also run
    borrowed does not take a borrowing prod-batch gang's slot, and a guaranteed prod-batch gang
    still takes a guaranteed research gang's slot (the class order among guaranteed gangs)."""
    pol = Policy(reserve_min_gpus=32, guaranteed_gangs_outrank_borrowed=True, borrowed_gang_guard=None)
    st = setup()
    st.set_quota("over", "h100", 0, 1000)
    st.set_quota("t", "h100", 0, 1000)  # the research gang would borrow as well
    q = queue_of(spec("bgang", team="over", cls="prod-batch", replicas=4, gpr=8, pack="block", max_blocks=1))
    assert [r.job_id for r in cycle(st, q, 100, pol).reservations] == ["bgang"]
    q.push(gang(submit=150))
    assert [r.job_id for r in cycle(st, q, 200, pol).reservations] == ["bgang"]

    st = setup()
    st.set_quota("pb", "h100", 1000)
    q = queue_of(gang())
    assert [r.job_id for r in cycle(st, q, 100, pol).reservations] == ["gang"]
    q.push(spec("pgang", team="pb", cls="prod-batch", replicas=4, gpr=8, pack="block", max_blocks=1, submit=150))
    assert [r.job_id for r in cycle(st, q, 200, pol).reservations] == ["pgang"]


def test_guaranteed_work_that_waited_may_use_a_borrowing_gangs_reserved_nodes() -> None:
    """A borrowing gang holds b0 (2 nodes free now, 2 at 1000/3000). A guaranteed 1-node job of
    another team, too long to backfill, waits while younger than the policy's wait, then takes a
    reserved free node; the gang's own team's guaranteed job never does; nor anyone without the knob."""
    for wait in (300.0, None):
        pol = Policy(reserve_min_gpus=32, claim_borrowed_reservations_after_s=wait)
        st = setup()
        st.set_quota("over", "h100", 8, 1000)  # the 4-node gang runs borrowed, an 8-GPU job guaranteed
        st.set_quota("t2", "h100", 100)
        q = queue_of(spec("bgang", team="over", replicas=4, gpr=8, pack="block", max_blocks=1))
        p = cycle(st, q, 100, pol)
        assert [r.job_id for r in p.reservations] == ["bgang"] and p.reservations[0].blocks == ("b0",)
        q.push(spec("mine", team="over", gpr=8, submit=50))
        q.push(spec("theirs", team="t2", gpr=8, submit=50))
        p = cycle(st, q, 200, pol)  # waited 150 s
        assert p.reason("theirs") is PendingReason.RESERVATION and p.reason("mine") is PendingReason.RESERVATION
        p = cycle(st, q, 400, pol)  # waited 350 s
        assert p.reason("mine") is PendingReason.RESERVATION
        if wait is None:
            assert p.reason("theirs") is PendingReason.RESERVATION
        else:
            assert blocks_of(p, "theirs") == ("b0",) and not p.placement("theirs").borrowed
            assert [r.job_id for r in p.reservations] == ["bgang"]  # the gang keeps waiting, later


def test_a_gang_that_borrows_after_its_teams_placements_this_cycle_may_be_claimed() -> None:
    """The gang fits its team's guarantee when the cycle starts; its team's prod-serving job,
    placed first in the same cycle, takes one reserved node (the higher-class last resort) and
    pushes the gang beyond the guarantee. Another team's guaranteed job that waited may then
    claim a reserved node, and ``check_plan`` judges the claim on the state the engine saw."""
    pol = Policy(reserve_min_gpus=32, claim_borrowed_reservations_after_s=300.0)
    st = setup()
    st.set_quota("over", "h100", 32, 1000)  # the 4-node gang alone runs guaranteed
    st.set_quota("t2", "h100", 100)
    q = queue_of(spec("g", team="over", replicas=4, gpr=8, pack="block", max_blocks=1))
    p = cycle(st, q, 100, pol)
    assert [(r.job_id, r.blocks) for r in p.reservations] == [("g", ("b0",))]
    q.push(spec("serve", team="over", cls="prod-serving", gpr=8, submit=390))
    q.push(spec("theirs", team="t2", gpr=8, submit=50))
    p = cycle(st, q, 400, pol)  # "theirs" waited 350 s
    assert blocks_of(p, "serve") == ("b0",) and not p.placement("serve").borrowed
    assert blocks_of(p, "theirs") == ("b0",) and not p.placement("theirs").borrowed


def test_guaranteed_reservations_hold_against_borrowed_higher_classes() -> None:
    """``guaranteed_reservations_hold``: (the gang's team guarantee, the prod-batch job's team
    guarantee, field) -> does the prod-batch job take a node the research gang reserved?
    Today's last resort lets any higher class take it; with the field, work that would run
    borrowed may not while the gang would run guaranteed."""
    rows = [
        (1000, 0, False, True),  # today: the higher class's last resort, borrowed or not
        (1000, 0, True, False),  # borrowed work waits: the gang runs guaranteed
        (1000, 100, True, True),  # guaranteed higher-class work keeps the last resort
        (16, 0, True, True),  # the gang itself would borrow: nothing guaranteed to hold
    ]
    for gang_guarantee, job_guarantee, hold, takes in rows:
        pol = Policy(reserve_min_gpus=32, borrowed_gang_guard=None, guaranteed_reservations_hold=hold)
        st = setup()
        st.set_quota("t", "h100", gang_guarantee, 1000)
        st.set_quota("over", "h100", job_guarantee, 1000)
        q = queue_of(gang())
        p = cycle(st, q, 100, pol)
        assert [(r.job_id, r.blocks) for r in p.reservations] == [("gang", ("b0",))]
        q.push(spec("pb", team="over", cls="prod-batch", gpr=8, submit=150))
        p = cycle(st, q, 200, pol)
        row = (gang_guarantee, job_guarantee, hold)
        if takes:
            assert blocks_of(p, "pb") == ("b0",), row
            assert p.placement("pb").borrowed is (job_guarantee == 0), row
        else:
            assert p.reason("pb") is PendingReason.RESERVATION, row
    assert Policy().guaranteed_reservations_hold is False


def test_check_plan_flags_borrowed_work_on_a_held_guaranteed_reservation() -> None:
    """The invariant checker judges the field as the engine does: the plan made without it
    (the borrowed prod-batch job on the gang's reserved node) breaks the rule with it."""
    off = Policy(reserve_min_gpus=32, borrowed_gang_guard=None)
    on = Policy(reserve_min_gpus=32, borrowed_gang_guard=None, guaranteed_reservations_hold=True)
    st = setup()
    st.set_quota("over", "h100", 0, 1000)
    q = queue_of(gang())
    cycle(st, q, 100, off)
    q.push(spec("pb", team="over", cls="prod-batch", gpr=8, submit=150))
    p = plan(st, q, off, 200)
    assert blocks_of(p, "pb") == ("b0",)
    assert not check_plan(st, p, q, off)
    errs = check_plan(st, p, q, on)
    assert errs and all("pb: uses b0n" in e and "reserved for gang" in e for e in errs), errs


def _drain_setup(guarantee: int):
    """b0: n0 runs guaranteed work to 3000, n1-n3 another team's borrowed research work for
    10 h (there before any gang); b1: guaranteed work to 5000-8000."""
    st = cluster(blocks=2, nodes=4)
    st.set_quota("t", "h100", guarantee, 1000)
    st.set_quota("o", "h100", 0, 1000)
    fill(st, ["b0n0"], team="run", runtime=3000, prefix="e3000")
    fill(st, ["b0n1", "b0n2", "b0n3"], team="o", borrowed=True, runtime=10 * HOUR, prefix="bw")
    for i, n in enumerate(["b1n0", "b1n1", "b1n2", "b1n3"]):
        fill(st, [n], team="run", runtime=5000 + 1000 * i, prefix=f"e{5000 + 1000 * i}")
    return st


def test_a_guaranteed_gangs_drain_counts_reclaimable_borrowed_work_as_gone() -> None:
    """``drain_reclaims_borrowed``: (field, the gang's team guarantee) -> the blocks the gang
    reserves and when it expects to start. Within its guarantee and with the field, the gang
    counts the other team's borrowed work on b0 as gone: it reserves b0 for 3000, when the
    guaranteed work there ends, and then reclaims that work. A gang that would borrow itself
    takes none."""
    rows = [
        (False, 1000, ("b1",), 8000.0),  # today: only jobs' ends
        (True, 1000, ("b0",), 3000.0),
        (True, 0, ("b1",), 8000.0),  # the gang would borrow: nothing to reclaim for it
    ]
    for field, guarantee, blocks, start in rows:
        pol = Policy(reserve_min_gpus=32, borrowed_gang_guard=None, drain_reclaims_borrowed=field)
        st = _drain_setup(guarantee)
        q = queue_of(gang(submit=10))
        row = (field, guarantee)
        p = cycle(st, q, 100, pol)
        assert p.reason("gang") is PendingReason.RESERVED, row
        [res] = p.reservations
        assert (res.blocks, res.expected_start) == (blocks, start), row
        if blocks != ("b0",):
            continue
        st.release("e3000-b0n0", 3000)
        p = cycle(st, q, 3001, pol)
        # the rest of its nodes are free: the owner reclaims the borrowed work there first
        assert sorted((pr.victim, pr.reason.value) for pr in p.preemptions) == [
            (f"bw-b0n{i}", "reclaim") for i in (1, 2, 3)
        ], row
        assert p.reason("gang") is PendingReason.PREEMPTING, row
        for i in (1, 2, 3):
            st.release(f"bw-b0n{i}", 3031)
        p = cycle(st, q, 3032, pol)
        assert blocks_of(p, "gang") == ("b0",), row
    assert Policy().drain_reclaims_borrowed is False


def test_a_drain_reclaims_work_there_first_only_while_its_owner_is_within_its_guarantee() -> None:
    """The gang reserved b0 within its guarantee; its team's guarantee is then cut, so it would
    borrow. When b0's guaranteed work ends it reclaims nothing, and the invariant checker
    refuses a plan in which it does."""
    from dataclasses import replace

    from placement import Preemption, PreemptReason

    pol = Policy(reserve_min_gpus=32, borrowed_gang_guard=None, drain_reclaims_borrowed=True)
    st = _drain_setup(1000)
    q = queue_of(gang(submit=10))
    cycle(st, q, 100, pol)
    assert st.reservation("gang").evicts_borrowed
    st.set_quota("t", "h100", 0, 1000)
    st.release("e3000-b0n0", 3000)
    p = plan(st, q, pol, 3001)
    assert p.preemptions == () and p.reason("gang") is not PendingReason.PREEMPTING
    forged = replace(p, preemptions=(Preemption("bw-b0n1", "gang", PreemptReason.RECLAIM, 30.0, True),))
    assert "gang: borrows yet reclaims bw-b0n1, there before its reservation" in check_plan(st, forged, q, pol)
