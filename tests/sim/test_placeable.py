"""sim.placeable: does a waiting job's shape fit nodes free or holding work it may take back?"""

from __future__ import annotations

import pytest

from placement import ClusterState, NodeHealth
from sim.placeable import NodeRoom

from ..placement.helpers import HOUR, cluster, occupy, spec


def _fragmented() -> ClusterState:
    """2 blocks x 4 nodes of 8 GPUs. On every node team x runs 5 GPUs within its guarantee;
    team a runs the other 3 borrowed (research) on b0's four nodes and on b1n0, and on
    b1n1-b1n3 they are free."""
    st = cluster()
    st.set_quota("x", "h100", 40, 0)
    st.set_quota("a", "h100", 0, 64)
    st.set_quota("b", "h100", 16, 0)
    for b in range(2):
        for n in range(4):
            occupy(st, spec(f"x{b}{n}", team="x", gpr=5), {f"b{b}n{n}": (0, 1, 2, 3, 4)})
    for n in range(4):
        occupy(st, spec(f"a0{n}", team="a", gpr=3), {f"b0n{n}": (5, 6, 7)}, borrowed=True)
    occupy(st, spec("a10", team="a", gpr=3), {"b1n0": (5, 6, 7)}, borrowed=True)
    return st


def test_gpus_in_parts_of_nodes_hold_small_jobs_but_no_whole_node_job() -> None:
    st = _fragmented()
    room = NodeRoom(st, "h100")
    # 3 GPUs free or reclaimable on every node (24 in all): enough GPUs for 16
    assert sum(map(sum, room.room("b", 2))) == 24
    assert room.fits(spec("small", team="b", gpr=3), 0.0)
    # a 4-GPU job fits no node; spread as 4 x 1-GPU replicas it does (pack=any or block), one
    # node only (pack=node) it does not
    assert not room.fits(spec("four", team="b", gpr=4), 0.0)
    assert room.fits(spec("spread", team="b", replicas=4, gpr=1), 0.0)
    assert room.fits(spec("spread-block", team="b", replicas=6, gpr=1, pack="block"), 0.0)
    # 3 x 2-GPU replicas: one per node, 1 GPU of each node's 3 left over
    assert room.fits(spec("pairs", team="b", replicas=3, gpr=2), 0.0)
    assert not room.fits(spec("one-node", team="b", replicas=4, gpr=1, pack="node"), 0.0)
    # two whole nodes: x's guaranteed research work is no victim of b's research job
    assert not room.fits(spec("gang", team="b", replicas=2, gpr=8), 0.0)


@pytest.mark.parametrize(
    ("team", "cls", "fits"),
    [
        ("b", "research", True),  # a's borrowed research work: the same class, another team's
        ("b", "prod-batch", True),  # a higher class takes back lower classes' borrowed work
        ("b", "preemptible", False),  # a lower class may not take back research work
        ("a", "research", False),  # a team's own work is not capacity it takes back
    ],
)
def test_only_work_the_job_may_take_back_counts(team: str, cls: str, fits: bool) -> None:
    st = _fragmented()
    # a's 8-GPU job on a node of its own in a third block: the only whole node to clear
    st.add_node("b2n0", "b2", "h100", 8)
    occupy(st, spec("a-whole", team="a", gpr=8), ["b2n0"], borrowed=True)
    assert NodeRoom(st, "h100").fits(spec("one", team=team, cls=cls, gpr=8), 0.0) is fits


def test_a_node_stopping_or_not_ready_or_held_as_a_spare_is_no_room() -> None:
    st = cluster(blocks=1, nodes=2)
    st.set_quota("a", "h100", 0, 64)
    occupy(st, spec("a0", team="a", gpr=8), ["b0n0"], borrowed=True)
    occupy(st, spec("a1", team="a", gpr=8), ["b0n1"], borrowed=True)
    job = spec("gang", team="b", replicas=2, gpr=8)
    assert NodeRoom(st, "h100").fits(job, 0.0)
    st.mark_preempting("a1", "someone")  # already stopping: not counted again
    assert not NodeRoom(st, "h100").fits(job, 0.0)
    st2 = cluster(blocks=1, nodes=2)
    st2.set_node_health("b0n1", NodeHealth.SUSPECT)
    assert not NodeRoom(st2, "h100").fits(job, 0.0)


def test_a_block_limit_counts_whole_nodes_in_the_fewest_blocks_and_lapses_with_its_wait() -> None:
    # 3 blocks of 4 nodes; free whole nodes: 2 in b0, 1 in b1, 1 in b2 (the rest held by x's
    # guaranteed work)
    st = cluster(blocks=3, nodes=4)
    st.set_quota("x", "h100", 96, 0)
    for nid in ("b0n2", "b0n3", "b1n1", "b1n2", "b1n3", "b2n1", "b2n2", "b2n3"):
        occupy(st, spec(f"x-{nid}", team="x", gpr=8), [nid])
    room = NodeRoom(st, "h100")
    three = dict(team="b", replicas=3, gpr=8, pack="block")
    assert room.fits(spec("g2", **three, max_blocks=2), 0.0)
    assert not room.fits(spec("g1", **three, max_blocks=1), 0.0)
    # past its max_blocks_wait_s the limit lifts, as the engine lifts it
    waits = spec("g1w", **three, max_blocks=1, max_blocks_wait_s=HOUR)
    assert not room.fits(waits, HOUR - 1.0)
    assert room.fits(waits, HOUR + 1.0)
    # a policy that ignores topology ignores the limit too
    assert NodeRoom(st, "h100", respect_topology=False).fits(spec("g1", **three, max_blocks=1), 0.0)
