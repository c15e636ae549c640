"""Victim choice for a job that cannot fit on free capacity.

Eligible victims (``eligible``) for a preemptor of class rank ``r``:

* never prod-serving; never a job already being preempted;
* never within ``preemption_protect_s`` of its start, unless it is borrowed (borrowed
  capacity is always reclaimable: docs/design.md invariant 4 and the reclaim bound of
  grace + 2 cycles; the protection is against priority churn of guaranteed work) or, for
  a preemptor of ``Policy.first_runs_unprotected_min_gpus`` or more, on its first run;
* normal mode (the preemptor is within its team's guarantee): jobs of a lower class
  (rank > r), or borrowed jobs of the same class of *another* team (a team never
  reclaims its own borrowed work: it would only trade its work for its work);
* normal mode, once the preemptor has waited ``Policy.reclaim_small_borrowed_after_s``:
  also *small* borrowed jobs (fewer than ``reserve_min_gpus`` GPUs) of *higher* classes
  of other teams, never prod-serving: borrowed capacity is given back to a team within
  its guarantee whatever the classes, without stopping a gang across classes;
* ... and, for a whole-node gang of ``reserve_min_gpus`` or more not itself preempted within
  that wait (``Policy.reclaim_higher_borrowed_gangs``, ``Mode.higher_gangs``): borrowed gangs
  of higher classes of other teams no larger than itself, never prod-serving;
* borrowed-only mode (prod-serving beyond its guarantee, or a gang beyond it with
  ``Policy.borrowed_gangs_reclaim_lower``): borrowed jobs of lower classes only (of
  other teams);
* a job preempted ``daily_preemption_budget`` times in ``preemption_window_s`` is a
  victim only if it is borrowed.

Choice (the rules' order: fewest jobs preempted, then least lost work, i.e. GPU-seconds
since each victim's last checkpoint, or since its start if it cannot checkpoint):

* a small job (one node): over every usable node, the fewest eligible occupants whose
  GPUs (with the node's free ones) suffice, then least lost work, then (one victim)
  the team furthest over its share, then ids. Exact: one victim is searched in order of
  time since checkpoint and stops only once no later candidate can lose less; several
  victims are searched per node (at most one occupant per GPU: every subset of the
  fewest size), blocks skipped only by a lower bound.
* whole nodes: target blocks first. If one block can hold the gang (its free nodes plus
  nodes whose every occupant is eligible), every such block is a candidate: each has a
  lower bound on its cost (``_BlockView.bound``) and blocks are solved in bound order
  until the bound passes the best found, so no block that could do better is skipped.
  The cost of a victim set is its size, plus (``Policy.victim_excess_cost``) every node
  its victims hold beyond the need; then least lost work, most free nodes, block id.
  Otherwise the fewest blocks with the most potential, and victims inside them.
  Within the targets (``_solve``): nodes are grouped by their occupant set, groups that
  share a victim form a component, each component's options (victim set, nodes freed)
  are enumerated, and a covering knapsack over the components picks the cheapest
  combination. Exact when every component has at most ``_EXACT_GROUPS`` occupant sets
  and the knapsack has at most ``_EXACT_CELLS`` cells (options x nodes needed); past
  either, the documented approximation: a larger component offers only its greedy
  chain of options (cheapest victims per node freed first), and a larger knapsack is
  replaced by the greedy itself (``_greedy``), which may preempt more than the optimum.
"""

from __future__ import annotations

import math
from bisect import insort
from dataclasses import dataclass
from itertools import combinations

from placement.model import SERVING_RANK, NodeHealth, Pack, Policy, PreemptReason
from placement.quota import over_share
from placement.state import ClusterState, RunningJob, _Block, _TypeIndex
from placement.topology import Search, Shape


@dataclass(frozen=True, slots=True)
class Mode:
    rank: int  # the preemptor's class rank
    borrowed_only: bool  # prod-serving beyond its guarantee
    team: str = ""  # the preemptor's team: its own borrowed work is never reclaimed for it
    # within its guarantee and past Policy.reclaim_small_borrowed_after_s: small borrowed
    # jobs of higher classes too
    higher_small: bool = False
    # ... and, for a gang (Policy.reclaim_higher_borrowed_gangs), borrowed gangs of higher classes
    # of at most this many GPUs (its own size: no gang is stopped for a smaller one); 0: none
    higher_gangs: int = 0
    # the preemptor may stop guaranteed jobs on their first run within their protection
    # (Policy.first_runs_unprotected_min_gpus)
    first_runs: bool = False


