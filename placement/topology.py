"""Where a job fits: job shape, block and node selection, hot spares.

Rules (docs/design.md, Jobs and Placement):

* a replica (<= node-size GPUs) runs on one node;
* a job of >= node-size GPUs in total takes whole nodes (replicas packed per node);
  ``nodes = ceil(replicas / (node_gpus // gpus_per_replica))``, charged as whole nodes;
* whole-node jobs: fill whole blocks first, best-fit for the rest (the block with the
  fewest free nodes that still fits), at most ``max_blocks`` blocks for ``pack=block``;
* small jobs: one node, best fit (the node with the fewest free GPUs that fits, so
  partly used nodes and blocks fill first); ``pack=node`` never spreads, otherwise a
  small job that fits on no single node may spread its replicas (``pack=block``:
  within one block);
* with ``Policy.topology`` False: first fit by node id, blocks ignored.

Searches read only the indexes of ``ClusterState`` (free nodes per block, nodes per
free-GPU count), never the whole cluster.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Collection, Container
from dataclasses import dataclass

from placement.model import JobSpec, NodeHealth, Pack, PendingReason, Placement, Policy, ReplicaSlot
from placement.state import ClusterState, _TypeIndex, indices_of, make_placement


@dataclass(frozen=True, slots=True)
class Shape:
    whole: bool  # takes whole nodes
    nodes: int  # whole nodes needed (1 for small jobs)
    per_node: int  # replicas per node (whole-node jobs)
    charge: int  # GPUs charged to quota
    total: int  # GPUs the replicas use


_SHAPES: dict[tuple[int, int, Pack, int], Shape | str] = {}


def job_shape(job: JobSpec, node_gpus: int) -> Shape | str:
    """The job's shape on nodes of ``node_gpus`` GPUs, or a string saying why it is invalid."""
    key = (job.gpus_per_replica, job.replicas, job.topology.pack, node_gpus)
    got = _SHAPES.get(key)
    if got is None:
        if len(_SHAPES) > 65536:
            _SHAPES.clear()
        got = _SHAPES[key] = _shape(job, node_gpus)
    return got


