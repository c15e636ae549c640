"""The chaos checker's invariants as tables over small hand-built histories.

One clean history (a job submitted, placed, run and succeeded, every record in place) holds
every invariant. Each row of ``CASES`` changes it in one way: a violating change must make
its invariant false (with a counterexample), and a near miss (the closest thing that is
allowed) must keep it true, so a rule can neither be vacuous nor over-eager.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from chaos import checker, history, schedule
from chaos.checker import INVARIANTS, CheckParams, check
from chaos.history import (
    AllocationRow,
    AuditRow,
    History,
    JobEvent,
    JobRow,
    LeaderRow,
    LeaseRow,
    RankRecord,
    WorkflowRun,
)
from chaos.timeline import FAULT_KINDS, Fault, LeaderSample, RunRecord, Submission

EDGES = frozenset(
    {
        ("QUEUED", "STARTING"),
        ("STARTING", "RUNNING"),
        ("STARTING", "QUEUED"),
        ("RUNNING", "SUCCEEDED"),
        ("RUNNING", "QUEUED"),
        ("RUNNING", "FAILED"),
        ("RUNNING", "PREEMPTING"),
        ("PREEMPTING", "QUEUED"),
        ("QUEUED", "CANCELLED"),
    }
)
PARAMS = CheckParams(
    leak_bound_s=10.0, overlap_bound_s=3.0, explain_window_s=5.0, epoch_slack_s=0.5, stuck_bound_s=30.0
)


def _event(i: int, event: str, frm: str | None, to: str, at: float, attempt: int = 1, **detail: Any) -> JobEvent:
    return JobEvent(i, "j1", attempt, event, frm, to, None, detail, "test", at)


def _rank(**over: Any) -> RankRecord:
    base: dict[str, Any] = dict(
        node_id="n1", lease_id="j1.a1.r0", job_id="j1", attempt=1, rank=0, gpus=(0, 1), epoch=1,
        started_at=12.0, exit_state="EXITED", exit_code=0, exit_reason="", exit_by="supervisor",
        finished_at=25.0, reported_at=25.5, stop_reason=None,
    )  # fmt: skip
    return RankRecord(**(base | over))


def _lease(**over: Any) -> LeaseRow:
    base: dict[str, Any] = dict(
        lease_id="j1.a1.r0", job_id="j1", attempt=1, rank=0, node_id="n1", gpus=(0, 1), epoch=1, live=False,
        created_at=10.0, released_at=30.0, release_reason="finished",
    )  # fmt: skip
    return LeaseRow(**(base | over))


def _allocate(lease: LeaseRow, at: float, epoch: int = 1, actor: str = "placement:c1", i: int = 1) -> AuditRow:
    placement = {"rank": lease.rank, "node": lease.node_id, "gpus": list(lease.gpus)}
    return AuditRow(i, at, actor, "allocate", lease.job_id, None,
                    {"attempt": lease.attempt, "epoch": epoch, "placements": [placement]})  # fmt: skip


def _release(lease_id: str, at: float, actor: str = "control:c1", i: int = 2) -> AuditRow:
    return AuditRow(i, at, actor, "release", "j1", "finished", {"lease_id": lease_id})


def clean() -> tuple[History, RunRecord]:
    """One job, one attempt, everything recorded: every invariant holds."""
    lease = _lease()
    h = History(
        read_at=100.0,
        jobs={"j1": JobRow("j1", "chaos-0000-short", "alpha", "alpha-user", "research", 1, "SUCCEEDED", 1, 1.0, 30.0)},
        events=(
            _event(1, "submitted", None, "QUEUED", 1.0),
            _event(2, "allocated", "QUEUED", "STARTING", 10.0),
            _event(3, "running", "STARTING", "RUNNING", 12.5),
            _event(4, "succeeded", "RUNNING", "SUCCEEDED", 29.0),
        ),
        leases=(lease,),
        allocations=(),
        audit=(_allocate(lease, 10.0), _release(lease.lease_id, 30.0)),
        idempotency=(history.IdempotencyRow("alpha-user", "k1", "done", 202, "j1"),),
        leader=(LeaderRow("gpufleet", 1, "c1", 0.0, 200.0),),
        nodes={"n1": "ready"},
        edges=EDGES,
        task_reports=(history.TaskReport("j1.a1.r0", "j1", 1, 0, "EXITED", 0, 25.4),),
        workflows={"j1": (WorkflowRun("j1", "r1", "COMPLETED", 1.0, 31.0),)},
        ranks=(_rank(),),
    )
    sub = Submission("k1", "alpha-user", "alpha", "chaos-0000-short", "short", "research", 1, 2, 1.0,
                     statuses=(202,), job_ids=("j1",))  # fmt: skip
    rec = RunRecord(
        submissions=(sub,),
        leaders=(LeaderSample(1, "c1", 0.0, 200.0, 0.0, 100.0),),
        started_at=0.0,
        faults_ended_at=90.0,
    )
    return h, rec


Change = Callable[[History, RunRecord], tuple[History, RunRecord]]


def _h(**over: Any) -> Change:
    return lambda h, r: (dataclasses.replace(h, **over), r)


def _with(
    fn: Callable[[History, RunRecord], dict[str, Any]], rec: Callable[[RunRecord], RunRecord] | None = None
) -> Change:
    def change(h: History, r: RunRecord) -> tuple[History, RunRecord]:
        return dataclasses.replace(h, **fn(h, r)), (rec(r) if rec else r)

    return change


def _rec(**over: Any) -> Change:
    return lambda h, r: (h, dataclasses.replace(r, **over))


def _faults(*faults: Fault) -> Change:
    return _rec(faults=faults)


def _second_attempt(start: float, end: float | None, *, first_exit_code: int = 0) -> Change:
    """Attempt 2 of j1 ran on n2 from ``start`` to ``end`` (None: still running)."""

    def fn(h: History, r: RunRecord) -> dict[str, Any]:
        first = dataclasses.replace(h.ranks[0], exit_code=first_exit_code)
        second = _rank(node_id="n2", lease_id="j1.a2.r0", attempt=2, started_at=start, finished_at=end,
                       exit_state="EXITED" if end is not None else None, reported_at=None)  # fmt: skip
        return {"ranks": (first, second)}

    return _with(fn)


def _placed_second_attempt(placed: float) -> Change:
    """Attempt 2 of j1 placed (its lease row) at ``placed``, its rank running from 30 to 40."""

    def change(h: History, r: RunRecord) -> tuple[History, RunRecord]:
        h, r = _second_attempt(30.0, 40.0)(h, r)
        lease = _lease(lease_id="j1.a2.r0", attempt=2, node_id="n2", created_at=placed, released_at=40.0)
        return dataclasses.replace(h, leases=(*h.leases, lease)), r

    return change


def _running_at_end(rank_ended: float | None) -> Change:
    """j1 RUNNING at the end (read at 100) with its lease live, its rank ended at ``rank_ended``
    (None: still running) and no report of it acted on."""

    def fn(h: History, r: RunRecord) -> dict[str, Any]:
        job = dataclasses.replace(h.jobs["j1"], state="RUNNING", finished_at=None)
        return {
            "jobs": {"j1": job},
            "events": h.events[:3],
            "leases": (_lease(live=True, released_at=None, release_reason=None),),
            "audit": h.audit[:1],
            "task_reports": (),
            "workflows": {"j1": (WorkflowRun("j1", "r1", "RUNNING", 1.0, None),)},
            "ranks": (_rank(finished_at=rank_ended, exit_state="EXITED" if rank_ended else None, reported_at=None),),
        }

    return _with(fn)


def _in_state_at_end(state: str, since: float, pending_reason: str | None = None) -> Change:
    """j1 in ``state`` since ``since`` at the end (read at 100), its lease released."""

    def fn(h: History, r: RunRecord) -> dict[str, Any]:
        job = dataclasses.replace(h.jobs["j1"], state=state, finished_at=None, pending_reason=pending_reason)
        return {
            "jobs": {"j1": job},
            "events": (*h.events[:3], _event(4, "moved", "RUNNING", state, since)),
            "workflows": {"j1": (WorkflowRun("j1", "r1", "RUNNING", 1.0, None),)},
        }

    return _with(fn)


# (invariant, what the violating change does, violating change, near miss that is allowed)
CASES: list[tuple[str, str, Change, Change]] = [
    (
        "no_double_allocation",
        "a second lease holds GPU 1 of n1 while the first is live; the near miss starts as it ends",
        _with(
            lambda h, r: {
                "leases": (
                    *h.leases,
                    _lease(lease_id="j2.a1.r0", job_id="j2", gpus=(1,), created_at=20.0, released_at=40.0),
                )
            }
        ),
        _with(
            lambda h, r: {
                "leases": (
                    *h.leases,
                    _lease(lease_id="j2.a1.r0", job_id="j2", gpus=(1,), created_at=30.0, released_at=40.0),
                )
            }
        ),
    ),
    (
        "no_double_allocation",
        "an allocation row outlives its lease; the near miss is a live lease with its rows",
        _h(allocations=(AllocationRow("n1", 0, "j1.a1.r0"),)),
        _with(
            lambda h, r: {
                "leases": (_lease(live=True, released_at=None),),
                "allocations": (AllocationRow("n1", 0, "j1.a1.r0"), AllocationRow("n1", 1, "j1.a1.r0")),
            }
        ),
    ),
    (
        "no_gpu_shared_by_ranks",
        "another lease's rank runs on GPU 0 of n1 while j1's does; the near miss starts as it exits",
        _with(
            lambda h, r: {
                "ranks": (
                    *h.ranks,
                    _rank(lease_id="j2.a1.r0", job_id="j2", gpus=(0,), started_at=20.0, finished_at=28.0),
                )
            }
        ),
        _with(
            lambda h, r: {
                "ranks": (
                    *h.ranks,
                    _rank(lease_id="j2.a1.r0", job_id="j2", gpus=(0,), started_at=25.0, finished_at=28.0),
                )
            }
        ),
    ),
    (
        "no_leaked_lease",
        "the workflow closed at 15 and the lease lived on to 30 (15 s > 10 s); the near miss to 24",
        _h(workflows={"j1": (WorkflowRun("j1", "r1", "COMPLETED", 1.0, 15.0),)}),
        _h(workflows={"j1": (WorkflowRun("j1", "r1", "COMPLETED", 1.0, 21.0),)}),
    ),
    (
        "no_leaked_lease",
        "a live lease of a SUCCEEDED job at the end; the near miss is the job still RUNNING",
        _with(
            lambda h, r: {
                "leases": (_lease(live=True, released_at=None),),
                "allocations": (AllocationRow("n1", 0, "j1.a1.r0"), AllocationRow("n1", 1, "j1.a1.r0")),
                "workflows": {"j1": (WorkflowRun("j1", "r1", "RUNNING", 1.0, None),)},
            }
        ),
        _with(
            lambda h, r: {
                "leases": (_lease(live=True, released_at=None),),
                "allocations": (AllocationRow("n1", 0, "j1.a1.r0"), AllocationRow("n1", 1, "j1.a1.r0")),
                "jobs": {"j1": dataclasses.replace(h.jobs["j1"], state="RUNNING")},
                "workflows": {"j1": (WorkflowRun("j1", "r1", "RUNNING", 1.0, None),)},
            }
        ),
    ),
    (
        "no_lost_job",
        "an accepted submission has no job; the near miss was refused (503) and has none",
        _rec(
            submissions=(
                Submission(
                    "k2",
                    "alpha-user",
                    "alpha",
                    "chaos-0001-short",
                    "short",
                    "research",
                    1,
                    1,
                    2.0,
                    statuses=(202,),
                    job_ids=("j9",),
                ),
            )
        ),
        _rec(
            submissions=(
                Submission(
                    "k2", "alpha-user", "alpha", "chaos-0001-short", "short", "research", 1, 1, 2.0, statuses=(503, 0)
                ),
            )
        ),
    ),
    (
        "no_lost_job",
        "a RUNNING job whose workflow completed; the near miss has it running",
        _with(lambda h, r: {"jobs": {"j1": dataclasses.replace(h.jobs["j1"], state="RUNNING")}}),
        _with(
            lambda h, r: {
                "jobs": {"j1": dataclasses.replace(h.jobs["j1"], state="RUNNING")},
                "workflows": {"j1": (WorkflowRun("j1", "r1", "RUNNING", 1.0, None),)},
            }
        ),
    ),
    (
        "no_rerun_of_finished_rank",
        "attempt 1 exited 0 and was acknowledged at 25.5, attempt 2 started at 30; the near miss had attempt 1 exit 1",
        _second_attempt(30.0, 40.0),
        _second_attempt(30.0, 40.0, first_exit_code=1),
    ),
    (
        "no_rerun_of_finished_rank",
        "attempt 2 was placed at 27, after the success was stored at 25.4; the near miss was placed at 25.0 (in flight)",
        _placed_second_attempt(27.0),
        _placed_second_attempt(25.0),
    ),
    (
        "attempt_overlap_within_design",
        "attempt 2 ran from 20 while attempt 1 ran to 25 (5 s > 3 s); the near miss from 23",
        _second_attempt(20.0, 40.0, first_exit_code=1),
        _second_attempt(23.0, 40.0, first_exit_code=1),
    ),
    (
        "no_stale_epoch_write",
        "c2 took epoch 2 at 20, then a lease of epoch 1 was written at 22; the near miss within the slack",
        _with(
            lambda h, r: {
                "leases": (
                    *h.leases,
                    _lease(lease_id="j2.a1.r0", job_id="j2", node_id="n2", created_at=22.0, released_at=23.0),
                )
            },
            lambda r: dataclasses.replace(r, leaders=(*r.leaders, LeaderSample(2, "c2", 20.0, 99.0, 20.1, 90.0))),
        ),
        _with(
            lambda h, r: {
                "leases": (
                    *h.leases,
                    _lease(lease_id="j2.a1.r0", job_id="j2", node_id="n2", created_at=20.3, released_at=23.0),
                )
            },
            lambda r: dataclasses.replace(r, leaders=(*r.leaders, LeaderSample(2, "c2", 20.0, 99.0, 20.1, 90.0))),
        ),
    ),
    (
        "no_stale_epoch_write",
        "deposed c1's placement role released a lease after c2 led; the near miss is c2's own release",
        _with(
            lambda h, r: {"audit": (*h.audit, _release("j1.a1.r0", 40.0, actor="placement:c1", i=3))},
            lambda r: dataclasses.replace(r, leaders=(*r.leaders, LeaderSample(2, "c2", 35.0, 99.0, 35.1, 90.0))),
        ),
        _with(
            lambda h, r: {"audit": (*h.audit, _release("j1.a1.r0", 40.0, actor="placement:c2", i=3))},
            lambda r: dataclasses.replace(r, leaders=(*r.leaders, LeaderSample(2, "c2", 35.0, 99.0, 35.1, 90.0))),
        ),
    ),
    (
        "audit_complete",
        "the lease has no allocate audit row; the near miss names it in a restart_replica row",
        _with(lambda h, r: {"audit": h.audit[1:]}),
        _with(
            lambda h, r: {
                "audit": (
                    AuditRow(
                        1,
                        10.0,
                        "control:c1",
                        "restart_replica",
                        "j1",
                        None,
                        {"new_lease": "j1.a1.r0", "old_lease": "j1.a1.r9"},
                    ),
                    h.audit[1],
                )
            }
        ),
    ),
    (
        "audit_complete",
        "the job is SUCCEEDED but its last event entered RUNNING; the near miss has the event",
        _with(lambda h, r: {"events": h.events[:3]}),
        _with(lambda h, r: {"events": (*h.events[:3], _event(9, "succeeded", "RUNNING", "SUCCEEDED", 29.0))}),
    ),
    (
        "audit_complete",
        "a node is draining with no audited change; the near miss has its drain row",
        _h(nodes={"n1": "draining"}),
        _with(
            lambda h, r: {
                "nodes": {"n1": "draining"},
                "audit": (*h.audit, AuditRow(5, 50.0, "admin", "drain", "n1", "maintenance", {})),
            }
        ),
    ),
    (
        "no_outage_kill",
        "j1's rank was FENCED at 25 after a leader kill at 20-22 and no node fault; the near miss had its agent killed",
        _with(
            lambda h, r: {"ranks": (_rank(exit_state="FENCED", exit_code=None),)},
            lambda r: dataclasses.replace(r, faults=(Fault("leader_kill", 20.0, 22.0, "c1"),)),
        ),
        _with(
            lambda h, r: {"ranks": (_rank(exit_state="FENCED", exit_code=None),)},
            lambda r: dataclasses.replace(
                r, faults=(Fault("leader_kill", 20.0, 22.0, "c1"), Fault("agent_kill", 21.0, 23.0, "a1", ("n1",)))
            ),
        ),
    ),
    (
        "no_outage_kill",
        "an attempt re-queued (not its fault) during a Temporal restart; the near miss was the job's own fault",
        _with(
            lambda h, r: {
                "events": (
                    *h.events,
                    _event(
                        5,
                        "requeued",
                        "RUNNING",
                        "QUEUED",
                        26.0,
                        attempt=2,
                        cause="failed",
                        job_fault=False,
                        previous_attempt=1,
                    ),
                )
            },
            lambda r: dataclasses.replace(r, faults=(Fault("temporal_restart", 24.0, 27.0, "temporal"),)),
        ),
        _with(
            lambda h, r: {
                "events": (
                    *h.events,
                    _event(
                        5,
                        "requeued",
                        "RUNNING",
                        "QUEUED",
                        26.0,
                        attempt=2,
                        cause="failed",
                        job_fault=True,
                        previous_attempt=1,
                    ),
                )
            },
            lambda r: dataclasses.replace(r, faults=(Fault("temporal_restart", 24.0, 27.0, "temporal"),)),
        ),
    ),
    (
        "no_duplicate_submission",
        "two jobs carry one submission's name; the near miss is one job answered twice",
        _with(
            lambda h, r: {"jobs": {**h.jobs, "j2": dataclasses.replace(h.jobs["j1"], job_id="j2")}},
            lambda r: dataclasses.replace(
                r, submissions=(dataclasses.replace(r.submissions[0], statuses=(202, 202), job_ids=("j1", "j2")),)
            ),
        ),
        _rec(
            submissions=(
                Submission(
                    "k1",
                    "alpha-user",
                    "alpha",
                    "chaos-0000-short",
                    "short",
                    "research",
                    1,
                    2,
                    1.0,
                    statuses=(0, 202, 202),
                    job_ids=("j1", "j1"),
                ),
            )
        ),
    ),
    (
        "no_stuck_job",
        "a RUNNING job's only rank ended 75 s before the end (its exit never acted on); the near miss ended 25 s before",
        _running_at_end(25.0),
        _running_at_end(75.0),
    ),
    (
        "no_stuck_job",
        "a RUNNING job's rank still runs is not stuck: the near miss; a job PREEMPTING for 80 s is",
        _in_state_at_end("PREEMPTING", 20.0),
        _running_at_end(None),
    ),
    (
        "no_stuck_job",
        "a RUNNING job whose only lease was released 70 s before the end; the near miss's lease is live",
        _in_state_at_end("RUNNING", 12.5),
        _running_at_end(None),
    ),
    (
        "no_stuck_job",
        "a job STARTING for 90 s; the near miss entered STARTING 20 s before the end",
        _in_state_at_end("STARTING", 10.0),
        _in_state_at_end("STARTING", 80.0),
    ),
    (
        "no_stuck_job",
        "a job QUEUED for 90 s with no pending reason; the near miss has one",
        _in_state_at_end("QUEUED", 10.0),
        _in_state_at_end("QUEUED", 10.0, pending_reason="capacity"),
    ),
    (
        "job_transitions_valid",
        "a change QUEUED -> SUCCEEDED, no edge of the table; the near miss goes through the edges",
        _with(lambda h, r: {"events": (h.events[0], _event(2, "succeeded", "QUEUED", "SUCCEEDED", 29.0))}),
        _h(),
    ),
]


def test_the_clean_history_holds_every_invariant() -> None:
    h, rec = clean()
    v = check(h, rec, PARAMS)
    assert v.ok, v.counterexamples
    assert list(v.invariants) == list(INVARIANTS)
    assert set(checker.INVARIANTS) >= {
        "no_double_allocation", "no_leaked_lease", "no_lost_job", "no_rerun_of_finished_rank",
        "attempt_overlap_within_design", "no_stale_epoch_write", "audit_complete", "no_outage_kill",
        "no_duplicate_submission",
    }  # fmt: skip


@pytest.mark.parametrize(("name", "what", "bad", "near"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_each_invariant_catches_its_violation_and_allows_the_near_miss(
    name: str, what: str, bad: Change, near: Change
) -> None:
    h, rec = bad(*clean())
    v = check(h, rec, PARAMS)
    assert v.invariants[name] is False, f"{name} missed: {what}"
    assert v.counterexamples[name], "a false invariant comes with its counterexamples"
    assert not v.ok
    h, rec = near(*clean())
    v = check(h, rec, PARAMS)
    assert v.invariants[name] is True, f"{name} refused the near miss ({what}): {v.counterexamples.get(name)}"


def test_counterexamples_give_times_since_the_run_began() -> None:
    h, rec = _second_attempt(30.0, 40.0)(*clean())
    rec = dataclasses.replace(rec, started_at=5.0)
    (example,) = check(h, rec, PARAMS).counterexamples["no_rerun_of_finished_rank"]
    assert example["rerun_started"] == 25.0 and example["on_record"] == 20.4  # the stored report, 25.4 - 5


def test_a_rerun_before_the_success_was_on_record_is_measured_not_judged() -> None:
    """Nothing had the success on record yet (no report stored or acknowledged, no event):
    the control plane could not know; reported, not a violation."""

    def unrecorded(h: History, r: RunRecord) -> tuple[History, RunRecord]:
        h, r = _second_attempt(26.0, 40.0)(h, r)
        first = dataclasses.replace(h.ranks[0], reported_at=None)
        return dataclasses.replace(h, ranks=(first, h.ranks[1]), task_reports=(), events=h.events[:3]), r

    v = check(*unrecorded(*clean()), PARAMS)
    assert v.invariants["no_rerun_of_finished_rank"]
    assert v.measurements["reruns_before_success_on_record"][0]["rerun"] == "j1.a2.r0"


def test_an_unexplained_kill_is_measured_when_no_fault_was_near() -> None:
    h, rec = _with(lambda h, r: {"ranks": (_rank(exit_state="LOST", exit_code=None),)})(*clean())
    v = check(h, rec, PARAMS)
    assert v.invariants["no_outage_kill"]
    assert v.measurements["unexplained_kills"][0]["job"] == "j1"


def test_unreadable_visibility_fails_the_invariants_that_need_it() -> None:
    h, rec = clean()
    v = check(dataclasses.replace(h, workflows=None), rec, PARAMS)
    assert not v.invariants["no_leaked_lease"] and not v.invariants["no_lost_job"]


def test_interval_helpers() -> None:
    assert checker.union([(5, 6), (1, 3), (2, 4)]) == [(1, 4), (5, 6)]
    assert checker.intersect([(0, 4), (6, 9)], [(3, 7)]) == [(3, 4), (6, 7)]
    assert checker.subtract((0, 10), [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]
    assert checker.length([(0, 1.5), (2, 3)]) == 2.5


def test_the_agent_record_names_are_the_agents() -> None:
    from worker_agent import statefiles

    for name in ("TASK", "SUPERVISOR", "EXIT", "REPORTED", "STOP"):
        assert getattr(history, name) == getattr(statefiles, name)


def test_the_run_record_round_trips_through_json() -> None:
    _, rec = clean()
    rec = dataclasses.replace(rec, faults=(Fault("agent_kill", 1.0, 2.0, "a1", ("n1", "n2"), {"down_s": 1.0}),))
    assert RunRecord.from_json(rec.to_json()) == rec


@pytest.mark.parametrize("seed", [1, 2, 3, 17])
def test_a_run_of_three_minutes_plans_every_fault_kind(seed: int) -> None:
    plan = schedule.plan(seed, 180.0)
    assert {p.kind for p in plan} == set(FAULT_KINDS)
    assert plan == schedule.plan(seed, 180.0), "one seed, one schedule"
    assert all(20.0 <= p.at_s <= 170.0 for p in plan)
    assert [p.at_s for p in plan] == sorted(p.at_s for p in plan)
    assert len(schedule.plan(seed, 3600.0)) <= 40, "bounded in count"
