"""Property tests over random clusters, queues and event sequences.

Invariants (``placement.invariants``): no GPU in two placements; gangs
all-or-nothing; whole nodes for >= node-size jobs; max_blocks honoured; prod-serving
never a victim and, beyond its guarantee, only reclaiming borrowed allocations; no
victim inside its 30-minute protection or past its daily budget (unless borrowed);
no preemption for borrowing; guaranteed usage never above the guarantee; indexes
equal to a recomputation. And: the same inputs in any order give the same plan.
"""

from __future__ import annotations

import os
import random as _random
from dataclasses import replace

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from placement import (
    PRESETS,
    ClusterState,
    JobQueue,
    NodeHealth,
    PendingReason,
    Policy,
    apply,
    check_plan,
    check_state,
    fail_node,
    plan,
    requeue_spec,
)

from .strategies import HOUR, build, job_specs, populate, rebuild, scenarios, snapshot, unique

# GPUFLEET_PLACEMENT_EXAMPLES=2000 for a longer hunt; the default keeps the suite well under a minute
PROPS = settings(
    max_examples=int(os.environ.get("GPUFLEET_PLACEMENT_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
POLICIES = [
    Policy(reserve_min_gpus=16, hot_spare_min_gpus=16, hot_spare_fraction=0.2),
    Policy(),
    Policy(serving_borrows_idle=True, reserve_min_gpus=8, max_reservations_per_type=2),
    PRESETS["easy_backfill"],
    PRESETS["fifo_first_fit"],
]


def checked_cycle(stt, q, policy, now, twice: bool = False):
    p = plan(stt, q, policy, now)
    if twice:
        assert plan(stt, q, policy, now) == p  # plan left the state as it found it
    errs = check_plan(stt, p, q, policy, respect_topology=policy.topology)
    assert not errs, errs
    apply(stt, p, q, now)
    errs = check_state(stt, respect_topology=policy.topology)
    assert not errs, errs
    event(f"placements: {min(len(p.placements), 3)}+")
    event(f"preemptions: {bool(p.preemptions)}")
    event(f"reservations: {bool(p.reservations)}")
    event(f"relabels: {bool(p.relabels)}")
    event(f"replacement: {any(x.replacement for x in p.placements)}")
    event(f"backfill: {any(x.backfill for x in p.placements)}")
    event(f"spares: {any(x.spare_nodes for x in p.placements)}")
    return p


@PROPS
@given(data=st.data())
def test_plan_invariants_on_random_clusters_and_queues(data) -> None:
    sc = data.draw(scenarios())
    stt = build(sc)
    running = unique(data.draw(st.lists(job_specs(sc, "r"), max_size=20)))
    populate(stt, running, [0.0, 1000.0, 3000.0])
    queued = unique(data.draw(st.lists(job_specs(sc, "q"), max_size=14)))
    q = JobQueue(queued)
    policy = data.draw(st.sampled_from(POLICIES))
    now = data.draw(st.sampled_from([3000.0, 2 * HOUR, 6 * HOUR]))
    before = list(q)
    p = checked_cycle(stt, q, policy, now, twice=True)
    # every queued job (fewer than the lookahead here) is placed or has a reason
    for j in before:
        assert p.reason_for(j) is not PendingReason.LOOKAHEAD, j.job_id


def two_cycles_on_a_random_world(data, policy: Policy) -> None:
    """A random cluster and queue, planned twice at one time and once two minutes later,
    every invariant checked: the property test of a policy field that is off by default."""
    sc = data.draw(scenarios())
    stt = build(sc)
    populate(stt, unique(data.draw(st.lists(job_specs(sc, "r"), max_size=20))), [0.0, 1000.0, 3000.0])
    q = JobQueue(unique(data.draw(st.lists(job_specs(sc, "q"), max_size=14))))
    now = data.draw(st.sampled_from([3000.0, 2 * HOUR, 6 * HOUR]))
    checked_cycle(stt, q, policy, now, twice=True)
    checked_cycle(stt, q, policy, now + 120)


# Fields off by default get tests of their own, so that POLICIES, and with it the other
# tests' derandomized examples, stay.
# hot spares that yield to guaranteed work (Policy.spares_yield_after_s)
SPARES_YIELD = Policy(reserve_min_gpus=16, hot_spare_min_gpus=16, hot_spare_fraction=0.2, spares_yield_after_s=60.0)
# borrowed small jobs kept apart from guaranteed work (Policy.borrowed_apart)
BORROWED_APART = Policy(reserve_min_gpus=16, borrowed_apart=True)
# a job preempted lately waits before it starts borrowed (Policy.borrowed_restart_backoff_s)
RESTART_BACKOFF = Policy(reserve_min_gpus=16, borrowed_restart_backoff_s=600.0)
# guaranteed gangs that waited reclaim higher classes' borrowed gangs (Policy.reclaim_higher_borrowed_gangs)
HIGHER_GANGS = Policy(reserve_min_gpus=16, reclaim_higher_borrowed_gangs=True)
# guaranteed gangs' reserved nodes held against borrowed higher-class work (Policy.guaranteed_reservations_hold)
RESERVATIONS_HOLD = Policy(reserve_min_gpus=16, guaranteed_reservations_hold=True)
# evictable backfill only for jobs that save and of a node at most
# (Policy.evictable_backfill_saving_only, Policy.evictable_backfill_max_gpus)
EVICTABLE_LIMITS = Policy(reserve_min_gpus=16, evictable_backfill_saving_only=True, evictable_backfill_max_gpus=8)
# a guaranteed gang's drain counts other teams' borrowed work as gone and reclaims it
# (Policy.drain_reclaims_borrowed)
DRAIN_RECLAIMS = Policy(reserve_min_gpus=16, drain_reclaims_borrowed=True)
# reclaims that would lose much borrowed work wait (Policy.reclaim_max_lost_s): a low cap and
# a long hold, so most reclaims of a random world are held back, gangs' too (the default holds
# only jobs within one node: without the explicit False both policies would be that one)
RECLAIM_CAP = Policy(
    reserve_min_gpus=16, reclaim_max_lost_s=60.0, reclaim_hold_s=4 * HOUR, reclaim_hold_small_only=False
)
# ... held for jobs within one node only (Policy.reclaim_hold_small_only)
RECLAIM_CAP_SMALL = replace(RECLAIM_CAP, reclaim_hold_small_only=True)
# ... and for larger jobs that would stop borrowed work at least twice their size
# (Policy.reclaim_hold_gang_victims_ratio)
RECLAIM_CAP_RATIO = replace(RECLAIM_CAP_SMALL, reclaim_hold_gang_victims_ratio=2.0)
# new jobs wait for their victims' checkpoints (Policy.checkpoint_wait_s): long enough that
# most queued jobs of a random world may wait, with ``checkpoint_twice`` giving a pace
CHECKPOINT_WAIT = Policy(reserve_min_gpus=16, checkpoint_wait_s=4 * HOUR)
WAITS_FOR_CHECKPOINTS = "waits for its victims' checkpoints"


def checkpoint_twice(stt: ClusterState, now: float) -> None:
    """Running jobs that ran long enough checkpoint twice before ``now`` (their pace known,
    their next checkpoint due 1-4 minutes on); no draws, so the examples stay."""
    for i, rj in enumerate(sorted(stt.running_jobs(), key=lambda r: r.job_id)):
        every = 300.0 * (1 + i % 4)
        last = now - every + 60.0 * (1 + i % 4)
        if last - every > rj.started_at:
            stt.set_checkpoint(rj.job_id, last - every)
            stt.set_checkpoint(rj.job_id, last)


@PROPS
@given(data=st.data())
def test_plan_invariants_with_hot_spares_that_yield(data) -> None:
    two_cycles_on_a_random_world(data, SPARES_YIELD)


@PROPS
@given(data=st.data())
def test_plan_invariants_with_borrowed_work_kept_apart(data) -> None:
    two_cycles_on_a_random_world(data, BORROWED_APART)


@PROPS
@given(data=st.data())
def test_plan_invariants_with_borrowed_restarts_backing_off(data) -> None:
    two_cycles_on_a_random_world(data, RESTART_BACKOFF)


@PROPS
@given(data=st.data())
def test_plan_invariants_with_gangs_reclaiming_higher_classes_gangs(data) -> None:
    two_cycles_on_a_random_world(data, HIGHER_GANGS)


@PROPS
@given(data=st.data())
def test_plan_invariants_with_guaranteed_reservations_holding(data) -> None:
    two_cycles_on_a_random_world(data, RESERVATIONS_HOLD)


@PROPS
@given(data=st.data())
def test_plan_invariants_with_evictable_backfill_limited(data) -> None:
    two_cycles_on_a_random_world(data, EVICTABLE_LIMITS)


@PROPS
@given(data=st.data())
def test_plan_invariants_with_drains_reclaiming_borrowed_work(data) -> None:
    two_cycles_on_a_random_world(data, DRAIN_RECLAIMS)


@PROPS
@given(data=st.data())
def test_plan_invariants_with_dear_reclaims_held(data) -> None:
    two_cycles_on_a_random_world(data, data.draw(st.sampled_from([RECLAIM_CAP, RECLAIM_CAP_SMALL, RECLAIM_CAP_RATIO])))


@PROPS
@given(data=st.data())
def test_contended_clusters_with_guaranteed_reservations_holding(data) -> None:
    stt, q = contended_world(data)
    now = data.draw(st.sampled_from([3000.0, 4400.0, 6 * HOUR]))
    _preempt_then_restart(stt, q, RESERVATIONS_HOLD, now)


@PROPS
@given(data=st.data())
def test_contended_clusters_preempt_by_the_rules(data) -> None:
    """Full clusters of lower-class work, higher-class and reclaiming jobs queued."""
    stt, q = contended_world(data)
    policy = data.draw(st.sampled_from(POLICIES[:3]))
    now = data.draw(st.sampled_from([3000.0, 4400.0, 6 * HOUR]))
    _preempt_then_restart(stt, q, policy, now)


@PROPS
@given(data=st.data())
def test_contended_clusters_with_jobs_waiting_for_checkpoints(data) -> None:
    stt, q = contended_world(data)
    now = data.draw(st.sampled_from([3000.0, 4400.0, 6 * HOUR]))
    checkpoint_twice(stt, now)
    _preempt_then_restart(stt, q, CHECKPOINT_WAIT, now)


def _preempt_then_restart(stt: ClusterState, q: JobQueue, policy: Policy, now: float) -> None:
    p = checked_cycle(stt, q, policy, now, twice=True)
    event(f"waits for checkpoints: {any(pe.detail == WAITS_FOR_CHECKPOINTS for pe in p.pending)}")
    # victims stop; their beneficiaries then get placed or keep waiting, still by the rules
    for vid in stt.preempting():
        rj = stt.release(vid, now + 60)
        q.push(requeue_spec(rj.spec, now + 60, preempted=True))
    checked_cycle(stt, q, policy, now + 61)


def contended_world(data) -> tuple[ClusterState, JobQueue]:
    sc = data.draw(scenarios())
    stt = build(sc)
    low = [
        j
        for j in unique(data.draw(st.lists(job_specs(sc, "r"), min_size=4, max_size=24)))
        if j.priority.value in ("research", "preemptible") or data.draw(st.booleans())
    ]
    populate(stt, low, [0.0, 1000.0, 2500.0])
    populate(stt, unique(data.draw(st.lists(job_specs(sc, "fill"), max_size=12))), [2600.0])
    queued = [
        j
        for j in unique(data.draw(st.lists(job_specs(sc, "q"), min_size=1, max_size=12)))
        if j.priority.value != "preemptible"
    ]
    return stt, JobQueue(queued)


@PROPS
@given(data=st.data())
def test_event_sequences_keep_every_invariant(data) -> None:
    sc = data.draw(scenarios())
    stt = build(sc)
    policy = data.draw(st.sampled_from(POLICIES))
    populate(stt, unique(data.draw(st.lists(job_specs(sc, "r"), max_size=10))), [0.0, 2000.0])
    q = JobQueue(unique(data.draw(st.lists(job_specs(sc, "q"), max_size=8))))
    now = 2 * HOUR
    ids = 0
    for _ in range(data.draw(st.integers(1, 8))):
        action = data.draw(st.sampled_from(["submit", "end", "stop", "node", "quota", "ckpt", "tick", "tick"]))
        running = [rj.job_id for rj in stt.running_jobs()]
        if action == "submit":
            for j in data.draw(st.lists(job_specs(sc, f"s{ids}-", submit_max=now), max_size=4)):
                if j.job_id not in q and not stt.is_running(j.job_id):
                    q.push(j)
            ids += 1
        elif action == "end" and running:
            stt.release(data.draw(st.sampled_from(running)), now)
        elif action == "stop":
            # victims finish their grace period: released and re-queued
            for vid in stt.preempting():
                rj = stt.release(vid, now)
                q.push(requeue_spec(rj.spec, now, preempted=True))
        elif action == "node":
            nid = data.draw(st.sampled_from([n[0] for n in sc.nodes]))
            health = data.draw(st.sampled_from(list(NodeHealth)))
            if health is NodeHealth.READY:
                stt.set_node_health(nid, health)
            else:
                res = fail_node(stt, nid, now, health)
                for _jid in res.released:
                    pass  # the driver would re-queue; here they simply leave
        elif action == "quota":
            team, t, _, _ = data.draw(st.sampled_from(sc.quotas))
            stt.set_quota(
                team, t, data.draw(st.sampled_from([0, 8, 16, 64])), data.draw(st.sampled_from([0, 16, 1000]))
            )
        elif action == "ckpt" and running:
            stt.set_checkpoint(data.draw(st.sampled_from(running)), now)
        now += data.draw(st.sampled_from([1.0, 60.0, 1800.0, 4 * HOUR]))
        checked_cycle(stt, q, policy, now)


@PROPS
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_permuted_input_gives_the_same_plan(data, seed: int) -> None:
    sc = data.draw(scenarios())
    base = build(sc)
    policy = data.draw(st.sampled_from(POLICIES))
    populate(
        base, unique(data.draw(st.lists(job_specs(sc, "r"), max_size=12))), [0.0, 2500.0], Policy(reserve_min_gpus=8)
    )
    queued = unique(data.draw(st.lists(job_specs(sc, "q"), max_size=12)))
    now = 3 * HOUR
    # a first cycle leaves reservations, preemptions and spares in the state
    q0 = JobQueue(queued)
    apply(base, plan(base, q0, policy, now - 10), q0, now - 10)
    snap = snapshot(base)
    usage = [(team, t, base.usage(team, t, now)) for team in sc.teams for t in sc.types]
    remaining = list(q0)
    a = rebuild(snap, 0, usage, now)
    b = rebuild(snap, seed, usage, now)
    shuffled = list(remaining)
    _random.Random(seed).shuffle(shuffled)
    pa = plan(a, JobQueue(remaining), policy, now)
    pb = plan(b, JobQueue(shuffled), policy, now)
    assert pa == pb
    topo = policy.topology
    assert not check_state(a, strict_quota=False, respect_topology=topo)
    assert not check_state(b, strict_quota=False, respect_topology=topo)
