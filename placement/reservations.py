"""Reservations and backfill.

A head-of-line large gang (>= ``Policy.reserve_min_gpus``, whole nodes) that cannot
fit and cannot preempt reserves the nodes it will use, and no more: the fewest blocks
(at most ``max_blocks``; the minimum number for ``pack=block`` without a limit) where
enough nodes become free earliest, judging by running jobs' ``started_at +
max_runtime``, and in them exactly the ``nodes_needed`` nodes that free soonest (the
free ones first). The other nodes of those blocks stay open to everyone. That time is
the reservation's ``expected_start``. Every cycle the node set is re-chosen within the
same blocks (``refresh_head_of_line``): a node of the blocks that came free replaces
a reserved node still busy, so the gang waits for the first ``nodes_needed`` nodes to
free in its blocks, and never holds more than it needs (cached per block version).

Who may use reserved nodes (``may_use``): the owner; jobs of a strictly higher
class than the owner (head-of-line reservations only: nodes cleared by preemption
are held for their beneficiary whatever the class, or it would preempt again and its
reclaim would overrun the grace period; with ``Policy.guaranteed_reservations_hold``,
not work that would run borrowed while the owner would run guaranteed); and, with
backfill, jobs whose max_runtime ends by the expected start. Reservations survive
across cycles and are dropped when the owner is placed or leaves the queue. Preemption
reservations hold the nodes being cleared for a beneficiary (expected start: now +
the victims' grace).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from typing import cast

from placement.model import SERVING_RANK, JobSpec, NodeHealth, Pack, Policy, Reservation, ReservationKind
from placement.quota import beyond_guarantee
from placement.state import ClusterState, RunningJob, _Block, _Node, _TypeIndex

_INF = float("inf")
_NEG = float("-inf")


def may_use(
    res: Reservation,
    job: JobSpec,
    now: float,
    policy: Policy,
    class_rule: bool = True,
    owner_rule: bool = True,
    evictably: bool = False,
) -> bool:
    """May ``job`` use nodes held by ``res``? ``class_rule`` False leaves out the higher-class
    exception (the engine tries without it first, so a higher class takes reserved nodes
    only as a last resort). ``owner_rule`` False judges ``res`` as someone else's even if
    ``job`` owns it (``Exclusions`` is shared by equal jobs and decides ownership itself).
    ``evictably``: ``job`` is placed borrowed and accepts being stopped when the owner is
    ready (``may_backfill_evictably``; the engine tries this last)."""
    if owner_rule and res.job_id == job.job_id:
        return True
    if class_rule and job.rank < res.priority_rank and res.kind is ReservationKind.HEAD_OF_LINE:
        return True  # nodes cleared by preemption are never taken: the beneficiary would preempt again
    if (
        evictably
        and may_backfill_evictably(res, job)
        and _owner_not_due(res, now, policy)
        and backfills_evictably(job, policy)
    ):
        return True
    return policy.backfill and now + job.max_runtime_s <= res.expected_start


class Exclusions:
    """The reservation owners whose nodes one job may not use, decided lazily per owner.

    Behaves as a read-only set for ``in``; ``key`` identifies the answer for caching
    (it depends only on the job's type, class, max_runtime, own reservation, the rule
    set and the reservation set's version). ``span``, where given, stands for the max_runtime
    in the key: the reservations' expected starts either side of the job's end
    (``engine._Cycle._backfill_span``), which decide the same answers.
    """

    __slots__ = (
        "avail",
        "borrowed_job",
        "cache",
        "claim_team",
        "class_rule",
        "evictably",
        "job",
        "key",
        "now",
        "own",
        "own_pre",
        "policy",
        "state",
    )

    def __init__(
        self,
        state: ClusterState,
        job: JobSpec,
        now: float,
        policy: Policy,
        class_rule: bool = True,
        evictably: bool = False,
        claim_team: str | None = None,
        span: object = None,
        borrowed_job: bool = False,
    ) -> None:
        self.state = state
        self.job = job
        self.now = now
        self.policy = policy
        self.class_rule = class_rule
        self.evictably = evictably
        # a guaranteed job's team past Policy.claim_borrowed_reservations_after_s: borrowing
        # gangs of other teams do not hold their nodes against it
        self.claim_team = claim_team
        # the job would run borrowed and Policy.guaranteed_reservations_hold is on (the engine's
        # ``_excl`` judges both, for its cache key): a guaranteed gang's head-of-line nodes are
        # not its last resort
        self.borrowed_job = borrowed_job
        self.cache: dict[object, bool] = {}  # keyed like ``__contains__``'s argument
        # block -> (its version, free whole nodes the job may use): ``topology.Search.block_avail``
        # of this object's answers, which are kept once asked (every owner it reads holds nodes
        # there, so a reservation coming or going there, or a node freeing, moves the version)
        self.avail: dict[str, tuple[int, int]] = {}
        own = job.job_id if job.job_id in state._reservations else None
        self.own = own
        # nodes cleared by preemption for this job are its own whatever else holds them
        # (a gang's head-of-line reservation may have picked them as free soonest)
        mine = state._reservations.get(job.job_id)
        self.own_pre = job.job_id if mine is not None and mine.kind is ReservationKind.PREEMPTION else None
        # a new reservation only takes capacity away, and answers are per owner: the key changes
        # only when a reservation goes (or is replaced)
        self.key = (
            job.gpu_type,
            job.rank,
            job.max_runtime_s if span is None else span,
            own,
            class_rule,
            state.res_free_version,
            evictably,
            claim_team,
            self.borrowed_job,
        )

    def __contains__(self, owner: object) -> bool:
        if owner == self.own:
            return False
        got = self.cache.get(owner)
        if got is None:
            # owners are job ids: ``object`` only to fit ``Container[str]`` (cast on the miss path only)
            res = self.state._reservations.get(cast(str, owner))
            if res is None:
                return False  # not (yet) an owner: not cached, it may reserve later this cycle
            # the object is shared by every job with an equal key: a reservation its first
            # user made later in the cycle is another job's to all the others (seen: a job
            # placed on the free GPUs a reclaim had just counted on; the reclaim overran)
            class_rule = self.class_rule and not (self.borrowed_job and not owner_borrows(self.state, res))
            got = res.gpu_type == self.job.gpu_type and not may_use(
                res, self.job, self.now, self.policy, class_rule, owner_rule=False, evictably=self.evictably
            )
            if (
                got
                and self.claim_team is not None
                and res.kind is ReservationKind.HEAD_OF_LINE
                and res.team != self.claim_team
                and owner_borrows(self.state, res)
            ):
                got = False
            self.cache[owner] = got
        return got

    def __bool__(self) -> bool:
        return bool(self.state._reservations)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Exclusions) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)


def owner_borrows(state: ClusterState, res: Reservation) -> bool:
    """Would the reservation's gang run borrowed if placed now?"""
    return beyond_guarantee(state, res.team, res.gpu_type, res.gpus)


def evictable_for(rj: RunningJob, res: Reservation | None) -> bool:
    """Is ``rj`` evictable backfill of ``res``: borrowed work of the owner's class or lower
    (the owner's own team's too: the gang comes first in its queue), started while the
    reservation stood, which the owner stops when the rest of its nodes are free
    (``Policy.evictable_backfill``)? With ``res.evicts_borrowed`` (``Policy.drain_reclaims_borrowed``)
    other teams' such work that was there first counts too (a team never reclaims its own)."""
    return (
        res is not None
        and res.evicts_backfill
        and res.kind is ReservationKind.HEAD_OF_LINE
        and rj.borrowed
        and rj.preempting_for is None
        and rj.rank != SERVING_RANK
        and rj.rank >= res.priority_rank
        and (rj.started_at >= res.created_at or (res.evicts_borrowed and rj.team != res.team))
    )


def _owner_not_due(res: Reservation, now: float, policy: Policy) -> bool:
    """``Policy.evictable_backfill_min_s``: is the owner's expected start (its nodes' free
    times, evictable backfill counted as gone) far enough off for evictable backfill?"""
    m = policy.evictable_backfill_min_s
    return m is None or res.expected_start > now + m


def backfills_evictably(job: JobSpec, policy: Policy) -> bool:
    """May ``job`` backfill evictably at all, whatever the reservation? The owner stops such
    work as soon as it is ready, so ``Policy.evictable_backfill_saving_only`` keeps out jobs
    that cannot checkpoint (they lose every second they ran) and
    ``Policy.evictable_backfill_max_gpus`` jobs whose stop throws away more GPUs' work."""
    if policy.evictable_backfill_saving_only and not job.preemptible:
        return False
    m = policy.evictable_backfill_max_gpus
    return m is None or job.total_gpus <= m


def may_backfill_evictably(res: Reservation, job: JobSpec) -> bool:
    """May ``job``, placed borrowed, run on ``res``'s nodes until the owner needs them?"""
    return (
        res.evicts_backfill
        and res.kind is ReservationKind.HEAD_OF_LINE
        and job.rank != SERVING_RANK
        and job.rank >= res.priority_rank
    )


def node_free_time(state: ClusterState, node: _Node, res: Reservation | None = None) -> float:
    """When the node will be entirely free (-inf: now; inf: never, e.g. not ready), for
    ``res`` if given (its evictable backfill counts as gone)."""
    if node.health is not NodeHealth.READY or node.spare_of is not None:
        return _INF
    t = _NEG
    running = state._running
    for jid in node.jobs:
        rj = running[jid]
        if rj.preempting_for is not None:
            continue  # stopping within its grace period
        if res is not None and evictable_for(rj, res):
            continue  # backfill the owner stops when it is ready
        e = rj.started_at + rj.spec.max_runtime_s  # rj.end_time, without the property call (hot)
        if e > t:
            t = e
    return t


def _block_times(state: ClusterState, bid: str, owner: str | None, mine: Reservation | None = None) -> list[float]:
    return [t for t, _, _ in _block_node_times(state, bid, owner, mine)]


# entries of ``ClusterState.block_times_cache`` kept at most (then it starts afresh)
_BLOCK_TIMES_MAX = 4096


def _evict_terms(
    state: ClusterState, owner: str | None, mine: Reservation | None = None
) -> tuple[Reservation, tuple[object, ...]] | None:
    """The owner's reservation (or ``mine``, one it would make) if its evictable backfill counts
    as gone (``node_free_time``), with the fields ``evictable_for`` reads of it."""
    if mine is None:
        mine = state._reservations.get(owner) if owner is not None else None
    if mine is None or not mine.evicts_backfill:
        return None
    return mine, (mine.kind, mine.priority_rank, mine.created_at, mine.evicts_borrowed, mine.team)


def _block_node_times(
    state: ClusterState, bid: str, owner: str | None, mine: Reservation | None = None
) -> list[tuple[float, int, str]]:
    """(when the node is free, 1 if it is being cleared for another job else 0, node) for the
    nodes of a block, soonest first; nodes held by another gang's head-of-line reservation
    never are (inf). A node cleared by preemption for another job counts as free at once (it
    may be a gang's best node), but among equal times an unclaimed node is held first: the
    beneficiary takes its cleared nodes whatever other reservations hold them.

    Cached per (block, owner): the answer reads only the block's nodes, their jobs (started_at,
    max_runtime, borrowed, stopping), the other reservations holding them (all of which move the
    block's version less the owner's own bumps, ``_owner_version``) and the owner's reservation
    terms; never which nodes the owner itself holds. Read-only for callers."""
    blk = state._blocks[bid]
    ev = _evict_terms(state, owner, mine)
    stamp = (_owner_version(blk, owner), ev[1] if ev is not None else None)
    cache = state.block_times_cache
    got = cache.get((bid, owner))
    if got is not None and got[0] == stamp:
        return got[1]
    out = _block_node_times_now(state, blk.nodes, owner, ev[0] if ev is not None else None)
    if len(cache) >= _BLOCK_TIMES_MAX:
        cache.clear()
    cache[(bid, owner)] = (stamp, out)
    return out


def _owner_version(blk: _Block, owner: str | None) -> int:
    """The block's version less the bumps of ``owner``'s own reservation changes there (its nodes,
    its kind: what its own node times never read). Moves on every other change and never goes
    back (an owner's count is dropped only with its last node there, which only raises it)."""
    return blk.version - blk.own.get(owner, 0) if owner is not None else blk.version


def _block_node_times_now(
    state: ClusterState, block_nodes: list[str], owner: str | None, mine: Reservation | None
) -> list[tuple[float, int, str]]:
    node_res = state._node_res
    out = []
    reservations = state._reservations
    for nid in block_nodes:
        owners = node_res.get(nid)
        if owners:
            others = [o for o in owners if o != owner]
            if any(reservations[o].kind is ReservationKind.HEAD_OF_LINE for o in others):
                out.append((_INF, 0, nid))  # another gang's
                continue
            if others:
                out.append((node_free_time(state, state._nodes[nid], mine), 1, nid))
                continue
        out.append((node_free_time(state, state._nodes[nid], mine), 0, nid))
    out.sort()
    return out


def select_nodes(
    state: ClusterState, blocks: Iterable[str], k: int, owner: str | None, mine: Reservation | None = None
) -> tuple[tuple[str, ...], float]:
    """The ``k`` nodes of ``blocks`` that free soonest (free ones first, then by id), and when
    the last of them frees (inf if fewer than ``k`` ever will); ``mine``: the reservation the
    owner would make, if it has none yet."""
    lists = [_block_node_times(state, b, owner, mine) for b in blocks if b in state._blocks]
    if len(lists) == 1:
        times = lists[0]  # sorted already (and read-only)
    else:
        times = [t for lst in lists for t in lst]
        times.sort()
    if len(times) < k or k <= 0:
        return (), _INF
    picked = times[:k]
    return tuple(sorted(n for _, _, n in picked)), picked[-1][0]


def refresh_head_of_line(state: ClusterState, res: Reservation, now: float) -> tuple[tuple[str, ...], float]:
    """A node-level head-of-line reservation re-chosen in its blocks: (nodes, expected start).
    Cached per block versions less the owner's own bumps (``_owner_version``: a block's version
    changes with any of its nodes, and with the reservations holding them) and the owner's
    terms; kept when the reservation is renewed (the key holds all the answer reads)."""
    blocks = state._blocks
    versions = tuple(_owner_version(blocks[b], res.job_id) for b in res.blocks if b in blocks)
    ev = _evict_terms(state, res.job_id)
    key = (res.blocks, res.nodes_needed, versions, ev[1] if ev is not None else None)
    cached = state.res_cache.get(res.job_id)
    if cached is not None and cached[0] == key:
        nodes, raw = cached[1]
    else:
        nodes, raw = select_nodes(state, res.blocks, res.nodes_needed, res.job_id)
        state.res_cache[res.job_id] = (key, (nodes, raw))
    return nodes, max(raw, now)


def plan_head_of_line(
    state: ClusterState, ti: _TypeIndex, job: JobSpec, nodes_needed: int, now: float, mine: Reservation | None = None
) -> tuple[tuple[str, ...], float] | None:
    """Blocks where ``nodes_needed`` nodes are free earliest, and when. Blocks may be shared
    with other reservations (their nodes never count), ``pack=block`` without ``max_blocks``
    is held to the minimum number of blocks, and the fewest blocks reaching the earliest time
    are returned (the caller reserves the nodes in them that free soonest)."""
    per_block = [(bid, _block_times(state, bid, job.job_id, mine)) for bid in sorted(ti.blocks)]
    if not per_block:
        return None
    pack = job.topology.pack
    k = nodes_needed
    if pack is Pack.BLOCK and job.topology.max_blocks:
        m = job.topology.max_blocks
    elif pack is Pack.NODE:
        m = 1
    elif pack is Pack.BLOCK:
        size = max(len(state._blocks[b].nodes) for b, _ in per_block)
        m = -(-k // size)  # as few blocks as possible
    else:
        m = len(per_block)

    def counts(t: float) -> list[tuple[int, str]]:
        return [(bisect_right(times, t), bid) for bid, times in per_block]

    def feasible(t: float) -> bool:
        c = sorted((n for n, _ in counts(t)), reverse=True)
        return sum(c[:m]) >= k

    candidates = sorted({x for _, times in per_block for x in times if x != _INF})
    if not candidates or not feasible(candidates[-1]):
        return None
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    t = candidates[lo]
    now_free = {bid: bisect_right(times, now) for bid, times in per_block}
    ranked = sorted(counts(t), key=lambda cb: (-cb[0], -now_free[cb[1]], cb[1]))
    chosen: list[str] = []
    got = 0
    for n, bid in ranked:
        if got >= k:
            break
        if n == 0:
            continue
        chosen.append(bid)
        got += n
    return tuple(sorted(chosen)), max(t, now)


def make_head_of_line(
    job: JobSpec,
    blocks: tuple[str, ...],
    nodes_needed: int,
    gpus: int,
    start: float,
    now: float,
    nodes: tuple[str, ...] = (),
    evicts_backfill: bool = False,
    evicts_borrowed: bool = False,
) -> Reservation:
    return Reservation(
        job_id=job.job_id,
        gpu_type=job.gpu_type,
        kind=ReservationKind.HEAD_OF_LINE,
        blocks=blocks,
        nodes=nodes,
        nodes_needed=nodes_needed,
        gpus=gpus,
        priority_rank=job.rank,
        expected_start=start,
        created_at=now,
        team=job.team,
        evicts_backfill=evicts_backfill,
        evicts_borrowed=evicts_borrowed,
    )
