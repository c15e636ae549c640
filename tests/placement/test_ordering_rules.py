"""Queue order rules (docs/design.md, Placement), one test per rule."""

from __future__ import annotations

from placement import ClusterState, JobQueue, Ordering, PendingReason, Policy, iter_order, plan

from .helpers import HOUR, cluster, cycle, fill, queue_of, spec


def order(st: ClusterState, q: JobQueue, now: float = 0.0, policy: Policy | None = None) -> list[str]:
    return [j.job_id for j in iter_order(q, st, policy or Policy(), now)]


def test_order_priority_class_first() -> None:
    st = cluster()
    q = queue_of(
        spec("p", cls="preemptible", submit=0),
        spec("r", cls="research", submit=1),
        spec("b", cls="prod-batch", submit=2),
        spec("s", cls="prod-serving", submit=3),
    )
    assert order(st, q) == ["s", "b", "r", "p"]


def test_order_team_below_its_guarantee_first_within_class() -> None:
    st = cluster()
    st.set_quota("over", "h100", 8)
    st.set_quota("under", "h100", 16)
    fill(st, ["b0n0"], team="over")  # 'over' uses its whole guarantee
    st.set_usage("under", "h100", 10_000.0, 0.0)  # heavy past usage does not matter: it is below its guarantee
    q = queue_of(spec("o", team="over", submit=0), spec("u", team="under", submit=5))
    assert order(st, q) == ["u", "o"]


def test_order_fair_share_position_most_underserved_first() -> None:
    st = cluster()
    for t in ("heavy", "light"):
        st.set_quota(t, "h100", 0)  # nobody below a guarantee: fair share decides
    st.set_quota("heavy", "h100", 8)
    st.set_quota("light", "h100", 8)
    fill(st, ["b0n0"], team="heavy")
    fill(st, ["b0n1"], team="light")
    st.set_usage("heavy", "h100", 500.0, 0.0)
    st.set_usage("light", "h100", 10.0, 0.0)
    q = queue_of(spec("h", team="heavy", submit=0), spec("l", team="light", submit=10))
    assert order(st, q, now=20) == ["l", "h"]


def test_order_aging_one_step_per_hour_waited() -> None:
    st = cluster()
    for t, use in (("a", 10.0), ("b", 20.0), ("c", 30.0)):
        st.set_quota(t, "h100", 8)
        fill(st, [f"b0n{'abc'.index(t)}"], team=t, prefix=t)
        st.set_usage(t, "h100", use, 0.0)
    now = 10 * HOUR
    # c is at position 2; its job waited 2.5 hours: key -0.5, ahead of a's fresh job (key 0)
    q = queue_of(
        spec("a1", team="a", submit=now),
        spec("b1", team="b", submit=now),
        spec("c1", team="c", submit=now - 2.5 * HOUR),
    )
    assert order(st, q, now=now) == ["c1", "a1", "b1"]
    # waiting only 1.5 hours puts it between a (0) and b (1)
    q = queue_of(
        spec("a1", team="a", submit=now),
        spec("b1", team="b", submit=now),
        spec("c1", team="c", submit=now - 1.5 * HOUR),
    )
    assert order(st, q, now=now) == ["a1", "c1", "b1"]


def test_order_aging_never_crosses_classes() -> None:
    st = cluster()
    q = queue_of(spec("old", cls="research", submit=0), spec("new", cls="prod-batch", submit=1000 * HOUR))
    assert order(st, q, now=1000 * HOUR) == ["new", "old"]


def test_order_ties_by_submit_time_then_id() -> None:
    st = cluster()
    q = queue_of(spec("z", submit=5), spec("y", submit=1), spec("x", submit=5))
    assert order(st, q, now=10) == ["y", "x", "z"]


def test_order_requeued_front_of_class() -> None:
    st = cluster()
    q = queue_of(spec("r1", submit=0), spec("again", submit=50, front=True), spec("b", cls="prod-batch", submit=99))
    assert order(st, q, now=100) == ["b", "again", "r1"]


def test_order_merges_per_team_lanes_without_sorting_the_queue() -> None:
    st = cluster()
    jobs = [spec(f"{t}{i:03d}", team=t, submit=i * 10 + k) for k, t in enumerate("abc") for i in range(100)]
    q = queue_of(*jobs)
    got = order(st, q, now=2000, policy=Policy(ordering=Ordering.CLASS_FIFO))
    assert got == [j.job_id for j in sorted(jobs, key=lambda j: (j.submit_time, j.job_id))]


def test_order_fifo_ignores_classes() -> None:
    st = cluster()
    q = queue_of(spec("r", cls="research", submit=0), spec("s", cls="prod-serving", submit=1))
    assert order(st, q, policy=Policy(ordering=Ordering.FIFO)) == ["r", "s"]


def test_lookahead_limits_the_jobs_considered() -> None:
    st = cluster(blocks=1, nodes=1)
    st.set_quota("t", "h100", 0, 100)  # not below a guarantee (those are looked at regardless)
    fill(st, ["b0n0"])
    q = queue_of(*[spec(f"j{i}", submit=i) for i in range(10)])
    p = plan(st, q, Policy(lookahead=3), 100.0)
    assert p.considered == 3
    assert {x.job_id for x in p.pending} == {"j0", "j1", "j2"}
    assert p.reason("j5") is PendingReason.LOOKAHEAD
    assert p.reason("j0") is PendingReason.CAPACITY


