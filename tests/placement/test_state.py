"""ClusterState: indexes, conflicts, usage decay, events, rebuild from the store."""

from __future__ import annotations

import pytest

from placement import (
    AllocationConflict,
    Checkpointed,
    JobEnded,
    NodeGpus,
    NodeHealth,
    NodeHealthChanged,
    Placement,
    ReplicasLost,
    ReplicaSlot,
    UnknownJob,
    UnknownNode,
    apply_event,
    check_state,
    requeue_spec,
)

from .helpers import HOUR, cluster, cycle, occupy, queue_of, spec


def _placement(jid: str, node: str, gpus: tuple[int, ...], gpr: int = 1, gpu_type: str = "h100") -> Placement:
    slots = tuple(ReplicaSlot(i, node, gpus[i * gpr : (i + 1) * gpr]) for i in range(len(gpus) // gpr))
    return Placement(jid, gpu_type, (NodeGpus(node, gpus),), slots, ("b0",), False, len(gpus))


def test_indexes_follow_allocations_and_releases() -> None:
    st = cluster(blocks=1, nodes=2)
    st.set_quota("t", "h100", 8)
    assert (st.free_gpus("h100"), st.free_nodes("h100")) == (16, 2)
    occupy(st, spec("a", gpr=3), {"b0n0": (0, 1, 2)})
    assert (st.free_gpus("h100"), st.free_nodes("h100")) == (13, 1)
    assert st.node_free("b0n0") == (3, 4, 5, 6, 7)
    st.release("a", 10)
    assert (st.free_gpus("h100"), st.free_nodes("h100")) == (16, 2)
    assert check_state(st) == []


def test_a_gpu_is_never_allocated_twice() -> None:
    st = cluster(blocks=1, nodes=1)
    st.set_quota("t", "h100", 8)
    st.allocate(spec("a", gpr=2), _placement("a", "b0n0", (0, 1), gpr=2), 0)
    with pytest.raises(AllocationConflict):
        st.allocate(spec("b", gpr=2), _placement("b", "b0n0", (1, 2), gpr=2), 0)
    with pytest.raises(AllocationConflict):
        st.allocate(spec("a", gpr=2), _placement("a", "b0n0", (4, 5), gpr=2), 0)  # already running
    assert check_state(st) == []


def test_allocation_checks_type_and_health() -> None:
    st = cluster(blocks=1, nodes=2)
    with pytest.raises(AllocationConflict):
        st.allocate(spec("a", gpu_type="a100"), _placement("a", "b0n0", (0,), gpu_type="a100"), 0)
    st.set_node_health("b0n1", NodeHealth.DOWN)
    with pytest.raises(AllocationConflict):
        st.allocate(spec("b"), _placement("b", "b0n1", (0,)), 0)
    with pytest.raises(UnknownNode):
        st.set_node_health("nope", NodeHealth.READY)
    with pytest.raises(UnknownJob):
        st.release("nope", 0)


def test_a_partial_gang_is_refused_but_a_degraded_serving_job_is_rebuilt() -> None:
    st = cluster(blocks=1, nodes=2)
    st.set_quota("t", "h100", 100)
    gang = spec("g", replicas=2, gpr=2)
    with pytest.raises(AllocationConflict):
        st.allocate(gang, _placement("g", "b0n0", (0, 1), gpr=2), 0)
    svc = spec("s", cls="prod-serving", replicas=2, gpr=2)
    st.allocate(svc, _placement("s", "b0n0", (0, 1), gpr=2), 0)
    assert st.missing_replicas("s") == (1,)
    p = cycle(st, queue_of(), 10)
    assert p.placement("s").replacement and st.missing_replicas("s") == ()


def test_usage_decays_with_a_half_life_and_accrues_while_running() -> None:
    st = cluster(blocks=1, nodes=1)
    st.usage_half_life_s = 10 * HOUR
    st.set_usage("t", "h100", 100.0, 0.0)
    assert st.usage("t", "h100", 10 * HOUR) == pytest.approx(50.0)
    st.set_usage("t", "h100", 0.0, 0.0)
    occupy(st, spec("a", gpr=8), ["b0n0"], started_at=0.0)
    # 8 GPUs for 1 hour, barely decayed
    assert st.usage("t", "h100", HOUR) == pytest.approx(8.0, rel=0.05)
    st.release("a", HOUR)
    assert st.usage("t", "h100", 11 * HOUR) == pytest.approx(st.usage("t", "h100", HOUR) / 2, rel=1e-6)


def test_events() -> None:
    st = cluster(blocks=1, nodes=2)
    st.set_quota("t", "h100", 100)
    occupy(st, spec("a", gpr=8), ["b0n0"])
    occupy(st, spec("s", cls="prod-serving", replicas=2, gpr=4), {"b0n1": tuple(range(8))})
    assert apply_event(st, Checkpointed("a", 50.0), 60) == ("a",)
    assert st.running("a").last_checkpoint_at == 50.0
    assert apply_event(st, ReplicasLost("s", (1,)), 70) == ("s",)
    assert st.missing_replicas("s") == (1,)
    assert apply_event(st, NodeHealthChanged("b0n0", NodeHealth.CORDONED), 80) == ("a",)
    assert apply_event(st, JobEnded("a"), 90) == ("a",)
    assert apply_event(st, JobEnded("a"), 91) == ()
    assert check_state(st) == []


def test_requeue_spec_keeps_submit_time_and_counts_preemptions() -> None:
    j = spec("a", submit=5.0)
    r = requeue_spec(j, 100.0, preempted=True, checkpoint_at=90.0)
    assert (r.attempt, r.submit_time, r.preemption_times, r.last_checkpoint_at, r.front) == (
        1,
        5.0,
        (100.0,),
        90.0,
        False,
    )
    f = requeue_spec(r, 200.0, front=True)
    assert (f.attempt, f.preemption_times, f.front) == (2, (100.0,), True)


def test_quota_change_is_rechecked_by_the_next_plan() -> None:
    st = cluster(blocks=1, nodes=2)
    st.set_quota("t", "h100", 16)
    occupy(st, spec("a", gpr=8), ["b0n0"], started_at=0)
    occupy(st, spec("b", gpr=8), ["b0n1"], started_at=1)
    st.set_quota("t", "h100", 8, 8)
    assert ("t", "h100") in st.quota_dirty()
    cycle(st, queue_of(), 10)
    assert st.quota_dirty() == () and st.running("b").borrowed


def test_free_reserved_nodes_are_counted_per_block_and_owner_set() -> None:
    from placement import Reservation, ReservationKind
    from placement.topology import Search

    st = cluster(blocks=2, nodes=4)
    st.set_quota("t", "h100", 1000)

    def res(jid: str, nodes: tuple[str, ...]) -> Reservation:
        return Reservation(
            jid, "h100", ReservationKind.PREEMPTION, ("b0",), nodes, len(nodes), 8 * len(nodes), 2, 0.0, 0.0
        )

    st.add_reservation(res("A", ("b0n0", "b0n1", "b0n2")))
    st.add_reservation(res("B", ("b0n1",)))
    assert st.block_free_by_owners("b0") == {("A",): 2, ("A", "B"): 1}
    occupy(st, spec("x", gpr=8), ["b0n0"])  # a busy node is not free any more
    assert st.block_free_by_owners("b0") == {("A",): 1, ("A", "B"): 1}
    ti = st.type_index("h100")
    assert Search(st, ti, frozenset({"B"})).block_avail("b0") == 2  # b0n2, b0n3
    assert Search(st, ti, frozenset({"A"})).block_avail("b0") == 1  # b0n3
    assert Search(st, ti, frozenset()).block_avail("b0") == 3
    # a tentative section rolls the counts back with everything else
    st.begin_tentative()
    st.remove_reservation("A")
    assert st.block_free_by_owners("b0") == {("B",): 1}
    st.rollback()
    assert st.block_free_by_owners("b0") == {("A",): 1, ("A", "B"): 1}
    st.release("x", 10)
    st.set_node_health("b0n2", NodeHealth.DOWN)
    assert st.block_free_by_owners("b0") == {("A",): 1, ("A", "B"): 1}
    assert check_state(st) == []


def test_healthy_and_borrowed_by_class_reads() -> None:
    st = cluster(blocks=1, nodes=3)
    st.set_quota("t", "h100", 0, 100)
    occupy(st, spec("b", cls="research", gpr=8), ["b0n0"], borrowed=True)
    occupy(st, spec("s", cls="prod-serving", gpr=8), ["b0n1"], borrowed=True)
    st.set_node_health("b0n2", NodeHealth.DOWN)
    assert st.healthy_gpus("h100") == 16 and st.healthy_gpus() == 16
    assert st.borrowed_gpus_by_class("h100") == (0, 0, 8, 0)
    assert st.borrowed_gpus_by_class("a100") == (0, 0, 0, 0)
