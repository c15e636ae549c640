"""The node state machine and the health decisions of the leader (docs/design.md, Health). Pure:
no I/O, no clock (``now`` is passed in), no randomness.

    from control.node_states import NodeObservation, decide, transition

    d = decide(obs, params, now)         # -> Decision(event, transition) or None
    t = transition("ready", Event.SILENT) # -> Transition(to="suspect", actions=(), why=...)

``TABLE`` has one entry per (state, event) pair, with the reason for each edge; the
shell (``control.health``) writes the new state (only when it changes, audited) and
carries out the actions. ``tests/health/test_node_states.py`` sweeps every pair.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum


class NodeState(StrEnum):
    READY = "ready"
    SUSPECT = "suspect"  # silent past suspect_after_s: no new placements
    DOWN = "down"  # silent past down_after_s: its gangs were recovered; comes back only through burn-in
    CORDONED = "cordoned"  # a fatal fault or a hang: out of service until it passes burn-in
    DRAINING = "draining"  # an admin drain: no new placements; returns on an admin return (through burn-in)
    BURN_IN = "burn_in"  # running the burn-in test; ready only when it passes


class Event(StrEnum):
    HEARTBEAT = "heartbeat"  # a fresh heartbeat with nothing fatal in it
    SILENT = "silent"  # no heartbeat for suspect_after_s, counted from the takeover at the earliest
    LOST = "lost"  # no heartbeat for down_after_s
    FATAL = "fatal"  # fatal Xid, double-bit ECC, NVLink down, InfiniBand flaps past the threshold
    HANG = "hang"  # a rank's step counter stalled hang_after_s with its GPUs idle
    UNFIT = "unfit"  # it cannot host new ranks: a full or read-only disk (its agent), failing jobs (store.node_blame)
    CLEAR = "clear"  # fresh heartbeat, no fault, no live lease, no rank left on the node: may burn in
    BURN_IN_PASSED = "burn_in_passed"
    BURN_IN_FAILED = "burn_in_failed"
    RETURN = "return"  # an admin returns a drained node to service


class Action(StrEnum):
    RECOVER = "recover"  # end every gang with a live lease on the node (node_failed), re-queue at the front
    BURN_IN = "burn_in"  # start the burn-in test on the node


@dataclass(frozen=True)
class Transition:
    to: NodeState
    actions: tuple[Action, ...]
    why: str

    def changes(self, frm: NodeState | str) -> bool:
        return self.to != NodeState(frm)


R, S, D, C, DR, B = (NodeState.READY, NodeState.SUSPECT, NodeState.DOWN, NodeState.CORDONED,
                     NodeState.DRAINING, NodeState.BURN_IN)  # fmt: skip
E = Event
_REC = (Action.RECOVER,)
_BURN = (Action.BURN_IN,)


def _t(to: NodeState, why: str, actions: tuple[Action, ...] = ()) -> Transition:
    return Transition(to, actions, why)


# (state, event) -> transition. Every pair is listed; "stay" edges say why nothing happens.
TABLE: dict[tuple[NodeState, Event], Transition] = {
    # --- ready ---------------------------------------------------------------------------
    (R, E.HEARTBEAT): _t(R, "healthy and heard from: stays in service"),
    (R, E.SILENT): _t(S, "no heartbeat for suspect_after_s: no new placements, running work untouched"),
    (R, E.LOST): _t(D, "no heartbeat for down_after_s (first seen already long silent): recover its gangs", _REC),
    (R, E.FATAL): _t(C, "fatal GPU or link fault: cordon at once and restart its gangs elsewhere", _REC),
    (R, E.HANG): _t(C, "a gang hangs on it (stalled steps, idle GPUs): cordon, restart the gang", _REC),
    (R, E.UNFIT): _t(
        C, "cannot host new ranks (a full or read-only disk, jobs that fail only here): cordon; its running ranks go on"
    ),
    (R, E.CLEAR): _t(R, "already in service"),
    (R, E.BURN_IN_PASSED): _t(R, "stale burn-in result: ignored"),
    (R, E.BURN_IN_FAILED): _t(R, "stale burn-in result: ignored"),
    (R, E.RETURN): _t(R, "already in service"),
    # --- suspect -------------------------------------------------------------------------
    (S, E.HEARTBEAT): _t(R, "heard from again before down_after_s: back in service, its ranks never stopped"),
    (S, E.SILENT): _t(S, "still silent, not yet down"),
    (S, E.LOST): _t(D, "silent for down_after_s: down, recover its gangs", _REC),
    (S, E.FATAL): _t(C, "fatal GPU or link fault: cordon and restart its gangs", _REC),
    (S, E.HANG): _t(C, "a gang hangs on it: cordon, restart the gang", _REC),
    (S, E.UNFIT): _t(C, "heard from again, but cannot host new ranks: cordon; its running ranks go on"),
    (S, E.CLEAR): _t(R, "heard from again (and empty): back in service"),
    (S, E.BURN_IN_PASSED): _t(S, "stale burn-in result: ignored"),
    (S, E.BURN_IN_FAILED): _t(S, "stale burn-in result: ignored"),
    (S, E.RETURN): _t(S, "not drained: nothing to return"),
    # --- down ----------------------------------------------------------------------------
    (D, E.HEARTBEAT): _t(D, "back, but its leases were released: it returns only once clear, through burn-in"),
    (D, E.SILENT): _t(D, "already down"),
    (D, E.LOST): _t(D, "already down (recovery re-tried while it still holds live leases)", _REC),
    (D, E.FATAL): _t(C, "back with a fatal fault: cordoned until repaired and burnt in", _REC),
    (D, E.HANG): _t(D, "down: its gangs are already being recovered", _REC),
    (D, E.UNFIT): _t(D, "back, but cannot host new ranks: stays down until it can, is clear and burnt in"),
    (D, E.CLEAR): _t(B, "back, no leases, its agent confirms no rank is left: burn in before reuse", _BURN),
    (D, E.BURN_IN_PASSED): _t(D, "stale burn-in result: ignored"),
    (D, E.BURN_IN_FAILED): _t(D, "stale burn-in result: ignored"),
    (D, E.RETURN): _t(D, "a silent node cannot be returned: it comes back through burn-in once clear"),
    # --- cordoned ------------------------------------------------------------------------
    (C, E.HEARTBEAT): _t(C, "cordoned until it is clear and passes burn-in"),
    (C, E.SILENT): _t(C, "out of service already; silence changes nothing"),
    (C, E.LOST): _t(C, "out of service already (recovery re-tried while it holds live leases)", _REC),
    (C, E.FATAL): _t(C, "still faulty (recovery re-tried while it holds live leases)", _REC),
    (C, E.HANG): _t(C, "already cordoned (recovery re-tried)", _REC),
    (C, E.UNFIT): _t(C, "still cannot host new ranks: burn-in waits until it can"),
    (C, E.CLEAR): _t(B, "repaired (no fault), empty, no rank left: run burn-in", _BURN),
    (C, E.BURN_IN_PASSED): _t(C, "stale burn-in result: ignored"),
    (C, E.BURN_IN_FAILED): _t(C, "stale burn-in result: ignored"),
    (C, E.RETURN): _t(C, "a cordoned node returns only through burn-in once clear"),
    # --- draining ------------------------------------------------------------------------
    (DR, E.HEARTBEAT): _t(DR, "draining: no new placements; running work finishes (or is evicted)"),
    (DR, E.SILENT): _t(DR, "no placements anyway; running work keeps its chance until down_after_s"),
    (DR, E.LOST): _t(D, "silent for down_after_s: down, recover its gangs", _REC),
    (DR, E.FATAL): _t(C, "fatal fault while draining: cordon, restart its gangs now", _REC),
    (DR, E.HANG): _t(C, "a gang hangs while draining: cordon, restart it", _REC),
    (DR, E.UNFIT): _t(DR, "draining: no new placements anyway; its running work is the drain's"),
    (DR, E.CLEAR): _t(DR, "drained: waits for an admin return"),
    (DR, E.BURN_IN_PASSED): _t(DR, "stale burn-in result: ignored"),
    (DR, E.BURN_IN_FAILED): _t(DR, "stale burn-in result: ignored"),
    (DR, E.RETURN): _t(B, "an admin returns the drained node: burn in before reuse", _BURN),
    # --- burn_in -------------------------------------------------------------------------
    (B, E.HEARTBEAT): _t(B, "burn-in running"),
    (B, E.SILENT): _t(B, "burn-in running; down_after_s decides"),
    (B, E.LOST): _t(D, "lost during burn-in: down (it burns in again once back and clear)"),
    (B, E.FATAL): _t(C, "fatal fault during burn-in: failed, cordoned"),
    (B, E.HANG): _t(C, "the burn-in hangs: failed, cordoned"),
    (B, E.UNFIT): _t(C, "cannot host ranks during burn-in: failed, cordoned until it can"),
    (B, E.CLEAR): _t(B, "burn-in running"),
    (B, E.BURN_IN_PASSED): _t(R, "burn-in passed: back in service"),
    (B, E.BURN_IN_FAILED): _t(C, "burn-in failed: cordoned (tried again once clear, after a back-off)"),
    (B, E.RETURN): _t(B, "burn-in running"),
}


def transition(state: NodeState | str, event: Event | str) -> Transition:
    return TABLE[(NodeState(state), Event(event))]


# ------------------------------------------------------------------------- observations


@dataclass(frozen=True)
class HealthParams:
    suspect_after_s: float = 30.0
    down_after_s: float = 90.0
    takeover_quiet_s: float = 30.0
    hang_after_s: float = 600.0
    unconfirmed_kill_s: float = 900.0
    fence_margin: float = 1.5
    fatal_xids: frozenset[int] = frozenset({48, 63, 64, 74, 79, 94, 95})
    ib_flap_threshold: int = 5
    idle_util_pct: float = 1.0
    mass_silence_fraction: float = 0.2  # the mass-silence guard (control.health.silence_guard)
    mass_silence_min_nodes: int = 3

    @property
    def fence_window_s(self) -> float:
        return self.unconfirmed_kill_s * self.fence_margin


@dataclass(frozen=True)
class GpuView:
    index: int
    health: str = "ok"
    sm_util: float | None = None
    ecc_dbe: int | None = None
    xids: tuple[int, ...] = ()
    faults: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankView:
    lease_id: str
    job_id: str
    epoch: int
    attempt: int
    step: int | None  # None: the rank reports no steps (never a hang)
    step_age_s: float
    gpu_indices: tuple[int, ...]


@dataclass(frozen=True)
class NodeObservation:
    """What the leader knows of one node at ``now`` (monotonic seconds)."""

    node_id: str
    state: NodeState
    last_heartbeat_at: float | None  # monotonic; None: not heard since this leader took over
    took_over_at: float  # monotonic
    gpus: tuple[GpuView, ...] = ()
    running: tuple[RankView, ...] = ()  # ranks the agent reports running
    live_leases: frozenset[str] = frozenset()  # live leases on the node in the store
    silent_since: float | None = None  # when it went silent (for the fence window after a return)
    node_faults: tuple[str, ...] = ()  # what keeps it from hosting new ranks: its agent's word, the jobs' record


def fatal_faults(gpus: Iterable[GpuView], params: HealthParams) -> list[str]:
    """The fatal faults of a heartbeat: fatal Xid, double-bit ECC, NVLink down, IB flaps past the threshold."""
    out: list[str] = []
    for g in gpus:
        for x in g.xids:
            if x in params.fatal_xids:
                out.append(f"gpu{g.index}:xid:{x}")
        if g.ecc_dbe:
            out.append(f"gpu{g.index}:ecc:dbe={g.ecc_dbe}")
        flaps = 0
        for f in g.faults:
            if f.startswith("nvlink:") and f.endswith(":down"):
                out.append(f"gpu{g.index}:{f}")
            elif f.startswith("ib:"):
                # "ib:<port>:flaps=<n>" (cumulative) or one "ib:<port>:flap" per flap
                _, _, rest = f.partition(":")
                n = rest.rsplit("flaps=", 1)
                try:
                    flaps += int(n[1]) if len(n) == 2 else 1
                except ValueError:
                    flaps += 1
        if flaps >= params.ib_flap_threshold:
            out.append(f"gpu{g.index}:ib:flaps={flaps}")
        if g.health == "failed" and not any(o.startswith(f"gpu{g.index}:") for o in out):
            out.append(f"gpu{g.index}:failed:{','.join(g.faults) or 'unknown'}")
    return out


def hung_ranks(obs: NodeObservation, params: HealthParams) -> list[RankView]:
    """Ranks whose step counter stalled ``hang_after_s`` while every one of their GPUs sits idle."""
    util = {g.index: g.sm_util for g in obs.gpus}
    out = []
    for r in obs.running:
        if r.step is None or r.step_age_s < params.hang_after_s or not r.gpu_indices:
            continue
        if all((u := util.get(i)) is not None and u <= params.idle_util_pct for i in r.gpu_indices):
            out.append(r)
    return out


@dataclass(frozen=True)
class Decision:
    frm: NodeState
    event: Event
    transition: Transition
    detail: str = ""
    hung: tuple[RankView, ...] = ()

    @property
    def changes(self) -> bool:
        return self.transition.to != self.frm


def silent_since(last_heartbeat_at: float | None, took_over_at: float) -> float:
    """Since when this leader has not heard the node: its latest heartbeat, but never before the
    takeover. A node streaming to the previous leader had no way to reach this one earlier, so
    its silence counts from the takeover at the earliest."""
    return took_over_at if last_heartbeat_at is None else max(last_heartbeat_at, took_over_at)


def silence(obs: NodeObservation, now: float) -> float:
    """Seconds this leader has gone without a heartbeat from the node (``silent_since``)."""
    return now - silent_since(obs.last_heartbeat_at, obs.took_over_at)


def heard_recently(obs: NodeObservation, params: HealthParams, now: float) -> bool:
    """A heartbeat within ``suspect_after_s``: what it reports is evidence about the node now."""
    return obs.last_heartbeat_at is not None and now - obs.last_heartbeat_at < params.suspect_after_s


def derive_event(
    obs: NodeObservation, params: HealthParams, now: float
) -> tuple[Event, str, tuple[RankView, ...]] | None:
    """The one event that describes the node now (the most severe first); None: nothing to say
    (not heard lately, but it has not had the whole suspect window to reach this leader yet)."""
    age = silence(obs, now)
    if heard_recently(obs, params, now):
        faults = fatal_faults(obs.gpus, params)
        if faults:
            return Event.FATAL, "; ".join(faults[:8]), ()
        hung = hung_ranks(obs, params)
        if hung:
            what = ", ".join(r.lease_id for r in hung[:4])
            return (
                Event.HANG,
                f"{len(hung)} rank(s) stalled {params.hang_after_s:.0f}s with idle GPUs: {what}",
                tuple(hung),
            )
        if obs.node_faults:
            return Event.UNFIT, "; ".join(obs.node_faults[:4]), ()
        fenced = obs.silent_since is not None and now - obs.silent_since >= params.fence_window_s
        if not obs.live_leases and (not obs.running or fenced):
            return (
                Event.CLEAR,
                "no fault, no live lease, no rank left" if not obs.running else "fence window passed",
                (),
            )
        return Event.HEARTBEAT, "", ()
    if now - obs.took_over_at < params.takeover_quiet_s:
        return None  # docs/design.md, Leadership: a new leader has not heard the heartbeats yet
    if age < params.suspect_after_s:
        return None  # the node has not had the whole suspect window to reach this leader
    if age >= params.down_after_s:
        return Event.LOST, f"no heartbeat for {age:.1f}s", ()
    return Event.SILENT, f"no heartbeat for {age:.1f}s", ()


def decide(obs: NodeObservation, params: HealthParams, now: float) -> Decision | None:
    """What to do with one node now: the event and the table's transition (maybe a stay)."""
    ev = derive_event(obs, params, now)
    if ev is None:
        return None
    event, detail, hung = ev
    return Decision(obs.state, event, transition(obs.state, event), detail, hung)


