"""How a cycle spends its work: lookahead, quota-skipped lanes, reservation owners,
reserved capacity for higher classes, re-planned reservations, protected victims."""

from __future__ import annotations

from placement import JobQueue, PendingReason, Policy, iter_order, plan

from .helpers import HOUR, cluster, cycle, fill, queue_of, spec


def test_jobs_stopped_only_by_quota_do_not_use_up_the_lookahead() -> None:
    st = cluster(blocks=1, nodes=4)
    st.set_quota("full", "h100", 0, 0)  # no room at all
    st.set_quota("ok", "h100", 8)
    jobs = [spec(f"f{i}", team="full", submit=i) for i in range(50)] + [spec("mine", team="ok", submit=100)]
    q = queue_of(*jobs)
    p = cycle(st, q, 200, Policy(lookahead=5))
    assert p.placement("mine") is not None
    assert p.considered <= 6
    assert ("full", "h100", 1) in p.quota_blocked
    assert p.reason_for(jobs[30]) is PendingReason.QUOTA


def test_a_team_with_a_little_room_skips_only_its_larger_jobs() -> None:
    st = cluster(blocks=1, nodes=4)
    st.set_quota("t", "h100", 2)
    q = queue_of(spec("big", gpr=8, submit=0), spec("big2", gpr=8, submit=1), spec("one", gpr=1, submit=2))
    p = cycle(st, q, 100, Policy(lookahead=1))
    assert p.placement("one") is not None
    assert p.reason_for(spec("big2", gpr=8)) is PendingReason.QUOTA


def test_reservation_owner_is_looked_at_even_beyond_the_lookahead() -> None:
    st = cluster(blocks=2, nodes=4)
    st.set_quota("t", "h100", 1000)
    fill(st, ["b0n0", "b0n1"], team="run", runtime=1000)
    fill(st, ["b1n0", "b1n1", "b1n2", "b1n3"], team="run", runtime=50_000, prefix="long")
    q = queue_of(spec("gang", replicas=4, gpr=8, pack="block", max_blocks=1, submit=0))
    pol = Policy(reserve_min_gpus=32, lookahead=1)
    p = cycle(st, q, 100, pol)
    assert p.reason("gang") is PendingReason.RESERVED
    # many earlier-ordered jobs now fill the lookahead; the reserved block frees up
    for i in range(5):
        q.push(spec(f"x{i}", replicas=8, gpr=8, submit=-10 - i))  # same class, submitted earlier
    st.release("f-b0n0", 1000)
    st.release("f-b0n1", 1000)
    p = cycle(st, q, 1001, pol)
    assert p.placement("gang") is not None and p.placement("gang").blocks == ("b0",)


def test_higher_class_takes_reserved_nodes_only_as_a_last_resort() -> None:
    st = cluster(blocks=2, nodes=4)
    st.set_quota("t", "h100", 1000)
    st.set_quota("hi", "h100", 1000)
    fill(st, ["b0n0", "b0n1"], team="run", runtime=1000)
    fill(st, ["b1n0", "b1n1"], team="run", runtime=50_000, prefix="long")
    q = queue_of(spec("gang", replicas=4, gpr=8, pack="block", max_blocks=1))
    pol = Policy(reserve_min_gpus=32)
    p = cycle(st, q, 100, pol)
    assert p.reservations[0].blocks == ("b0",)
    q.push(spec("hi", team="hi", cls="prod-batch", gpr=8, runtime=20 * HOUR, submit=200))
    p = cycle(st, q, 200, pol)
    assert p.placement("hi").blocks == ("b1",)  # free capacity outside the reservation first


def test_a_slipped_reservation_moves_to_earlier_blocks() -> None:
    st = cluster(blocks=2, nodes=4)
    st.set_quota("t", "h100", 1000)
    fill(st, ["b0n0", "b0n1", "b0n2", "b0n3"], team="run", runtime=2000)
    fill(st, ["b1n0", "b1n1", "b1n2", "b1n3"], team="run", runtime=5000, prefix="later")
    q = queue_of(spec("gang", replicas=4, gpr=8, pack="block", max_blocks=1))
    pol = Policy(reserve_min_gpus=32, reservation_replan_s=600)
    p = cycle(st, q, 100, pol)
    assert p.reservations[0].blocks == ("b0",) and p.reservations[0].expected_start == 2000
    # b0's nodes fail: b0 can no longer hold the gang before its nodes come back
    for n in ("b0n0", "b0n1"):
        from placement import fail_node

        fail_node(st, n, 150)
    p = cycle(st, q, 200, pol)
    assert p.reservations[0].blocks == ("b1",) and p.reservations[0].expected_start == 5000


def test_protected_jobs_are_not_scanned_as_victims_until_their_protection_passes() -> None:
    st = cluster(blocks=1, nodes=2)
    st.set_quota("me", "h100", 100)
    fill(st, ["b0n0", "b0n1"], team="low", cls="preemptible", started_at=0.0)
    plan(st, JobQueue(), Policy(), 100.0)
    ti = st.type_index("h100")
    assert sum(len(v) for v in ti.victims.values()) == 0  # both still protected
    p = cycle(st, queue_of(spec("x", team="me", cls="prod-batch", gpr=8)), 1900.0)
    assert len(p.preemptions) == 1
    assert sum(len(v) for v in ti.victims.values()) == 1  # one listed, the other now preempting


def test_iter_order_skips_lanes_without_room() -> None:
    st = cluster()
    st.set_quota("a", "h100", 1)
    q = queue_of(spec("small", team="a", gpr=1), spec("large", team="a", gpr=4, submit=1))
    blocked: set = set()
    got = [j.job_id for j in iter_order(q, st, Policy(), 10.0, lambda t, g, floor: floor <= 1, blocked)]
    assert got == ["small"] and blocked == {("a", "h100", 3)}
