"""The job state table (docs/design.md, Job lifecycle), as data.

Stable names (the Postgres mirror and the workflows import these):

* ``JobState`` values: ``QUEUED``, ``STARTING``, ``RUNNING``, ``PREEMPTING``,
  ``CANCELLING``, ``SUCCEEDED``, ``FAILED``, ``CANCELLED``, ``TIMED_OUT``.
* ``JobEvent`` values: ``allocate``, ``all_started``, ``start_timeout``,
  ``rank_failed``, ``node_failed``, ``preempt``, ``stopped``, ``cancel``,
  ``exit_ok``, ``exit_fail``, ``runtime_expired``, ``reject``, ``cancel_stopped``.
* ``STATE_CHANGES`` / ``allowed_change(from, to)``: the (from, to) pairs of the table
  (``store.audit.write_job_event`` checks every state change against them).
* ``EDGES``: ``{(state, event): (new_state, why)}``; ``TRANSITIONS``: ``{(state, event):
  new_state}``; any pair not in them is invalid.
* ``transition(state, event) -> JobState`` raises ``InvalidTransition``.
* ``TERMINAL``: states with no way out; ``ACTIVE``: states that hold GPUs.

``rank_failed`` / ``node_failed`` / ``start_timeout`` are failed *attempts* (the
infrastructure or the gang start failed): the whole gang is released and the job
re-queued at the front of its class. ``exit_fail`` is the job's own failure (the
workflow decides retries before sending it): terminal.
"""

from __future__ import annotations

from enum import StrEnum


class JobState(StrEnum):
    QUEUED = "QUEUED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    PREEMPTING = "PREEMPTING"
    CANCELLING = "CANCELLING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    TIMED_OUT = "TIMED_OUT"

    def __str__(self) -> str:
        return self.value


class JobEvent(StrEnum):
    ALLOCATE = "allocate"  # placement committed a gang for the job
    ALL_STARTED = "all_started"  # every rank reported started
    START_TIMEOUT = "start_timeout"  # the gang did not fully start in time
    RANK_FAILED = "rank_failed"  # a rank died for an infrastructure reason (retryable attempt)
    NODE_FAILED = "node_failed"  # a node under the job went down / was cordoned
    PREEMPT = "preempt"  # placement chose the job as a victim
    STOPPED = "stopped"  # every rank is gone after a StopTask (grace ended or exited)
    CANCEL = "cancel"  # user cancel
    EXIT_OK = "exit_ok"  # the job exited 0 on every rank
    EXIT_FAIL = "exit_fail"  # the job failed by itself (no retries left)
    RUNTIME_EXPIRED = "runtime_expired"  # max_runtime timer fired
    REJECT = "reject"  # admission: the job can never run (invalid shape, unknown GPU type)
    CANCEL_STOPPED = "cancel_stopped"  # every rank is gone (or never started) and a cancel is pending
    EARLIER_SUCCESS = "earlier_success"  # an earlier attempt exited 0 on every rank; its reports came late

    def __str__(self) -> str:
        return self.value


S, E = JobState, JobEvent

