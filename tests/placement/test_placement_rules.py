"""Placement rules (docs/design.md, Jobs and Placement), one test per rule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from placement import (
    ClusterState,
    JobEnded,
    NodeHealth,
    PendingReason,
    Policy,
    apply_event,
    check_state,
    fail_node,
    plan,
    requeue_spec,
)

from .helpers import add_blocks, big_quota, blocks_of, cluster, cycle, fill, nodes_of, occupy, queue_of, spec


def test_whole_nodes_for_jobs_of_8_or_more_gpus() -> None:
    st = cluster(blocks=1, nodes=4)
    big_quota(st, "t")
    occupy(st, spec("small", gpr=2), {"b0n0": (0, 1)})
    q = queue_of(spec("j", replicas=3, gpr=4))  # 12 GPUs: 2 replicas on one node, 1 on another
    p = cycle(st, q, 100)
    pl = p.placement("j")
    assert pl is not None
    assert sorted(n.node_id for n in pl.nodes) == ["b0n1", "b0n2"]
    assert all(n.gpus == tuple(range(8)) for n in pl.nodes)  # whole nodes, even the half-used one
    assert pl.gpus == 16
    assert st.node_jobs("b0n2") == {"j": tuple(range(8))}


def test_job_of_exactly_8_gpus_in_small_replicas_takes_a_whole_node() -> None:
    st = cluster(blocks=1, nodes=2)
    big_quota(st, "t")
    occupy(st, spec("small", gpr=1), {"b0n0": (0,)})
    p = cycle(st, queue_of(spec("j", replicas=4, gpr=2)), 100)
    assert nodes_of(p, "j") == ["b0n1"]


def test_fill_whole_blocks_first_then_best_fit() -> None:
    st = cluster(blocks=3, nodes=4)
    big_quota(st, "t")
    fill(st, ["b1n0", "b1n1"])  # b1 has 2 free nodes; b0 and b2 are whole free blocks
    p = cycle(st, queue_of(spec("j", replicas=6, gpr=8, pack="block")), 100)
    # 6 nodes: one whole block (b0, lowest id) + the best fit for the remaining 2 (b1, exactly 2 free)
    assert blocks_of(p, "j") == ("b0", "b1")


def test_best_fit_block_fewest_free_that_still_fit() -> None:
    st = cluster(blocks=3, nodes=4)
    big_quota(st, "t")
    fill(st, ["b1n0"])  # b1: 3 free
    fill(st, ["b2n0", "b2n1"])  # b2: 2 free
    p = cycle(
        st,
        queue_of(spec("j2", replicas=2, gpr=8, pack="block"), spec("j3", replicas=3, gpr=8, pack="block", submit=1)),
        100,
    )
    assert blocks_of(p, "j2") == ("b2",)
    assert blocks_of(p, "j3") == ("b1",)


def test_max_blocks_honoured() -> None:
    st = cluster(blocks=3, nodes=4)
    big_quota(st, "t")
    fill(st, ["b0n0", "b0n1", "b1n0", "b1n1", "b2n0", "b2n1"])  # 2 free nodes per block
    q = queue_of(spec("two", replicas=4, gpr=8, pack="block", max_blocks=1))
    p = cycle(st, q, 100)
    assert p.reason("two") is PendingReason.TOPOLOGY
    q = queue_of(spec("two", replicas=4, gpr=8, pack="block", max_blocks=2))
    p = cycle(st, q, 100)
    assert len(blocks_of(p, "two")) == 2


def test_max_blocks_lapses_after_its_wait() -> None:
    """``max_blocks_wait_s`` (Slurm's --switches=N@max-time): the job waits that long from
    submit for max_blocks, then takes the fewest blocks it can; without it the limit holds."""
    for wait, placed_at_400 in ((300.0, True), (None, False)):
        st = cluster(blocks=3, nodes=4)
        big_quota(st, "t")
        fill(st, ["b0n0", "b0n1", "b1n0", "b1n1", "b2n0", "b2n1", "b2n2"])  # 2, 2 and 1 free nodes
        q = queue_of(spec("two", replicas=4, gpr=8, pack="block", max_blocks=1, max_blocks_wait_s=wait, submit=100))
        p = cycle(st, q, 399)
        assert p.reason("two") is PendingReason.TOPOLOGY
        p = cycle(st, q, 400)
        if placed_at_400:
            assert blocks_of(p, "two") == ("b0", "b1")  # the fewest blocks, not three
            assert check_state(st) == []  # the running job's lapsed limit is not a violation
        else:
            assert p.reason("two") is PendingReason.TOPOLOGY


def test_pack_node_puts_every_replica_on_one_node() -> None:
    st = cluster(blocks=1, nodes=2)
    big_quota(st, "t")
    occupy(st, spec("a", gpr=5), {"b0n0": (0, 1, 2, 3, 4)})
    occupy(st, spec("b", gpr=5), {"b0n1": (0, 1, 2, 3, 4)})
    # 2 x 2 GPUs: spreads across the two nodes when allowed, never with pack=node
    p = cycle(st, queue_of(spec("spread", replicas=2, gpr=2, pack="any")), 100, do_apply=False)
    assert len(nodes_of(p, "spread")) == 2
    p = cycle(st, queue_of(spec("one", replicas=2, gpr=2, pack="node")), 100)
    assert p.reason("one") is PendingReason.TOPOLOGY


def test_pack_node_larger_than_a_node_is_invalid() -> None:
    st = cluster()
    big_quota(st, "t")
    p = cycle(st, queue_of(spec("j", replicas=2, gpr=8, pack="node"), spec("k", gpr=9, submit=1)), 100)
    assert p.reason("j") is PendingReason.INVALID
    assert p.reason("k") is PendingReason.INVALID


def test_small_jobs_go_to_partly_used_blocks() -> None:
    st = cluster(blocks=3, nodes=4)
    big_quota(st, "t")
    fill(st, ["b1n0", "b1n1", "b1n2"])  # b1 partly used (one free node), b0/b2 untouched
    p = cycle(st, queue_of(spec("s", gpr=2)), 100)
    assert nodes_of(p, "s") == ["b1n3"]


def test_small_jobs_best_fit_node() -> None:
    st = cluster(blocks=1, nodes=3)
    big_quota(st, "t")
    occupy(st, spec("x", gpr=2), {"b0n0": (0, 1)})  # 6 free
    occupy(st, spec("y", gpr=5), {"b0n1": (0, 1, 2, 3, 4)})  # 3 free
    p = cycle(st, queue_of(spec("s3", gpr=3), spec("s4", gpr=4, submit=1)), 100)
    assert nodes_of(p, "s3") == ["b0n1"]
    assert nodes_of(p, "s4") == ["b0n0"]
    assert p.placement("s3").nodes[0].gpus == (5, 6, 7)


def test_gang_all_or_nothing() -> None:
    st = cluster(blocks=1, nodes=4)
    big_quota(st, "t")
    fill(st, ["b0n0", "b0n1"])
    p = cycle(st, queue_of(spec("gang", replicas=3, gpr=8)), 100)
    assert p.placements == ()
    assert p.reason("gang") is PendingReason.CAPACITY
    assert st.free_nodes("h100") == 2


def test_a_whole_node_job_short_of_free_nodes_but_not_of_gpus_is_told_topology() -> None:
    # one GPU used on each of two nodes: 14 GPUs free, no whole free node. An 8-GPU job (a
    # whole node) waits on the shape of the free GPUs, not their number: `topology`, with
    # the nodes it lacks; a 16-GPU job, more than the free GPUs, is told `capacity`
    st = cluster(blocks=1, nodes=2)
    big_quota(st, "t")
    occupy(st, spec("x"), {"b0n0": (0,)})
    occupy(st, spec("y"), {"b0n1": (0,)})
    p = cycle(st, queue_of(spec("g8", gpr=8), spec("g16", replicas=2, gpr=8, submit=1)), 100)
    assert p.placements == ()
    assert p.reason("g8") is PendingReason.TOPOLOGY
    assert p._index["g8"].detail == "needs 1 whole free node(s), 0 free"
    assert p.reason("g16") is PendingReason.CAPACITY


def test_a_one_replica_job_waiting_on_fragments_is_told_the_most_any_node_has() -> None:
    # 3 and 2 GPUs free on two nodes: 5 free, but a 4-GPU replica fits neither
    st = cluster(blocks=1, nodes=2)
    big_quota(st, "t")
    occupy(st, spec("x", gpr=5), {"b0n0": (0, 1, 2, 3, 4)})
    occupy(st, spec("y", gpr=6), {"b0n1": (0, 1, 2, 3, 4, 5)})
    p = cycle(st, queue_of(spec("s4", gpr=4)), 100)
    assert p.reason("s4") is PendingReason.TOPOLOGY
    assert p._index["s4"].detail == "needs 4 free GPUs on one node, 3 at most"


def test_jobs_run_only_on_their_gpu_type() -> None:
    st = cluster(blocks=1, nodes=2, gpu_type="a100", prefix="a")
    add_blocks(st, 1, 2, gpu_type="h100", prefix="h")
    big_quota(st, "t", gpu_type="a100")
    big_quota(st, "t", gpu_type="h100")
    p = cycle(
        st,
        queue_of(spec("h", gpr=8, gpu_type="h100"), spec("a", gpr=8, gpu_type="a100"), spec("x", gpu_type="v100")),
        100,
    )
    assert all(n.startswith("h") for n in nodes_of(p, "h"))
    assert all(n.startswith("a") for n in nodes_of(p, "a"))
    assert p.reason("x") is PendingReason.GPU_TYPE


def test_only_ready_nodes_take_placements() -> None:
    st = cluster(blocks=1, nodes=2)
    big_quota(st, "t")
    st.set_node_health("b0n0", NodeHealth.CORDONED)
    st.set_node_health("b0n1", NodeHealth.SUSPECT)
    p = cycle(st, queue_of(spec("j", gpr=4)), 100)
    assert p.reason("j") is PendingReason.NODE_HEALTH
    st.set_node_health("b0n1", NodeHealth.READY)
    p = cycle(st, queue_of(spec("j", gpr=4)), 100)
    assert nodes_of(p, "j") == ["b0n1"]


def test_hot_spares_held_for_large_gangs_and_used_on_restart() -> None:
    st = cluster(blocks=3, nodes=4)
    big_quota(st, "t")
    policy = Policy(hot_spare_min_gpus=64, hot_spare_fraction=0.1)
    q = queue_of(spec("big", replicas=8, gpr=8, pack="block"))
    p = cycle(st, q, 100, policy)
    pl = p.placement("big")
    assert len(pl.nodes) == 8 and len(pl.spare_nodes) == 1
    spare = pl.spare_nodes[0]
    assert st.spares("big") == (spare,)
    # nobody else may take the spare (not before Policy.spares_yield_after_s: see below)
    q2 = queue_of(
        spec("other", gpr=8, submit=101),
        spec("other2", gpr=8, submit=102),
        spec("other3", gpr=8, submit=103),
        spec("other4", gpr=8, submit=104),
    )
    p2 = cycle(st, q2, 110, policy)
    assert all(spare not in [n.node_id for n in pl2.nodes] for pl2 in p2.placements)
    assert len(p2.placements) == 3  # 12 nodes - 8 - 1 spare = 3 free
    # a node of the gang fails: the gang is released (spares kept) and restarts using its spare
    failed = nodes_of(p, "big")[0]
    res = fail_node(st, failed, 200)
    assert res.released == ("big",)
    assert st.spares("big") == (spare,)
    q3 = queue_of(requeue_spec(q.get("big") or spec("big", replicas=8, gpr=8, pack="block"), 200, front=True))
    p3 = cycle(st, q3, 200, policy)
    assert spare in nodes_of(p3, "big")
    assert failed not in nodes_of(p3, "big")


def test_spares_released_when_the_gang_ends() -> None:
    st = cluster(blocks=3, nodes=4)
    big_quota(st, "t")
    policy = Policy(hot_spare_min_gpus=64, hot_spare_fraction=0.1)
    p = cycle(st, queue_of(spec("big", replicas=8, gpr=8)), 100, policy)
    assert p.placement("big").spare_nodes
    apply_event(st, JobEnded("big"), 200)
    assert st.spares("big") == ()
    assert st.free_nodes("h100") == 12


def test_prod_serving_lost_replica_replaced_alone() -> None:
    st = cluster(blocks=1, nodes=4)
    big_quota(st, "inf")
    q = queue_of(spec("svc", team="inf", cls="prod-serving", replicas=3, gpr=4))
    p = cycle(st, q, 100)
    pl = p.placement("svc")
    assert len(pl.slots) == 3
    lost_node = pl.slots[0].node_id
    res = fail_node(st, lost_node, 200)
    assert res.degraded == ("svc",) and res.released == ()
    assert st.is_running("svc")
    assert st.missing_replicas("svc")
    p2 = cycle(st, queue_of(), 210)
    rp = p2.placement("svc")
    assert rp is not None and rp.replacement
    assert {s.replica for s in rp.slots} == set(st.missing_replicas("svc")) | {s.replica for s in rp.slots}
    assert st.missing_replicas("svc") == ()
    assert all(s.node_id != lost_node for s in rp.slots)


def test_plan_leaves_state_and_queue_unchanged() -> None:
    st = cluster(blocks=2, nodes=4)
    big_quota(st, "t")
    fill(st, ["b0n0"])
    q = queue_of(spec("a", replicas=2, gpr=8), spec("b", gpr=3, submit=1))
    before = (st.free_gpus("h100"), st.free_nodes("h100"), len(st), len(q))
    p = plan(st, q, Policy(), 100)
    assert len(p.placements) == 2
    assert (st.free_gpus("h100"), st.free_nodes("h100"), len(st), len(q)) == before
    assert not st.tentative


def test_apply_partial_commit() -> None:
    from placement import apply, check_state

    st = cluster(blocks=2, nodes=4)
    big_quota(st, "t")
    q = queue_of(spec("a", gpr=8), spec("b", gpr=8, submit=1))
    p = plan(st, q, Policy(), 100)
    apply(st, p, q, 100, committed={"b"})
    assert st.is_running("b") and not st.is_running("a")
    assert "a" in q and "b" not in q
    assert check_state(st) == []


def test_a_job_kept_off_hot_spares_is_told_hot_spare_not_capacity() -> None:
    """A big gang holds one idle spare node. A whole-node job that would fit with it, a small
    job that finds no node with room but the spare, are told ``hot_spare``; a job too large
    even with the spare is told ``capacity``; the same small job without spares held, ``topology``
    (fragmented GPUs) as before."""
    st = cluster(blocks=2, nodes=5)
    big_quota(st, "t", "s")
    policy = Policy(hot_spare_min_gpus=64, hot_spare_fraction=0.1, preemption=False, reservations=False)
    p = cycle(st, queue_of(spec("big", replicas=8, gpr=8, pack="block")), 100, policy)
    (spare,) = p.placement("big").spare_nodes
    free = [n for n in st.node_ids() if not st.node_jobs(n) and n != spare]
    assert len(free) == 1
    # 7 GPUs of the last free node busy: one GPU free, nowhere a node for 2 GPUs but the spare
    occupy(st, spec("frag", team="s", gpr=7), {free[0]: tuple(range(7))}, started_at=100)
    # (queued for less than Policy.spares_yield_after_s: the spare is not theirs yet)
    q = queue_of(
        spec("one-node", gpr=8, replicas=1, submit=101),
        spec("small", gpr=2, submit=102),
        spec("too-big", gpr=8, replicas=3, submit=103),
    )
    p = cycle(st, q, 110, policy, do_apply=False)
    assert p.placements == ()
    assert p.reason("one-node") is PendingReason.HOT_SPARE
    assert p.reason("small") is PendingReason.HOT_SPARE
    assert p.reason("too-big") is PendingReason.CAPACITY
    st.release("big", 120)  # its spares go with it
    occupy(st, spec("fill", team="s", replicas=8, gpr=8), [n for n in st.node_ids() if not st.node_jobs(n)][:-1])
    left = [n for n in st.node_ids() if not st.node_jobs(n)]
    occupy(st, spec("frag2", team="s", gpr=7), {left[0]: tuple(range(7))}, started_at=100)
    p = cycle(st, queue_of(spec("small", gpr=2, submit=2)), 130, policy, do_apply=False)
    assert p.reason("small") is PendingReason.TOPOLOGY


def test_hot_spares_yield_to_guaranteed_work_that_waited() -> None:
    """A big gang's spare node stays idle for its restart, but a job within its team's
    guarantee that has waited ``spares_yield_after_s`` and fits nowhere else takes it: the
    node leaves the gang's pool (the plan's ``spares_taken``). Borrowed work and work that
    has not waited that long are told ``hot_spare``; with the rule off, so is everyone."""
    policy = Policy(
        hot_spare_min_gpus=64, hot_spare_fraction=0.1, preemption=False, reservations=False, spares_yield_after_s=60
    )

    def setup() -> tuple[ClusterState, str]:
        st = cluster(blocks=2, nodes=5)
        big_quota(st, "t")
        st.set_quota("g", "h100", 8, 0)
        st.set_quota("b", "h100", 0, 64)
        p = cycle(st, queue_of(spec("big", replicas=8, gpr=8, pack="block")), 100, policy)
        (spare,) = p.placement("big").spare_nodes
        last = [n for n in st.node_ids() if not st.node_jobs(n) and n != spare]
        occupy(st, spec("other", team="t", gpr=8), last, started_at=100)
        return st, spare

    st, spare = setup()
    q = queue_of(spec("borrower", team="b", gpr=8, submit=0), spec("fresh", team="g", gpr=8, submit=150))
    p = cycle(st, q, 200, policy)
    assert p.placements == () and p.spares_taken == ()
    assert p.reason("borrower") is PendingReason.HOT_SPARE
    assert p.reason("fresh") is PendingReason.HOT_SPARE
    assert st.spares("big") == (spare,)
    # the guaranteed job that waited past the threshold takes it
    p = cycle(st, queue_of(spec("waited", team="g", gpr=8, submit=100)), 200, policy)
    assert nodes_of(p, "waited") == [spare]
    assert p.spares_taken == (spare,) and p.dropped_spares == ()
    assert st.spares("big") == ()
    # the rule off (the default): held whatever the wait
    st, spare = setup()
    off = replace(policy, spares_yield_after_s=None)
    assert Policy().spares_yield_after_s is None
    p = cycle(st, queue_of(spec("waited", team="g", gpr=8, submit=100)), 200, off)
    assert p.reason("waited") is PendingReason.HOT_SPARE and st.spares("big") == (spare,)


def test_guaranteed_work_takes_only_the_spares_it_needs() -> None:
    """Two spares held; a waited 8-GPU guaranteed job takes one, the gang keeps the other.
    A job that would not fit even with every spare takes none."""
    policy = Policy(
        hot_spare_min_gpus=64, hot_spare_fraction=0.2, preemption=False, reservations=False, spares_yield_after_s=60
    )
    st = cluster(blocks=2, nodes=6)
    big_quota(st, "t")
    st.set_quota("g", "h100", 64, 0)
    p = cycle(st, queue_of(spec("big", replicas=8, gpr=8, pack="block")), 100, policy)
    spares = p.placement("big").spare_nodes
    assert len(spares) == 2
    occupy(
        st,
        spec("other", team="t", replicas=2, gpr=8),
        [n for n in st.node_ids() if not st.node_jobs(n) and n not in spares],
        started_at=100,
    )
    p = cycle(st, queue_of(spec("huge", team="g", replicas=3, gpr=8, submit=0)), 300, policy)
    assert p.reason("huge") is PendingReason.CAPACITY and p.spares_taken == () and st.spares("big") == spares
    p = cycle(st, queue_of(spec("one", team="g", gpr=8, submit=0)), 300, policy)
    assert len(p.spares_taken) == 1 and nodes_of(p, "one") == list(p.spares_taken)
    assert st.spares("big") == tuple(n for n in spares if n not in p.spares_taken)


def test_spares_of_a_gang_placed_in_the_same_cycle_do_not_yield() -> None:
    """The gang's spare is chosen by this plan and held only once it is applied: a guaranteed
    job that waited past ``spares_yield_after_s`` and is decided after the gang in the same
    cycle is told ``hot_spare``; it takes the spare in a later cycle."""
    policy = Policy(
        hot_spare_min_gpus=64, hot_spare_fraction=0.1, preemption=False, reservations=False, spares_yield_after_s=60
    )
    st = cluster(blocks=2, nodes=5)
    big_quota(st, "t")
    st.set_quota("g", "h100", 8, 0)
    occupy(st, spec("other", team="t", gpr=8), ["b1n4"], started_at=0)
    q = queue_of(
        spec("big", cls="prod-batch", replicas=8, gpr=8, pack="block", submit=50),
        spec("waited", team="g", gpr=8, submit=0),
    )
    p = cycle(st, q, 200, policy)
    (spare,) = p.placement("big").spare_nodes
    assert p.reason("waited") is PendingReason.HOT_SPARE and p.spares_taken == ()
    assert st.spares("big") == (spare,)
    p = cycle(st, q, 230, policy)
    assert nodes_of(p, "waited") == [spare] and p.spares_taken == (spare,)


@pytest.mark.parametrize(
    ("job", "occupied", "before", "after"),
    [
        (spec("whole", gpr=8), {}, ["b0n0"], ["b0n1"]),
        (spec("gang", replicas=2, gpr=8), {}, ["b0n0", "b0n1"], ["b0n1", "b0n2"]),
        (spec("small", gpr=2), {"b0n0": (0, 1)}, ["b0n0"], ["b0n1"]),
    ],
    ids=["whole-node", "gang", "small"],
)
def test_a_job_goes_past_the_nodes_its_attempts_failed_on_while_others_fit(job, occupied, before, after) -> None:
    """``JobSpec.avoid_nodes``: after an attempt failed on b0n0 the same search picks b0n0
    again (its GPUs are free the moment the attempt ends); the job goes elsewhere."""
    for avoid, want in ((frozenset(), before), (frozenset({"b0n0"}), after)):
        st = cluster(blocks=1, nodes=3)
        big_quota(st, "t")
        if occupied:
            occupy(st, spec("other", gpr=2), occupied)
        p = cycle(st, queue_of(replace(job, avoid_nodes=avoid)), 100)
        assert sorted(nodes_of(p, job.job_id)) == want, avoid


def test_a_job_runs_on_a_node_its_attempts_failed_on_when_nothing_else_fits() -> None:
    st = cluster(blocks=1, nodes=2)
    big_quota(st, "t")
    fill(st, ["b0n1"])
    p = cycle(st, queue_of(spec("j", gpr=8, avoid_nodes=frozenset({"b0n0"}))), 100)
    assert nodes_of(p, "j") == ["b0n0"]  # a preference, not a ban: a healthy node's GPUs stay in use
