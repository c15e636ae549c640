"""A cycle repeats an equal job's decision (``plan(dedupe=True)``, the default) only where
deciding the job afresh would give the same answer: the plans are equal, job by job.

Queues here are made of clones (equal in everything but id, submit time, attempt and
preemption history), the case the repetition is for, on random clusters that also run
spares, reservations and preemptions, and are planned over several cycles.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from placement import ClusterState, JobQueue, Pack, Policy, Topology, apply, fail_node, plan, requeue_spec

from .helpers import big_quota, cluster, cycle, fill, nodes_of, occupy, queue_of, spec
from .strategies import CLASSES, HOUR, build, job_specs, populate, scenarios, unique
from .test_properties import (
    BORROWED_APART,
    CHECKPOINT_WAIT,
    EVICTABLE_LIMITS,
    HIGHER_GANGS,
    POLICIES,
    PROPS,
    RECLAIM_CAP,
    RECLAIM_CAP_RATIO,
    RECLAIM_CAP_SMALL,
    RESTART_BACKOFF,
    SPARES_YIELD,
    checkpoint_twice,
)
from .test_reservation_rules import setup as reservation_setup

# spares that yield after a minute, reclaim and claims after short waits: thresholds that
# clones of one template cross at different times
SHORT_WAITS = Policy(
    reserve_min_gpus=8,
    hot_spare_min_gpus=8,
    hot_spare_fraction=0.25,
    spares_yield_after_s=60.0,
    reclaim_small_borrowed_after_s=300.0,
    claim_borrowed_reservations_after_s=600.0,
    max_reservations_per_type=1,
)
TOPOLOGIES = [Topology(), Topology(Pack.BLOCK, 1), Topology(Pack.BLOCK, 1, 900.0), Topology(Pack.NODE)]


def _same_plan(stt, q, policy, now):
    fresh = plan(stt, q, policy, now, dedupe=False)
    repeated = plan(stt, q, policy, now)
    assert repeated.pending == fresh.pending
    assert repeated == fresh
    return repeated


@st.composite
def clone_queues(draw, sc, prefix: str):
    templates = unique(draw(st.lists(job_specs(sc, "t"), min_size=1, max_size=5)))
    jobs = []
    for ti, t in enumerate(templates):
        for k in range(draw(st.integers(1, 6))):
            clone = replace(
                t,
                job_id=f"{prefix}{ti}-{k}",
                submit_time=draw(st.sampled_from([t.submit_time, 0.0, 1800.0, 2 * HOUR, 5 * HOUR])),
                attempt=draw(st.integers(0, 2)),
            )
            # a near-clone: one field a decision reads differs (it must not repeat the decision)
            differ = draw(st.sampled_from(["", "", "", "team", "priority", "runtime", "topology", "other"]))
            if differ == "team":
                clone = replace(clone, team=draw(st.sampled_from(sc.teams)))
            elif differ == "priority":
                clone = replace(clone, priority=draw(st.sampled_from(CLASSES)))
            elif differ == "runtime":
                clone = replace(clone, max_runtime_s=draw(st.sampled_from([600.0, HOUR, 48 * HOUR])))
            elif differ == "topology":
                clone = replace(clone, topology=draw(st.sampled_from(TOPOLOGIES)))
            elif differ == "other":
                clone = replace(clone, preemptible=not clone.preemptible, grace_s=draw(st.sampled_from([0.0, 300.0])))
            jobs.append(clone)
    return jobs


@PROPS
@given(data=st.data())
def test_repeated_decisions_equal_fresh_ones(data) -> None:
    stt, q = _clone_world(data)
    policy = data.draw(
        st.sampled_from(
            [
                *POLICIES,
                SPARES_YIELD,
                BORROWED_APART,
                RESTART_BACKOFF,
                HIGHER_GANGS,
                SHORT_WAITS,
                EVICTABLE_LIMITS,
                RECLAIM_CAP,
                RECLAIM_CAP_SMALL,
                RECLAIM_CAP_RATIO,
            ]
        )
    )
    now = data.draw(st.sampled_from([3000.0, 2 * HOUR, 6 * HOUR]))
    _three_cycles(stt, q, policy, now)


@PROPS
@given(data=st.data())
def test_repeated_decisions_equal_fresh_ones_while_jobs_wait_for_checkpoints(data) -> None:
    stt, q = _clone_world(data)
    now = data.draw(st.sampled_from([3000.0, 2 * HOUR, 6 * HOUR]))
    checkpoint_twice(stt, now)
    _three_cycles(stt, q, CHECKPOINT_WAIT, now)


def _clone_world(data) -> tuple[ClusterState, JobQueue]:
    """A random cluster running random work, and a queue of clones."""
    sc = data.draw(scenarios())
    stt = build(sc)
    populate(stt, unique(data.draw(st.lists(job_specs(sc, "r"), max_size=16))), [0.0, 1000.0, 3000.0])
    return stt, JobQueue(data.draw(clone_queues(sc, "q")))


def _three_cycles(stt, q, policy, now) -> None:
    for step in range(3):
        p = _same_plan(stt, q, policy, now)
        apply(stt, p, q, now)
        now += 90.0
        # victims stop and come back as clones of themselves; some running work ends
        for vid in stt.preempting():
            q.push(requeue_spec(stt.release(vid, now).spec, now, preempted=True))
        if step == 0:
            for rj in list(stt.running_jobs())[::3]:
                if rj.preempting_for is None:
                    stt.release(rj.job_id, now)


# --------------------------------------------------------------------------- table
# Each case queues a job that pends, then a job equal to it but for one thing a decision
# reads (or with something changed in between), decided afterwards in the same cycle
# (``front`` orders them and is not read by a decision), whose answer differs: repeating
# the first decision would be wrong (the other waiting thresholds are off, so that the one
# under test is the only difference). Every case asserts the answers differ, so a case that
# stops crossing its line fails instead of passing vacuously.

NOW = 10_000.0


def _spares_yield_wait():
    """Only a guaranteed job that waited ``spares_yield_after_s`` may take a hot spare."""
    pol = Policy(
        hot_spare_min_gpus=64, hot_spare_fraction=0.1, preemption=False, reservations=False, spares_yield_after_s=60
    )
    st = cluster(blocks=2, nodes=5)
    big_quota(st, "t")
    st.set_quota("g", "h100", 8, 0)
    cycle(st, queue_of(spec("big", replicas=8, gpr=8, pack="block")), 100, pol)
    last = [n for n in st.node_ids() if not st.node_jobs(n) and n not in st.spares("big")]
    occupy(st, spec("other", team="t", gpr=8), last, started_at=100)
    q = queue_of(spec("fresh", team="g", gpr=8, submit=190, front=True), spec("waited", team="g", gpr=8, submit=100))
    return st, q, pol, 200.0, "fresh", "waited"


def _reclaim_small_wait():
    """Only a guaranteed job that waited ``reclaim_small_borrowed_after_s`` takes back a
    higher class's small borrowed job."""
    pol = Policy(reserve_min_gpus=16, reclaim_small_borrowed_after_s=300.0, claim_borrowed_reservations_after_s=None)
    st = cluster(blocks=1, nodes=2)
    st.set_quota("me", "h100", 100, 100)
    st.set_quota("b", "h100", 0, 100)
    occupy(st, spec("v", team="b", cls="prod-batch", gpr=8), ["b0n0"], borrowed=True)
    fill(st, ["b0n1"], team="g", cls="prod-batch")
    q = queue_of(
        spec("fresh", team="me", gpr=8, submit=NOW - 10, front=True), spec("waited", team="me", gpr=8, submit=NOW - 300)
    )
    return st, q, pol, NOW, "fresh", "waited"