# (state, event) -> (new state, why): every edge of the job state machine, with its reason
# (docs/design.md's job state table is generated from this).
EDGES: dict[tuple[JobState, JobEvent], tuple[JobState, str]] = {
    (S.QUEUED, E.ALLOCATE): (S.STARTING, "a gang placement committed; ranks are being started"),
    (S.QUEUED, E.CANCEL): (S.CANCELLED, "nothing runs yet: cancel is immediate"),
    (S.QUEUED, E.REJECT): (S.FAILED, "it can never be placed"),
    (S.QUEUED, E.EARLIER_SUCCESS): (
        S.SUCCEEDED,
        "the attempt recovered from a silent node had in fact finished: its exits arrived late",
    ),
    (S.STARTING, E.ALL_STARTED): (S.RUNNING, "every rank started"),
    (S.STARTING, E.START_TIMEOUT): (S.QUEUED, "gang not started in time: released, front of its class"),
    (S.STARTING, E.RANK_FAILED): (S.QUEUED, "failed attempt: whole gang released, front of its class"),
    (S.STARTING, E.NODE_FAILED): (S.QUEUED, "a node died during start: released, front of its class"),
    (S.STARTING, E.CANCEL): (S.CANCELLING, "stop the ranks already started"),
    (S.STARTING, E.CANCEL_STOPPED): (
        S.CANCELLED,
        "cancelled before the workflow started any rank (or a failed start stopped them)",
    ),
    (S.STARTING, E.PREEMPT): (S.PREEMPTING, "a victim still starting: its started ranks get StopTask"),
    (S.STARTING, E.EXIT_FAIL): (S.FAILED, "a rank failed by itself before the gang was up, no retries left"),
    (S.STARTING, E.EARLIER_SUCCESS): (S.SUCCEEDED, "an earlier attempt had finished (late exits): this one is stopped"),
    (S.RUNNING, E.EXIT_OK): (S.SUCCEEDED, "finished"),
    (S.RUNNING, E.EXIT_FAIL): (S.FAILED, "the job's own failure"),
    (S.RUNNING, E.RANK_FAILED): (S.QUEUED, "failed attempt: whole gang released, front of its class"),
    (S.RUNNING, E.NODE_FAILED): (S.QUEUED, "node lost: released, resumes from its last checkpoint"),
    (S.RUNNING, E.PREEMPT): (S.PREEMPTING, "StopTask with grace sent; it checkpoints"),
    (S.RUNNING, E.CANCEL): (S.CANCELLING, "StopTask sent"),
    (S.RUNNING, E.RUNTIME_EXPIRED): (S.TIMED_OUT, "max_runtime reached; ranks are stopped"),
    (S.RUNNING, E.CANCEL_STOPPED): (S.CANCELLED, "a failed attempt's ranks were stopped while a cancel waited"),
    (S.RUNNING, E.EARLIER_SUCCESS): (S.SUCCEEDED, "an earlier attempt had finished (late exits): this one is stopped"),
    (S.PREEMPTING, E.STOPPED): (S.QUEUED, "attempt + 1, original submit time, resumes from checkpoint"),
    (S.PREEMPTING, E.EXIT_OK): (S.SUCCEEDED, "it finished during its grace period"),
    (S.PREEMPTING, E.EXIT_FAIL): (S.QUEUED, "crashed while checkpointing: still re-queued (last good checkpoint)"),
    (S.PREEMPTING, E.NODE_FAILED): (S.QUEUED, "a node died during the grace period: released and re-queued"),
    (S.PREEMPTING, E.CANCEL): (S.CANCELLING, "user cancel wins over re-queue"),
    (S.PREEMPTING, E.RUNTIME_EXPIRED): (S.TIMED_OUT, "its time ran out while stopping"),
    (S.PREEMPTING, E.CANCEL_STOPPED): (S.CANCELLED, "stopped for the preemption while a cancel waited: no re-queue"),
    (S.PREEMPTING, E.EARLIER_SUCCESS): (S.SUCCEEDED, "an earlier attempt had finished (late exits)"),
    (S.CANCELLING, E.STOPPED): (S.CANCELLED, "every rank stopped"),
    (S.CANCELLING, E.EXIT_OK): (S.SUCCEEDED, "it finished before the stop landed"),
    (S.CANCELLING, E.EXIT_FAIL): (S.CANCELLED, "exited under SIGTERM: the cancel stands"),
    (S.CANCELLING, E.NODE_FAILED): (S.CANCELLED, "node gone: nothing left to stop there"),
    (S.CANCELLING, E.RUNTIME_EXPIRED): (S.CANCELLED, "the cancel was first"),
}

TRANSITIONS: dict[tuple[JobState, JobEvent], JobState] = {key: to for key, (to, _) in EDGES.items()}

TERMINAL: frozenset[JobState] = frozenset({S.SUCCEEDED, S.FAILED, S.CANCELLED, S.TIMED_OUT})

# (from, to) pairs of the table: what a store write may do to a job's state
STATE_CHANGES: frozenset[tuple[JobState, JobState]] = frozenset((a, b) for (a, _), b in TRANSITIONS.items())


def allowed_change(from_state: JobState | str, to_state: JobState | str) -> bool:
    """Whether some event moves a job from ``from_state`` to ``to_state``."""
    return (JobState(from_state), JobState(to_state)) in STATE_CHANGES


ACTIVE: frozenset[JobState] = frozenset({S.STARTING, S.RUNNING, S.PREEMPTING, S.CANCELLING})


class InvalidTransition(ValueError):
    """``(state, event)`` is not an edge of ``TRANSITIONS``."""

    def __init__(self, state: JobState, event: JobEvent) -> None:
        super().__init__(f"no transition from {state.value} on {event.value}")
        self.state = state
        self.event = event


def transition(state: JobState | str, event: JobEvent | str) -> JobState:
    """The state after ``event`` in ``state``; raises ``InvalidTransition`` for an invalid pair."""
    st = state if isinstance(state, JobState) else JobState(state)
    ev = event if isinstance(event, JobEvent) else JobEvent(event)
    try:
        return TRANSITIONS[(st, ev)]
    except KeyError:
        raise InvalidTransition(st, ev) from None


def can_transition(state: JobState | str, event: JobEvent | str) -> bool:
    try:
        transition(state, event)
    except InvalidTransition:
        return False
    return True
