"""A cycle repeats an equal job's decision (``plan(dedupe=True)``, the default) only where
deciding the job afresh would give the same answer: the plans are equal, job by job.

Queues here are made of clones (equal in everything but id, submit time, attempt and
preemption history), the case the repetition is for, on random clusters that also run
spares, reservations and preemptions, and are planned over several cycles.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from placement import JobQueue, Pack, Policy, Topology, apply, plan, requeue_spec

from .strategies import CLASSES, HOUR, build, job_specs, populate, scenarios, unique
from .test_properties import BORROWED_APART, POLICIES, PROPS, SPARES_YIELD

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
    sc = data.draw(scenarios())
    stt = build(sc)
    populate(stt, unique(data.draw(st.lists(job_specs(sc, "r"), max_size=16))), [0.0, 1000.0, 3000.0])
    q = JobQueue(data.draw(clone_queues(sc, "q")))
    policy = data.draw(st.sampled_from([*POLICIES, SPARES_YIELD, BORROWED_APART, SHORT_WAITS]))
    now = data.draw(st.sampled_from([3000.0, 2 * HOUR, 6 * HOUR]))
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