def _gang_reclaim_settled():
    """A guaranteed gang preempted moments ago does not yet take back a higher class's
    borrowed gang; an equal gang not preempted lately does (no restart backoff, which would
    tell them apart too, and no reservation, which the first would make)."""
    pol = Policy(
        reserve_min_gpus=16,
        reclaim_higher_borrowed_gangs=True,
        reservations=False,
        claim_borrowed_reservations_after_s=None,
        borrowed_restart_backoff_s=None,
    )
    st = cluster(blocks=1, nodes=3)
    st.set_quota("me", "h100", 100, 100)
    st.set_quota("b", "h100", 0, 100)
    occupy(st, spec("v", team="b", cls="prod-batch", replicas=2, gpr=8), ["b0n0", "b0n1"], borrowed=True)
    fill(st, ["b0n2"], team="g", cls="prod-batch")
    q = queue_of(
        spec("recent", team="me", replicas=2, gpr=8, submit=NOW - 900, preemption_times=(NOW - 100,), front=True),
        spec("settled", team="me", replicas=2, gpr=8, submit=NOW - 900),
    )
    return st, q, pol, NOW, "recent", "settled"


def _claim_wait():
    """Only a guaranteed job that waited ``claim_borrowed_reservations_after_s`` may use a
    borrowing gang's reserved nodes."""
    pol = Policy(reserve_min_gpus=32, claim_borrowed_reservations_after_s=300.0, reclaim_small_borrowed_after_s=None)
    st = reservation_setup()
    st.set_quota("over", "h100", 8, 1000)  # the 4-node gang runs borrowed
    st.set_quota("t2", "h100", 100)
    q = queue_of(spec("bgang", team="over", replicas=4, gpr=8, pack="block", max_blocks=1, front=True))
    cycle(st, q, 100, pol)
    assert [r.job_id for r in st.reservations()] == ["bgang"]
    q.push(spec("fresh", team="t2", gpr=8, submit=350, front=True))  # after the owner (submit 0)
    q.push(spec("waited", team="t2", gpr=8, submit=50))
    return st, q, pol, 400.0, "fresh", "waited"