_CATS: dict[tuple[int, bool, bool], list[tuple[int, bool]]] = {}
_CAT_SETS: dict[tuple[int, bool, bool], frozenset[tuple[int, bool]]] = {}
# within the targets, exact while every component of nodes sharing victims has at most this
# many distinct occupant sets (2**n option subsets each) ...
_EXACT_GROUPS = 8
# ... and the covering knapsack has at most this many cells (options x nodes needed)
_EXACT_CELLS = 20_000


def categories(mode: Mode) -> list[tuple[int, bool]]:
    key = (mode.rank, mode.borrowed_only, mode.higher_small)
    got = _CATS.get(key)
    if got is None:
        got = _CATS[key] = _categories(mode)
    return got


def categories_set(mode: Mode) -> frozenset[tuple[int, bool]]:
    key = (mode.rank, mode.borrowed_only, mode.higher_small)
    got = _CAT_SETS.get(key)
    if got is None:
        got = _CAT_SETS[key] = frozenset(categories(mode))
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
    if rj.spec.start_protected(rj.borrowed, mode.first_runs) and now - rj.started_at < policy.preemption_protect_s:
        return False
    if mode.borrowed_only:
        if not rj.borrowed or rj.rank <= mode.rank:
            return False
    elif not (
        rj.rank > mode.rank
        or (
            rj.borrowed
            and (
                rj.rank == mode.rank
                or (mode.higher_small and (rj.charge < policy.reserve_min_gpus or rj.charge <= mode.higher_gangs))
            )
        )
    ):
        return False
    if _own_team(rj, mode):
        return False  # a reclaim of the team's own borrowed work
    budget = policy.daily_preemption_budget
    if not rj.borrowed and budget >= 0:
        # fewer preemptions ever than the budget: none to count in the window (the common case)
        if (
            len(rj.spec.preemption_times) >= budget
            and rj.spec.preemptions_since(now - policy.preemption_window_s) >= budget
        ):
            return False
    return True


def _own_team(rj: RunningJob, mode: Mode) -> bool:
    """Would taking ``rj`` reclaim the preemptor's own team's borrowed work?"""
    return bool(mode.team) and rj.spec.team == mode.team and (mode.borrowed_only or rj.rank <= mode.rank)


def reason_for(rj: RunningJob, mode: Mode) -> PreemptReason:
    if mode.borrowed_only or rj.rank <= mode.rank:
        return PreemptReason.RECLAIM
    return PreemptReason.PRIORITY


def eligible_upper_bound(ti: _TypeIndex, mode: Mode) -> int:
    return sum(ti.cat_gpus.get(c, 0) for c in categories(mode))


@dataclass(frozen=True, slots=True)
class VictimChoice:
    victims: tuple[str, ...]
    nodes: tuple[str, ...]  # nodes to hold for the beneficiary
    blocks: tuple[str, ...]
    grace_s: float


def lost_work(rj: RunningJob, now: float) -> float:
    """GPU-seconds lost if preempted now: its GPUs x time since its last checkpoint (or start)."""
    return rj.charge * max(0.0, now - rj.lost_since)


def _weight(rj: RunningJob, policy: Policy) -> int:
    """A victim's share of the cost of a whole-node victim set: 1, plus (``victim_excess_cost``)
    the nodes it holds (the set's cost is then its size plus the nodes held beyond the need:
    every freed node is held by a victim, so the nodes held are never fewer than the need)."""
    return 1 + len(rj.held) if policy.victim_excess_cost else 1


def _node_usable(state: ClusterState, search: Search, nid: str) -> bool:
    node = state._nodes[nid]
    return node.health is NodeHealth.READY and node.spare_of is None and search.ok(nid)


# ---------------------------------------------------------------------- the index


