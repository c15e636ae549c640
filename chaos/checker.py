"""The independent checker: invariants judged over what happened (``chaos.history``: Postgres,
Temporal's visibility, the agents' records) and what the run did (``chaos.timeline``).

It shares no code with the platform: its SQL is its own (``chaos.history``), and an
import-linter contract keeps it from ``store``, ``control``, ``api``, ``workflows`` and
``activities``. Each invariant is a pure function of a ``History`` and a ``RunRecord``; a
false one comes with counterexamples (small dicts, times in seconds since the run began).

A lease is *live* from its row's ``created_at`` to its ``released_at`` (both the
transaction's start time); a rank *runs* from ``supervisor.json``'s ``started_at`` to
``exit.json``'s ``finished_at`` (still running when no exit is on record).

``no_double_allocation``
    Over the whole lease history no (node, GPU) belonged to two leases live at overlapping
    times (overlap > ``slack_s``), every allocation row belongs to a live lease holding
    that GPU, and every live lease has its allocation rows.
``no_gpu_shared_by_ranks``
    The same on the agents' side: no (node, GPU) ran two ranks at once.
``no_leaked_lease``
    No lease stayed live for more than ``leak_bound_s`` at a stretch while its job had no
    running workflow (Temporal's visibility: the union of the job's runs, each from its
    start to its close); and at the end every live lease belongs to the current attempt
    of a job in STARTING, RUNNING, PREEMPTING or CANCELLING (none to a terminal job).
``no_lost_job``
    Every accepted submission (a 202 the workload got) is exactly one job (found by the
    submission's unique name and principal, and the one the 202 named); and every job
    ended (a terminal state) or is in flight with a running workflow at the end.
``no_rerun_of_finished_rank``
    When every rank of attempt N exited 0 (the agents' exit records), no rank of a later
    attempt that ran was placed (its lease row created: the platform's decision to run it
    again) after the control plane had that success on record: the earliest of the stored
    reports of every rank (``task_reports``, where that table exists), the acknowledgements
    of every rank's exit (``reported.json``: the control plane told the agent it has the
    report) and the job's ``succeeded`` event of attempt N. A later attempt placed before
    the success was on record, whose rank started after its predecessor finished, could not
    have known: it is reported (``reruns_before_success_on_record``, with when it was placed,
    started and the success recorded), not judged; the design stops it ("Late success").
``attempt_overlap_within_design``
    For each job and each two of its attempts, the time during which ranks of both ran
    (the intersection of the unions of their ranks' running intervals) is at most
    ``overlap_bound_s`` (the stack's unconfirmed-kill window, the fence grace and a
    margin). The largest overlap is reported whatever the verdict.
``no_stale_epoch_write``
    No epoch-bearing write (a lease row; an ``allocate``, ``preempt``, ``relabel`` or
    ``node_state`` audit row; a published reservation or hot spare) carries an epoch lower
    than one that had begun before it was written, and no ``release`` audit row was written
    by a leader role (``placement:<holder>``, ``health:<holder>``) of a holder another
    holder had deposed. When each epoch began: the leader rows the run saw (``acquired_at``,
    minus ``epoch_slack_s`` for the lock wait of the takeover's transaction), else the
    epoch's first write (a takeover commits before its first write, so that bound is exact).
``audit_complete``
    Every job's ``job_events`` form a chain (each change leaves the state the last one
    entered) ending in the job's state and attempt; every lease has its ``allocate`` (or
    ``restart_replica``) audit row naming its rank, node and GPUs; every released lease its
    ``release`` (or ``restart_replica``) row; every change to PREEMPTING a ``preempt`` row,
    to CANCELLING (or to CANCELLED from another state) a ``cancel`` row, to TIMED_OUT a
    ``timeout`` row, of that attempt; every node's state is the one its last audited change
    entered (``ready`` when none).
``no_outage_kill``
    No attempt with a running rank ended for a reason not its own (``requeued`` with cause
    ``failed`` and ``job_fault`` false), and no rank was FENCED or LOST, while only
    control-plane faults (leader stop or kill, Temporal or Postgres restart) were active or
    had ended within ``explain_window_s``: such an ending is explained only by a node fault
    (agent kill, Xid, hang) on one of the attempt's nodes within that window. Endings near
    no fault at all are reported as ``unexplained_kills``.
``no_duplicate_submission``
    Retries with one Idempotency-Key created one job: every 202 of a key named one job, at
    most one job carries the submission's name, and the stored response names that job.
``job_transitions_valid``
    Every state change in ``job_events`` is an edge of the job state table
    (``job_state_changes``).
``no_stuck_job``
    At the end every job not finished still moves: none has been STARTING, PREEMPTING or
    CANCELLING for more than ``stuck_bound_s`` (the state entered, from ``job_events``); no
    RUNNING job had every rank of its attempt ended (the agents' exit records), or no live
    lease, for more than that (an exit the control plane never acted on: a report dropped
    on the way); no job QUEUED for more than that has no pending reason (placement never
    judged it). Safety alone holds for a platform that stops doing anything.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from chaos.history import TERMINAL_STATES, History, JobRow, LeaseRow, RankRecord
from chaos.timeline import CONTROL_FAULTS, NODE_FAULTS, Fault, RunRecord

INVARIANTS = (
    "no_double_allocation",
    "no_leaked_lease",
    "no_lost_job",
    "no_rerun_of_finished_rank",
    "attempt_overlap_within_design",
    "no_stale_epoch_write",
    "audit_complete",
    "no_outage_kill",
    "no_duplicate_submission",
    "no_gpu_shared_by_ranks",
    "job_transitions_valid",
    "no_stuck_job",
)
MAX_EXAMPLES = 20
ACTIVE_STATES = frozenset({"STARTING", "RUNNING", "PREEMPTING", "CANCELLING"})
EPOCH_AUDIT_ACTIONS = frozenset({"allocate", "preempt", "relabel", "node_state"})
LEADER_ROLES = ("placement", "health")

Interval = tuple[float, float]


@dataclass(frozen=True)
class CheckParams:
    """Bounds the invariants are judged with (``chaos.run`` derives them from the stack's settings)."""

    leak_bound_s: float = 180.0
    overlap_bound_s: float = 960.0  # production: unconfirmed_kill_s 900 + fence grace 30 + margin
    explain_window_s: float = 120.0
    epoch_slack_s: float = 0.5
    slack_s: float = 0.0
    leader_ttl_s: float = 15.0
    stuck_bound_s: float = 300.0


@dataclass(frozen=True)
class Verdict:
    invariants: Mapping[str, bool]
    counterexamples: Mapping[str, list[dict[str, Any]]]
    measurements: Mapping[str, Any]
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return all(self.invariants.values())


class _Clock:
    """Times in counterexamples: seconds since the run began, to 0.1 s."""

    def __init__(self, t0: float) -> None:
        self.t0 = t0

    def __call__(self, t: float | None) -> float | None:
        return None if t is None else round(t - self.t0, 1)


# ---------------------------------------------------------------------------- intervals


def union(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def intersect(xs: Sequence[Interval], ys: Sequence[Interval]) -> list[Interval]:
    """Both unions (sorted, disjoint) -> their intersection."""
    out: list[Interval] = []
    i = j = 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(span: Interval, covered: Sequence[Interval]) -> list[Interval]:
    """``span`` minus a union (sorted, disjoint)."""
    out: list[Interval] = []
    start, end = span
    for a, b in covered:
        if b <= start:
            continue
        if a >= end:
            break
        if a > start:
            out.append((start, a))
        start = max(start, b)
    if start < end:
        out.append((start, end))
    return out


def length(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in intervals)


# ---------------------------------------------------------------------------- invariants


def _lease_end(lz: LeaseRow, now: float) -> float:
    return lz.released_at if lz.released_at is not None else now


def no_double_allocation(h: History, p: CheckParams, at: _Clock) -> list[dict[str, Any]]:
    bad: list[dict[str, Any]] = []
    by_gpu: dict[tuple[str, int], list[LeaseRow]] = defaultdict(list)
    for lz in h.leases:
        for g in lz.gpus:
            by_gpu[(lz.node_id, g)].append(lz)
    for (node, gpu), leases in sorted(by_gpu.items()):
        leases.sort(key=lambda x: (x.created_at, x.lease_id))
        for i, a in enumerate(leases):
            a_end = _lease_end(a, h.read_at)
            for b in leases[i + 1 :]:
                if b.created_at >= a_end:
                    break
                overlap = min(a_end, _lease_end(b, h.read_at)) - b.created_at
                if overlap > p.slack_s:
                    bad.append(
                        {
                            "node": node, "gpu": gpu, "leases": [a.lease_id, b.lease_id],
                            "live": [[at(a.created_at), at(a.released_at)], [at(b.created_at), at(b.released_at)]],
                            "overlap_s": round(overlap, 3),
                        }
                    )  # fmt: skip
    leases_by_id = {lz.lease_id: lz for lz in h.leases}
    held: set[tuple[str, int, str]] = set()
    for row in h.allocations:
        held.add((row.node_id, row.gpu, row.lease_id))
        owner = leases_by_id.get(row.lease_id)
        if owner is None or not owner.live or owner.node_id != row.node_id or row.gpu not in owner.gpus:
            bad.append(
                {"allocation": f"{row.node_id}/{row.gpu}", "lease": row.lease_id,
                 "why": "no live lease of this lease id holds this GPU"}
            )  # fmt: skip
    for lz in h.leases:
        if lz.live:
            missing = [g for g in lz.gpus if (lz.node_id, g, lz.lease_id) not in held]
            if missing:
                bad.append(
                    {"lease": lz.lease_id, "node": lz.node_id, "gpus": missing, "why": "live lease without its rows"}
                )
    return bad


def no_gpu_shared_by_ranks(h: History, p: CheckParams, at: _Clock) -> list[dict[str, Any]]:
    bad: list[dict[str, Any]] = []
    by_gpu: dict[tuple[str, int], list[tuple[Interval, RankRecord]]] = defaultdict(list)
    for r in h.ranks:
        span = r.running_interval(h.read_at)
        if span is not None:
            for g in r.gpus:
                by_gpu[(r.node_id, g)].append((span, r))
    for (node, gpu), runs in sorted(by_gpu.items()):
        runs.sort(key=lambda x: x[0])
        for i, (sa, a) in enumerate(runs):
            for sb, b in runs[i + 1 :]:
                if sb[0] >= sa[1]:
                    break
                overlap = min(sa[1], sb[1]) - sb[0]
                if overlap > p.slack_s and a.lease_id != b.lease_id:
                    bad.append(
                        {
                            "node": node, "gpu": gpu, "leases": [a.lease_id, b.lease_id],
                            "ran": [[at(sa[0]), at(sa[1])], [at(sb[0]), at(sb[1])]], "overlap_s": round(overlap, 3),
                        }
                    )  # fmt: skip
    return bad


def _workflow_spans(h: History, job_id: str) -> list[Interval]:
    assert h.workflows is not None
    return union(
        (r.start_time, r.close_time if r.close_time is not None else h.read_at) for r in h.workflows.get(job_id, ())
    )


def no_leaked_lease(h: History, p: CheckParams, at: _Clock, measured: dict[str, Any]) -> list[dict[str, Any]]:
    if h.workflows is None:
        return [{"why": "Temporal's visibility could not be read: leases cannot be judged"}]
    bad: list[dict[str, Any]] = []
    spans: dict[str, list[Interval]] = {}
    longest = 0.0
    for lz in h.leases:
        if lz.job_id not in spans:
            spans[lz.job_id] = _workflow_spans(h, lz.job_id)
        for a, b in subtract((lz.created_at, _lease_end(lz, h.read_at)), spans[lz.job_id]):
            longest = max(longest, b - a)
            if b - a > p.leak_bound_s:
                bad.append(
                    {"lease": lz.lease_id, "job": lz.job_id, "no_workflow": [at(a), at(b)], "seconds": round(b - a, 1),
                     "released": at(lz.released_at)}
                )  # fmt: skip
    for lz in h.leases:
        if not lz.live:
            continue
        job = h.jobs.get(lz.job_id)
        why = None
        if job is None:
            why = "no such job"
        elif job.state in TERMINAL_STATES:
            why = f"live lease of a {job.state} job"
        elif job.attempt != lz.attempt:
            why = f"live lease of attempt {lz.attempt}; the job is at attempt {job.attempt} ({job.state})"
        elif job.state not in ACTIVE_STATES:
            why = f"live lease of a {job.state} job"
        if why:
            bad.append({"lease": lz.lease_id, "job": lz.job_id, "at_end": why, "since": at(lz.created_at)})
    measured["lease_without_workflow_max_s"] = round(longest, 2)
    measured["lease_without_workflow_bound_s"] = p.leak_bound_s
    return bad


def _jobs_by_name(h: History) -> dict[tuple[str, str], list[JobRow]]:
    out: dict[tuple[str, str], list[JobRow]] = defaultdict(list)
    for job in h.jobs.values():
        if job.name:
            out[(job.submitted_by, job.name)].append(job)
    return out


def no_lost_job(h: History, rec: RunRecord, at: _Clock) -> list[dict[str, Any]]:
    bad: list[dict[str, Any]] = []
    by_name = _jobs_by_name(h)
    for s in rec.submissions:
        if not s.accepted:
            continue
        jobs = by_name.get((s.principal, s.name), [])
        if len(jobs) != 1:
            bad.append({"key": s.key, "name": s.name, "jobs": [j.job_id for j in jobs],
                        "why": "no job" if not jobs else f"{len(jobs)} jobs"})  # fmt: skip
        elif jobs[0].job_id not in s.job_ids:
            bad.append({"key": s.key, "name": s.name, "job": jobs[0].job_id, "accepted_as": list(s.job_ids),
                        "why": "the 202 named another job"})  # fmt: skip
    if h.workflows is None:
        bad.append({"why": "Temporal's visibility could not be read: jobs in flight cannot be judged"})
        return bad
    for job in sorted(h.jobs.values(), key=lambda j: j.submitted_at):
        if job.state in TERMINAL_STATES:
            continue
        runs = h.workflows.get(job.job_id, ())
        if not any(r.status == "RUNNING" for r in runs):
            last = runs[-1] if runs else None
            bad.append(
                {"job": job.job_id, "name": job.name, "state": job.state, "attempt": job.attempt,
                 "workflow": f"{last.status} (closed {at(last.close_time)})" if last else "never started",
                 "why": "in flight without a running workflow"}
            )  # fmt: skip
    return bad


def _latest_per_rank(records: Iterable[RankRecord]) -> dict[int, RankRecord]:
    out: dict[int, RankRecord] = {}
    for r in records:
        cur = out.get(r.rank)
        if cur is None or (r.started_at or 0.0) >= (cur.started_at or 0.0):
            out[r.rank] = r
    return out


def no_rerun_of_finished_rank(h: History, at: _Clock, measured: dict[str, Any]) -> list[dict[str, Any]]:
    bad: list[dict[str, Any]] = []
    unrecorded: list[dict[str, Any]] = []
    by_attempt: dict[tuple[str, int], list[RankRecord]] = defaultdict(list)
    for r in h.ranks:
        by_attempt[(r.job_id, r.attempt)].append(r)
    stored: dict[str, float] = {}
    for t in h.task_reports or ():
        if t.state == "EXITED" and t.exit_code == 0:
            stored[t.lease_id] = min(stored.get(t.lease_id, t.received_at), t.received_at)
    succeeded = {(e.job_id, e.attempt): e.at for e in h.events if e.event == "succeeded"}
    placed_at = {lz.lease_id: lz.created_at for lz in h.leases}
    for (job_id, attempt), records in sorted(by_attempt.items()):
        job = h.jobs.get(job_id)
        if job is None:
            continue  # not a job's rank (a burn-in)
        latest = _latest_per_rank(records)
        if set(latest) != set(range(job.replicas)):
            continue
        if not all(r.exit_state == "EXITED" and r.exit_code == 0 for r in latest.values()):
            continue
        finished = max(r.finished_at or 0.0 for r in latest.values())
        on_record: list[tuple[float, str]] = []
        if all(r.reported_at is not None for r in latest.values()):
            on_record.append((max(r.reported_at or 0.0 for r in latest.values()), "every exit acknowledged"))
        if h.task_reports is not None and all(r.lease_id in stored for r in latest.values()):
            on_record.append((max(stored[r.lease_id] for r in latest.values()), "every exit stored (task_reports)"))
        if (job_id, attempt) in succeeded:
            on_record.append((succeeded[(job_id, attempt)], "succeeded event"))
        record_at, how = min(on_record) if on_record else (None, "")
        for r in _later_attempts(by_attempt, job_id, attempt):
            if r.started_at is None:
                continue
            # the platform decided to run it again when it placed it (its lease row)
            placed = placed_at.get(r.lease_id, r.started_at)
            if record_at is not None and placed > record_at:
                bad.append(
                    {"job": job_id, "succeeded_attempt": attempt, "on_record": at(record_at), "how": how,
                     "rerun": r.lease_id, "rerun_placed": at(placed), "rerun_started": at(r.started_at)}
                )  # fmt: skip
            elif r.started_at > finished:
                unrecorded.append(
                    {"job": job_id, "succeeded_attempt": attempt, "finished": at(finished), "on_record": at(record_at),
                     "rerun": r.lease_id, "rerun_placed": at(placed), "rerun_started": at(r.started_at)}
                )  # fmt: skip
    measured["reruns_before_success_on_record"] = unrecorded[:MAX_EXAMPLES]
    return bad


def _later_attempts(
    by_attempt: Mapping[tuple[str, int], list[RankRecord]], job_id: str, attempt: int
) -> list[RankRecord]:
    return [r for (j, a), rs in sorted(by_attempt.items()) if j == job_id and a > attempt for r in rs]


def attempt_overlap_within_design(
    h: History, p: CheckParams, at: _Clock, measured: dict[str, Any]
) -> list[dict[str, Any]]:
    runs: dict[str, dict[int, list[Interval]]] = defaultdict(lambda: defaultdict(list))
    for r in h.ranks:
        span = r.running_interval(h.read_at)
        if span is not None and r.job_id in h.jobs:
            runs[r.job_id][r.attempt].append(span)
    overlaps: list[dict[str, Any]] = []
    for job_id, attempts in runs.items():
        unions = {a: union(spans) for a, spans in attempts.items()}
        keys = sorted(unions)
        for i, a in enumerate(keys):
            for b in keys[i + 1 :]:
                both = intersect(unions[a], unions[b])
                if both:
                    overlaps.append(
                        {"job": job_id, "attempts": [a, b], "overlap_s": round(length(both), 2),
                         "from": at(both[0][0]), "to": at(both[-1][1])}
                    )  # fmt: skip
    overlaps.sort(key=lambda o: -o["overlap_s"])
    measured["attempt_overlap_max_s"] = overlaps[0]["overlap_s"] if overlaps else 0.0
    measured["attempt_overlap_bound_s"] = p.overlap_bound_s
    measured["attempt_overlaps"] = overlaps[:5]
    return [o for o in overlaps if o["overlap_s"] > p.overlap_bound_s]


@dataclass(frozen=True)
class _EpochStart:
    at: float
    source: str  # "observed" (a leader row) or "first write"
    holder: str | None


def epoch_starts(h: History, rec: RunRecord) -> dict[int, _EpochStart]:
    """When each epoch began and who held it: the leader rows seen, else its first write."""
    starts: dict[int, _EpochStart] = {}
    for s in rec.leaders:
        starts[s.epoch] = _EpochStart(s.acquired_at, "observed", s.holder)
    for row in h.leader:
        starts.setdefault(row.epoch, _EpochStart(row.acquired_at, "observed", row.holder))
    first: dict[int, float] = {}
    holders: dict[int, str] = {}
    for kind, _, epoch, t, actor in _epoch_writes(h):
        first[epoch] = min(first.get(epoch, t), t)
        role, _, holder = (actor or "").partition(":")
        if kind == "allocate" and role == "placement" and holder:
            holders.setdefault(epoch, holder)
    for epoch, t in first.items():
        if epoch not in starts:
            starts[epoch] = _EpochStart(t, "first write", holders.get(epoch))
    return starts


def _epoch_writes(h: History) -> list[tuple[str, str, int, float, str | None]]:
    """(kind, subject, epoch, written at, actor) of every write that carries the writer's epoch."""
    out: list[tuple[str, str, int, float, str | None]] = [
        ("lease", lz.lease_id, lz.epoch, lz.created_at, None) for lz in h.leases
    ]
    for a in h.audit:
        epoch = a.detail.get("epoch")
        if a.action in EPOCH_AUDIT_ACTIONS and isinstance(epoch, int):
            out.append((a.action, a.subject, epoch, a.at, a.actor))
    out.extend((r.table, r.subject, r.epoch, r.at, None) for r in h.epoch_rows)
    return out


def no_stale_epoch_write(
    h: History, rec: RunRecord, p: CheckParams, at: _Clock, measured: dict[str, Any]
) -> list[dict[str, Any]]:
    starts = epoch_starts(h, rec)
    measured["epochs"] = [
        {"epoch": e, "began": at(s.at), "holder": s.holder, "source": s.source} for e, s in sorted(starts.items())
    ]

    def begun_before(t: float) -> list[int]:
        return [e for e, s in starts.items() if s.at + (p.epoch_slack_s if s.source == "observed" else 0.0) < t]

    bad: list[dict[str, Any]] = []
    for kind, subject, epoch, t, actor in _epoch_writes(h):
        newer = [e for e in begun_before(t) if e > epoch]
        if newer:
            e = max(newer)
            bad.append(
                {"write": kind, "subject": subject, "epoch": epoch, "written": at(t), "actor": actor,
                 "epoch_in_force": e, "since": at(starts[e].at)}
            )  # fmt: skip
    for a in h.audit:
        role, _, holder = a.actor.partition(":")
        if a.action != "release" or role not in LEADER_ROLES or not holder:
            continue
        begun = begun_before(a.at)
        if not begun:
            continue
        in_force = max(begun)
        leader = starts[in_force].holder
        if leader is not None and leader != holder:
            bad.append(
                {"write": "release", "subject": a.subject, "actor": a.actor, "written": at(a.at),
                 "epoch_in_force": in_force, "held_by": leader, "reason": a.reason}
            )  # fmt: skip
    return bad


def _release_names(a: Any) -> list[str]:
    d = a.detail
    names = [d["lease_id"]] if isinstance(d.get("lease_id"), str) else []
    names += [x.get("lease_id") for x in d.get("leases") or () if isinstance(x, dict) and x.get("lease_id")]
    return names


def audit_complete(h: History, at: _Clock) -> list[dict[str, Any]]:
    bad: list[dict[str, Any]] = []
    events: dict[str, list[Any]] = defaultdict(list)
    for e in h.events:
        events[e.job_id].append(e)
    for job in h.jobs.values():
        chain = [e for e in events.get(job.job_id, ()) if e.to_state is not None]
        if not chain or chain[0].from_state is not None or chain[0].to_state != "QUEUED":
            bad.append({"job": job.job_id, "why": "no 'submitted' event entering QUEUED first"})
            continue
        state = chain[0].to_state
        for e in chain[1:]:
            if e.from_state == e.to_state:
                continue
            if e.from_state != state:
                bad.append(
                    {"job": job.job_id, "event": e.event, "event_id": e.id, "from": e.from_state, "to": e.to_state,
                     "why": f"the last recorded change entered {state}"}
                )  # fmt: skip
            state = e.to_state
        if state != job.state:
            bad.append({"job": job.job_id, "state": job.state, "last_event_state": state,
                        "why": "the job's state is not the one its last event entered"})  # fmt: skip
        top = max(e.attempt for e in events[job.job_id])
        if top != job.attempt:
            bad.append({"job": job.job_id, "attempt": job.attempt, "last_event_attempt": top,
                        "why": "the job's attempt is not its events'"})  # fmt: skip
    allocated: set[tuple[str, int, int, str, tuple[int, ...]]] = set()
    replicas_restarted: set[str] = set()
    released: set[str] = set()
    audited: set[tuple[str, str, int]] = set()
    for a in h.audit:
        if a.action == "allocate":
            for pl in a.detail.get("placements") or ():
                allocated.add(
                    (a.subject, int(a.detail.get("attempt") or 0), int(pl.get("rank", -1)), str(pl.get("node")),
                     tuple(pl.get("gpus") or ()))
                )  # fmt: skip
        elif a.action == "restart_replica":
            replicas_restarted.add(str(a.detail.get("new_lease")))
            released.add(str(a.detail.get("old_lease")))
        elif a.action == "release":
            released.update(_release_names(a))
        if a.action in ("preempt", "cancel", "timeout") and a.detail.get("attempt") is not None:
            audited.add((a.action, a.subject, int(a.detail["attempt"])))
    for lz in h.leases:
        if lz.lease_id not in replicas_restarted and (
            (lz.job_id, lz.attempt, lz.rank, lz.node_id, lz.gpus) not in allocated
        ):
            bad.append({"lease": lz.lease_id, "created": at(lz.created_at), "why": "no allocate audit row names it"})
        if not lz.live and lz.lease_id not in released:
            bad.append({"lease": lz.lease_id, "released": at(lz.released_at), "reason": lz.release_reason,
                        "why": "no release audit row names it"})  # fmt: skip
    for e in h.events:
        need = None
        if e.to_state == "PREEMPTING" and e.from_state != "PREEMPTING":
            need = "preempt"
        elif e.to_state == "CANCELLING" and e.from_state != "CANCELLING":
            need = "cancel"
        elif e.to_state == "CANCELLED" and e.from_state not in (None, "CANCELLING", "CANCELLED"):
            need = "cancel"
        elif e.to_state == "TIMED_OUT" and e.from_state != "TIMED_OUT":
            need = "timeout"
        if need and (need, e.job_id, e.attempt) not in audited:
            bad.append({"job": e.job_id, "attempt": e.attempt, "event": e.event, "to": e.to_state,
                        "at": at(e.at), "why": f"no {need} audit row for this attempt"})  # fmt: skip
    last: dict[str, str] = {}
    for a in h.audit:
        if a.action == "node_state" and a.detail.get("to"):
            last[a.subject] = str(a.detail["to"])
        elif a.action == "node_return":
            last[a.subject] = str(a.detail.get("to") or "burn_in")
        elif a.action == "drain":
            last[a.subject] = "draining"
    for node, state in sorted(h.nodes.items()):
        if state != last.get(node, "ready"):
            bad.append({"node": node, "state": state, "last_audited": last.get(node),
                        "why": "the node's state is not the one its last audited change entered"})  # fmt: skip
    return bad


def _faults_near(
    faults: Iterable[Fault], t: float, window: float, kinds: frozenset[str], nodes: set[str] | None = None
) -> list[Fault]:
    return [
        f
        for f in faults
        if f.kind in kinds and f.started_at <= t <= f.ended_at + window and (nodes is None or set(f.nodes) & nodes)
    ]


def _endings(h: History) -> list[dict[str, Any]]:
    """Every end of an attempt or a rank that was not the job's doing (or a request)."""
    out: list[dict[str, Any]] = []
    for e in h.events:
        if e.event == "requeued" and e.detail.get("cause") == "failed" and not e.detail.get("job_fault"):
            prev = int(e.detail.get("previous_attempt") or e.attempt - 1)
            out.append({"job": e.job_id, "attempt": prev, "at": e.at, "how": f"attempt re-queued: {e.reason}"})
    for r in h.ranks:
        if r.job_id in h.jobs and r.started_at is not None and r.exit_state in ("FENCED", "LOST"):
            out.append(
                {"job": r.job_id, "attempt": r.attempt, "at": r.finished_at or h.read_at, "node": r.node_id,
                 "how": f"rank {r.rank} {r.exit_state}: {r.exit_reason}"}
            )  # fmt: skip
    return out


def no_outage_kill(
    h: History, rec: RunRecord, p: CheckParams, at: _Clock, measured: dict[str, Any]
) -> list[dict[str, Any]]:
    nodes_of: dict[tuple[str, int], set[str]] = defaultdict(set)
    for lz in h.leases:
        nodes_of[(lz.job_id, lz.attempt)].add(lz.node_id)
    ran = {(r.job_id, r.attempt) for r in h.ranks if r.started_at is not None}
    bad: dict[tuple[str, int], dict[str, Any]] = {}
    unexplained: dict[tuple[str, int], dict[str, Any]] = {}
    for end in _endings(h):
        key = (end["job"], end["attempt"])
        if key not in ran:
            continue  # nothing of it ran: a failed start, not a kill
        nodes = nodes_of.get(key, set()) | ({end["node"]} if "node" in end else set())
        if _faults_near(rec.faults, end["at"], p.explain_window_s, NODE_FAULTS, nodes):
            continue
        control = _faults_near(rec.faults, end["at"], p.explain_window_s, CONTROL_FAULTS)
        target = bad if control else unexplained
        entry = target.setdefault(
            key,
            {"job": key[0], "attempt": key[1], "nodes": sorted(nodes), "ended": []}
            | ({"faults": [f"{f.kind} at {at(f.started_at)}..{at(f.ended_at)}" for f in control]} if control else {}),
        )
        entry["ended"].append(f"{at(end['at'])}: {end['how']}"[:300])
    measured["unexplained_kills"] = list(unexplained.values())[:MAX_EXAMPLES]
    return list(bad.values())


def no_duplicate_submission(h: History, rec: RunRecord) -> list[dict[str, Any]]:
    bad: list[dict[str, Any]] = []
    by_name = _jobs_by_name(h)
    stored = {(r.principal, r.key): r for r in h.idempotency}
    for s in rec.submissions:
        jobs = [j.job_id for j in by_name.get((s.principal, s.name), [])]
        why = []
        if len(set(s.job_ids)) > 1:
            why.append(f"its 202s named {len(set(s.job_ids))} jobs")
        if len(jobs) > 1:
            why.append(f"{len(jobs)} jobs carry its name")
        row = stored.get((s.principal, s.key))
        if row is not None and row.job_id and jobs and row.job_id not in jobs:
            why.append("the stored response names another job")
        if why:
            bad.append({"key": s.key, "name": s.name, "sends": s.sends, "accepted_as": sorted(set(s.job_ids)),
                        "jobs": jobs, "why": "; ".join(why)})  # fmt: skip
    return bad


def job_transitions_valid(h: History, at: _Clock) -> list[dict[str, Any]]:
    return [
        {"job": e.job_id, "event": e.event, "from": e.from_state, "to": e.to_state, "at": at(e.at)}
        for e in h.events
        if e.from_state and e.to_state and e.from_state != e.to_state and (e.from_state, e.to_state) not in h.edges
    ]


def _entered(h: History, job: JobRow) -> float:
    """When the job entered the state it is in (its last event into it; its submission if none)."""
    times = [e.at for e in h.events if e.job_id == job.job_id and e.to_state == job.state]
    return max(times, default=job.submitted_at)


def no_stuck_job(h: History, p: CheckParams, at: _Clock) -> list[dict[str, Any]]:
    bad: list[dict[str, Any]] = []
    live: dict[tuple[str, int], list[LeaseRow]] = defaultdict(list)
    released: dict[tuple[str, int], float] = {}
    for lz in h.leases:
        key = (lz.job_id, lz.attempt)
        if lz.live:
            live[key].append(lz)
        elif lz.released_at is not None:
            released[key] = max(released.get(key, 0.0), lz.released_at)
    ranks = {r.lease_id: r for r in h.ranks}
    late = h.read_at - p.stuck_bound_s
    for job in sorted(h.jobs.values(), key=lambda j: j.job_id):
        if job.state in TERMINAL_STATES:
            continue
        since = _entered(h, job)
        key = (job.job_id, job.attempt)
        why = None
        if job.state in ("STARTING", "PREEMPTING", "CANCELLING") and since < late:
            why = f"{job.state} since {at(since)}"
        elif job.state == "RUNNING" and since < late:
            leases = live.get(key, [])
            records = [ranks.get(lz.lease_id) for lz in leases]
            ended = [r.finished_at for r in records if r is not None and r.finished_at is not None]
            if not leases and released.get(key, since) < late:
                why = f"RUNNING with no live lease since {at(released.get(key, since))}"
            elif leases and len(ended) == len(leases) and max(ended) < late:
                why = f"RUNNING, every rank of the attempt ended by {at(max(ended))}"
        elif job.state == "QUEUED" and since < late and not job.pending_reason:
            why = f"QUEUED since {at(since)} with no pending reason"
        if why:
            bad.append({"job": job.job_id, "name": job.name, "attempt": job.attempt, "why": why})
    return bad


# ---------------------------------------------------------------------------- measurements


def _pcts(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0, "p50": None, "max": None}
    xs = sorted(values)
    return {"n": len(xs), "p50": round(xs[len(xs) // 2], 2), "max": round(xs[-1], 2)}


def takeovers(h: History, rec: RunRecord, p: CheckParams, at: _Clock) -> list[dict[str, Any]]:
    """Each leader change the run saw: how long no one led, and how long after a fault."""
    out: list[dict[str, Any]] = []
    seen = sorted(rec.leaders, key=lambda s: s.epoch)
    for prev, nxt in itertools.pairwise(seen):
        last_renewal = prev.expires_at - p.leader_ttl_s
        faults = [
            f
            for f in rec.faults
            if f.kind in CONTROL_FAULTS and f.started_at <= nxt.acquired_at and nxt.acquired_at - f.started_at < 120
        ]
        fault = max(faults, key=lambda f: f.started_at) if faults else None
        out.append(
            {"epoch": nxt.epoch, "holder": nxt.holder, "from": prev.holder, "at": at(nxt.acquired_at),
             "leaderless_s": round(max(0.0, nxt.acquired_at - last_renewal), 2),
             "fault": fault.kind if fault else None,
             "since_fault_s": round(nxt.acquired_at - fault.started_at, 2) if fault else None}
        )  # fmt: skip
    return out


def _cause(faults: Sequence[Fault], t: float, nodes: set[str], window: float) -> Fault | None:
    """The fault an attempt that ended at ``t`` on ``nodes`` is put down to: the latest node
    fault on one of its nodes within ``window``, else the latest control-plane fault then
    (the same reading as ``no_outage_kill``), else none."""
    for kinds, on in ((NODE_FAULTS, nodes), (CONTROL_FAULTS, None)):
        near = _faults_near(faults, t, window, kinds, on)
        if near:
            return max(near, key=lambda f: f.started_at)
    return None


def failure_to_restart(h: History, rec: RunRecord, p: CheckParams, at: _Clock) -> list[dict[str, Any]]:
    """Per fault: the attempts it interrupted (each re-queued attempt is put down to one
    fault, ``_cause``) and how long from the fault until each job ran again."""
    nodes_of: dict[tuple[str, int], set[str]] = defaultdict(set)
    for lz in h.leases:
        nodes_of[(lz.job_id, lz.attempt)].add(lz.node_id)
    running: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for e in h.events:
        if e.event == "running":
            running[e.job_id].append((e.attempt, e.at))
    interrupted: dict[int, list[tuple[str, int, float]]] = defaultdict(list)
    for e in h.events:
        if e.event != "requeued" or e.detail.get("cause") != "failed" or e.detail.get("job_fault"):
            continue
        attempt = int(e.detail.get("previous_attempt") or e.attempt - 1)
        f = _cause(rec.faults, e.at, nodes_of.get((e.job_id, attempt), set()), p.explain_window_s)
        if f is not None:
            interrupted[id(f)].append((e.job_id, attempt, e.at))
    out = []
    for f in rec.faults:
        hit = 0
        if f.kind in NODE_FAULTS:
            hit = len(
                {
                    (lz.job_id, lz.attempt)
                    for lz in h.leases
                    if lz.node_id in f.nodes
                    and lz.created_at <= f.started_at
                    and (lz.released_at is None or lz.released_at > f.started_at)
                }
            )
        restarts = []
        for job_id, attempt, t in sorted(interrupted.get(id(f), ())):
            again = [x for a, x in running.get(job_id, ()) if a > attempt and x >= t]
            restarts.append(
                {"job": job_id, "attempt": attempt, "seconds": round(min(again) - f.started_at, 2) if again else None}
            )
        out.append(
            {"kind": f.kind, "at": at(f.started_at), "target": f.target, "running_on_target": hit,
             "interrupted": len(restarts), "restarts": restarts}
        )  # fmt: skip
    return out


# ---------------------------------------------------------------------------- the verdict


def check(h: History, rec: RunRecord, params: CheckParams | None = None) -> Verdict:
    p = params or CheckParams()
    at = _Clock(rec.started_at or min((j.submitted_at for j in h.jobs.values()), default=h.read_at))
    measured: dict[str, Any] = {}
    judges: dict[str, Callable[[], list[dict[str, Any]]]] = {
        "no_double_allocation": lambda: no_double_allocation(h, p, at),
        "no_leaked_lease": lambda: no_leaked_lease(h, p, at, measured),
        "no_lost_job": lambda: no_lost_job(h, rec, at),
        "no_rerun_of_finished_rank": lambda: no_rerun_of_finished_rank(h, at, measured),
        "attempt_overlap_within_design": lambda: attempt_overlap_within_design(h, p, at, measured),
        "no_stale_epoch_write": lambda: no_stale_epoch_write(h, rec, p, at, measured),
        "audit_complete": lambda: audit_complete(h, at),
        "no_outage_kill": lambda: no_outage_kill(h, rec, p, at, measured),
        "no_duplicate_submission": lambda: no_duplicate_submission(h, rec),
        "no_gpu_shared_by_ranks": lambda: no_gpu_shared_by_ranks(h, p, at),
        "job_transitions_valid": lambda: job_transitions_valid(h, at),
        "no_stuck_job": lambda: no_stuck_job(h, p, at),
    }
    invariants: dict[str, bool] = {}
    examples: dict[str, list[dict[str, Any]]] = {}
    counts: dict[str, int] = {}
    for name in INVARIANTS:
        found = judges[name]()
        invariants[name] = not found
        if found:
            examples[name] = found[:MAX_EXAMPLES]
            counts[name] = len(found)
    measured["violations"] = counts
    measured["takeovers"] = takeovers(h, rec, p, at)
    measured["takeover_s"] = _pcts(
        [t["since_fault_s"] for t in measured["takeovers"] if t["since_fault_s"] is not None]
    )
    measured["failure_to_restart"] = failure_to_restart(h, rec, p, at)
    measured["failure_to_restart_s"] = _pcts(
        [r["seconds"] for f in measured["failure_to_restart"] for r in f["restarts"] if r["seconds"] is not None]
    )
    measured["postgres_failovers"] = [
        {"at_s": at(f.started_at), **{k: v for k, v in f.detail.items() if k.endswith("_s") or "primary" in k}}
        for f in rec.faults
        if f.kind == "postgres_failover"
    ]
    notes = list(h.notes)
    if not rec.leaders:
        notes.append("no leader rows observed by the run: epochs begin at their first write (derived from audit rows)")
    return Verdict(invariants, examples, measured, tuple(notes))