def _run_time():
    """A job short enough to end before a reservation's start backfills; a long one does not."""
    pol = Policy(reserve_min_gpus=32)
    st = reservation_setup()
    q = queue_of(spec("gang", team="t", replicas=4, gpr=8, pack="block", max_blocks=1, front=True))
    cycle(st, q, 100, pol)
    q.push(spec("long", team="t", gpr=8, runtime=10 * HOUR, submit=1, front=True))
    q.push(spec("short", team="t", gpr=8, runtime=1000, submit=2))
    return st, q, pol, 200.0, "long", "short"


def _run_time_near_the_start():
    """What counts is when a job would end, not how long it runs: both run times here are
    shorter than the reservation's start (3,000) is from zero, yet only one ends by it."""
    pol = Policy(reserve_min_gpus=32)
    st = reservation_setup()
    q = queue_of(spec("gang", team="t", replicas=4, gpr=8, pack="block", max_blocks=1, front=True))
    cycle(st, q, 100, pol)
    q.push(spec("long", team="t", gpr=8, runtime=2900, submit=1, front=True))  # ends 3,100
    q.push(spec("short", team="t", gpr=8, runtime=2000, submit=2))  # ends 2,200
    return st, q, pol, 200.0, "long", "short"


def _lent_to_b():
    """Two free nodes lent by ``lender``, whose 16 GPUs of demand are expected back (more
    than is free after one 8-GPU job), to team ``b``, which borrows only."""
    st = cluster(blocks=1, nodes=2)
    st.set_quota("lender", "h100", 16, 0)
    st.set_demand_forecast({("lender", "h100"): 16})
    st.set_quota("b", "h100", 0, 100)
    return st


def _unsaved_borrow():
    """With ``unsaved_borrow_guard``, a borrowed job that cannot checkpoint keeps off the GPUs
    guaranteed demand is expected back to; an equal job that checkpoints starts."""
    pol = Policy(unsaved_borrow_guard=1.0)
    st = _lent_to_b()
    q = queue_of(
        spec("unsaved", team="b", gpr=8, submit=0, preemptible=False, front=True),
        spec("saved", team="b", gpr=8, submit=0),
    )
    return st, q, pol, NOW, "unsaved", "saved"


def _after_a_placement():
    """A gang finds two free nodes in different blocks (``topology``); a job placed next takes
    one, and an equal gang after it finds too few nodes (``capacity``)."""
    pol = Policy(preemption=False, reservations=False)
    st = cluster(blocks=2, nodes=2)
    big_quota(st, "t")
    fill(st, ["b0n0", "b1n0"], team="run")
    gang = {"team": "t", "replicas": 2, "gpr": 8, "pack": "block", "max_blocks": 1}
    q = queue_of(
        spec("a1", **gang, submit=20, front=True), spec("b", team="t", gpr=8, submit=0), spec("a2", **gang, submit=10)
    )
    return st, q, pol, 100.0, "a1", "a2"


