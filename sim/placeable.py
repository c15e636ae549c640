"""Could a waiting job be placed on nodes that are free or hold only work it may take back?

The starvation figure beside the GPU count (``Metrics``: ``starved_while_nodes_suffice``)
asks this of a starving team's waiting work. ``starved_while_capacity_suffices`` adds up
free and reclaimable GPUs over the whole GPU type; a 1,024-GPU gang limited to 5 blocks
can find those GPUs in parts of nodes all over the cluster and still have nowhere to run.
Here each node counts for what the job's shape can use of it, by ``placement.topology``'s
rules:

* a job of node size or more takes whole nodes: a node counts if every GPU on it is free
  or held by work the job may take back; ``pack=block`` takes at most ``max_blocks``
  blocks (lifted past ``max_blocks_wait_s``, as the engine lifts it), ``pack=node`` one
  node;
* a smaller job takes one node, or spreads its replicas over nodes (``pack=block``: within
  one block; ``pack=node``: never).

Work the job may take back is the yardstick's: other teams' borrowed work of the job's
class or a lower one (prod-serving never), not already stopping, whatever its age. Nodes
not ``ready`` and hot spares are left out; nodes held by reservations count (holding them
is a scheduler's choice). Exact GPU indices and NVLink masks are not checked: a node's
free and reclaimable GPUs are counted, not which ones.
"""

from __future__ import annotations

from placement.model import JobSpec, NodeHealth, Pack
from placement.state import ClusterState, RunningJob
from placement.topology import job_shape


class NodeRoom:
    """One GPU type's ready nodes, hot spares left out, as they stand at one instant."""

    def __init__(self, state: ClusterState, gpu_type: str, respect_topology: bool = True) -> None:
        self.node_gpus = state.node_gpus(gpu_type) or 0
        self.respect_topology = respect_topology
        # per block, per node: (free GPUs, the jobs on it with the GPUs each holds there)
        self.blocks: list[list[tuple[int, tuple[tuple[RunningJob, int], ...]]]] = []
        for bid in state.block_ids(gpu_type):
            nodes = []
            for nid in state.block_nodes(bid):
                if state.node_health(nid) is not NodeHealth.READY or state.node_spare_of(nid) is not None:
                    continue
                held = tuple((state.running(j), len(g)) for j, g in state.node_jobs(nid).items())
                nodes.append((len(state.node_free(nid)), held))
            self.blocks.append(nodes)
        self._room: dict[tuple[str, int], list[list[int]]] = {}

    def room(self, team: str, min_rank: int) -> list[list[int]]:
        """Per block, per node: GPUs free or held by other teams' borrowed work of rank
        ``min_rank`` or lower priority, not stopping."""
        key = (team, min_rank)
        got = self._room.get(key)
        if got is None:
            got = self._room[key] = [
                [
                    free
                    + sum(
                        n
                        for rj, n in held
                        if rj.borrowed and rj.team != team and rj.rank >= min_rank and rj.preempting_for is None
                    )
                    for free, held in nodes
                ]
                for nodes in self.blocks
            ]
        return got

    def fits(self, job: JobSpec, now: float) -> bool:
        """Could ``job`` (of team ``job.team``) be placed at ``now`` on free and reclaimable GPUs?"""
        shape = job_shape(job, self.node_gpus) if self.node_gpus else "no nodes"
        if isinstance(shape, str):
            return False
        room = self.room(job.team, max(job.rank, 1))
        topo = job.as_placed_at(now).topology
        if shape.whole:
            clear = [sum(1 for a in nodes if a >= self.node_gpus) for nodes in room]
            if topo.pack is Pack.BLOCK and topo.max_blocks and self.respect_topology:
                return sum(sorted(clear, reverse=True)[: topo.max_blocks]) >= shape.nodes
            return sum(clear) >= shape.nodes  # pack=node: shape.nodes is 1 (job_shape)
        gpr, reps = job.gpus_per_replica, job.replicas
        if any(a // gpr >= reps for nodes in room for a in nodes):
            return True
        if topo.pack is Pack.NODE:
            return False
        per_block = [sum(a // gpr for a in nodes) for nodes in room]
        if topo.pack is Pack.BLOCK and self.respect_topology:
            return max(per_block, default=0) >= reps
        return sum(per_block) >= reps
