"""The node state machine (control.health.node_states): every (state x event) pair, the decisions
from observations, and a Hypothesis state machine over agent message sequences."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from control.agent_link import HeartbeatTable
from control.health.node_states import (
    TABLE,
    Action,
    Event,
    GpuView,
    HealthParams,
    LeaseView,
    NodeObservation,
    NodeState,
    RankView,
    decide,
    fatal_faults,
    reconcile,
    transition,
)
from proto import agent_pb2 as pb

P = HealthParams(
    suspect_after_s=30,
    down_after_s=90,
    takeover_quiet_s=30,
    hang_after_s=600,
    unconfirmed_kill_s=900,
    fence_margin=1.5,
    ib_flap_threshold=5,
)

OUT_OF_SERVICE = {NodeState.DOWN, NodeState.CORDONED, NodeState.BURN_IN}
# what the table must do for each pair, stated independently of it
EXPECTED: dict[tuple[NodeState, Event], NodeState] = {}
for s, e in itertools.product(NodeState, Event):
    to = s
    if e == Event.SILENT and s == NodeState.READY:
        to = NodeState.SUSPECT
    elif e in (Event.HEARTBEAT, Event.CLEAR) and s == NodeState.SUSPECT:
        to = NodeState.READY
    elif e == Event.LOST and s in (NodeState.READY, NodeState.SUSPECT, NodeState.DRAINING, NodeState.BURN_IN):
        to = NodeState.DOWN
    elif e == Event.FATAL and s != NodeState.CORDONED:
        to = NodeState.CORDONED
    elif e == Event.HANG and s in (NodeState.READY, NodeState.SUSPECT, NodeState.DRAINING, NodeState.BURN_IN):
        to = NodeState.CORDONED
    elif e == Event.UNFIT and s in (NodeState.READY, NodeState.SUSPECT, NodeState.BURN_IN):
        to = NodeState.CORDONED
    elif e == Event.CLEAR and s in (NodeState.DOWN, NodeState.CORDONED):
        to = NodeState.BURN_IN
    elif e == Event.RETURN and s == NodeState.DRAINING:
        to = NodeState.BURN_IN
    elif e == Event.BURN_IN_PASSED and s == NodeState.BURN_IN:
        to = NodeState.READY
    elif e == Event.BURN_IN_FAILED and s == NodeState.BURN_IN:
        to = NodeState.CORDONED
    EXPECTED[(s, e)] = to


def test_the_table_lists_every_pair_with_a_reason():
    assert set(TABLE) == set(itertools.product(NodeState, Event))
    assert all(t.why for t in TABLE.values())


@pytest.mark.parametrize("state,event", list(itertools.product(NodeState, Event)), ids=lambda x: str(x))
def test_every_state_event_pair(state, event):
    t = transition(state, event)
    assert t.to == EXPECTED[(state, event)], t.why
    # a node becomes ready only by a heartbeat of a suspect node or a passed burn-in
    if t.to == NodeState.READY and state != NodeState.READY:
        assert (state, event) in {
            (NodeState.SUSPECT, Event.HEARTBEAT),
            (NodeState.SUSPECT, Event.CLEAR),
            (NodeState.BURN_IN, Event.BURN_IN_PASSED),
        }
    # leaving service because of a failure always recovers the gangs there, except a node that
    # only cannot take new ranks (a full disk): what runs there goes on
    if state in (NodeState.READY, NodeState.SUSPECT, NodeState.DRAINING) and t.to in (
        NodeState.DOWN,
        NodeState.CORDONED,
    ):
        assert (Action.RECOVER in t.actions) == (event != Event.UNFIT)
    # burn-in is started exactly when a node enters burn_in
    assert (Action.BURN_IN in t.actions) == (t.to == NodeState.BURN_IN and state != NodeState.BURN_IN)
    # suspicion alone never stops running work
    if event == Event.SILENT:
        assert Action.RECOVER not in t.actions


# --------------------------------------------------------------------------- decisions


def obs(state="ready", *, hb=100.0, took=0.0, gpus=(), running=(), live=(), silent_since=None, node_faults=()):
    return NodeObservation(
        "n1", NodeState(state), hb, took, tuple(gpus), tuple(running), frozenset(live), silent_since,
        tuple(node_faults),
    )  # fmt: skip


def rank(lid="j.a1.r0", step=10, age=0.0, gpus=(0,), epoch=1):
    return RankView(lid, "j", epoch, 1, step, age, tuple(gpus))


def test_silence_suspect_then_down_and_back():
    assert decide(obs(hb=100.0, live=["x"]), P, 129.0).event == Event.HEARTBEAT
    d = decide(obs(hb=100.0), P, 131.0)
    assert (d.event, d.transition.to, d.changes) == (Event.SILENT, NodeState.SUSPECT, True)
    d = decide(obs("suspect", hb=100.0), P, 191.0)
    assert (d.event, d.transition.to, d.transition.actions) == (Event.LOST, NodeState.DOWN, (Action.RECOVER,))
    d = decide(obs("suspect", hb=190.0, live=["x"], running=[rank("x")]), P, 191.0)
    assert (d.event, d.transition.to) == (Event.HEARTBEAT, NodeState.READY)


def test_takeover_quiet_period_marks_nothing_suspect():
    # a new leader at t=1000 has heard nothing: silent nodes are left alone for 30 s
    assert decide(obs(hb=None, took=1000.0), P, 1029.0) is None
    d = decide(obs(hb=None, took=1000.0), P, 1031.0)
    assert d.event == Event.SILENT and d.transition.to == NodeState.SUSPECT
    # not heard since the takeover: down 90 s after it, not before
    assert decide(obs(hb=None, took=1000.0), P, 1089.0).event == Event.SILENT
    assert decide(obs(hb=None, took=1000.0), P, 1091.0).event == Event.LOST


@pytest.mark.parametrize(
    "gpu,fatal",
    [
        (GpuView(0, xids=(79,)), True),
        (GpuView(0, xids=(48,)), True),
        (GpuView(0, xids=(94,)), True),
        (GpuView(0, xids=(13,)), False),
        (GpuView(0, xids=(31, 43)), False),
        (GpuView(0, ecc_dbe=1), True),
        (GpuView(0, ecc_dbe=0), False),
        (GpuView(0, faults=("nvlink:3:down",)), True),
        (GpuView(0, faults=("ib:mlx5_0:flaps=5",)), True),
        (GpuView(0, faults=("ib:mlx5_0:flaps=4",)), False),
        (GpuView(0, faults=("ib:mlx5_0:flap",) * 5), True),
        (GpuView(0, health="failed", faults=("row_remap_failure",)), True),
        (GpuView(0, health="degraded", faults=("slow:0.5",)), False),
    ],
)
def test_fatal_faults_cordon_at_once(gpu, fatal):
    assert bool(fatal_faults([gpu], P)) == fatal
    d = decide(obs(gpus=[gpu], live=["x"]), P, 100.0)
    if fatal:
        assert (
            d.event == Event.FATAL and d.transition.to == NodeState.CORDONED and Action.RECOVER in d.transition.actions
        )
    else:
        assert d.event == Event.HEARTBEAT and not d.changes


def test_hang_needs_a_stalled_step_and_idle_gpus():
    idle = [GpuView(0, sm_util=0.0), GpuView(1, sm_util=0.0)]
    busy = [GpuView(0, sm_util=95.0), GpuView(1, sm_util=0.0)]
    assert decide(obs(gpus=idle, running=[rank(age=601, gpus=(0, 1))], live=["j.a1.r0"]), P, 100).event == Event.HANG
    assert (
        decide(obs(gpus=idle, running=[rank(age=599, gpus=(0, 1))], live=["j.a1.r0"]), P, 100).event == Event.HEARTBEAT
    )
    assert (
        decide(obs(gpus=busy, running=[rank(age=601, gpus=(0, 1))], live=["j.a1.r0"]), P, 100).event == Event.HEARTBEAT
    )
    # a rank that reports no steps is never a hang
    assert (
        decide(obs(gpus=idle, running=[rank(step=None, age=9999, gpus=(0,))], live=["j.a1.r0"]), P, 100).event
        == Event.HEARTBEAT
    )


def test_a_node_that_cannot_host_new_ranks_is_cordoned_and_its_ranks_go_on():
    full = ["disk /var/lib/gpufleet/agent/n1: 12.0 MiB free, below 1.00 GiB (agent_min_free_disk_bytes)"]
    d = decide(obs(node_faults=full, live=["j.a1.r0"], running=[rank()]), P, 100.0)
    assert (d.event, d.transition.to, d.transition.actions) == (Event.UNFIT, NodeState.CORDONED, ())
    assert "12.0 MiB free" in d.detail
    # a fatal GPU fault outranks it (and recovers the gangs)
    d = decide(obs(node_faults=full, gpus=[GpuView(0, xids=(79,))], live=["j.a1.r0"]), P, 100.0)
    assert d.event == Event.FATAL and Action.RECOVER in d.transition.actions
    # cordoned and empty, but still unfit: no burn-in yet (it would fail to start)
    d = decide(obs("cordoned", node_faults=full), P, 100.0)
    assert (d.event, d.changes) == (Event.UNFIT, False)
    # the disk freed: clear, burn-in
    d = decide(obs("cordoned"), P, 100.0)
    assert (d.event, d.transition.to) == (Event.CLEAR, NodeState.BURN_IN)
    # a node heard from only long ago: its old report is no evidence now
    assert decide(obs(hb=0.0, node_faults=full), P, 200.0).event == Event.LOST


def test_a_down_node_returns_only_when_clear_or_past_the_fence_window():
    stray = rank("old.a1.r0")
    # back, but a rank of a released lease still runs: not clear (reconciliation stops it first)
    assert decide(obs("down", running=[stray], silent_since=0.0), P, 100.0).event == Event.HEARTBEAT
    # back, still a live lease on it (its job not yet re-queued): not clear
    assert decide(obs("down", live=["j.a1.r0"]), P, 100.0).event == Event.HEARTBEAT
    d = decide(obs("down"), P, 100.0)
    assert (d.event, d.transition.to, d.transition.actions) == (Event.CLEAR, NodeState.BURN_IN, (Action.BURN_IN,))
    # the self-fence window (900 s x 1.5) has passed since it went silent: its ranks are gone anyway
    assert decide(obs("down", hb=1400.0, running=[stray], silent_since=0.0), P, 1400.0).event == Event.CLEAR


def test_reconcile_flags_wrong_gpus_and_missing_tasks():
    live = {"a": LeaseView("a", "j", 1, 3, (0, 1), 0.0), "b": LeaseView("b", "k", 1, 3, (2,), 0.0)}
    rec = reconcile([RankView("a", "j", 3, 1, 1, 0.0, (0, 5))], live)
    assert [x[0] for x in rec.kill_wrong_gpus] == ["a"] and rec.missing == ("b",)
    rec = reconcile([RankView("a", "j", 3, 1, 1, 0.0, (1, 0)), RankView("b", "k", 3, 1, 1, 0.0, (2,))], live)
    assert rec.kill_wrong_gpus == () and rec.missing == ()
    # an older epoch of the lease on other GPUs is not this lease's rank: left to the agent's epoch check
    assert reconcile([RankView("a", "j", 2, 1, 1, 0.0, (7,))], live).kill_wrong_gpus == ()


# --------------------------------------------------------------- agent message sequences


def _hb(boot: str, seq: int, *, xid: int | None = None, lease: str | None = None, epoch: int = 1) -> pb.Heartbeat:
    m = pb.Heartbeat(node_id="n1", boot_id=boot, seq=seq)
    for i in range(2):
        g = m.gpus.add(index=i, health=pb.GPU_HEALTH_OK, sm_util=50.0)
        if xid is not None and i == 0:
            g.xids.append(xid)
            g.health = pb.GPU_HEALTH_FAILED
    if lease:
        m.running.add(lease_id=lease, job_id="j", epoch=epoch, step=1, attempt=1, rank=0, gpu_indices=[0])
    return m


# legal edges: the table's (plus staying)
LEGAL = {(s, t.to) for (s, _), t in TABLE.items()}


class AgentMessages(RuleBasedStateMachine):
    """Heartbeats arrive duplicated, reordered, from old boots and with stale epochs; the
    leader's table keeps only fresh ones and the node's state only takes table edges."""

    def __init__(self):
        super().__init__()
        self.table = HeartbeatTable()
        self.sent: list[pb.Heartbeat] = []
        self.boot = "b1"
        self.seq = 0
        self.now = 0.0
        self.state = NodeState.READY
        self.last_hb: float | None = None
        self.newest: tuple[str, int] | None = None
        self.live = {"j.a1.r0"}
        self.reboots = 0

    def _deliver(self, msg: pb.Heartbeat) -> None:
        entry = self.table.offer("n1", msg)
        if entry is not None:
            self.newest = (msg.boot_id, msg.seq)
            self.last_hb = self.now
        self._step()

    def _step(self) -> None:
        e = self.table.get("n1")
        gpus, running = (), ()
        if e is not None:
            r = e.report()
            gpus = tuple(
                GpuView(g.index, g.health, g.sm_util, g.ecc_dbe, tuple(g.xids), tuple(g.faults)) for g in r.gpus
            )
            running = tuple(
                RankView(x.lease_id, x.job_id, x.epoch, x.attempt, x.step, x.step_age_s, tuple(x.gpu_indices))
                for x in r.running
            )
        o = NodeObservation("n1", self.state, self.last_hb, -100.0, gpus, running, frozenset(self.live))
        d = decide(o, P, self.now)
        if d is not None:
            assert (self.state, d.transition.to) in LEGAL
            if Action.RECOVER in d.transition.actions:
                self.live = set()  # the gang is released
            self.state = d.transition.to

    @rule(xid=st.sampled_from([None, None, None, 13, 79]), lease=st.booleans(), epoch=st.integers(1, 3))
    def fresh(self, xid, lease, epoch):
        self.seq += 1
        m = _hb(self.boot, self.seq, xid=xid, lease="j.a1.r0" if lease else None, epoch=epoch)
        self.sent.append(m)
        self._deliver(m)

    @precondition(lambda self: self.sent)
    @rule(i=st.integers(0, 50))
    def duplicate_or_reordered(self, i):
        m = self.sent[i % len(self.sent)]
        before = self.newest
        self._deliver(m)
        if (m.boot_id, m.seq) != before:
            assert self.newest == before, "an old or duplicate heartbeat replaced a newer one"

    # The table remembers the last RETIRED_BOOTS boots of a node (bounded memory): a message
    # delayed across more agent restarts than that cannot arrive (each boot streams on a new
    # connection; the old one is closed), so the model stays within it.
    @precondition(lambda self: self.reboots < HeartbeatTable.RETIRED_BOOTS)
    @rule()
    def reboot(self):
        self.reboots += 1
        self.boot = f"b{len(self.sent) + 2}"

    @rule(dt=st.floats(0.1, 120.0))
    def time_passes(self, dt):
        self.now += dt
        self._step()

    @invariant()
    def state_is_known(self):
        assert self.state in NodeState
        if self.state in OUT_OF_SERVICE:
            assert not self.live or self.state == NodeState.BURN_IN


TestAgentMessages = AgentMessages.TestCase
TestAgentMessages.settings = hsettings(max_examples=150, stateful_step_count=40, deadline=None)