def _own_spares():
    """A gang restarting after a node failure places on the hot spare it kept; an equal gang
    without spares, decided just before it, is told ``hot_spare``."""
    pol = Policy(hot_spare_min_gpus=64, hot_spare_fraction=0.1, preemption=False, reservations=False)
    st = cluster(blocks=2, nodes=5)
    big_quota(st, "t")
    q = queue_of(spec("big", replicas=8, gpr=8, pack="block"))
    p = cycle(st, q, 100, pol)
    last = [n for n in st.node_ids() if not st.node_jobs(n) and n not in st.spares("big")]
    occupy(st, spec("other", team="t", gpr=8), last, started_at=100)
    fail_node(st, nodes_of(p, "big")[0], 200)
    assert st.spares("big")
    q = queue_of(
        spec("a-twin", replicas=8, gpr=8, pack="block", front=True),  # same submit, sorts first by id
        requeue_spec(spec("big", replicas=8, gpr=8, pack="block"), 200, front=True),
    )
    return st, q, pol, 300.0, "a-twin", "big"


def _own_reservation():
    """The owner of a head-of-line reservation is told ``reserved``; an equal gang without
    one, decided just before it, cannot reserve (one slot per type)."""
    pol = Policy(reserve_min_gpus=32, max_reservations_per_type=1)
    st = reservation_setup()
    gang = {"team": "t", "replicas": 4, "gpr": 8, "pack": "block", "max_blocks": 1}
    q = queue_of(spec("gang", **gang, submit=5, front=True))
    cycle(st, q, 100, pol)
    q.push(spec("a-twin", **gang, submit=5, front=True))  # sorts first by id
    return st, q, pol, 200.0, "a-twin", "gang"


def _victims_stopping():
    """A job whose victims are stopping is told ``preempting``; an equal job decided just
    before it finds nothing left to take (``capacity``)."""
    pol = Policy(
        reserve_min_gpus=16,
        reclaim_small_borrowed_after_s=None,
        claim_borrowed_reservations_after_s=None,
        reclaim_max_lost_s=None,  # the victim has run since NOW - 3,600: a dear reclaim
    )
    st = cluster(blocks=1, nodes=1)
    st.set_quota("me", "h100", 100, 100)
    st.set_quota("b", "h100", 0, 100)
    occupy(st, spec("v", team="b", gpr=8), ["b0n0"], borrowed=True)
    p = cycle(st, queue_of(spec("x", team="me", gpr=8, submit=NOW - 60)), NOW, pol)
    assert [v.victim for v in p.preemptions] == ["v"]
    twin = {"team": "me", "gpr": 8, "submit": NOW - 60, "front": True}
    q = queue_of(spec("a-twin", **twin), spec("x", **twin))  # the twin sorts first by id
    return st, q, pol, NOW + 10, "a-twin", "x"


def _restart_backoff():
    """A job preempted lately backs off before it starts borrowed; an equal job never
    preempted, decided after it, starts."""
    pol = Policy(borrowed_restart_backoff_s=600.0)
    st = _lent_to_b()
    q = queue_of(
        spec("backs-off", team="b", gpr=8, submit=0, preemption_times=(NOW - 100,), front=True),
        spec("fresh", team="b", gpr=8, submit=0),
    )
    return st, q, pol, NOW, "backs-off", "fresh"


def _restart_backoff_count():
    """Two jobs that both back off, after 1 and after 3 preemptions, are told their own count."""
    pol = Policy(borrowed_restart_backoff_s=600.0)
    st = _lent_to_b()
    q = queue_of(
        spec("once", team="b", gpr=8, submit=0, preemption_times=(NOW - 100,), front=True),
        spec("thrice", team="b", gpr=8, submit=0, preemption_times=(NOW - 300, NOW - 200, NOW - 100)),
    )
    return st, q, pol, NOW, "once", "thrice"


def _checkpoint_wait():
    """A job submitted within ``checkpoint_wait_s`` waits for its victims' checkpoints due in
    100 s; an equal job submitted before the wait preempts."""
    pol = Policy(checkpoint_wait_s=300.0, claim_borrowed_reservations_after_s=None, reclaim_small_borrowed_after_s=None)
    st = cluster(blocks=1, nodes=2)
    st.set_quota("b", "h100", 0, 100)
    for jid in fill(st, ["b0n0", "b0n1"], team="b", borrowed=True, started_at=NOW - 7200, preemptible=True):
        st.set_checkpoint(jid, NOW - 3500)
        st.set_checkpoint(jid, NOW - 1700)  # every 1,800 s: the next is due in 100 s
    st.set_quota("me", "h100", 16, 0)
    q = queue_of(
        spec("new", team="me", gpr=8, submit=NOW - 10, front=True), spec("old", team="me", gpr=8, submit=NOW - 400)
    )
    return st, q, pol, NOW, "new", "old"


