"""Silence after a takeover and the mass-silence guard (control.health.node_states, silence_guard):
pure tables and properties, no I/O."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from control.health.node_states import (
    Action,
    Event,
    HealthParams,
    NodeObservation,
    NodeState,
    decide,
    silence,
)
from control.health.silence_guard import (
    IN_SERVICE,
    SilenceCensus,
    count_silence,
    engage_at,
    hold,
    is_silent,
    judge,
    release_below,
)

P = HealthParams(suspect_after_s=30, down_after_s=90, takeover_quiet_s=30, mass_silence_fraction=0.2,
                 mass_silence_min_nodes=3)  # fmt: skip
SHORT_QUIET = HealthParams(suspect_after_s=30, down_after_s=90, takeover_quiet_s=5)
TOOK = 1000.0


def obs(state="ready", *, hb=None, took=TOOK, live=("x",)):
    return NodeObservation("n1", NodeState(state), hb, took, (), (), frozenset(live))


# ------------------------------------------------------------------ silence is judged from the takeover

# (params, last heartbeat, seconds after the takeover) -> the event (None: nothing to say yet)
SILENCE_FROM_TAKEOVER = [
    # not heard since the takeover: the whole suspect window counts from the takeover
    (P, None, 29.9, None),  # quiet period and suspect window both running
    (P, None, 30.0, Event.SILENT),  # both over
    (SHORT_QUIET, None, 6.0, None),  # quiet over, but the node has not had its 30 s to reach us
    (SHORT_QUIET, None, 29.9, None),
    (SHORT_QUIET, None, 30.0, Event.SILENT),
    (P, None, 89.9, Event.SILENT),
    (P, None, 90.0, Event.LOST),  # down_after_s, from the takeover
    # last heard by this leader before it took over (an earlier leadership): counts from the takeover
    (SHORT_QUIET, TOOK - 500.0, 10.0, None),
    (SHORT_QUIET, TOOK - 500.0, 30.0, Event.SILENT),
    (P, TOOK - 500.0, 89.0, Event.SILENT),
    # heard after the takeover: counts from its heartbeat
    (SHORT_QUIET, TOOK + 20.0, 49.9, Event.HEARTBEAT),
    (SHORT_QUIET, TOOK + 20.0, 50.0, Event.SILENT),
    (P, TOOK + 20.0, 110.0, Event.LOST),
]


@pytest.mark.parametrize("params,hb,after,event", SILENCE_FROM_TAKEOVER)
def test_a_node_is_suspect_only_after_it_had_the_whole_window_to_reach_the_new_leader(params, hb, after, event):
    d = decide(obs(hb=hb), params, TOOK + after)
    assert (d.event if d is not None else None) == event


@given(hb=st.one_of(st.none(), st.floats(0, 2000)), after=st.floats(0, 400), quiet=st.floats(0, 60))
def test_no_node_is_suspect_or_down_before_the_suspect_window_since_the_takeover(hb, after, quiet):
    params = HealthParams(suspect_after_s=30, down_after_s=90, takeover_quiet_s=quiet)
    o = obs(hb=hb if hb is None or hb <= TOOK + after else None)
    d = decide(o, params, TOOK + after)
    if d is not None and d.event in (Event.SILENT, Event.LOST):
        assert after >= 30 and silence(o, TOOK + after) >= 30 and after >= quiet
        assert (d.event == Event.LOST) == (silence(o, TOOK + after) >= 90)


# ------------------------------------------------------------------ the census


def test_the_census_counts_the_silent_nodes_in_service():
    now = TOOK + 40
    nodes = [
        (NodeState.READY, None),  # never heard since the takeover: silent (40 s)
        (NodeState.READY, TOOK + 35),  # heard 5 s ago
        (NodeState.SUSPECT, TOOK + 5),  # silent 35 s
        (NodeState.DRAINING, None),  # silent
        (NodeState.BURN_IN, TOOK + 39),
        (NodeState.DOWN, None),  # written off already: not counted at all
        (NodeState.CORDONED, None),
    ]
    assert count_silence(nodes, TOOK, P, now) == SilenceCensus(in_service=5, silent=3)
    assert count_silence(nodes, TOOK, P, TOOK + 20) == SilenceCensus(5, 0)  # the quiet period: nobody yet


@pytest.mark.parametrize("state", list(NodeState))
def test_in_service_means_expected_to_speak_and_not_written_off(state):
    assert (state in IN_SERVICE) == (state not in (NodeState.DOWN, NodeState.CORDONED))


def test_is_silent_agrees_with_the_node_decision():
    for hb, after in itertools.product([None, TOOK - 100, TOOK + 1, TOOK + 50], [10, 29, 31, 60, 95, 200]):
        now = TOOK + after
        if hb is not None and hb > now:
            continue
        d = decide(obs(hb=hb), P, now)
        assert is_silent(hb, TOOK, P, now) == (d is not None and d.event in (Event.SILENT, Event.LOST)), (hb, after)


# ------------------------------------------------------------------ engage and release

# (engaged before, in service, silent) -> (engaged after, changed). Fraction 0.2, at least 3 nodes.
GUARD = [
    (False, 3008, 0, False, False),
    (False, 3008, 601, False, False),  # 20% of 3008 is 601.6: 602 engage
    (False, 3008, 602, True, True),
    (False, 3008, 2588, True, True),  # the probe of issue 19
    (True, 3008, 602, True, False),
    (True, 3008, 301, True, False),  # held until under half the share (10%: 300.8 -> 301)
    (True, 3008, 300, False, True),
    (True, 3008, 0, False, True),
    (False, 6, 1, False, False),  # a small cluster's one dead node is a failure, not a partition
    (False, 6, 2, False, False),  # 33%, but fewer than 3 nodes
    (False, 6, 3, True, True),
    (True, 6, 3, True, False),
    (True, 6, 2, False, True),  # below the minimum: released
    (False, 10, 3, True, True),
    (False, 0, 0, False, False),
    (True, 0, 0, False, True),
]


@pytest.mark.parametrize("before,in_service,silent,after,changed", GUARD)
def test_the_guard_engages_and_releases(before, in_service, silent, after, changed):
    v = judge(before, SilenceCensus(in_service, silent), P)
    assert (v.engaged, v.changed) == (after, changed), v.why
    assert v.why


@given(n=st.integers(0, 5000), silent=st.integers(0, 5000), frac=st.floats(0.01, 1.0), least=st.integers(1, 50))
def test_the_guard_rule(n, silent, frac, least):
    silent = min(silent, n)
    params = HealthParams(mass_silence_fraction=frac, mass_silence_min_nodes=least)
    c = SilenceCensus(n, silent)
    engage = judge(False, c, params)
    assert engage.engaged == (n > 0 and silent >= least and silent >= frac * n - 1e-9)
    held = judge(True, c, params)
    # it never releases on the census that engaged it (no flapping), and releases only below half the share
    if engage.engaged:
        assert held.engaged
    if not held.engaged:
        assert silent < least or silent < frac / 2 * n + 1e-9
    assert release_below(n, params) <= engage_at(n, params)


# ------------------------------------------------------------------ holding decisions


@pytest.mark.parametrize("state", [NodeState.READY, NodeState.SUSPECT, NodeState.DRAINING, NodeState.BURN_IN])
def test_while_engaged_silence_marks_nothing_down_and_recovers_nothing(state):
    d = decide(obs(state.value), P, TOOK + 200)  # silent 200 s: lost
    assert d.event == Event.LOST
    held = hold(d, engaged=True)
    assert held.event == Event.SILENT and held.transition.to != NodeState.DOWN
    assert Action.RECOVER not in held.transition.actions and "mass-silence guard" in held.detail
    # suspect is fine: it only stops new placements
    assert held.transition.to == (NodeState.SUSPECT if state in (NodeState.READY, NodeState.SUSPECT) else state)
    assert hold(d, engaged=False) is d


def test_the_guard_does_not_hide_what_nodes_report_nor_undo_earlier_failures():
    from control.health.node_states import GpuView

    fatal = decide(
        NodeObservation("n1", NodeState.READY, TOOK + 99, TOOK, (GpuView(0, xids=(79,)),), (), frozenset({"x"})),
        P,
        TOOK + 100,
    )
    assert hold(fatal, engaged=True) is fatal and fatal.transition.to == NodeState.CORDONED
    already_down = decide(obs("down"), P, TOOK + 200)  # recovery re-tried for a node down before
    assert hold(already_down, engaged=True) is already_down
    assert hold(None, engaged=True) is None


@hsettings(max_examples=300)
@given(
    state=st.sampled_from(list(NodeState)),
    hb=st.one_of(st.none(), st.floats(0, 1400)),
    after=st.floats(0, 500),
    live=st.booleans(),
)
def test_while_engaged_no_node_in_service_goes_down_for_silence(state, hb, after, live):
    now = TOOK + after
    o = obs(state.value, hb=hb if hb is None or hb <= now else None, live=("x",) if live else ())
    d = hold(decide(o, P, now), engaged=True)
    if d is not None and state in IN_SERVICE:
        assert not (d.transition.to == NodeState.DOWN or Action.RECOVER in d.transition.actions)