def test_a_team_that_reaches_its_guarantee_stops_going_first_within_the_cycle() -> None:
    """Team "a" is below its 16-GPU guarantee, "b" at its own: a's first two 8-GPU jobs go
    first; once they are placed a is at its guarantee, and b (less served: the better
    fair-share position, and an older job) comes before a's third job in the same cycle."""
    st = cluster(blocks=1, nodes=5)
    st.set_quota("a", "h100", 16, 100)
    st.set_quota("b", "h100", 16, 100)
    st.set_usage("a", "h100", 5000.0, 0.0)  # a is well served: b's fair-share position is better
    fill(st, ["b0n0", "b0n1"], team="b", prefix="b-run")  # b uses its guarantee
    st.set_quota("b", "h100", 16, 100)
    q = queue_of(
        spec("a1", team="a", gpr=8, submit=10),
        spec("a2", team="a", gpr=8, submit=11),
        spec("a3", team="a", gpr=8, submit=12),
        spec("b1", team="b", gpr=8, submit=0),
    )
    p = cycle(st, q, 10 * HOUR, Policy(preemption=False, reservations=False))
    assert {pl.job_id for pl in p.placements} == {"a1", "a2", "b1"}
    assert p.reason("a3") is PendingReason.CAPACITY


ACROSS = Policy(guarantees_before_classes=True)
CLASSES_FIRST = Policy(guarantees_before_classes=False)  # the baselines' order


def test_guarantees_before_classes_puts_every_team_below_its_guarantee_first() -> None:
    """``guarantees_before_classes``: a research job of a team below its guarantee comes before
    a prod-batch job of a team at its guarantee; among teams below (and among those above) the
    class order stands, and front-of-class jobs still lead their class."""
    st = cluster()
    st.set_quota("over", "h100", 8)
    st.set_quota("under", "h100", 16)
    st.set_quota("under2", "h100", 16)
    fill(st, ["b0n0"], team="over")  # 'over' uses its whole guarantee
    q = queue_of(
        spec("o-batch", team="over", cls="prod-batch", submit=0),
        spec("o-serve", team="over", cls="prod-serving", submit=1),
        spec("u-res", team="under", cls="research", submit=2),  # aged ten hours by ``now``
        spec("u-pre", team="under", cls="preemptible", submit=3),
        spec("u2-batch", team="under2", cls="prod-batch", submit=4),
        spec("u-again", team="under", cls="research", submit=5, front=True),
        spec("o-again", team="over", cls="research", submit=6, front=True),
    )
    now = 10 * HOUR
    assert order(st, q, now, ACROSS) == ["u2-batch", "u-again", "u-res", "u-pre", "o-serve", "o-batch", "o-again"]
    assert order(st, q, now) == order(st, q, now, ACROSS)  # on in gpufleet
    # without it, classes first
    assert order(st, q, now, CLASSES_FIRST) == [
        "o-serve",
        "u2-batch",
        "o-batch",
        "u-again",
        "o-again",
        "u-res",
        "u-pre",
    ]


def low_and_high(nodes: int) -> ClusterState:
    """Teams "low" and "high", 16-GPU guarantees each; high uses its guarantee on two nodes."""
    st = cluster(blocks=1, nodes=nodes)
    st.set_quota("low", "h100", 16, 100)
    st.set_quota("high", "h100", 16, 100)
    fill(st, ["b0n0", "b0n1"], team="high", prefix="high-run")
    return st


def test_guarantees_before_classes_a_team_that_reaches_its_guarantee_goes_behind() -> None:
    """Team "low" (research) is below its 16-GPU guarantee, "high" (prod-batch) at its own: low's
    first two 8-GPU jobs come first; once placed, low is at its guarantee and high's job comes
    before low's third in the same cycle."""
    st = low_and_high(nodes=5)
    q = queue_of(
        spec("l1", team="low", cls="research", gpr=8, submit=10),
        spec("l2", team="low", cls="research", gpr=8, submit=11),
        spec("l3", team="low", cls="research", gpr=8, submit=12),
        spec("h1", team="high", cls="prod-batch", gpr=8, submit=20),
    )
    pol = Policy(preemption=False, reservations=False, guarantees_before_classes=True)
    p = cycle(st, q, 10 * HOUR, pol)
    assert {pl.job_id for pl in p.placements} == {"l1", "l2", "h1"}
    assert p.reason("l3") is PendingReason.CAPACITY
    # one free node: it goes to low's research job, not to high's prod-batch job (classes first)
    classes_first = Policy(preemption=False, reservations=False, guarantees_before_classes=False)
    for policy, winner in ((classes_first, "h1"), (pol, "l1")):
        st2 = low_and_high(nodes=3)
        q2 = queue_of(
            spec("l1", team="low", cls="research", gpr=8, submit=10),
            spec("h1", team="high", cls="prod-batch", gpr=8, submit=20),
        )
        assert {pl.job_id for pl in cycle(st2, q2, 10 * HOUR, policy).placements} == {winner}