# ------------------------------------------------------------------------- reconciliation


@dataclass(frozen=True)
class LeaseView:
    lease_id: str
    job_id: str
    attempt: int
    epoch: int
    gpu_indices: tuple[int, ...]
    created_at: float  # monotonic, when this leader first knew it


@dataclass(frozen=True)
class Reconciliation:
    kill_wrong_gpus: tuple[tuple[str, int, str], ...] = ()  # (lease_id, epoch, reason)
    missing: tuple[str, ...] = ()  # live leases whose task the agent does not report
    found: tuple[str, ...] = ()  # leases reported running again


def reconcile(running: Sequence[RankView], live: Mapping[str, LeaseView]) -> Reconciliation:
    """Compare what an agent runs with the store's live leases on that node (one fresh heartbeat)."""
    wrong = []
    seen = set()
    for r in running:
        lz = live.get(r.lease_id)
        if lz is None:
            continue  # no live lease: the process's reconciliation stops it (DB-verified)
        seen.add(r.lease_id)
        if r.epoch != lz.epoch:
            continue  # an older or newer epoch of the same lease: the agent orders them
        if r.gpu_indices and tuple(sorted(r.gpu_indices)) != tuple(sorted(lz.gpu_indices)):
            wrong.append(
                (
                    r.lease_id,
                    r.epoch,
                    f"reconciliation: rank on GPUs {list(r.gpu_indices)}, lease holds {list(lz.gpu_indices)}",
                )
            )
    missing = tuple(sorted(set(live) - seen))
    return Reconciliation(tuple(wrong), missing, tuple(sorted(seen)))


__all__ = [
    "TABLE",
    "Action",
    "Decision",
    "Event",
    "GpuView",
    "HealthParams",
    "LeaseView",
    "NodeObservation",
    "NodeState",
    "RankView",
    "Reconciliation",
    "decide",
    "derive_event",
    "fatal_faults",
    "heard_recently",
    "hung_ranks",
    "reconcile",
    "silence",
    "silent_since",
    "transition",
]
