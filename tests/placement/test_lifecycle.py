"""The job state table: every (state x event) pair is either an edge or a typed error."""

from __future__ import annotations

import itertools

import pytest

from placement.lifecycle import (
    ACTIVE,
    TERMINAL,
    TRANSITIONS,
    InvalidTransition,
    JobEvent,
    JobState,
    can_transition,
    transition,
)

S, E = JobState, JobEvent


@pytest.mark.parametrize("state,event", list(itertools.product(JobState, JobEvent)))
def test_every_state_event_pair(state: JobState, event: JobEvent) -> None:
    if (state, event) in TRANSITIONS:
        assert transition(state, event) is TRANSITIONS[(state, event)]
        assert transition(state.value, event.value) is TRANSITIONS[(state, event)]
        assert can_transition(state, event)
    else:
        with pytest.raises(InvalidTransition) as ei:
            transition(state, event)
        assert ei.value.state is state and ei.value.event is event
        assert not can_transition(state, event)


def test_terminal_states_have_no_way_out() -> None:
    for (state, _), _new in TRANSITIONS.items():
        assert state not in TERMINAL


def test_every_non_terminal_state_can_reach_a_terminal_state() -> None:
    for start in JobState:
        seen = {start}
        frontier = [start]
        while frontier:
            s = frontier.pop()
            for (a, _), b in TRANSITIONS.items():
                if a is s and b not in seen:
                    seen.add(b)
                    frontier.append(b)
        assert start in TERMINAL or seen & TERMINAL, start


def test_design_edges() -> None:
    # docs/design.md, Job lifecycle
    assert transition(S.QUEUED, E.ALLOCATE) is S.STARTING
    assert transition(S.STARTING, E.ALL_STARTED) is S.RUNNING
    assert transition(S.RUNNING, E.EXIT_OK) is S.SUCCEEDED
    assert transition(S.RUNNING, E.EXIT_FAIL) is S.FAILED
    assert transition(S.RUNNING, E.RUNTIME_EXPIRED) is S.TIMED_OUT
    assert transition(S.RUNNING, E.PREEMPT) is S.PREEMPTING
    assert transition(S.PREEMPTING, E.STOPPED) is S.QUEUED
    assert transition(S.STARTING, E.RANK_FAILED) is S.QUEUED
    assert transition(S.RUNNING, E.RANK_FAILED) is S.QUEUED
    assert transition(S.STARTING, E.START_TIMEOUT) is S.QUEUED
    assert transition(S.RUNNING, E.CANCEL) is S.CANCELLING
    assert transition(S.CANCELLING, E.STOPPED) is S.CANCELLED
    assert transition(S.QUEUED, E.CANCEL) is S.CANCELLED


def test_active_states_hold_gpus() -> None:
    assert ACTIVE == {S.STARTING, S.RUNNING, S.PREEMPTING, S.CANCELLING}
    assert not ACTIVE & TERMINAL


def test_unknown_names_raise_value_error() -> None:
    with pytest.raises(ValueError):
        transition("NOPE", "allocate")


def test_the_edges_the_store_writes_beyond_design() -> None:
    # a victim still starting is preempted; a cancel pending when the ranks are gone stands
    assert transition(S.STARTING, E.PREEMPT) is S.PREEMPTING
    assert transition(S.STARTING, E.EXIT_FAIL) is S.FAILED
    for state in (S.STARTING, S.RUNNING, S.PREEMPTING):
        assert transition(state, E.CANCEL_STOPPED) is S.CANCELLED


def test_allowed_change_is_the_table_projected_on_states() -> None:
    from placement.lifecycle import STATE_CHANGES, allowed_change

    assert allowed_change("QUEUED", "STARTING") and allowed_change(S.PREEMPTING, S.QUEUED)
    assert not allowed_change("QUEUED", "RUNNING")  # never without STARTING
    assert not allowed_change("SUCCEEDED", "QUEUED")  # terminal
    assert STATE_CHANGES == {(a, b) for (a, _), b in TRANSITIONS.items()}
