"""The mass-silence guard (docs/design.md, Health). Pure: no I/O, no clock (``now`` is passed in).

When a large share of the nodes in service go silent together, the likely cause is the control
plane or the network between it and the nodes (a frozen or partitioned leader, a takeover the
agents have not caught up with yet, a switch), not hundreds of nodes failing in the same
minute. Marking them down would restart every gang on them, all at once, for nothing. So, like
the Kubernetes node lifecycle controller in a fully disrupted zone, the leader holds while the
guard is engaged: no node is marked down and no job is recovered *because of silence*. A silent
node may still become suspect (that only stops new placements on it), and what nodes report
themselves (fatal faults, hangs) is acted on as usual.

    c = count_silence(nodes, took_over_at, params, now)   # SilenceCensus(in_service, silent)
    v = judge(engaged, c, params)                          # GuardVerdict(engaged, changed, why)
    d = hold(decision, engaged=v.engaged)                  # a silence-made LOST becomes SILENT

The rule (``HealthParams``):

* a node is *in service* when it is expected to speak and still counts: ready, suspect,
  draining or burn_in (down and cordoned nodes are written off already);
* it is *silent* when this leader has not heard it for ``suspect_after_s`` (counted from the
  takeover at the earliest, ``node_states.silence``) and the takeover quiet period is over;
* the guard engages when at least ``mass_silence_min_nodes`` nodes and at least
  ``mass_silence_fraction`` of the nodes in service are silent, and releases when fewer than
  ``mass_silence_min_nodes``, or fewer than half that share, are (the gap keeps it from
  flapping while agents come back). Once released, a node still silent is judged as always:
  its silence counts from its own last heartbeat, so one that is really gone goes down at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from control.health.node_states import Decision, Event, HealthParams, NodeState, silent_since, transition

IN_SERVICE = frozenset({NodeState.READY, NodeState.SUSPECT, NodeState.DRAINING, NodeState.BURN_IN})


@dataclass(frozen=True)
class SilenceCensus:
    in_service: int  # nodes expected to speak (IN_SERVICE)
    silent: int  # of them, silent for the whole suspect window

    @property
    def fraction(self) -> float:
        return self.silent / self.in_service if self.in_service else 0.0


@dataclass(frozen=True)
class GuardVerdict:
    engaged: bool
    changed: bool  # engaged or released by this census
    why: str


def is_silent(last_heartbeat_at: float | None, took_over_at: float, params: HealthParams, now: float) -> bool:
    """Not heard for ``suspect_after_s`` by this leader (the same silence ``node_states`` judges)."""
    if now - took_over_at < params.takeover_quiet_s:
        return False
    return now - silent_since(last_heartbeat_at, took_over_at) >= params.suspect_after_s


def count_silence(
    nodes: Iterable[tuple[NodeState, float | None]], took_over_at: float, params: HealthParams, now: float
) -> SilenceCensus:
    """Count ``(state, last heartbeat)`` pairs: the nodes in service, and the silent ones among them."""
    in_service = silent = 0
    for state, last in nodes:
        if state in IN_SERVICE:
            in_service += 1
            if is_silent(last, took_over_at, params, now):
                silent += 1
    return SilenceCensus(in_service, silent)


def engage_at(in_service: int, params: HealthParams) -> int:
    """The fewest silent nodes that engage the guard."""
    return max(params.mass_silence_min_nodes, math.ceil(params.mass_silence_fraction * in_service))


def release_below(in_service: int, params: HealthParams) -> int:
    """While engaged, the guard holds as long as at least this many nodes are silent."""
    return max(params.mass_silence_min_nodes, math.ceil(params.mass_silence_fraction / 2 * in_service))


def judge(engaged: bool, census: SilenceCensus, params: HealthParams) -> GuardVerdict:
    """Whether the guard holds after ``census`` (``engaged``: whether it held before)."""
    n, silent = census.in_service, census.silent
    share = f"{silent} of {n} nodes in service silent ({census.fraction:.0%})"
    if not engaged:
        if n and silent >= engage_at(n, params):
            return GuardVerdict(
                True,
                True,
                f"{share}, at least {params.mass_silence_fraction:.0%}: a control-plane or network failure, not the"
                " nodes': none is marked down and no job recovered for silence",
            )
        return GuardVerdict(False, False, share)
    if silent >= release_below(n, params):
        return GuardVerdict(True, False, share)
    under = (
        f"under {params.mass_silence_min_nodes} nodes"
        if silent < params.mass_silence_min_nodes
        else f"under {params.mass_silence_fraction / 2:.0%}"
    )
    return GuardVerdict(False, True, f"{share}, {under}: silence is judged again")


def hold(decision: Decision | None, *, engaged: bool) -> Decision | None:
    """While the guard is engaged, a node in service that silence would mark down (LOST) is
    only silent: it becomes or stays suspect, and nothing is recovered. Other decisions pass."""
    if decision is None or not engaged or decision.event != Event.LOST or decision.frm not in IN_SERVICE:
        return decision
    detail = (
        f"{decision.detail}; held by the mass-silence guard" if decision.detail else "held by the mass-silence guard"
    )
    return replace(decision, event=Event.SILENT, transition=transition(decision.frm, Event.SILENT), detail=detail)


__all__ = [
    "IN_SERVICE",
    "GuardVerdict",
    "SilenceCensus",
    "count_silence",
    "engage_at",
    "hold",
    "is_silent",
    "judge",
    "release_below",
]
