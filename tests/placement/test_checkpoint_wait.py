"""``Policy.checkpoint_wait_s``: a new job waits for its victims' checkpoints that are due soon
instead of throwing away the work they are about to save."""

from __future__ import annotations

import pytest

from placement import PendingReason, Policy, ReservationKind

from .helpers import cluster, cycle, fill, queue_of, spec

NOW = 10_000.0


def _victims(st, since: list[float], every: list[float | None]) -> list[str]:
    """Borrowed jobs of class preemptible of team "b" on whole nodes b0n0, b0n1..., started two hours
    ago; each checkpointed ``since`` seconds ago, and ``every`` before that (None: once)."""
    st.set_quota("b", "h100", 0, 100)
    nodes = [f"b0n{i}" for i in range(len(since))]
    jids = fill(st, nodes, team="b", cls="preemptible", borrowed=True, started_at=NOW - 7200.0, preemptible=True)
    for jid, s, e in zip(jids, since, every, strict=True):
        if e is not None:
            st.set_checkpoint(jid, NOW - s - e)
        st.set_checkpoint(jid, NOW - s)
    return jids


@pytest.mark.parametrize(
    ("cls", "gpus", "waited", "since", "every", "wait", "preempts"),
    [
        ("research", 16, 10.0, 1700.0, 1800.0, 300.0, False),  # due in 100 s, within the wait
        ("research", 16, 10.0, 1500.0, 1800.0, 300.0, True),  # due in 300 s: after the wait ends (290 s)
        ("research", 16, 300.0, 1700.0, 1800.0, 300.0, True),  # waited the whole wait
        ("research", 16, 10.0, 1700.0, None, 300.0, True),  # one checkpoint: its pace is unknown
        ("research", 16, 10.0, 1900.0, 1800.0, 300.0, True),  # overdue: no telling when
        ("research", 16, 10.0, 1700.0, 1800.0, None, True),  # the field off
        ("research", 8, 10.0, 1700.0, 1800.0, 300.0, False),  # a one-node research job waits
        ("preemptible", 8, 10.0, 1700.0, 1800.0, 300.0, False),
        ("prod-batch", 16, 10.0, 1700.0, 1800.0, 300.0, False),  # a multi-node prod-batch job waits
        ("prod-batch", 8, 10.0, 1700.0, 1800.0, 300.0, True),  # a small prod job: the 2-minute p95 wait
        ("prod-serving", 16, 10.0, 1700.0, 1800.0, 300.0, True),
    ],
)
def test_a_new_job_waits_for_checkpoints_due_within_the_wait(
    cls: str, gpus: int, waited: float, since: float, every: float | None, wait: float | None, preempts: bool
) -> None:
    """(class, GPUs, waited, victims' last checkpoint, their pace, wait) -> preempts now?
    Two borrowed jobs fill the cluster; "owner" reclaims within its guarantee."""
    st = cluster(blocks=1, nodes=2)
    _victims(st, [since, since], [every, every])
    st.set_quota("owner", "h100", 16, 0)
    q = queue_of(spec("x", team="owner", cls=cls, gpr=8, replicas=gpus // 8, submit=NOW - waited))
    p = cycle(st, q, NOW, Policy(checkpoint_wait_s=wait))
    assert bool(p.preemptions) is preempts
    assert not p.placements
    if not preempts:
        assert not p.reservations  # it drains nothing while it waits
        assert p.reason_for(q.get("x")) is PendingReason.CAPACITY
        assert [pe.detail for pe in p.pending] == ["waits for its victims' checkpoints"]


@pytest.mark.parametrize(
    ("since", "every", "waits"),
    [
        # (last checkpoint ago, pace) of the two victims: the first is due in 100 s
        ((1700.0, 1000.0), (1800.0, 3600.0), True),  # 1,700 of 2,700 s of lost work saved
        ((500.0, 1700.0), (600.0, 3600.0), False),  # 500 of 2,200: most is lost anyway
    ],
)
def test_it_waits_only_when_most_of_the_lost_work_is_saved(
    since: tuple[float, float], every: tuple[float, float], waits: bool
) -> None:
    st = cluster(blocks=1, nodes=2)
    _victims(st, list(since), list(every))
    st.set_quota("owner", "h100", 16, 0)
    q = queue_of(spec("x", team="owner", gpr=8, replicas=2, submit=NOW - 10.0))
    p = cycle(st, q, NOW, Policy(checkpoint_wait_s=300.0))
    assert bool(p.preemptions) is not waits


def test_once_the_victims_checkpoint_it_preempts_them_having_lost_nothing() -> None:
    st = cluster(blocks=1, nodes=2)
    jids = _victims(st, [1700.0, 1700.0], [1800.0, 1800.0])
    st.set_quota("owner", "h100", 16, 0)
    q = queue_of(spec("x", team="owner", gpr=8, replicas=2, submit=NOW - 10.0))
    pol = Policy(checkpoint_wait_s=300.0)
    assert not cycle(st, q, NOW, pol).preemptions
    for jid in jids:
        st.set_checkpoint(jid, NOW + 100.0)
    p = cycle(st, q, NOW + 101.0, pol)
    assert sorted(pr.victim for pr in p.preemptions) == sorted(jids)
    assert all(st.running(j).last_checkpoint_at == NOW + 100.0 for j in jids)


def test_the_pace_is_read_from_this_runs_checkpoints_and_rolls_back() -> None:
    st = cluster(blocks=1, nodes=1)
    st.set_quota("b", "h100", 0, 100)
    (jid,) = fill(
        st, ["b0n0"], team="b", borrowed=True, started_at=NOW, preemptible=True, last_checkpoint_at=NOW - 50.0
    )
    rj = st.running(jid)
    assert rj.ckpt_every is None  # a checkpoint of its run before a preemption
    st.set_checkpoint(jid, NOW + 600.0)
    assert rj.ckpt_every is None  # the first of this run: no pace yet
    st.set_checkpoint(jid, NOW + 1500.0)
    assert rj.ckpt_every == 900.0
    st.begin_tentative()
    st.set_checkpoint(jid, NOW + 1700.0)
    assert rj.ckpt_every == 200.0
    st.rollback()
    assert (rj.last_checkpoint_at, rj.ckpt_every) == (NOW + 1500.0, 900.0)


@pytest.mark.parametrize(
    ("since", "every", "waits"),
    [
        (1700.0, 1800.0, True),  # saves 1,700 s x 8 GPUs; the free node idles 100 s x 8
        (50.0, 150.0, False),  # saves 50 s x 8 GPUs: less than the 100 s the free node would idle
    ],
)
def test_it_waits_only_when_the_work_saved_beats_the_gpus_left_idle(since: float, every: float, waits: bool) -> None:
    """One node is free, two run victims due in 100 s; the job needs two nodes: the free one
    and one victim's. Waiting leaves the free node idle meanwhile."""
    st = cluster(blocks=1, nodes=3)
    _victims(st, [since, since], [every, every])
    st.set_quota("owner", "h100", 16, 0)
    q = queue_of(spec("x", team="owner", gpr=8, replicas=2, submit=NOW - 10.0))
    p = cycle(st, q, NOW, Policy(checkpoint_wait_s=300.0))
    assert len(p.preemptions) == (0 if waits else 1)


def test_a_gang_that_waits_reserves_meanwhile_then_preempts() -> None:
    """A gang waiting for its victims' checkpoints starts its drain (a head-of-line
    reservation) at once, and preempts them once they have checkpointed."""
    st = cluster(blocks=1, nodes=2)
    jids = _victims(st, [1700.0, 1700.0], [1800.0, 1800.0])
    st.set_quota("owner", "h100", 16, 0)
    q = queue_of(spec("x", team="owner", gpr=8, replicas=2, pack="block", submit=NOW - 10.0))
    pol = Policy(checkpoint_wait_s=300.0, reserve_min_gpus=16)
    p = cycle(st, q, NOW, pol)
    assert not p.preemptions
    assert [(r.job_id, r.kind) for r in p.reservations] == [("x", ReservationKind.HEAD_OF_LINE)]
    assert p.reason_for(q.get("x")) is PendingReason.RESERVED
    for jid in jids:
        st.set_checkpoint(jid, NOW + 100.0)
    p = cycle(st, q, NOW + 101.0, pol)
    assert sorted(pr.victim for pr in p.preemptions) == sorted(jids)