def _shape(job: JobSpec, node_gpus: int) -> Shape | str:
    gpr, reps = job.gpus_per_replica, job.replicas
    if gpr < 1 or reps < 1:
        return "replicas and gpus_per_replica must be >= 1"
    if gpr > node_gpus:
        return f"gpus_per_replica {gpr} > {node_gpus} GPUs per node"
    total = gpr * reps
    if total >= node_gpus:
        per = node_gpus // gpr
        n = -(-reps // per)
        if job.topology.pack is Pack.NODE and n > 1:
            return f"pack=node but {total} GPUs need {n} nodes"
        return Shape(True, n, per, n * node_gpus, total)
    return Shape(False, 1, reps, total, total)


class Search:
    """One job's view of the free capacity: which reservations it may not use, which nodes only,
    which nodes not."""

    __slots__ = ("any_excl", "avail", "avoid", "end", "excl", "node_res", "own_pre", "restrict", "state", "ti")

    def __init__(
        self,
        state: ClusterState,
        ti: _TypeIndex,
        excl: Container[str] = (),
        restrict: Collection[str] | None = None,
        avoid: frozenset[str] = frozenset(),
    ) -> None:
        self.state = state
        self.ti = ti
        self.end: float | None = None  # the placed job's expected end (Policy.align_node_ends)
        self.excl = excl  # reservation owners whose nodes this job may not use
        self.restrict = restrict  # if set, only these nodes
        self.avoid = avoid  # not these nodes (JobSpec.avoid_nodes, on the first try)
        self.node_res = state._node_res
        self.any_excl = bool(excl)  # a Search lives within one decision: the set cannot change
        # the job's own preemption reservation: its nodes are usable whoever else holds them
        self.own_pre: str | None = getattr(excl, "own_pre", None)
        # the exclusions' own memo of ``block_avail`` (``Exclusions.avail``), None for a plain set
        self.avail: dict[str, tuple[int, int]] | None = getattr(excl, "avail", None) if restrict is None else None

    def ok(self, nid: str) -> bool:
        if self.restrict is not None and nid not in self.restrict:
            return False
        if self.avoid and nid in self.avoid:
            return False
        if self.any_excl:
            owners = self.node_res.get(nid)
            if owners and self.own_pre not in owners:
                excl = self.excl
                for o in owners:
                    if o in excl:
                        return False
        return True

    def block_avail(self, bid: str) -> int:
        """Free whole nodes of the block this job may use (O(owner sets held there))."""
        blk = self.ti.blocks[bid]
        if self.restrict is None and not self.avoid:
            n = len(blk.free_nodes)
            if not n or not self.any_excl:
                return n
            held = self.state._block_res_free.get(bid)
            if held:
                memo = self.avail
                if memo is not None:
                    got = memo.get(bid)
                    if got is not None and got[0] == blk.version:
                        return got[1]
                excl = self.excl
                own = self.own_pre
                for owners, c in held.items():
                    if own is not None and own in owners:
                        continue
                    for o in owners:
                        if o in excl:
                            n -= c
                            break
                if memo is not None:
                    memo[bid] = (blk.version, n)
            return n
        ok = self.ok
        return sum(1 for n in blk.free_nodes if ok(n))

    def block_nodes(self, bid: str, k: int) -> list[str]:
        out = []
        ok = self.ok
        for n in self.ti.blocks[bid].free_nodes:
            if ok(n):
                out.append(n)
                if len(out) == k:
                    break
        return out


def _greedy_blocks(cands: list[tuple[int, str]], k: int, max_blocks: int) -> list[tuple[str, int]] | None:
    """Fewest blocks: largest first (whole blocks), the remainder best-fit. ``cands`` (avail, id)."""
    cands = sorted(cands)  # ascending avail, then id
    chosen: list[tuple[str, int]] = []
    need = k
    while need > 0:
        if len(chosen) >= max_blocks or not cands:
            return None
        i = bisect_left(cands, (need, ""))
        if i < len(cands):
            avail, bid = cands.pop(i)
            chosen.append((bid, need))
            need = 0
        else:
            # the largest block (a whole free block when there is one); ties by id
            j = bisect_left(cands, (cands[-1][0], ""))
            avail, bid = cands.pop(j)
            chosen.append((bid, avail))
            need -= avail
    return chosen


def too_few_free_nodes(ti: _TypeIndex, shape: Shape) -> PendingReason:
    """Why a whole-node job finds fewer whole free nodes than it needs: ``topology`` when the
    free GPUs would hold it but lie in parts of used nodes (fragments), else ``capacity``."""
    return PendingReason.TOPOLOGY if ti.free_gpus >= shape.total else PendingReason.CAPACITY


def find_whole_nodes(search: Search, shape: Shape, job: JobSpec, policy: Policy) -> list[str] | PendingReason:
    ti = search.ti
    k = shape.nodes
    if ti.free_nodes < k:
        return too_few_free_nodes(ti, shape)
    if search.restrict is not None:
        bids = sorted({search.state._nodes[n].block for n in search.restrict if n in search.state._nodes})
    else:
        bids = sorted(ti.blocks_free)
    if not policy.topology:
        out: list[str] = []
        for bid in bids:
            out.extend(search.block_nodes(bid, k - len(out)))
            if len(out) == k:
                return out
        return PendingReason.RESERVATION
    cands = []
    total = 0
    for bid in bids:
        a = search.block_avail(bid)
        if a:
            cands.append((a, bid))
            total += a
    if total < k:
        return PendingReason.RESERVATION
    pack = job.topology.pack
    if pack is Pack.BLOCK:
        max_b = job.topology.max_blocks or len(cands)
    elif pack is Pack.NODE:
        max_b = 1
    else:
        max_b = len(cands)
    chosen = _greedy_blocks(cands, k, max_b)
    if chosen is None:
        return PendingReason.TOPOLOGY
    out = []
    for bid, n in chosen:
        out.extend(search.block_nodes(bid, n))
    return out


def _lowest(mask: int, g: int) -> tuple[int, ...]:
    return indices_of(mask)[:g]


def find_small_node(search: Search, need: int, policy: Policy, borrowed: bool | None = None) -> str | None:
    """The node for ``need`` GPUs: best fit among partly used nodes, else a free node in the
    most used block (first fit by id without topology). With ``Policy.borrowed_apart`` and
    the job's ``borrowed`` flag given, best fit among partly used nodes whose jobs all share
    that flag comes first."""
    ti = search.ti
    G = ti.node_gpus
    buckets = ti.buckets
    ok = search.ok
    if borrowed is not None and policy.borrowed_apart and policy.topology and search.restrict is None:
        nid = _apart_node(search, need, borrowed)
        if nid is not None:
            return nid
    if search.restrict is not None:
        best = None
        for nid in sorted(search.restrict):
            node = search.state._nodes.get(nid)
            if node is None or node.gpu_type != ti.gpu_type or node.spare_of is not None:
                continue
            if node.health is not NodeHealth.READY or node.nfree < need or not ok(nid):
                continue
            key = (node.nfree, nid) if policy.topology else (0, nid)
            if best is None or key < best:
                best = key
        return best[1] if best else None
    if not policy.topology:
        best_id = None
        for f in range(need, G + 1):
            for nid in buckets[f]:
                if ok(nid):
                    if best_id is None or nid < best_id:
                        best_id = nid
                    break
        return best_id
    if policy.align_node_ends and search.end is not None:
        nid = _aligned_node(search, need)
        if nid is not None:
            return nid
    else:
        for f in range(need, G):
            for nid in buckets[f]:
                if ok(nid):
                    return nid
    if not buckets[G]:
        return None
    # a whole free node: from the block with the fewest free nodes (partly used blocks first)
    for _count, bid in sorted((c, b) for b, c in ti.blocks_free.items()):
        nodes = search.block_nodes(bid, 1)
        if nodes:
            return nodes[0]
    return None


def _aligned_node(search: Search, need: int) -> str | None:
    """Among partly used nodes that fit: one this job would not keep busy past its jobs'
    expected ends (start + max_runtime), best fit, the earliest such end; else the one it
    keeps busy the least longer. Nodes whose jobs end together free whole nodes together."""
    ti = search.ti
    nodes = search.state._nodes
    running = search.state._running
    ok = search.ok
    end = search.end
    assert end is not None
    best: tuple[int, float, float, str] | None = None
    for f in range(need, ti.node_gpus):
        for nid in ti.buckets[f]:
            if not ok(nid):
                continue
            horizon = 0.0
            for j in nodes[nid].jobs:
                rj = running[j]
                h = rj.started_at + rj.spec.max_runtime_s
                if h > horizon:
                    horizon = h
            ext = end - horizon
            key = (0, float(f), horizon, nid) if ext <= 0 else (1, ext, float(f), nid)
            if best is None or key < best:
                best = key
    return best[-1] if best is not None else None


def _apart_node(search: Search, need: int, borrowed: bool) -> str | None:
    """Best fit among partly used nodes whose running jobs are all ``borrowed`` (or all not):
    borrowed work kept off nodes with guaranteed work leaves whole nodes a reclaim can clear."""
    ti = search.ti
    nodes = search.state._nodes
    running = search.state._running
    ok = search.ok
    for f in range(need, ti.node_gpus):
        for nid in ti.buckets[f]:
            jobs = nodes[nid].jobs
            if jobs and all(running[j].borrowed is borrowed for j in jobs) and ok(nid):
                return nid
    return None


def find_spread(search: Search, job: JobSpec, policy: Policy) -> list[tuple[str, int]] | None:
    """Small job over several nodes: [(node, replicas there)], or None."""
    ti = search.ti
    gpr, reps = job.gpus_per_replica, job.replicas
    state = search.state
    cap = 0
    for f in range(gpr, ti.node_gpus + 1):
        cap += (f // gpr) * len(ti.buckets[f])
    if cap < reps:
        return None
    ok = search.ok
    cand: list[tuple[int, str]] = []  # (free, node) best fit first
    for f in range(gpr, ti.node_gpus + 1):
        for nid in ti.buckets[f]:
            if ok(nid):
                cand.append((f, nid))
    if not policy.topology:
        cand.sort(key=lambda x: x[1])
    if job.topology.pack is Pack.BLOCK and policy.topology:
        per_block: dict[str, int] = {}
        for f, nid in cand:
            b = state._nodes[nid].block
            per_block[b] = per_block.get(b, 0) + f // gpr
        fits = sorted((c, b) for b, c in per_block.items() if c >= reps)
        if not fits:
            return None
        block = fits[0][1]
        cand = [(f, n) for f, n in cand if state._nodes[n].block == block]
    out: list[tuple[str, int]] = []
    left = reps
    for f, nid in cand:
        r = min(f // gpr, left)
        out.append((nid, r))
        left -= r
        if not left:
            return out
    return None


def build_whole(state: ClusterState, job: JobSpec, shape: Shape, nodes: list[str], borrowed: bool) -> Placement:
    ti = state._types[job.gpu_type]
    G = ti.node_gpus
    gpr = job.gpus_per_replica
    all_gpus = tuple(range(G))
    slots = []
    for r in range(job.replicas):
        n = nodes[r // shape.per_node]
        off = (r % shape.per_node) * gpr
        slots.append(ReplicaSlot(r, n, all_gpus[off : off + gpr]))
    blocks = [state._nodes[n].block for n in nodes]
    return make_placement(job, [(n, all_gpus) for n in nodes], slots, blocks, borrowed, shape.charge)


def build_small(state: ClusterState, job: JobSpec, spread: list[tuple[str, int]], borrowed: bool) -> Placement:
    gpr = job.gpus_per_replica
    slots = []
    held = []
    r = 0
    for nid, count in spread:
        node = state._nodes[nid]
        gpus = _lowest(node.free_mask, count * gpr)
        held.append((nid, gpus))
        for i in range(count):
            slots.append(ReplicaSlot(r, nid, gpus[i * gpr : (i + 1) * gpr]))
            r += 1
    blocks = [state._nodes[n].block for n, _ in spread]
    return make_placement(job, held, slots, blocks, borrowed, job.total_gpus)


def find_placement(
    search: Search, job: JobSpec, shape: Shape, borrowed: bool, policy: Policy
) -> Placement | PendingReason:
    """A placement on free capacity this job may use, or why there is none."""
    state = search.state
    if shape.whole:
        r = find_whole_nodes(search, shape, job, policy)
        if isinstance(r, PendingReason):
            return r
        return build_whole(state, job, shape, r, borrowed)
    ti = search.ti
    if ti.free_gpus < shape.total:
        return PendingReason.CAPACITY
    nid = find_small_node(search, shape.total, policy, borrowed)
    if nid is not None:
        return build_small(state, job, [(nid, job.replicas)], borrowed)
    if job.replicas > 1 and job.topology.pack is not Pack.NODE and search.restrict is None:
        spread = find_spread(search, job, policy)
        if spread is not None:
            return build_small(state, job, spread, borrowed)
    # nothing fits: was it reservations, or shape?
    if any(ti.buckets[f] for f in range(shape.total, ti.node_gpus + 1)):
        return PendingReason.RESERVATION
    return PendingReason.TOPOLOGY


def choose_spares(search: Search, job: JobSpec, shape: Shape, placed_nodes: list[str], policy: Policy) -> list[str]:
    """Hot spares for a large gang: ceil(fraction x nodes), from free nodes of its blocks first,
    then the blocks with the fewest free nodes. Best effort (fewer if none are free)."""
    if shape.charge < policy.hot_spare_min_gpus or policy.hot_spare_fraction <= 0:
        return []
    want = math.ceil(policy.hot_spare_fraction * shape.nodes)
    state = search.state
    ti = search.ti
    taken = set(placed_nodes)
    own_blocks = sorted({state._nodes[n].block for n in placed_nodes})
    others = [b for _, b in sorted((c, b) for b, c in ti.blocks_free.items()) if b not in own_blocks]
    out: list[str] = []
    for bid in own_blocks + others:
        if bid not in ti.blocks_free:
            continue
        for n in ti.blocks[bid].free_nodes:
            if n not in taken and search.ok(n):
                out.append(n)
                if len(out) == want:
                    return out
    return out
