"""Victim choice for a job that cannot fit on free capacity.

Eligible victims (``eligible``) for a preemptor of class rank ``r``:

* never prod-serving; never a job already being preempted;
* never within ``preemption_protect_s`` of its start, unless it is borrowed (borrowed
  capacity is always reclaimable: docs/design.md invariant 4 and the reclaim bound of
  grace + 2 cycles; the protection is against priority churn of guaranteed work);
* normal mode (the preemptor is within its team's guarantee): jobs of a lower class
  (rank > r), or borrowed jobs of the same class of *another* team (a team never
  reclaims its own borrowed work: it would only trade its work for its work);
* normal mode, once the preemptor has waited ``Policy.reclaim_small_borrowed_after_s``:
  also *small* borrowed jobs (fewer than ``reserve_min_gpus`` GPUs) of *higher* classes
  of other teams, never prod-serving: borrowed capacity is given back to a team within
  its guarantee whatever the classes, without stopping a gang across classes;
* borrowed-only mode (prod-serving beyond its guarantee, or a gang beyond it with
  ``Policy.borrowed_gangs_reclaim_lower``): borrowed jobs of lower classes only (of
  other teams);
* a job preempted ``daily_preemption_budget`` times in ``preemption_window_s`` is a
  victim only if it is borrowed.

Choice: target blocks first (the blocks where the gang fits with the most nodes
already free), then victims inside them, greedily by fewest jobs per node freed,
then least lost work (GPU-seconds since the most recent checkpoint, or since start
if it cannot checkpoint), then the team furthest over its share (used /
guarantee), then id. A small job takes one victim if any suffices (the one losing
the least work), else the fewest victims sharing one node.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass

from placement.model import SERVING_RANK, NodeHealth, Pack, Policy, PreemptReason
from placement.quota import over_share
from placement.state import ClusterState, RunningJob, _TypeIndex
from placement.topology import Search, Shape


@dataclass(frozen=True, slots=True)
class Mode:
    rank: int  # the preemptor's class rank
    borrowed_only: bool  # prod-serving beyond its guarantee
    team: str = ""  # the preemptor's team: its own borrowed work is never reclaimed for it
    # within its guarantee and past Policy.reclaim_small_borrowed_after_s: small borrowed
    # jobs of higher classes too
    higher_small: bool = False


_CATS: dict[tuple[int, bool, bool], list[tuple[int, bool]]] = {}
_SCAN_LIMIT = 4096  # candidates looked at per small-job victim search
_AFTER_BEST = 16  # and at most this many more once one fits (least GPU-seconds among them)


def categories(mode: Mode) -> list[tuple[int, bool]]:
    key = (mode.rank, mode.borrowed_only, mode.higher_small)
    got = _CATS.get(key)
    if got is None:
        got = _CATS[key] = _categories(mode)
    return got


def _categories(mode: Mode) -> list[tuple[int, bool]]:
    if mode.borrowed_only:
        return [(r, True) for r in range(mode.rank + 1, 4)]
    cats = [(mode.rank, True)] if mode.rank != SERVING_RANK else []
    if mode.higher_small:
        cats += [(r, True) for r in range(SERVING_RANK + 1, mode.rank)]
    for r in range(mode.rank + 1, 4):
        cats.append((r, False))
        cats.append((r, True))
    return cats


def eligible(rj: RunningJob, mode: Mode, now: float, policy: Policy) -> bool:
    if rj.rank == SERVING_RANK or rj.preempting_for is not None:
        return False
    if rj.started_at >= now:
        return False  # placed by this very cycle
    if not rj.borrowed and now - rj.started_at < policy.preemption_protect_s:
        return False
    if mode.borrowed_only:
        if not rj.borrowed or rj.rank <= mode.rank:
            return False
    elif not (
        rj.rank > mode.rank
        or (rj.borrowed and (rj.rank == mode.rank or (mode.higher_small and rj.charge < policy.reserve_min_gpus)))
    ):
        return False
    if mode.team and rj.spec.team == mode.team and (mode.borrowed_only or rj.rank <= mode.rank):
        return False  # a reclaim of the team's own borrowed work
    if not rj.borrowed and policy.daily_preemption_budget >= 0:
        if rj.spec.preemptions_since(now - policy.preemption_window_s) >= policy.daily_preemption_budget:
            return False
    return True


def reason_for(rj: RunningJob, mode: Mode) -> PreemptReason:
    if mode.borrowed_only or rj.rank <= mode.rank:
        return PreemptReason.RECLAIM
    return PreemptReason.PRIORITY


def eligible_upper_bound(ti: _TypeIndex, mode: Mode) -> int:
    return sum(ti.cat_gpus.get(c, 0) for c in categories(mode))


def _iter_candidates(state: ClusterState, ti: _TypeIndex, mode: Mode) -> Iterator[RunningJob]:
    """Running jobs of the eligible categories, least lost work first (most recent checkpoint)."""
    lists = [ti.victims[c] for c in categories(mode) if ti.victims.get(c)]
    running = state._running
    for _, jid in heapq.merge(*lists):
        yield running[jid]


@dataclass(frozen=True, slots=True)
class VictimChoice:
    victims: tuple[str, ...]
    nodes: tuple[str, ...]  # nodes to hold for the beneficiary
    blocks: tuple[str, ...]
    grace_s: float


def _lost(rj: RunningJob, now: float) -> float:
    """GPU-seconds lost if preempted now: its GPUs x time since its last checkpoint (or start)."""
    return rj.charge * max(0.0, now - rj.lost_since)


def _node_usable(state: ClusterState, search: Search, nid: str) -> bool:
    node = state._nodes[nid]
    return node.health is NodeHealth.READY and node.spare_of is None and search.ok(nid)


def find_small(
    state: ClusterState,
    search: Search,
    need: int,
    mode: Mode,
    now: float,
    policy: Policy,
    limit: int,
    use_free: bool = True,
) -> VictimChoice | None:
    """Victims that make room for ``need`` GPUs on one node (a small job).

    ``use_free`` False: only the victims' GPUs count (prod-serving beyond its guarantee).
    """
    ti = search.ti
    best: tuple | None = None
    scanned = seen = 0
    over_cache: dict[str, float] = {}
    protect_until = now - policy.preemption_protect_s
    after_best = 0
    for rj in _iter_candidates(state, ti, mode):
        if best is not None:
            after_best += 1
            if now - rj.lost_since > best[1] or after_best > _AFTER_BEST:
                break  # from here every victim loses more work (>= 1 GPU x time since checkpoint)
        seen += 1
        if seen > _SCAN_LIMIT:
            break
        if (rj.started_at > protect_until and not rj.borrowed) or not eligible(rj, mode, now, policy):
            continue
        scanned += 1
        for nid in sorted(rj.held):
            node = state._nodes[nid]
            if (node.nfree if use_free else 0) + rj.held[nid].bit_count() < need:
                continue
            if not _node_usable(state, search, nid):
                continue
            o = over_cache.get(rj.team)
            if o is None:
                o = over_cache[rj.team] = over_share(state, rj.team, rj.gpu_type)
            key = (1, _lost(rj, now), -o, rj.job_id, nid)
            if best is None or key < best:
                best = key
        if best is None and scanned >= 512:
            break
    if best is not None:
        rj = state._running[best[3]]
        return VictimChoice((rj.job_id,), (best[4],), (state._nodes[best[4]].block,), rj.spec.grace_s)
    if limit < 2:
        return None
    # several victims on one node (small jobs sharing it)
    seen_nodes: set[str] = set()
    cand: tuple | None = None
    for rj in _iter_candidates(state, ti, mode):
        if not eligible(rj, mode, now, policy):
            continue
        for nid in rj.held:
            if nid in seen_nodes:
                continue
            seen_nodes.add(nid)
            if not _node_usable(state, search, nid):
                continue
            node = state._nodes[nid]
            occ = []
            for jid, m in node.jobs.items():
                occupant = state._running[jid]
                if eligible(occupant, mode, now, policy):
                    occ.append((-m.bit_count(), _lost(occupant, now), jid, m.bit_count()))
            occ.sort()
            free = node.nfree if use_free else 0
            picked = []
            for _, _, jid, n in occ:
                if free >= need:
                    break
                picked.append(jid)
                free += n
            if free < need or len(picked) > limit:
                continue
            lost = sum(_lost(state._running[j], now) for j in picked)
            ckey = (len(picked), lost, nid, tuple(picked))
            if cand is None or ckey < cand:
                cand = ckey
        if len(seen_nodes) > 2048:
            break
    if cand is None:
        return None
    picked = cand[3]
    grace = max(state._running[j].spec.grace_s for j in picked)
    return VictimChoice(tuple(sorted(picked)), (cand[2],), (state._nodes[cand[2]].block,), grace)


class ClearableIndex:
    """Per cycle and mode: nodes whose every occupant is an eligible victim, by block (lazy)."""

    def __init__(self, state: ClusterState, ti: _TypeIndex, mode: Mode, now: float, policy: Policy) -> None:
        counts: dict[str, int] = {}
        for rj in _iter_candidates(state, ti, mode):
            if eligible(rj, mode, now, policy):
                for nid in rj.held:
                    counts[nid] = counts.get(nid, 0) + 1
        by_block: dict[str, list[str]] = {}
        nodes = state._nodes
        for nid, c in counts.items():
            node = nodes[nid]
            if c == len(node.jobs) and node.health is NodeHealth.READY and node.spare_of is None:
                by_block.setdefault(node.block, []).append(nid)
        for v in by_block.values():
            v.sort()
        self.by_block = by_block


def _clearable_now(state: ClusterState, search: Search, nid: str, mode: Mode, now: float, policy: Policy) -> bool:
    if not _node_usable(state, search, nid):
        return False
    node = state._nodes[nid]
    if not node.jobs:
        return False
    running = state._running
    return all(eligible(running[j], mode, now, policy) for j in node.jobs)


def find_whole(
    state: ClusterState,
    search: Search,
    shape: Shape,
    pack: Pack,
    max_blocks: int | None,
    mode: Mode,
    now: float,
    policy: Policy,
    index: ClearableIndex,
    limit: int,
    use_free: bool = True,
) -> VictimChoice | None:
    """Victims that free ``shape.nodes`` whole nodes in at most ``max_blocks`` blocks.

    ``use_free`` False: free nodes do not count (prod-serving beyond its guarantee).
    """
    ti = search.ti
    k = shape.nodes
    pot: list[tuple[int, int, str]] = []
    for bid in sorted(set(index.by_block) | set(ti.blocks_free)):
        free = search.block_avail(bid) if use_free and bid in ti.blocks_free else 0
        clear = len(index.by_block.get(bid, ()))
        if free + clear:
            pot.append((free + clear, free, bid))
    if pack is Pack.BLOCK and max_blocks:
        m = max_blocks
    elif pack is Pack.NODE:
        m = 1
    else:
        m = len(pot)
    if not policy.topology:
        m = len(pot)
    single = [p for p in pot if p[0] >= k]
    if single:
        # one block: the one needing the fewest victims, then least lost work, most free nodes, id
        best = None
        for _, free, bid in sorted(single, key=lambda p: (-p[1], p[0], p[2]))[:_SINGLE_BLOCK_TRIES]:
            got = _select(state, search, [bid], k, mode, now, policy, index, limit, use_free)
            if got is not None:
                key = (_cost(state, got[0], k - len(got[2]), policy), got[3], -free, bid)
                if best is None or key < best[0]:
                    best = (key, bid, got)
        if best is None:
            return None
        targets = [best[1]]
        victims, freed, free_nodes, _ = best[2]
    else:
        targets = []
        got_n = 0
        for total, _free, bid in sorted(pot, key=lambda p: (-p[0], -p[1], p[2])):
            if got_n >= k:
                break
            if len(targets) >= m:
                return None
            targets.append(bid)
            got_n += total
        if got_n < k:
            return None
        targets.sort()
        sel = _select(state, search, targets, k, mode, now, policy, index, limit, use_free)
        if sel is None:
            return None
        victims, freed, free_nodes, _ = sel
    grace = max(state._running[j].spec.grace_s for j in victims)
    hold = tuple(sorted(free_nodes + freed))
    return VictimChoice(tuple(sorted(victims)), hold, tuple(sorted(targets)), grace)


_SINGLE_BLOCK_TRIES = 6


def _cost(state: ClusterState, victims: set[str], need: int, policy: Policy) -> int:
    """Victims, plus (``Policy.victim_excess_cost``) every node they hold beyond the ``need``."""
    if not policy.victim_excess_cost:
        return len(victims)
    running = state._running
    held = sum(len(running[j].held) for j in victims)
    return len(victims) + max(0, held - need)


def _select(
    state: ClusterState,
    search: Search,
    targets: list[str],
    k: int,
    mode: Mode,
    now: float,
    policy: Policy,
    index: ClearableIndex,
    limit: int,
    use_free: bool = True,
) -> tuple[set[str], list[str], list[str], float] | None:
    """Greedy victims inside ``targets``: (victims, nodes they free, nodes already free, lost work).

    Each step takes the occupants of one candidate node, the step with the fewest new
    victims per node it frees (up to what is still needed), then least lost work, then
    the team furthest over its share, then node id.
    """
    ti = search.ti
    free_nodes: list[str] = []
    for bid in targets:
        if use_free and bid in ti.blocks_free:
            free_nodes.extend(search.block_nodes(bid, len(ti.blocks[bid].free_nodes)))
    need = k - len(free_nodes)
    if need <= 0:
        return None  # it fits without victims (the caller's search should have found it)
    cand = [
        n for bid in targets for n in index.by_block.get(bid, ()) if _clearable_now(state, search, n, mode, now, policy)
    ]
    if len(cand) < need:
        return None
    running = state._running
    nodes = state._nodes
    chosen: set[str] = set()
    freed: list[str] = []
    remaining = set(cand)
    over_cache: dict[str, float] = {}
    lost_total = 0.0

    def over(team: str) -> float:
        v = over_cache.get(team)
        if v is None:
            v = over_cache[team] = over_share(state, team, ti.gpu_type)
        return v

    excess_cost = policy.victim_excess_cost
    occupants = {nid: tuple(nodes[nid].jobs) for nid in remaining}
    lost_of = {j: _lost(running[j], now) for occ in occupants.values() for j in occ}
    while len(freed) < need:
        left = need - len(freed)
        best = None
        scored: dict[frozenset[str], tuple] = {}
        for nid in sorted(remaining):
            new = frozenset(j for j in occupants[nid] if j not in chosen)
            got = scored.get(new)
            if got is None:
                after = chosen | new
                touched = {n for j in new for n in running[j].held if n in remaining}
                gain = sum(1 for n in touched if all(j in after for j in occupants[n]))
                useful = min(gain, left) or 1
                lost = sum(lost_of[j] for j in new)
                o = max((over(running[j].team) for j in new), default=0.0)
                cost = len(new)
                if excess_cost:
                    cost += max(0, sum(len(running[j].held) for j in new) - useful)
                got = scored[new] = (cost / useful, lost / useful, -o, lost)
            key = (got[0], got[1], got[2], nid)
            if best is None or key < best[0]:
                best = (key, new, got[3])
        if best is None:
            return None
        chosen |= best[1]
        lost_total += best[2]
        if len(chosen) > limit:
            return None
        for nid in sorted(remaining):
            if all(j in chosen for j in occupants[nid]):
                remaining.discard(nid)
                freed.append(nid)
    return chosen, freed, free_nodes, lost_total
