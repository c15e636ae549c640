"""``ClusterState``: the one mutable object of the engine, with incremental indexes.

It holds nodes (grouped in blocks, one GPU type per block), their health and free
GPUs, running jobs and what they hold, quotas and decayed usage per (team, GPU
type), reservations, hot spares, replicas lost by prod-serving jobs, and pending
preemptions. Every change goes through a method that updates the indexes in O(1)
or O(log n) (sorted lists per free-GPU count, per block), so a cycle never rescans
the cluster.

Indexes per GPU type:

* ``buckets[f]``: ids of ready, unheld nodes with exactly ``f`` free GPUs (sorted);
* per block ``free_nodes``: ready, unheld nodes with every GPU free (sorted);
* ``blocks_free``: block -> number of such nodes (blocks with at least one);
* totals of free GPUs / free whole nodes, idle GPUs on unhealthy nodes;
* per (class rank, borrowed) the running jobs that can be victims, sorted by most
  recent checkpoint (least lost work first), and their GPU totals.

``plan`` works on the state tentatively (a journal of inverse operations, rolled
back before it returns), so ``plan`` leaves the state exactly as it found it; a
driver calls ``commit.apply`` for what it committed. Not thread-safe.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

from placement.model import (
    SERVING_RANK,
    AllocationConflict,
    JobSpec,
    NodeGpus,
    NodeHealth,
    Placement,
    Quota,
    ReplicaSlot,
    Reservation,
    ReservationKind,
    UnknownJob,
    UnknownNode,
)

_LN2 = math.log(2.0)
_NO_QUOTA = Quota(0, 0)


def mask_of(gpus: Iterable[int]) -> int:
    m = 0
    for g in gpus:
        m |= 1 << g
    return m


def indices_of(mask: int) -> tuple[int, ...]:
    out = []
    i = 0
    while mask:
        if mask & 1:
            out.append(i)
        mask >>= 1
        i += 1
    return tuple(out)


def _sorted_remove(lst: list[Any], item: Any) -> None:
    i = bisect_left(lst, item)
    if i < len(lst) and lst[i] == item:
        del lst[i]
    else:  # pragma: no cover - an index bug
        raise AssertionError(f"index corrupt: {item!r} missing")


class _Node:
    __slots__ = ("block", "free_mask", "full", "gpu_type", "gpus", "health", "id", "jobs", "nfree", "spare_of")

    def __init__(self, node_id: str, block: str, gpu_type: str, gpus: int, health: NodeHealth) -> None:
        self.id = node_id
        self.block = block
        self.gpu_type = gpu_type
        self.gpus = gpus
        self.full = (1 << gpus) - 1
        self.health = health
        self.free_mask = self.full
        self.nfree = gpus
        self.jobs: dict[str, int] = {}  # job id -> mask of GPUs it holds here
        self.spare_of: str | None = None  # a hot spare held for this job


class _Block:
    __slots__ = ("free_nodes", "gpu_type", "id", "jversion", "nodes", "own", "version")

    def __init__(self, block_id: str, gpu_type: str) -> None:
        self.id = block_id
        self.gpu_type = gpu_type
        self.nodes: list[str] = []
        self.free_nodes: list[str] = []
        # bumped on any change to its nodes (free GPUs, health, spares, jobs, their borrowed /
        # stopping flags, which reservations hold them): a key for caches, never restored
        self.version = 0
        # bumped on changes to its nodes that run jobs (free GPUs, health, jobs, their borrowed /
        # stopping flags, victim listing), not on reservations or on nodes without jobs (spares
        # held and released): the victim index's key (``victims._BlockPart``), never restored
        self.jversion = 0
        # per reservation owner holding nodes here: how many of the version's bumps were changes
        # to its own reservation (its nodes here, its kind), which its own node times never read:
        # ``version - own[owner]`` moves on every other change (``reservations._block_node_times``)
        self.own: dict[str, int] = {}


class _TypeIndex:
    __slots__ = (
        "block_ids",
        "blocks",
        "blocks_free",
        "buckets",
        "cat_gpus",
        "free_gpus",
        "free_nodes",
        "gpu_type",
        "node_gpus",
        "spare_gpus",
        "spare_nodes",
        "total_gpus",
        "total_nodes",
        "unready_idle_gpus",
        "unready_idle_nodes",
        "victims",
    )

    def __init__(self, gpu_type: str, node_gpus: int) -> None:
        self.gpu_type = gpu_type
        self.node_gpus = node_gpus
        self.blocks: dict[str, _Block] = {}
        self.block_ids: list[str] = []  # ``blocks``' ids, sorted
        self.buckets: list[list[str]] = [[] for _ in range(node_gpus + 1)]
        self.free_gpus = 0
        self.free_nodes = 0
        self.blocks_free: dict[str, int] = {}
        self.total_gpus = 0
        self.total_nodes = 0
        self.unready_idle_gpus = 0
        self.unready_idle_nodes = 0
        self.spare_nodes = 0  # ready nodes held as hot spares (free, out of the free indexes)
        self.spare_gpus = 0
        # (rank, borrowed) -> sorted [(-lost_since, job_id)] of running, non-serving, not-preempting jobs
        self.victims: dict[tuple[int, bool], list[tuple[float, str]]] = {}
        self.cat_gpus: dict[tuple[int, bool], int] = {}


class RunningJob:
    """A running (or starting, or stopping) job as the engine sees it. Read-only for drivers."""

    __slots__ = (
        "blocks",
        "borrowed",
        "charge",
        "ckpt_every",
        "gpu_type",
        "held",
        "idle",
        "job_id",
        "last_checkpoint_at",
        "preempting_for",
        "rank",
        "slots",
        "spec",
        "started_at",
        "team",
        "vcat",
        "vkey",
        "whole",
        "young",
    )

    def __init__(self, spec: JobSpec, started_at: float, borrowed: bool, charge: int, whole: bool) -> None:
        self.spec = spec
        # copies of the (frozen) spec's fields: read millions of times per simulated day
        self.job_id = spec.job_id
        self.team = spec.team
        self.gpu_type = spec.gpu_type
        self.rank = spec.rank
        self.started_at = started_at
        self.last_checkpoint_at = spec.last_checkpoint_at
        # seconds between its last two checkpoints in this run (None until it has made two):
        # when its next one is due (``Policy.checkpoint_wait_s``)
        self.ckpt_every: float | None = None
        self.borrowed = borrowed
        self.charge = charge  # GPUs counted against quota (whole nodes for whole-node jobs)
        self.whole = whole
        self.held: dict[str, int] = {}  # node id -> GPU mask
        self.slots: dict[int, tuple[str, tuple[int, ...]]] = {}
        self.blocks: tuple[str, ...] = ()
        self.preempting_for: str | None = None
        self.vkey: tuple[float, str] | None = None  # its key in the victim list, when listed
        self.vcat: tuple[int, bool] | None = None  # its victim category, when counted
        self.young = False  # still protected: counted, not listed yet
        self.idle = False  # its GPUs sit idle (agents' readings; Policy.idle_victims_first)

    @property
    def end_time(self) -> float:
        return self.started_at + self.spec.max_runtime_s

    @property
    def lost_since(self) -> float:
        """Work since this time is lost if preempted now (last checkpoint, or start).

        A borrowed job whose GPUs sit idle does no work to lose: it is the cheapest victim."""
        if self.idle and self.borrowed:
            return math.inf
        if self.spec.preemptible and self.last_checkpoint_at is not None:
            return max(self.last_checkpoint_at, self.started_at)
        return self.started_at

    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted(self.held))


class _Acct:
    __slots__ = ("as_of", "borrowed_n", "gused", "jobs", "usage", "used")

    def __init__(self) -> None:
        self.used = 0  # GPUs charged to running jobs
        self.gused = 0  # of which guaranteed (not borrowed)
        self.borrowed_n = 0  # running jobs marked borrowed
        self.jobs: set[str] = set()
        self.usage = 0.0  # decayed GPU-hours as of ``as_of``
        self.as_of = 0.0


class ClusterState:
    """Cluster capacity, running jobs, quotas, usage, reservations and hot spares.

    Drivers: build it (``add_node``, ``set_quota``, ``set_usage``, ``allocate`` for
    what already runs), then per cycle call ``engine.plan`` and ``commit.apply``, and
    feed events (``release``, ``set_node_health``, ``release_replicas``,
    ``set_checkpoint``) as they happen.
    """

    def __init__(self, usage_half_life_s: float = 84 * 3600.0) -> None:
        self.usage_half_life_s = usage_half_life_s
        self._nodes: dict[str, _Node] = {}
        self._blocks: dict[str, _Block] = {}
        self._types: dict[str, _TypeIndex] = {}
        self._running: dict[str, RunningJob] = {}
        self._quota: dict[tuple[str, str], Quota] = {}
        self._acct: dict[tuple[str, str], _Acct] = {}
        self._reservations: dict[str, Reservation] = {}
        self._node_res: dict[str, tuple[str, ...]] = {}  # node -> reservation owners (sorted)
        self._block_res: dict[str, dict[str, int]] = {}
        # block -> owner tuple -> number of its free whole nodes (``free_nodes``) held by exactly
        # those reservation owners: a search that may not use some owners counts what is left
        # without walking the block
        self._block_res_free: dict[str, dict[tuple[str, ...], int]] = {}
        self._spares: dict[str, set[str]] = {}
        self._missing: dict[str, set[int]] = {}
        self._awaiting: dict[str, set[str]] = {}
        self._quota_dirty: set[tuple[str, str]] = set()
        self._forecast: dict[tuple[str, str], int] = {}  # (team, type) -> recent peak demand (driver's data)
        # type -> recent peak of all teams' demand within their guarantees, together (driver's data)
        self._pooled_forecast: dict[str, int] = {}
        self._journal: list[tuple[Callable[..., Any], tuple[Any, ...]]] | None = None
        # per head-of-line reservation: (its blocks, nodes needed, their versions less the owner's
        # own bumps, the owner's
        # evictable-backfill terms) -> (nodes, expected start), see reservations.refresh_head_of_line
        self.res_cache: dict[str, tuple[Any, tuple[tuple[str, ...], float]]] = {}
        # per (block, owner): ((block version less the owner's own bumps, owner's evictable-backfill
        # terms), node times),
        # see reservations._block_node_times; bounded (cleared past _BLOCK_TIMES_MAX entries)
        self.block_times_cache: dict[tuple[str, str | None], tuple[tuple[int, Any], list[tuple[float, int, str]]]] = {}
        # per victim mode, per block: that block's part of a ``victims.VictimIndex``, kept while
        # the block's ``jversion`` stands; bounded (at most one part per block and mode; cleared
        # past victims._VICTIM_BLOCKS_MAX modes)
        self.victim_blocks: dict[Any, dict[str, Any]] = {}
        self.res_version = 0  # bumped on every reservation change (cache invalidation only)
        self._res_sorted: tuple[int, tuple[Reservation, ...]] = (0, ())  # ``reservations()`` at a version
        self.res_free_version = 0  # bumped only when a reservation goes (capacity may come back)
        self._young: list[tuple[float, int, RunningJob]] = []  # (started_at, seq, job) not yet listed
        self._young_seq = 0
        self._clock = float("-inf")  # latest ``now`` seen by promote
        self._protect_s = 1800.0
        self._first_runs_listed = False

    # ------------------------------------------------------------------ journal

    def _log(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._journal is not None:
            self._journal.append((fn, args))

    def begin_tentative(self) -> None:
        if self._journal is not None:
            raise RuntimeError("already in a tentative section")
        self._journal = []

    def rollback(self) -> None:
        journal = self._journal
        self._journal = None
        if journal is None:
            return
        for fn, args in reversed(journal):
            fn(*args)

    @property
    def tentative(self) -> bool:
        return self._journal is not None

    def _no_tentative(self, what: str) -> None:
        if self._journal is not None:
            raise RuntimeError(f"{what} is not allowed inside a tentative section (plan)")

    # ------------------------------------------------------------------ nodes

    def add_node(
        self,
        node_id: str,
        block_id: str,
        gpu_type: str,
        gpus: int = 8,
        health: NodeHealth | str = NodeHealth.READY,
    ) -> None:
        """Add a node. Every node of a GPU type has the same number of GPUs; a block has one type."""
        self._no_tentative("add_node")
        if node_id in self._nodes:
            raise ValueError(f"node {node_id} exists")
        health = NodeHealth(health)
        ti = self._types.get(gpu_type)
        if ti is None:
            ti = self._types[gpu_type] = _TypeIndex(gpu_type, gpus)
        elif ti.node_gpus != gpus:
            raise ValueError(f"{gpu_type} nodes have {ti.node_gpus} GPUs, not {gpus}")
        blk = self._blocks.get(block_id)
        if blk is None:
            blk = self._blocks[block_id] = _Block(block_id, gpu_type)
            ti.blocks[block_id] = blk
            insort(ti.block_ids, block_id)
        elif blk.gpu_type != gpu_type:
            raise ValueError(f"block {block_id} holds {blk.gpu_type}, not {gpu_type}")
        node = _Node(node_id, block_id, gpu_type, gpus, health)
        self._nodes[node_id] = node
        insort(blk.nodes, node_id)
        ti.total_gpus += gpus
        ti.total_nodes += 1
        self._attach(node)

    def remove_node(self, node_id: str) -> None:
        node = self._node(node_id)
        if node.jobs:
            raise AllocationConflict(f"node {node_id} still runs {sorted(node.jobs)}")
        if node.spare_of is not None:
            self._unhold_spare(node)
        self._detach(node)
        blk = self._blocks[node.block]
        _sorted_remove(blk.nodes, node_id)
        ti = self._types[node.gpu_type]
        ti.total_gpus -= node.gpus
        ti.total_nodes -= 1
        del self._nodes[node_id]
        for owner in self._node_res.pop(node_id, ()):
            d = self._block_res[node.block]
            d[owner] -= 1
            if d[owner] <= 0:
                del d[owner]
                if not d:
                    del self._block_res[node.block]

    def set_node_health(self, node_id: str, health: NodeHealth | str) -> tuple[str, ...]:
        """Change a node's health; returns the jobs holding GPUs on it (the driver decides their fate).

        A hot spare on a node that is no longer ready stops being a spare.
        """
        self._no_tentative("set_node_health")
        node = self._node(node_id)
        health = NodeHealth(health)
        if health is not NodeHealth.READY and node.spare_of is not None:
            self._unhold_spare(node)
        self._detach(node)
        node.health = health
        self._attach(node)
        return tuple(sorted(node.jobs))

    def _node(self, node_id: str) -> _Node:
        try:
            return self._nodes[node_id]
        except KeyError:
            raise UnknownNode(node_id) from None

    def _detach(self, node: _Node) -> None:
        """Take a node out of the free indexes (before changing it)."""
        ti = self._types[node.gpu_type]
        blk = self._blocks[node.block]
        blk.version += 1
        if node.jobs:
            blk.jversion += 1
        if node.spare_of is not None:
            return
        if node.health is not NodeHealth.READY:
            ti.unready_idle_gpus -= node.nfree
            if node.nfree == node.gpus:
                ti.unready_idle_nodes -= 1
            return
        f = node.nfree
        if f:
            _sorted_remove(ti.buckets[f], node.id)
            ti.free_gpus -= f
            if f == node.gpus:
                _sorted_remove(blk.free_nodes, node.id)
                ti.free_nodes -= 1
                owners = self._node_res.get(node.id)
                if owners:
                    self._res_free_add(blk.id, owners, -1)
                n = len(blk.free_nodes)
                if n:
                    ti.blocks_free[blk.id] = n
                else:
                    del ti.blocks_free[blk.id]

    def _attach(self, node: _Node) -> None:
        ti = self._types[node.gpu_type]
        blk = self._blocks[node.block]
        blk.version += 1
        if node.jobs:
            blk.jversion += 1
        if node.spare_of is not None:
            return
        if node.health is not NodeHealth.READY:
            ti.unready_idle_gpus += node.nfree
            if node.nfree == node.gpus:
                ti.unready_idle_nodes += 1
            return
        f = node.nfree
        if f:
            insort(ti.buckets[f], node.id)
            ti.free_gpus += f
            if f == node.gpus:
                insort(blk.free_nodes, node.id)
                ti.free_nodes += 1
                owners = self._node_res.get(node.id)
                if owners:
                    self._res_free_add(blk.id, owners, 1)
                ti.blocks_free[blk.id] = len(blk.free_nodes)

    def _res_free_add(self, bid: str, owners: tuple[str, ...], k: int) -> None:
        d = self._block_res_free.get(bid)
        if d is None:
            d = self._block_res_free[bid] = {}
        c = d.get(owners, 0) + k
        if c:
            d[owners] = c
        else:
            del d[owners]
            if not d:
                del self._block_res_free[bid]

    def _is_free_whole(self, node: _Node) -> bool:
        """Is the node in its block's ``free_nodes`` index?"""
        return node.health is NodeHealth.READY and node.spare_of is None and node.nfree == node.gpus

    def _set_node_owners(self, node: _Node, old: tuple[str, ...], new: tuple[str, ...]) -> None:
        # the block's version covers who holds its nodes too (``reservations._block_node_times``):
        # one bump per owner that comes or goes, counted as that owner's own
        blk = self._blocks[node.block]
        own = blk.own
        blk.version += 1  # (once even if no owner comes or goes)
        first = True
        for o in [o for o in old if o not in new] + [o for o in new if o not in old]:
            if not first:
                blk.version += 1
            first = False
            own[o] = own.get(o, 0) + 1
        if new:
            self._node_res[node.id] = new
        else:
            del self._node_res[node.id]
        if self._is_free_whole(node):
            if old:
                self._res_free_add(node.block, old, -1)
            if new:
                self._res_free_add(node.block, new, 1)

    def block_free_by_owners(self, block_id: str) -> dict[tuple[str, ...], int]:
        """Free whole nodes of a block held by reservations, by owner tuple (read-only)."""
        return self._block_res_free.get(block_id) or {}

    def _take(self, node: _Node, mask: int, job_id: str) -> None:
        if node.free_mask & mask != mask:
            raise AllocationConflict(f"GPUs {indices_of(mask & ~node.free_mask)} of {node.id} are not free")
        self._detach(node)
        node.free_mask &= ~mask
        node.nfree = node.free_mask.bit_count()
        node.jobs[job_id] = node.jobs.get(job_id, 0) | mask
        self._attach(node)

    def _give(self, node: _Node, mask: int, job_id: str) -> None:
        self._detach(node)
        node.free_mask |= mask
        node.nfree = node.free_mask.bit_count()
        left = node.jobs.get(job_id, 0) & ~mask
        if left:
            node.jobs[job_id] = left
        else:
            node.jobs.pop(job_id, None)
        self._attach(node)

    # ------------------------------------------------------------------ quotas and usage

    def set_quota(self, team: str, gpu_type: str, guaranteed: int, borrow_limit: int = 0) -> None:
        """Set a team's quota for a GPU type; borrowed flags are re-checked by the next plan."""
        if guaranteed < 0 or borrow_limit < 0:
            raise ValueError("quota values must be >= 0")
        key = (team, gpu_type)
        self._quota[key] = Quota(guaranteed, borrow_limit)
        self._quota_dirty.add(key)

    def quota(self, team: str, gpu_type: str) -> Quota:
        return self._quota.get((team, gpu_type), _NO_QUOTA)

    def quotas(self) -> dict[tuple[str, str], Quota]:
        return dict(self._quota)

    def _acct_of(self, key: tuple[str, str]) -> _Acct:
        a = self._acct.get(key)
        if a is None:
            a = self._acct[key] = _Acct()
        return a

    def used(self, team: str, gpu_type: str) -> int:
        a = self._acct.get((team, gpu_type))
        return a.used if a else 0

    def guaranteed_used(self, team: str, gpu_type: str) -> int:
        a = self._acct.get((team, gpu_type))
        return a.gused if a else 0

    def borrowed_used(self, team: str, gpu_type: str) -> int:
        a = self._acct.get((team, gpu_type))
        return a.used - a.gused if a else 0

    def team_jobs(self, team: str, gpu_type: str) -> tuple[str, ...]:
        a = self._acct.get((team, gpu_type))
        return tuple(sorted(a.jobs)) if a else ()

    def teams(self) -> tuple[str, ...]:
        return tuple(sorted({k[0] for k in self._quota} | {k[0] for k in self._acct}))

    def set_demand_forecast(
        self, forecast: Mapping[tuple[str, str], int], pooled: Mapping[str, int] | None = None
    ) -> None:
        """Each (team, GPU type)'s expected demand (GPUs running + queued), as the driver
        estimates it from the recent past (``placement.forecast.DemandForecast``), and per GPU
        type the recent peak of all teams' demand within their guarantees together
        (``pooled``): replaces the previous forecast. Set between cycles, never during
        ``plan``. Read under the borrow guards (``Policy.reads_demand_forecast``)."""
        self._forecast = {k: int(v) for k, v in forecast.items() if v > 0}
        self._pooled_forecast = {t: int(v) for t, v in (pooled or {}).items() if v > 0}

    def demand_forecast(self, team: str, gpu_type: str) -> int:
        return self._forecast.get((team, gpu_type), 0)

    def returning_demand(self, gpu_type: str, pooled: bool = False, less_reserved: bool = False) -> int:
        """GPUs of guaranteed demand expected back: per team, its forecast demand within its
        guarantee less what it uses now (0 for a team at or over either), summed. ``pooled``
        (``Policy.pooled_demand_forecast``): at most the teams' combined recent peak within
        their guarantees less what they use within them now; teams peak at different times,
        so the sum of their own peaks expects more back at once than came back together
        (the sum where the driver gave no combined peak for the type). ``less_reserved``
        (``Policy.returning_demand_less_reserved``): GPUs reserved for a team's jobs count as
        used, since the reservation already holds room for that demand."""
        reserved: dict[str, int] = {}
        if less_reserved:
            for res in self._reservations.values():
                if res.gpu_type == gpu_type:
                    reserved[res.team] = reserved.get(res.team, 0) + res.gpus
        total = 0
        within = 0
        for (team, t), peak in self._forecast.items():
            if t != gpu_type:
                continue
            q = self._quota.get((team, t))
            if q is None:
                continue
            a = self._acct.get((team, t))
            used = (a.used if a is not None else 0) + reserved.get(team, 0)
            total += max(0, min(q.guaranteed, peak) - used)
            within += min(q.guaranteed, used)  # a team using GPUs has a forecast (its demand >= its use)
        combined = self._pooled_forecast.get(gpu_type) if pooled else None
        if combined is None:
            return total  # not asked, or the driver gave no combined peak: the sum
        return min(total, max(0, combined - within))

    def set_usage(self, team: str, gpu_type: str, gpu_hours: float, as_of: float) -> None:
        """Decayed GPU-hours of a team (on rebuild from the store); running jobs keep accruing."""
        a = self._acct_of((team, gpu_type))
        a.usage = float(gpu_hours)
        a.as_of = float(as_of)

    def usage(self, team: str, gpu_type: str, now: float) -> float:
        """Decayed GPU-hours at ``now`` (half-life ``usage_half_life_s``), including running jobs."""
        a = self._acct.get((team, gpu_type))
        if a is None:
            return 0.0
        return self._usage_at(a, now)

    def _usage_at(self, a: _Acct, now: float) -> float:
        dt = now - a.as_of
        if dt <= 0:
            return a.usage
        h = self.usage_half_life_s
        f = 0.5 ** (dt / h)
        return a.usage * f + a.used * (1.0 - f) * h / _LN2 / 3600.0

    def _settle(self, key: tuple[str, str], now: float) -> _Acct:
        a = self._acct_of(key)
        self._log(self._restore_usage, a, a.usage, a.as_of)
        if now > a.as_of:
            a.usage = self._usage_at(a, now)
            a.as_of = now
        return a

    @staticmethod
    def _restore_usage(a: _Acct, usage: float, as_of: float) -> None:
        a.usage = usage
        a.as_of = as_of

    def quota_dirty(self) -> tuple[tuple[str, str], ...]:
        return tuple(sorted(self._quota_dirty))

    def mark_quota_checked(self, keys: Iterable[tuple[str, str]]) -> None:
        for k in keys:
            self._quota_dirty.discard(k)

    # ------------------------------------------------------------------ running jobs

    def is_running(self, job_id: str) -> bool:
        return job_id in self._running

    def running(self, job_id: str) -> RunningJob:
        try:
            return self._running[job_id]
        except KeyError:
            raise UnknownJob(job_id) from None

    def get_running(self, job_id: str) -> RunningJob | None:
        return self._running.get(job_id)

    def running_jobs(self) -> Iterator[RunningJob]:
        """Running jobs in id order (a full scan: for drivers and checkers, not for cycles)."""
        for jid in sorted(self._running):
            yield self._running[jid]

    def __len__(self) -> int:
        return len(self._running)

    def allocate(self, job: JobSpec, placement: Placement, now: float, started_at: float | None = None) -> RunningJob:
        """Record a committed gang placement (or, on rebuild, a live allocation read from the
        store: pass ``started_at``; a prod-serving job may come with fewer slots than
        replicas, the rest being lost replicas to replace). Raises ``AllocationConflict``
        if any GPU is taken, a node is not ready or of another type, or a gang is partial."""
        if placement.replacement:
            return self.place_replicas(placement, now)
        if job.job_id != placement.job_id:
            raise ValueError("placement is for another job")
        if job.job_id in self._running:
            raise AllocationConflict(f"{job.job_id} is already running")
        if job.gpu_type != placement.gpu_type:
            raise AllocationConflict(f"{job.job_id} needs {job.gpu_type}, placement is {placement.gpu_type}")
        masks: list[tuple[_Node, int]] = []
        for ng in placement.nodes:
            node = self._node(ng.node_id)
            if node.gpu_type != job.gpu_type:
                raise AllocationConflict(f"{node.id} is {node.gpu_type}, job needs {job.gpu_type}")
            if node.health is not NodeHealth.READY:
                raise AllocationConflict(f"{node.id} is {node.health.value}")
            if node.spare_of is not None and node.spare_of != job.job_id:
                raise AllocationConflict(f"{node.id} is a hot spare of {node.spare_of}")
            m = mask_of(ng.gpus)
            if node.free_mask & m != m:
                raise AllocationConflict(f"GPUs {indices_of(m & ~node.free_mask)} of {node.id} are not free")
            masks.append((node, m))
        # the job's own spares are released before it takes nodes (a restart may use them)
        if job.job_id in self._spares:
            self.release_spares(job.job_id)
        start = started_at if started_at is not None else (job.started_at if job.started_at is not None else now)
        rj = RunningJob(job, start, placement.borrowed, placement.gpus, _is_whole(job, self._types[job.gpu_type]))
        for node, m in masks:
            rj.held[node.id] = rj.held.get(node.id, 0) | m
        for s in placement.slots:
            rj.slots[s.replica] = (s.node_id, s.gpus)
        rj.blocks = tuple(sorted({self._nodes[n].block for n in rj.held}))
        missing = set(range(job.replicas)) - set(rj.slots)
        if missing and job.rank != SERVING_RANK:
            raise AllocationConflict(f"{job.job_id}: a gang is all or nothing; replicas {sorted(missing)} have no slot")
        key = (job.team, job.gpu_type)
        self._settle(key, now)
        self._add_running(rj)
        self._log(self._remove_running, rj)
        if missing:  # a prod-serving job rebuilt with lost replicas: the next plan replaces them
            self._missing[job.job_id] = missing
            self._log(self._missing.pop, job.job_id, None)
        if self._journal is None and self._acct[key].gused > self.quota(*key).guaranteed:
            self._quota_dirty.add(key)  # a stale flag from the store: the next plan re-checks it
        for nid in placement.spare_nodes:
            self.hold_spare(nid, job.job_id)
        return rj

    def _add_running(self, rj: RunningJob) -> None:
        jid = rj.job_id
        for nid, m in rj.held.items():
            self._take(self._nodes[nid], m, jid)
        self._running[jid] = rj
        a = self._acct_of((rj.team, rj.gpu_type))
        a.used += rj.charge
        a.jobs.add(jid)
        if rj.borrowed:
            a.borrowed_n += 1
        else:
            a.gused += rj.charge
        self._victim_add(rj)

    def _remove_running(self, rj: RunningJob) -> None:
        jid = rj.job_id
        self._victim_remove(rj)
        for nid, m in rj.held.items():
            self._give(self._nodes[nid], m, jid)
        del self._running[jid]
        a = self._acct[(rj.team, rj.gpu_type)]
        a.used -= rj.charge
        a.jobs.discard(jid)
        if rj.borrowed:
            a.borrowed_n -= 1
        else:
            a.gused -= rj.charge

    def _victim_add(self, rj: RunningJob) -> None:
        """Index a job that may become a victim: counted in ``cat_gpus`` at once, listed in
        ``victims`` once its preemption protection has passed (``promote``), so victim
        searches never wade through jobs that just started. Borrowed jobs have no
        protection (borrowed capacity is always reclaimable): they are listed at once."""
        if rj.rank == SERVING_RANK or rj.preempting_for is not None:
            return
        ti = self._types[rj.gpu_type]
        cat = (rj.rank, rj.borrowed)
        rj.vcat = cat
        ti.cat_gpus[cat] = ti.cat_gpus.get(cat, 0) + rj.charge
        if (
            rj.spec.start_protected(rj.borrowed, self._first_runs_listed)
            and rj.started_at > self._clock - self._protect_s
        ):
            rj.young = True
            self._young_seq += 1
            heapq.heappush(self._young, (rj.started_at, self._young_seq, rj))
        else:
            rj.vkey = (-rj.lost_since, rj.job_id)
            insort(ti.victims.setdefault(cat, []), rj.vkey)

    def _victim_remove(self, rj: RunningJob) -> None:
        cat = rj.vcat
        if cat is None:
            return
        ti = self._types[rj.gpu_type]
        ti.cat_gpus[cat] -= rj.charge
        if rj.vkey is not None:
            _sorted_remove(ti.victims[cat], rj.vkey)
            rj.vkey = None
        rj.young = False
        rj.vcat = None

    def promote(self, now: float, protect_s: float, first_runs: bool = False) -> None:
        """List jobs whose protection (``protect_s`` after start) has passed by ``now`` as
        victim candidates; with ``first_runs`` (some preemptors may stop a guaranteed job on
        its first run, ``Policy.first_runs_unprotected_min_gpus``) such jobs are listed at
        once. Index upkeep only: it changes no decision (eligibility is always re-checked),
        so ``plan`` calls it without journaling."""
        self._protect_s = protect_s
        if now > self._clock:
            self._clock = now
        if first_runs != self._first_runs_listed:
            # who is listed changed (a state built before its first plan): list again
            self._first_runs_listed = first_runs
            for rj in list(self._running.values()):
                if rj.vcat is not None:
                    self._victim_remove(rj)
                    self._victim_add(rj)
                    self._bump_held(rj)
        young = self._young
        limit = now - protect_s
        while young and young[0][0] <= limit:
            started, _, rj = heapq.heappop(young)
            if rj.young and rj.started_at == started and self._running.get(rj.job_id) is rj:
                rj.young = False
                rj.vkey = (-rj.lost_since, rj.job_id)
                # a young job was counted by ``_victim_add``, which set its ``vcat``
                cat = cast("tuple[int, bool]", rj.vcat)
                insort(self._types[rj.gpu_type].victims.setdefault(cat, []), rj.vkey)
                self._bump_held(rj)  # listed now: its blocks' victim parts change

    def _bump_held(self, rj: RunningJob) -> None:
        """Move the versions (both) of the blocks where ``rj`` holds nodes (its victim listing,
        borrowed or stopping flag, or nodes changed)."""
        nodes, blocks = self._nodes, self._blocks
        for nid in rj.held:
            blk = blocks[nodes[nid].block]
            blk.version += 1
            blk.jversion += 1

    def release(self, job_id: str, now: float, keep_spares: bool = False) -> RunningJob:
        """A job's gang is gone (ended, stopped, failed): free its GPUs.

        ``keep_spares`` keeps its hot spares held for a restart (a failed attempt that is
        re-queued); otherwise they are freed too.
        """
        self._no_tentative("release")
        rj = self.running(job_id)
        self._settle((rj.team, rj.gpu_type), now)
        self._remove_running(rj)
        self._log(self._add_running, rj)
        self._quota_dirty.add((rj.team, rj.gpu_type))
        if rj.preempting_for is not None:
            waiting = self._awaiting.get(rj.preempting_for)
            if waiting is not None:
                waiting.discard(job_id)
                if not waiting:
                    del self._awaiting[rj.preempting_for]
        self._missing.pop(job_id, None)
        if not keep_spares and job_id in self._spares:
            self.release_spares(job_id)
        return rj

    def release_replicas(self, job_id: str, replicas: Iterable[int], now: float) -> None:
        """Lost replicas of a running job (prod-serving: replaced alone by a later plan).

        Frees their GPUs (the whole node for whole-node jobs once no replica is left on it);
        the job keeps its quota charge so the replacement always fits its quota.
        """
        self._no_tentative("release_replicas")
        rj = self.running(job_id)
        lost = set(replicas) & set(rj.slots)
        if not lost:
            return
        self._victim_remove(rj)
        for r in sorted(lost):
            nid, gpus = rj.slots.pop(r)
            self._missing.setdefault(job_id, set()).add(r)
            still_here = any(n == nid for n, _ in rj.slots.values())
            node = self._nodes[nid]
            if rj.whole:
                if not still_here:
                    m = rj.held.pop(nid)
                    self._give(node, m, job_id)
            else:
                m = mask_of(gpus) & rj.held.get(nid, 0)
                self._give(node, m, job_id)
                left = rj.held[nid] & ~m
                if left:
                    rj.held[nid] = left
                else:
                    del rj.held[nid]
        rj.blocks = tuple(sorted({self._nodes[n].block for n in rj.held}))
        self._victim_add(rj)
        self._bump_held(rj)

    def place_replicas(self, placement: Placement, now: float) -> RunningJob:
        """Record replacement replicas of a running job (``Placement.replacement``)."""
        rj = self.running(placement.job_id)
        missing = self._missing.get(rj.job_id, set())
        for s in placement.slots:
            if s.replica not in missing:
                raise AllocationConflict(f"replica {s.replica} of {rj.job_id} is not missing")
        for ng in placement.nodes:
            node = self._node(ng.node_id)
            m = mask_of(ng.gpus)
            if node.health is not NodeHealth.READY or node.free_mask & m != m or node.gpu_type != rj.gpu_type:
                raise AllocationConflict(f"GPUs {ng.gpus} of {node.id} are not free")
        saved = (dict(rj.held), dict(rj.slots), rj.blocks, set(missing))
        self._victim_remove(rj)
        for ng in placement.nodes:
            m = mask_of(ng.gpus)
            self._take(self._nodes[ng.node_id], m, rj.job_id)
            rj.held[ng.node_id] = rj.held.get(ng.node_id, 0) | m
        for s in placement.slots:
            rj.slots[s.replica] = (s.node_id, s.gpus)
            missing.discard(s.replica)
        if not missing:
            self._missing.pop(rj.job_id, None)
        rj.blocks = tuple(sorted({self._nodes[n].block for n in rj.held}))
        self._victim_add(rj)
        self._bump_held(rj)
        self._log(self._unplace_replicas, rj, placement, saved)
        return rj

    def _unplace_replicas(self, rj: RunningJob, placement: Placement, saved: Any) -> None:
        self._victim_remove(rj)
        for ng in placement.nodes:
            self._give(self._nodes[ng.node_id], mask_of(ng.gpus), rj.job_id)
        rj.held, rj.slots, rj.blocks, missing = saved
        self._missing[rj.job_id] = missing
        self._victim_add(rj)
        self._bump_held(rj)

    def missing_replicas(self, job_id: str) -> tuple[int, ...]:
        return tuple(sorted(self._missing.get(job_id, ())))

    def degraded_jobs(self) -> tuple[str, ...]:
        return tuple(sorted(self._missing))

    def set_checkpoint(self, job_id: str, at: float) -> None:
        """A running job checkpointed (less work lost if it is preempted)."""
        rj = self.running(job_id)
        listed = rj.vkey is not None
        self._victim_remove(rj)
        prev = rj.last_checkpoint_at
        self._log(self._restore_ckpt, rj, prev, rj.ckpt_every)
        if prev is not None and rj.started_at <= prev < at:
            rj.ckpt_every = at - prev  # a checkpoint of an earlier run says nothing of this one's pace
        rj.last_checkpoint_at = at
        self._victim_add(rj)
        if (rj.vkey is not None) != listed:
            self._bump_held(rj)

    def _restore_ckpt(self, rj: RunningJob, at: float | None, every: float | None) -> None:
        listed = rj.vkey is not None
        self._victim_remove(rj)
        rj.last_checkpoint_at = at
        rj.ckpt_every = every
        self._victim_add(rj)
        if (rj.vkey is not None) != listed:
            self._bump_held(rj)

    def set_idle(self, job_id: str, idle: bool) -> None:
        """The job's GPUs sit idle, or are in use again (the leader's reading of the agents)."""
        rj = self.running(job_id)
        if rj.idle == idle:
            return
        self._flip_idle(rj)
        self._log(self._flip_idle, rj)

    def _flip_idle(self, rj: RunningJob) -> None:
        listed = rj.vkey is not None
        self._victim_remove(rj)
        rj.idle = not rj.idle
        self._victim_add(rj)
        if (rj.vkey is not None) != listed:
            self._bump_held(rj)

    def set_borrowed(self, job_id: str, borrowed: bool) -> None:
        rj = self.running(job_id)
        if rj.borrowed == borrowed:
            return
        self._flip_borrowed(rj)
        self._log(self._flip_borrowed, rj)

    def _flip_borrowed(self, rj: RunningJob) -> None:
        self._victim_remove(rj)
        a = self._acct[(rj.team, rj.gpu_type)]
        if rj.borrowed:
            a.borrowed_n -= 1
            a.gused += rj.charge
        else:
            a.borrowed_n += 1
            a.gused -= rj.charge
        rj.borrowed = not rj.borrowed
        self._victim_add(rj)
        self._bump_held(rj)  # node free times of reservations that may evict borrowed work change

    def mark_preempting(self, victim: str, beneficiary: str) -> None:
        """A victim was told to stop for ``beneficiary``; it holds its GPUs until ``release``.
        (On rebuild, a beneficiary that is not known any more may be given as ``""``.)"""
        rj = self.running(victim)
        if rj.preempting_for is not None:
            raise AllocationConflict(f"{victim} is already being preempted")
        self._set_preempting(rj, beneficiary)
        self._log(self._set_preempting, rj, None)

    def _set_preempting(self, rj: RunningJob, beneficiary: str | None) -> None:
        self._victim_remove(rj)
        old = rj.preempting_for
        if old is not None:
            w = self._awaiting.get(old)
            if w is not None:
                w.discard(rj.job_id)
                if not w:
                    del self._awaiting[old]
        rj.preempting_for = beneficiary
        if beneficiary is not None:
            self._awaiting.setdefault(beneficiary, set()).add(rj.job_id)
        self._victim_add(rj)
        self._bump_held(rj)

    def awaiting(self, beneficiary: str) -> tuple[str, ...]:
        """Victims still stopping for ``beneficiary``."""
        return tuple(sorted(self._awaiting.get(beneficiary, ())))

    def preempting(self) -> tuple[str, ...]:
        return tuple(sorted(j for w in self._awaiting.values() for j in w))

    # ------------------------------------------------------------------ hot spares

    def hold_spare(self, node_id: str, job_id: str) -> None:
        node = self._node(node_id)
        if node.spare_of is not None or node.jobs or node.health is not NodeHealth.READY:
            raise AllocationConflict(f"{node_id} cannot be a spare")
        self._detach(node)
        node.spare_of = job_id
        self._attach(node)
        self._spare_count(node, 1)
        self._spares.setdefault(job_id, set()).add(node_id)
        self._log(self._unhold_spare, node)

    def _spare_count(self, node: _Node, k: int) -> None:
        ti = self._types[node.gpu_type]
        ti.spare_nodes += k
        ti.spare_gpus += k * node.gpus

    def _unhold_spare(self, node: _Node) -> None:
        job_id = node.spare_of
        assert job_id is not None
        self._detach(node)
        node.spare_of = None
        self._attach(node)
        self._spare_count(node, -1)
        s = self._spares[job_id]
        s.discard(node.id)
        if not s:
            del self._spares[job_id]

    def _rehold_spare(self, node: _Node, job_id: str) -> None:
        self._detach(node)
        node.spare_of = job_id
        self._attach(node)
        self._spare_count(node, 1)
        self._spares.setdefault(job_id, set()).add(node.id)

    def release_spares(self, job_id: str) -> tuple[str, ...]:
        nodes = tuple(sorted(self._spares.get(job_id, ())))
        for nid in nodes:
            node = self._nodes[nid]
            self._unhold_spare(node)
            self._log(self._rehold_spare, node, job_id)
        return nodes

    def drop_spare(self, node_id: str) -> None:
        """Release one spare node from its gang's pool (a no-op if it is not a spare)."""
        node = self._node(node_id)
        owner = node.spare_of
        if owner is None:
            return
        self._unhold_spare(node)
        self._log(self._rehold_spare, node, owner)

    def spares(self, job_id: str) -> tuple[str, ...]:
        return tuple(sorted(self._spares.get(job_id, ())))

    def spare_owners(self) -> tuple[str, ...]:
        return tuple(sorted(self._spares))

    # ------------------------------------------------------------------ reservations

    def reservations(self) -> tuple[Reservation, ...]:
        """Every reservation, by owner id (kept while ``res_version`` stands: the engine asks
        for it for every gang it considers reserving)."""
        got = self._res_sorted
        if got[0] == self.res_version:
            return got[1]
        out = tuple(self._reservations[j] for j in sorted(self._reservations))
        self._res_sorted = (self.res_version, out)
        return out

    def reservation(self, job_id: str) -> Reservation | None:
        return self._reservations.get(job_id)

    def reservation_nodes(self, res: Reservation) -> list[str]:
        """The nodes a reservation holds (every reservation names its nodes)."""
        return [n for n in res.nodes if n in self._nodes]

    def add_reservation(self, res: Reservation) -> None:
        """Hold capacity for ``res.job_id``.

        A head-of-line reservation replaces any other head-of-line reservation it
        overlaps (the engine only makes one on blocks nobody else holds, or when it
        displaces a lower class). Preemption reservations are layered: a node may be held
        by several owners (say, a gang's reserved block and a backfill job that preempted
        a victim there), and a job may use it only if it may use every one of them.
        """
        renew = res.job_id in self._reservations
        nodes = self.reservation_nodes(res)
        if res.kind is ReservationKind.HEAD_OF_LINE:
            for n in nodes:
                for other in self._node_res.get(n, ()):
                    o = self._reservations.get(other)
                    if other != res.job_id and o is not None and o.kind is ReservationKind.HEAD_OF_LINE:
                        self.remove_reservation(other)
        if renew:
            # new terms, on nodes mostly the same (an expected start rolled forward, a busy node
            # traded for one that came free): what removing and adding it again would leave,
            # touching only the nodes that change
            self._log(self._move_res, self._move_res(res))
            return
        self._add_res(res, nodes)
        self._log(self._del_res, res.job_id)

    def _hol_overlap(self, swap: set[str], new: dict[str, Reservation]) -> bool:
        """Does a head-of-line reservation of ``swap`` (as in ``new``) share a node with another
        reservation that is head-of-line now or in ``new`` (another of ``swap`` too)?"""
        held: set[str] = set()
        cur, node_res = self._reservations, self._node_res
        for jid in swap:
            if new[jid].kind is not ReservationKind.HEAD_OF_LINE:
                continue
            if not held.isdisjoint(new[jid].nodes):
                return True  # two renewed ones (moved onto a common node)
            held.update(new[jid].nodes)
            for n in new[jid].nodes:
                for o in node_res.get(n, ()):
                    if o != jid and (
                        cur[o].kind is ReservationKind.HEAD_OF_LINE
                        or (o in new and new[o].kind is ReservationKind.HEAD_OF_LINE)
                    ):
                        return True
        return bool(held) and any(
            r.kind is ReservationKind.HEAD_OF_LINE and not held.isdisjoint(r.nodes)
            for jid, r in new.items()
            if jid not in swap and (jid not in cur or cur[jid] != r)
        )

    def _move_res(self, res: Reservation) -> Reservation:
        """Replace the reservation of ``res.job_id`` by ``res``, leaving every index as removing
        the old one and adding ``res`` would (versions move alike); returns the old one."""
        jid = res.job_id
        old = self._reservations.pop(jid)
        self.res_version += 2
        self.res_free_version += 1
        # (its ``res_cache`` entry stays: keyed on everything the refresh reads, which its own
        # nodes and kind are not)
        self._reservations[jid] = res
        nodes = self.reservation_nodes(res)
        if old.nodes != res.nodes:
            keep = set(nodes)
            for n in self.reservation_nodes(old):
                if n not in keep:
                    self._drop_owner(n, jid)
        for n in nodes:
            self._add_owner(n, jid)
        if old.kind is not res.kind:  # other owners' node times read the kinds (its own do not)
            blocks, nodes_ = self._blocks, self._nodes
            for n in nodes:
                blk = blocks[nodes_[n].block]
                blk.version += 1
                blk.own[jid] = blk.own.get(jid, 0) + 1
        return old

    def _add_owner(self, n: str, jid: str) -> None:
        owners = self._node_res.get(n, ())
        if jid in owners:
            return
        node = self._nodes[n]
        self._set_node_owners(node, owners, tuple(sorted(owners + (jid,))))
        d = self._block_res.setdefault(node.block, {})
        d[jid] = d.get(jid, 0) + 1

    def _drop_owner(self, n: str, jid: str) -> None:
        owners = self._node_res.get(n, ())
        if jid not in owners:
            return
        node = self._nodes[n]
        self._set_node_owners(node, owners, tuple(o for o in owners if o != jid))
        b = node.block
        d = self._block_res[b]
        d[jid] -= 1
        if d[jid] <= 0:
            del d[jid]
            # none of its nodes here any more: ``version - own`` for it only moves up from here
            self._blocks[b].own.pop(jid, None)
            if not d:
                del self._block_res[b]

    def _add_res(self, res: Reservation, nodes: list[str]) -> None:
        self.res_version += 1
        self._reservations[res.job_id] = res
        for n in nodes:
            owners = self._node_res.get(n, ())
            if res.job_id in owners:
                continue
            node = self._nodes[n]
            self._set_node_owners(node, owners, tuple(sorted(owners + (res.job_id,))))
            b = node.block
            d = self._block_res.setdefault(b, {})
            d[res.job_id] = d.get(res.job_id, 0) + 1

    def remove_reservation(self, job_id: str) -> None:
        res = self._reservations.get(job_id)
        if res is None:
            return
        self._del_res(job_id)
        self._log(self._add_res, res, self.reservation_nodes(res))

    def _del_res(self, job_id: str) -> None:
        self.res_version += 1
        self.res_free_version += 1
        res = self._reservations.pop(job_id)
        self.res_cache.pop(job_id, None)
        for n in self.reservation_nodes(res):
            self._drop_owner(n, job_id)

    def set_reservations(self, reservations: Iterable[Reservation]) -> None:
        """Replace the reservation set (``apply`` does this with ``Plan.reservations``)."""
        new = {r.job_id: r for r in reservations}
        cur = self._reservations
        changed = [jid for jid in sorted(cur) if jid not in new or new[jid] != cur[jid]]
        # a reservation kept under new terms (on nodes mostly the same) is renewed in place (what
        # removing and adding it again leaves, touching only the nodes that change), unless a
        # head-of-line one among them shares a node with another head-of-line one, kept or to
        # add: then the order of removals and additions below decides which stays
        swap = {jid for jid in changed if jid in new}
        if swap and self._hol_overlap(swap, new):
            swap = set()
        for jid in changed:
            if jid in swap:
                self._log(self._move_res, self._move_res(new[jid]))
            else:
                self.remove_reservation(jid)
        for jid in sorted(new):
            if jid not in self._reservations:
                self.add_reservation(new[jid])

    def node_reservation(self, node_id: str) -> tuple[str, ...]:
        return self._node_res.get(node_id, ())

    # ------------------------------------------------------------------ reads

    def gpu_types(self) -> tuple[str, ...]:
        return tuple(sorted(self._types))

    def node_gpus(self, gpu_type: str) -> int | None:
        ti = self._types.get(gpu_type)
        return ti.node_gpus if ti else None

    def node_ids(self) -> tuple[str, ...]:
        return tuple(sorted(self._nodes))

    def node_block(self, node_id: str) -> str:
        return self._node(node_id).block

    def node_type(self, node_id: str) -> str:
        return self._node(node_id).gpu_type

    def node_health(self, node_id: str) -> NodeHealth:
        return self._node(node_id).health

    def node_free(self, node_id: str) -> tuple[int, ...]:
        return indices_of(self._node(node_id).free_mask)

    def node_size(self, node_id: str) -> int:
        return self._node(node_id).gpus

    def node_jobs(self, node_id: str) -> dict[str, tuple[int, ...]]:
        return {j: indices_of(m) for j, m in sorted(self._node(node_id).jobs.items())}

    def node_census(self) -> Iterator[tuple[str, str, NodeHealth, int, int, str | None]]:
        """(node, GPU type, health, GPUs, free GPUs, hot spare of) of every node: one pass, for
        the metrics the leader takes every cycle (a call per field costs ~10x more at 3,000 nodes)."""
        for n in self._nodes.values():
            yield n.id, n.gpu_type, n.health, n.gpus, n.nfree, n.spare_of

    def node_spare_of(self, node_id: str) -> str | None:
        return self._node(node_id).spare_of

    def block_ids(self, gpu_type: str | None = None) -> tuple[str, ...]:
        if gpu_type is None:
            return tuple(sorted(self._blocks))
        ti = self._types.get(gpu_type)
        return tuple(sorted(ti.blocks)) if ti else ()

    def block_nodes(self, block_id: str) -> tuple[str, ...]:
        return tuple(self._blocks[block_id].nodes)

    def free_gpus(self, gpu_type: str) -> int:
        """Free GPUs on ready nodes that are not hot spares."""
        ti = self._types.get(gpu_type)
        return ti.free_gpus if ti else 0

    def free_nodes(self, gpu_type: str) -> int:
        ti = self._types.get(gpu_type)
        return ti.free_nodes if ti else 0

    def total_gpus(self, gpu_type: str | None = None) -> int:
        if gpu_type is None:
            return sum(t.total_gpus for t in self._types.values())
        ti = self._types.get(gpu_type)
        return ti.total_gpus if ti else 0

    def allocated_gpus(self, gpu_type: str | None = None) -> int:
        """GPUs held by running jobs (a whole-node job holds whole nodes)."""
        types = [gpu_type] if gpu_type is not None else list(self._types)
        total = 0
        for t in types:
            ti = self._types.get(t)
            if ti is None:
                continue
            total += ti.total_gpus - ti.free_gpus - ti.unready_idle_gpus - self._spare_gpus(t)
        return total

    def healthy_gpus(self, gpu_type: str | None = None) -> int:
        """GPUs on ready nodes (busy or idle; hot spares included): the allocation denominator."""
        types = [gpu_type] if gpu_type is not None else list(self._types)
        total = 0
        for t in types:
            ti = self._types.get(t)
            if ti is not None:
                total += ti.total_gpus - ti.unready_idle_gpus
        return total

    def borrowed_gpus_by_class(self, gpu_type: str) -> tuple[int, int, int, int]:
        """GPUs held by running borrowed jobs per class rank (0 = prod-serving is always 0:
        serving is never a victim), not counting jobs already being preempted: the capacity
        a reclaim may take back, whatever the jobs' age."""
        ti = self._types.get(gpu_type)
        if ti is None:
            return (0, 0, 0, 0)
        cats = ti.cat_gpus
        return (cats.get((0, True), 0), cats.get((1, True), 0), cats.get((2, True), 0), cats.get((3, True), 0))

    def _spare_gpus(self, gpu_type: str) -> int:
        n = 0
        for nodes in self._spares.values():
            for nid in nodes:
                node = self._nodes[nid]
                if node.gpu_type == gpu_type:
                    n += node.nfree
        return n

    def type_index(self, gpu_type: str) -> _TypeIndex | None:
        return self._types.get(gpu_type)


def _is_whole(job: JobSpec, ti: _TypeIndex) -> bool:
    return job.total_gpus >= ti.node_gpus


def make_placement(
    job: JobSpec,
    nodes: list[tuple[str, tuple[int, ...]]],
    slots: list[ReplicaSlot],
    blocks: Iterable[str],
    borrowed: bool,
    gpus: int,
    spare_nodes: tuple[str, ...] = (),
    replacement: bool = False,
    backfill: bool = False,
) -> Placement:
    return Placement(
        job_id=job.job_id,
        gpu_type=job.gpu_type,
        nodes=tuple(NodeGpus(n, g) for n, g in sorted(nodes)),
        slots=tuple(sorted(slots, key=lambda s: s.replica)),
        blocks=tuple(sorted(set(blocks))),
        borrowed=borrowed,
        gpus=gpus,
        spare_nodes=tuple(sorted(spare_nodes)),
        replacement=replacement,
        backfill=backfill,
    )