class _BlockView:
    """One block's usable nodes with eligible occupants (``VictimIndex``)."""

    __slots__ = ("_bounds", "_counts", "clear", "nodes", "single")

    def __init__(
        self,
        nodes: list[tuple[str, int, tuple[tuple[str, int], ...], bool]],
        clear: list[str],
        single: tuple[int, int],
    ) -> None:
        # (node, free GPUs, eligible occupants ((job, GPUs there), ...) by id, every occupant eligible)
        self.nodes = nodes
        self.clear = clear  # the nodes whose every occupant is eligible
        # the most GPUs one victim can make available on a node: with its free GPUs, without
        self.single = single
        self._bounds: tuple[list[float], list[float]] | None = None
        self._counts: dict[tuple[int, bool], int | None] = {}

    def min_count(self, need: int, use_free: bool) -> int | None:
        """The fewest occupants of one node that make ``need`` GPUs available (a lower bound
        for a search that may use fewer of them), or None."""
        key = (need, use_free)
        if key in self._counts:
            return self._counts[key]
        best = None
        for _, f, occ, _ in self.nodes:
            got = f if use_free else 0
            c = 0
            for g in sorted((g for _, g in occ), reverse=True):
                if got >= need:
                    break
                got += g
                c += 1
            if got >= need and (best is None or c < best):
                best = c
        self._counts[key] = best
        return best

    def bound(self, state: ClusterState, need: int, now: float, policy: Policy) -> tuple[int, float]:
        """Lower bounds on (sum of victim weights, lost work) of any victim set that frees
        ``need`` of this block's clearable nodes: each victim's weight and lost work are
        spread over its clearable nodes here, and no set can do better than the ``need``
        cheapest nodes by that measure (each criterion bounded alone)."""
        if self._bounds is None:
            running = state._running
            share: dict[str, int] = {}
            for _n, _, occ, c in self.nodes:
                if c:
                    for j, _ in occ:
                        share[j] = share.get(j, 0) + 1
            ws: list[float] = []
            ls: list[float] = []
            for _n, _, occ, c in self.nodes:
                if c:
                    w = lo = 0.0
                    for j, _ in occ:
                        rj = running[j]
                        w += _weight(rj, policy) / share[j]
                        lo += lost_work(rj, now) / share[j]
                    ws.append(w)
                    ls.append(lo)
            ws.sort()
            ls.sort()
            pw, pl = [0.0], [0.0]
            for x in ws:
                pw.append(pw[-1] + x)
            for y in ls:
                pl.append(pl[-1] + y)
            self._bounds = (pw, pl)
        pw, pl = self._bounds
        if need >= len(pw):
            return 1 << 60, float("inf")
        # weights are integers: a sum of fractional shares bounds an integer from below
        return int(-(-round(pw[need], 9) // 1)), pl[need]


class VictimIndex:
    """Per cycle, GPU type and mode (built without the preemptor's team): eligible occupants of
    every node, per block, as when first asked for.

    Within a cycle a view only loses victims (placements take free GPUs, victims marked
    stopping, nodes held as spares), so it is a superset of what a search may take, and its
    counts and bounds stay upper / lower bounds: searches re-check every node they would
    clear against the state and the preemptor's own mode. The engine drops the indexes when
    a cycle relabels running jobs borrowed (``_guarantee_gang``): that adds victims.

    A block's part is kept across cycles (``ClusterState.victim_blocks``, per block and mode)
    while the block's ``jversion`` stands (any change to its nodes that run jobs, their jobs'
    borrowed / stopping flags or victim listing moves it; reservations and nodes without jobs,
    which a part never reads, do not) and time has not made one of its ineligible jobs eligible
    (re-asked: time only ever makes a job eligible, never the reverse)."""

    def __init__(self, state: ClusterState, ti: _TypeIndex, mode: Mode, now: float, policy: Policy) -> None:
        self.state, self.ti, self.mode, self.now, self.policy = state, ti, mode, now, policy
        self.bids = ti.block_ids
        cache = state.victim_blocks
        kept = cache.get(mode)
        if kept is None:
            if len(cache) >= _VICTIM_BLOCKS_MAX:
                cache.clear()
            kept = cache[mode] = {}
        parts: list[_BlockPart] = []
        blocks = ti.blocks
        for bid in self.bids:
            part = kept.get(bid)
            blk = blocks[bid]
            if (
                part is None
                or part.version != blk.jversion
                or now < part.now
                or policy is not part.policy
                or (part.unfit and not part.holds(blk.jversion, now, policy))
            ):
                part = kept[bid] = _BlockPart(state, blk, mode, now, policy)
            parts.append(part)
        self._parts = parts
        self._all: list[_BlockView] | None = None
        self._by_lost: list[tuple[float, str, str, int, int]] | None = None

    def by_lost(self) -> list[tuple[float, str, str, int, int]]:
        """(lost work, job, node, its GPUs there, the node's free GPUs) of every eligible job on
        every node it holds, least lost work first (then job, node)."""
        if self._by_lost is None:
            state, now = self.state, self.now
            running, nodes = state._running, state._nodes
            lost: dict[str, float] = {}
            out = []
            for part in self._parts:
                for nid, occ in part.occ.items():
                    f = nodes[nid].nfree
                    for j, g in occ:
                        lo = lost.get(j)
                        if lo is None:
                            lo = lost[j] = lost_work(running[j], now)
                        out.append((lo, j, nid, g, f))
            out.sort()
            self._by_lost = out
        return self._by_lost

    def views(self) -> list[_BlockView]:
        """Every block's view, in block id order (fresh views: their bounds read lost work now)."""
        if self._all is None:
            # every block without eligible occupants shares one view (an empty view's counts and
            # bounds depend on nothing): most blocks, for a preemptor of a high class
            empty = _BlockView([], [], (0, 0))
            self._all = [_BlockView(p.nodes, p.clear, p.single) if p.occ else empty for p in self._parts]
        return self._all


# victim modes of ``ClusterState.victim_blocks`` kept at most (then it starts afresh); each
# holds at most one part per block
_VICTIM_BLOCKS_MAX = 64


class _BlockPart:
    """One block's eligible occupants for one mode, and its view's contents, as of a block
    version and a time; with the jobs listed as victims there that were not eligible then."""

    __slots__ = ("clear", "mode", "nodes", "now", "occ", "policy", "single", "unfit", "version")

    def __init__(self, state: ClusterState, blk: _Block, mode: Mode, now: float, policy: Policy) -> None:
        self.version = blk.jversion
        self.mode = mode
        self.now = now
        self.policy = policy
        running, nodes_ = state._running, state._nodes
        cats = categories_set(mode)
        occ: dict[str, list[tuple[str, int]]] = {}
        ok: dict[str, bool] = {}
        unfit: list[RunningJob] = []
        for nid in blk.nodes:
            for jid in nodes_[nid].jobs:
                rj = running.get(jid)
                if rj is None or rj.vkey is None or rj.vcat not in cats:
                    continue  # not listed as a victim of this mode's categories
                e = ok.get(jid)
                if e is None:
                    e = ok[jid] = eligible(rj, mode, now, policy)
                    if not e:
                        unfit.append(rj)
                if e:
                    g = rj.held[nid].bit_count()
                    got = occ.get(nid)
                    if got is None:
                        occ[nid] = [(jid, g)]
                    else:
                        got.append((jid, g))
        self.occ = occ
        self.unfit = unfit
        # the view's contents: one pass over the block's nodes with eligible occupants, which
        # are clear, and the most one victim frees on a node
        out: list[tuple[str, int, tuple[tuple[str, int], ...], bool]] = []
        clear = []
        with_free = alone = 0
        for nid in sorted(occ):
            node = nodes_[nid]
            if node.health is not NodeHealth.READY or node.spare_of is not None:
                continue
            o = occ[nid]
            f = node.nfree
            t: tuple[tuple[str, int], ...]
            if len(o) == 1:
                t = (o[0],)
                top = o[0][1]
            else:
                t = tuple(sorted(o))
                top = max(g for _, g in o)
            c = len(o) == len(node.jobs)
            out.append((nid, f, t, c))
            if c:
                clear.append(nid)
            if top > alone:
                alone = top
            if f + top > with_free:
                with_free = f + top
        self.nodes = out
        self.clear = clear
        self.single = (with_free, alone)

    def holds(self, version: int, now: float, policy: Policy) -> bool:
        """Still the block's part at ``version`` and ``now``? (Time only makes jobs eligible.)"""
        if version != self.version or now < self.now or policy is not self.policy:
            return False
        mode = self.mode
        for rj in self.unfit:
            if eligible(rj, mode, now, policy):
                return False
        return True


def _live(state: ClusterState, nid: str, mode: Mode, now: float, policy: Policy) -> tuple[list[tuple[str, int]], bool]:
    """A node's occupants the preemptor may take now ((job, GPUs there), by id), and whether
    that is every occupant."""
    running = state._running
    jobs = state._nodes[nid].jobs
    occ = sorted((j, m.bit_count()) for j, m in jobs.items() if eligible(running[j], mode, now, policy))
    return occ, len(occ) == len(jobs)


# ---------------------------------------------------------------------- small jobs


def find_small(
    state: ClusterState,
    search: Search,
    need: int,
    mode: Mode,
    now: float,
    policy: Policy,
    limit: int,
    index: VictimIndex,
    use_free: bool = True,
) -> VictimChoice | None:
    """Victims that make room for ``need`` GPUs on one node (a small job): the fewest, then
    least lost work. ``use_free`` False: only the victims' GPUs count (prod-serving beyond
    its guarantee)."""
    views = list(zip(index.bids, index.views(), strict=True))
    i = 0 if use_free else 1
    if any(v.single[i] >= need for _, v in views):
        got = _one_victim(state, search, need, mode, now, policy, index, use_free)
        if got is not None:
            return got
    if limit < 2:
        return None
    return _several_on_one_node(state, search, need, mode, now, policy, limit, views, use_free)


def _one_victim(
    state: ClusterState,
    search: Search,
    need: int,
    mode: Mode,
    now: float,
    policy: Policy,
    index: VictimIndex,
    use_free: bool,
) -> VictimChoice | None:
    """The one victim losing the least work (then the team furthest over its share, then ids):
    the index's (job, node) pairs in order of lost work, the first that the state confirms,
    and any others losing as little (no cap: the order makes the first hit the optimum)."""
    best: tuple | None = None
    over_cache: dict[str, float] = {}
    nodes = state._nodes
    running = state._running
    for lost, jid, nid, g, f0 in index.by_lost():
        if best is not None and lost > best[1]:
            break
        if use_free:
            if f0 + g < need or nodes[nid].nfree + g < need:
                continue  # (free GPUs only shrink within a cycle)
        elif g < need:
            continue
        rj = running[jid]
        if not _node_usable(state, search, nid) or not eligible(rj, mode, now, policy):
            continue
        o = over_cache.get(rj.team)
        if o is None:
            o = over_cache[rj.team] = over_share(state, rj.team, rj.gpu_type)
        key = (1, lost, -o, jid, nid)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    rj = running[best[3]]
    return VictimChoice((rj.job_id,), (best[4],), (nodes[best[4]].block,), rj.spec.grace_s)


def _several_on_one_node(
    state: ClusterState,
    search: Search,
    need: int,
    mode: Mode,
    now: float,
    policy: Policy,
    limit: int,
    views: list[tuple[str, _BlockView]],
    use_free: bool,
) -> VictimChoice | None:
    """Several occupants of one node: per node the fewest that suffice (largest first), then of
    every subset of that size the one losing the least work. Exact over every node."""
    running = state._running
    best: tuple | None = None  # (count, lost, node, victims)
    lost_of: dict[str, float] = {}
    order = []
    for bid, v in views:
        lb = v.min_count(need, use_free)
        if lb is not None and lb <= limit:
            order.append((lb, bid, v))
    order.sort(key=lambda x: (x[0], x[1]))
    for lb, _, v in order:
        if best is not None and lb > best[0]:
            break
        for nid, nfree, occ, _ in v.nodes:
            if (nfree if use_free else 0) + sum(g for _, g in occ) < need:
                continue  # (the view's counts are upper bounds)
            if not _node_usable(state, search, nid):
                continue
            have = state._nodes[nid].nfree if use_free else 0
            cands, _ = _live(state, nid, mode, now, policy)
            if have + sum(g for _, g in cands) < need:
                continue
            # fewest victims: the largest occupants first
            c = 0
            got = have
            for g in sorted((g for _, g in cands), reverse=True):
                if got >= need:
                    break
                got += g
                c += 1
            if c == 0 or c > limit or (best is not None and c > best[0]):
                continue  # (none needed: the free GPUs are not this job's to take)
            for j, _ in cands:
                if j not in lost_of:
                    lost_of[j] = lost_work(running[j], now)
            for combo in combinations(cands, c):
                if have + sum(g for _, g in combo) < need:
                    continue
                picked = tuple(sorted(j for j, _ in combo))
                key = (c, math.fsum(lost_of[j] for j in picked), nid, picked)
                if best is None or key < best:
                    best = key
    if best is None:
        return None
    picked = best[3]
    grace = max(running[j].spec.grace_s for j in picked)
    return VictimChoice(picked, (best[2],), (state._nodes[best[2]].block,), grace)


# ---------------------------------------------------------------------- whole nodes


def find_whole(
    state: ClusterState,
    search: Search,
    shape: Shape,
    pack: Pack,
    max_blocks: int | None,
    mode: Mode,
    now: float,
    policy: Policy,
    index: VictimIndex,
    limit: int,
    use_free: bool = True,
) -> VictimChoice | None:
    """Victims that free ``shape.nodes`` whole nodes in at most ``max_blocks`` blocks.

    ``use_free`` False: free nodes do not count (prod-serving beyond its guarantee).
    """
    ti = search.ti
    k = shape.nodes
    pot: list[tuple[int, int, str]] = []
    views: dict[str, _BlockView] = {}
    blocks_free = ti.blocks_free
    for bid, v in zip(index.bids, index.views(), strict=True):
        views[bid] = v
        free = search.block_avail(bid) if use_free and bid in blocks_free else 0
        clear = len(v.clear)
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
    excess = policy.victim_excess_cost
    single = [p for p in pot if p[0] >= k]
    if single:
        # one block: every block that could hold it, in order of a lower bound on its cost;
        # stop once the bound passes the best found (fewest victims, least lost work, most
        # free nodes, id)
        order = []
        for _, free, bid in single:
            need = k - free
            if need <= 0:
                continue  # it fits without victims (the caller's search should have found it)
            bw, bl = views[bid].bound(state, need, now, policy)
            order.append(((bw - need if excess else bw), bl, -free, bid, need))
        order.sort()
        best: tuple | None = None
        for lb_cost, lb_lost, negfree, bid, need in order:
            if best is not None and (lb_cost > best[0][0] or (lb_cost == best[0][0] and lb_lost > _slack(best[0][1]))):
                break
            got = _solve(state, search, [bid], views, need, mode, now, policy, limit, use_free)
            if got is None:
                continue
            victims, freed, free_nodes, wsum, lost = got
            key = ((wsum - need if excess else wsum), lost, negfree, bid)
            if best is None or key < best[0]:
                best = (key, bid, got)
        if best is None:
            return None
        targets = [best[1]]
        victims, freed, free_nodes, _, _ = best[2]
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
        free_n = sum(search.block_avail(b) for b in targets if b in ti.blocks_free) if use_free else 0
        sel = _solve(state, search, targets, views, k - free_n, mode, now, policy, limit, use_free)
        if sel is None:
            return None
        victims, freed, free_nodes, _, _ = sel
    grace = max(state._running[j].spec.grace_s for j in victims)
    hold = tuple(sorted(free_nodes + freed))
    return VictimChoice(tuple(sorted(victims)), hold, tuple(sorted(targets)), grace)


def _slack(x: float) -> float:
    """``x`` plus float noise: bounds summed from shares may exceed an equal exact sum."""
    return x + 1e-9 * abs(x) + 1e-6


# (nodes freed, weight, lost work, minus the over-share of the victims' teams, victims)
_Option = tuple[int, int, float, float, frozenset[str]]


def _solve(
    state: ClusterState,
    search: Search,
    targets: list[str],
    views: dict[str, _BlockView],
    need: int,
    mode: Mode,
    now: float,
    policy: Policy,
    limit: int,
    use_free: bool = True,
) -> tuple[set[str], list[str], list[str], int, float] | None:
    """Victims inside ``targets`` freeing ``need`` more nodes: (victims, nodes they free,
    nodes already free, weight, lost work), least weight then least lost work."""
    ti = search.ti
    free_nodes: list[str] = []
    for bid in targets:
        if use_free and bid in ti.blocks_free:
            free_nodes.extend(search.block_nodes(bid, len(ti.blocks[bid].free_nodes)))
    if need <= 0:
        return None  # it fits without victims (the caller's search should have found it)
    running = state._running
    occupants: dict[str, tuple[str, ...]] = {}
    for bid in targets:
        for nid in views[bid].clear:
            if not _node_usable(state, search, nid):
                continue
            occ, clear = _live(state, nid, mode, now, policy)
            if clear and occ:
                occupants[nid] = tuple(j for j, _ in occ)
    if len(occupants) < need:
        return None
    weight = {j: _weight(running[j], policy) for occ in occupants.values() for j in occ}
    lost = {j: lost_work(running[j], now) for j in weight}
    over_cache: dict[str, float] = {}
    over: dict[str, float] = {}
    for j in weight:
        team = running[j].team
        o = over_cache.get(team)
        if o is None:
            o = over_cache[team] = over_share(state, team, ti.gpu_type)
        over[j] = -o
    comps = _components(occupants)
    options: list[list[_Option]] = []
    cells = 0
    for comp in comps:
        groups: dict[frozenset[str], int] = {}
        for nid in comp:
            key = frozenset(occupants[nid])
            groups[key] = groups.get(key, 0) + 1
        if len(groups) <= _EXACT_GROUPS:
            opts = _all_options(groups, weight, lost, over, need)
        else:
            opts = _greedy_chain(groups, weight, lost, over, need)
        options.append(opts)
        cells += len(opts)
    if cells * need > _EXACT_CELLS:
        chosen = _greedy(occupants, weight, lost, need, state, ti.gpu_type)
    else:
        chosen = _knapsack(options, need)
    if chosen is None or len(chosen) > limit:
        return None
    freed = sorted(n for n, occ in occupants.items() if all(j in chosen for j in occ))
    wsum = sum(weight[j] for j in chosen)
    return chosen, freed, free_nodes, wsum, math.fsum(lost[j] for j in chosen)


def _components(occupants: dict[str, tuple[str, ...]]) -> list[list[str]]:
    """Nodes grouped by shared victims (union-find over jobs), each sorted, in node order."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for occ in occupants.values():
        for j in occ:
            parent.setdefault(j, j)
        r = find(occ[0])
        for j in occ[1:]:
            rj = find(j)
            if rj != r:
                parent[rj] = r
    comps: dict[str, list[str]] = {}
    for nid in sorted(occupants):
        comps.setdefault(find(occupants[nid][0]), []).append(nid)
    return list(comps.values())


def _all_options(
    groups: dict[frozenset[str], int],
    weight: dict[str, int],
    lost: dict[str, float],
    over: dict[str, float],
    need: int,
) -> list[_Option]:
    """Every victim set a component offers (unions of its occupant sets), the cheapest per
    number of nodes freed (capped at ``need``)."""
    keys = sorted(groups, key=lambda g: sorted(g))
    best: dict[int, _Option] = {}
    seen: set[frozenset[str]] = set()
    n = len(keys)
    for mask in range(1, 1 << n):
        v: frozenset[str] = frozenset().union(*(keys[i] for i in range(n) if mask >> i & 1))
        if v in seen:
            continue
        seen.add(v)
        freed = min(need, sum(c for g, c in groups.items() if g <= v))
        opt = (freed, sum(weight[j] for j in v), math.fsum(lost[j] for j in v), math.fsum(over[j] for j in v), v)
        cur = best.get(freed)
        if cur is None or (opt[1], opt[2], opt[3], sorted(v)) < (cur[1], cur[2], cur[3], sorted(cur[4])):
            best[freed] = opt
    return [best[f] for f in sorted(best)]


def _greedy_chain(
    groups: dict[frozenset[str], int],
    weight: dict[str, int],
    lost: dict[str, float],
    over: dict[str, float],
    need: int,
) -> list[_Option]:
    """A large component's options, approximated: the chain the greedy builds (each step adds the
    occupant set costing least per node it newly frees, then least lost work per node)."""
    chosen: frozenset[str] = frozenset()
    out: list[_Option] = []
    left = dict(groups)
    freed = 0
    while left and freed < need:
        best = None
        for g in sorted(left, key=lambda g: sorted(g)):
            new = g - chosen
            after = chosen | new
            gain = sum(c for h, c in left.items() if h <= after)
            w = sum(weight[j] for j in new)
            lo = math.fsum(lost[j] for j in new)
            key = (w / gain, lo / gain)
            if best is None or key < best[0]:
                best = (key, after)
        assert best is not None
        chosen = best[1]
        for h in [h for h in left if h <= chosen]:
            freed += left.pop(h)
        out.append(
            (
                min(need, freed),
                sum(weight[j] for j in chosen),
                math.fsum(lost[j] for j in chosen),
                math.fsum(over[j] for j in chosen),
                chosen,
            )
        )
    return out


def _knapsack(options: list[list[_Option]], need: int) -> set[str] | None:
    """At most one option per component, at least ``need`` nodes freed, least (weight, lost
    work, then the teams furthest over their share): a covering knapsack by dynamic
    programming over nodes freed (capped at ``need``)."""
    # dp[f] = (weight, lost, -over, chain of (component, option)) for f nodes freed
    dp: list[tuple[int, float, float, tuple] | None] = [None] * (need + 1)
    dp[0] = (0, 0.0, 0.0, ())
    for ci, opts in enumerate(options):
        new = list(dp)
        for f, cur in enumerate(dp):
            if cur is None:
                continue
            w0, l0, o0, chain = cur
            for oi, (got, w, lo, o, _) in enumerate(opts):
                nf = min(need, f + got)
                cand = (w0 + w, l0 + lo, o0 + o)
                have = new[nf]
                if have is None or cand < have[:3]:
                    new[nf] = (*cand, (chain, ci, oi))
        dp = new
    top = dp[need]
    if top is None:
        return None
    out: set[str] = set()
    chain = top[3]
    while chain:
        chain, ci, oi = chain
        out |= options[ci][oi][4]
    return out


def _greedy(
    occupants: dict[str, tuple[str, ...]],
    weight: dict[str, int],
    lost: dict[str, float],
    need: int,
    state: ClusterState,
    gpu_type: str,
) -> set[str] | None:
    """The approximation for large instances: each step takes the occupants of one candidate
    node, the step with the least new weight per node it frees (up to what is still needed),
    then least lost work per node, then the team furthest over its share, then node id.

    Kept step by step rather than re-scored from scratch: each node not yet freed has its
    occupants not yet chosen (``new_of``); nodes with equal sets form a group, scored once. A
    group's gain is the number of nodes not yet freed whose set is within the group's (those
    the step would free). A step changes only the nodes holding a chosen job, and the gain of
    only the groups sharing a job with their new sets. Sums of lost work are correctly rounded
    (``math.fsum``), so a score is the same float whatever order a set iterates in: set order
    follows the interpreter's string hash seed, and a plan must not."""
    running = state._running
    over_cache: dict[str, float] = {}

    def over(team: str) -> float:
        v = over_cache.get(team)
        if v is None:
            v = over_cache[team] = over_share(state, team, gpu_type)
        return v

    holders: dict[str, list[str]] = {}
    for nid, occ in occupants.items():
        for j in occ:
            holders.setdefault(j, []).append(nid)
    chosen: set[str] = set()
    new_of: dict[str, frozenset[str]] = {}  # every node not yet freed -> its occupants not chosen
    groups: dict[frozenset[str], list[str]] = {}  # such a set -> its nodes, by id
    for nid in sorted(occupants):
        s = frozenset(occupants[nid])
        new_of[nid] = s
        g = groups.get(s)
        if g is None:
            groups[s] = [nid]
        else:
            g.append(nid)
    base: dict[frozenset[str], tuple[int, float, float]] = {}  # (weight, lost work, -over share)
    gains: dict[frozenset[str], int] = {}
    freed = 0
    while freed < need:
        left = need - freed
        best: tuple | None = None
        for s, members in groups.items():
            gain = gains.get(s)
            if gain is None:
                touched = {n for j in s for n in holders[j] if n in new_of}
                gain = gains[s] = sum(1 for n in touched if new_of[n] <= s)
            b = base.get(s)
            if b is None:
                b = base[s] = (
                    sum(weight[j] for j in s),
                    math.fsum(lost[j] for j in s),
                    -max((over(running[j].team) for j in s), default=0.0),
                )
            useful = min(gain, left) or 1
            key = (b[0] / useful, b[1] / useful, b[2], members[0])
            if best is None or key < best[0]:
                best = (key, s)
        if best is None:
            return None
        pick: frozenset[str] = best[1]
        chosen |= pick
        dirty: set[str] = set()
        for n in sorted({n for j in pick for n in holders[j] if n in new_of}):
            old = new_of[n]
            members = groups[old]
            members.remove(n)
            if not members:
                del groups[old]
                gains.pop(old, None)
            t = frozenset(j for j in occupants[n] if j not in chosen)
            if not t:
                del new_of[n]
                freed += 1
                continue
            new_of[n] = t
            g = groups.get(t)
            if g is None:
                groups[t] = [n]
            else:
                insort(g, n)
            dirty |= t
        for s in [s for s in gains if not s.isdisjoint(dirty)]:
            del gains[s]
    return chosen