def _prod_guard_hold():
    """``borrowed_guard_prod_hold_s``: the small-job guard holds a borrowed prod-batch job back
    only until it has waited that long; an equal job that has, decided after it, starts."""
    pol = Policy(borrowed_gang_guard=1.0, borrowed_guard_min_gpus=1, borrowed_guard_max_share=None)
    st = _lent_to_b()
    q = queue_of(
        spec("fresh", team="b", cls="prod-batch", gpr=8, submit=NOW - 10, front=True),
        spec("waited", team="b", cls="prod-batch", gpr=8, submit=NOW - 100),
    )
    return st, q, pol, NOW, "fresh", "waited"


def _outcome(p, jid: str):
    if p.placement(jid) is not None:
        return "placed"
    return (p.reason(jid), next(x.detail for x in p.pending if x.job_id == jid))


@pytest.mark.parametrize(
    "case",
    [
        _spares_yield_wait,
        _reclaim_small_wait,
        _claim_wait,
        _run_time,
        _run_time_near_the_start,
        _unsaved_borrow,
        _after_a_placement,
        _own_spares,
        _own_reservation,
        _victims_stopping,
        _restart_backoff,
        _restart_backoff_count,
        _gang_reclaim_settled,
        _checkpoint_wait,
        _prod_guard_hold,
    ],
)
def test_a_job_that_differs_where_the_decision_reads_is_decided_afresh(case) -> None:
    stt, q, pol, now, first, second = case()
    fresh = plan(stt, q, pol, now, dedupe=False)
    order = [x.job_id for x in fresh.pending]
    assert first in order, f"{first} should pend: {fresh}"
    assert _outcome(fresh, second) != _outcome(fresh, first)
    assert plan(stt, q, pol, now) == fresh


def test_the_plan_counts_the_decisions_taken_afresh() -> None:
    """Clones that pend for the same reason share one decision; without reuse each is decided."""
    st = cluster(blocks=1, nodes=1)
    big_quota(st, "t")
    fill(st, ["b0n0"], team="run")
    q = queue_of(*(spec(f"c{i}", team="t", gpr=8, submit=float(i)) for i in range(5)))
    fresh = plan(st, q, Policy(preemption=False), NOW, dedupe=False)
    repeated = plan(st, q, Policy(preemption=False), NOW)
    assert fresh.considered == repeated.considered == 5
    assert fresh.decided_afresh == 5
    assert repeated.decided_afresh == 1
    assert repeated == fresh  # the count is not part of a plan's value


def test_a_repeated_decision_spends_the_search_budget_a_fresh_one_would() -> None:
    """Two equal 2-node gangs with different run times (no reservation tells them apart) find
    no victims; a 1-node job of their team after them does, with the cycle's second search.
    Deciding the second gang afresh must not search again (its failed search is remembered
    for every job its run time does not set apart), or the last job finds the budget spent
    where the repeated decision left it one: the plans would differ."""
    st = cluster(blocks=1, nodes=3)
    big_quota(st, "t", "low", "serve")
    for n in ("b0n0", "b0n1"):  # half preemptible, half prod-serving: eligible GPUs, no clear node
        occupy(st, spec(f"low-{n}", team="low", cls="preemptible", gpr=4), {n: (0, 1, 2, 3)})
        occupy(st, spec(f"serve-{n}", team="serve", cls="prod-serving", gpr=4), {n: (4, 5, 6, 7)})
    occupy(st, spec("low-b0n2", team="low", cls="preemptible", gpr=8), ["b0n2"])
    q = queue_of(
        spec("gang-a", team="t", replicas=2, gpr=8, runtime=10 * HOUR, submit=1),
        spec("gang-b", team="t", replicas=2, gpr=8, runtime=5 * HOUR, submit=2),
        spec("one", team="t", gpr=8, submit=3),
    )
    pol = Policy(
        max_victim_searches_per_cycle=2, hot_spare_min_gpus=0, hot_spare_fraction=0.0, class_preemption_max_lost_s=None
    )
    fresh = plan(st, q, pol, NOW, dedupe=False)
    assert [(x.victim, x.beneficiary) for x in fresh.preemptions] == [("low-b0n2", "one")]
    assert fresh.reason("gang-a") is fresh.reason("gang-b") is not None
    repeated = plan(st, q, pol, NOW)
    assert repeated.decided_afresh == 2
    assert repeated == fresh
