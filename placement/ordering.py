"""Queue order (docs/design.md, Placement), without sorting the whole queue.

``JobQueue`` keeps one lane per (class, team, GPU type, size bucket), each sorted by
(submit_time, job_id), plus a front lane per class for jobs re-queued ahead of their
class (failed attempts, node failures). Size buckets (by total GPUs, floors in
``SIZE_FLOORS``) let a cycle skip, in one step, every job of a team too large for
the quota room it has left. Within a lane the fair-share key only moves
with the submit time (the team's position is common to the lane, and aging is
linear in waiting time), so the top N of a class is a lazy heap merge of the lane
heads: O(N log lanes) per cycle, whatever the queue length.

Order with ``Ordering.FAIR_SHARE``:

1. priority class (prod-serving first); within a class, front-of-class jobs first;
2. a team below its guarantee (for the job's GPU type) before a team at or above it,
   as of the moment the job comes up: a team that reaches its guarantee with this
   cycle's placements stops going first within the same cycle;
3. the team's fair-share position (0 = most underserved; teams ranked by dominant
   share = max over GPU types of decayed GPU-hours / guarantee) minus
   ``aging_step_per_hour`` per hour waited (aging never crosses classes);
4. submit time, then job id.

``CLASS_FIFO``: class, then submit time. ``FIFO``: submit time only.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Callable, Iterator

from placement.model import JobSpec, Ordering, Policy
from placement.state import ClusterState

_INF = float("inf")
SIZE_FLOORS = (1, 2, 3, 5, 9, 65, 513)


def size_floor(total_gpus: int) -> int:
    """The smallest total of the job's size bucket (a job's charge is >= its total)."""
    f = 1
    for x in SIZE_FLOORS:
        if total_gpus >= x:
            f = x
        else:
            break
    return f


class JobQueue:
    """The queued jobs. ``push`` / ``remove`` are O(log n) plus a list insert."""

    def __init__(self, jobs: list[JobSpec] | None = None) -> None:
        self._jobs: dict[str, JobSpec] = {}
        # job id -> (its queued spec, that spec as placed past its max_blocks_wait_s), see
        # ``placed_at``; an entry goes with the job
        self._placed: dict[str, tuple[JobSpec, JobSpec]] = {}
        self._lanes: dict[tuple[int, str, str, int], list[tuple[float, str]]] = {}
        self._front: dict[int, list[tuple[float, str]]] = {}
        for j in jobs or ():
            self.push(j)

    def push(self, job: JobSpec) -> None:
        """Queue a job (replacing a queued job with the same id)."""
        if job.job_id in self._jobs:
            self.remove(job.job_id)
        self._jobs[job.job_id] = job
        key = (job.submit_time, job.job_id)
        if job.front:
            insort(self._front.setdefault(job.rank, []), key)
        else:
            insort(self._lanes.setdefault((job.rank, job.team, job.gpu_type, size_floor(job.total_gpus)), []), key)

    def remove(self, job_id: str) -> JobSpec | None:
        job = self._jobs.pop(job_id, None)
        if job is None:
            return None
        self._placed.pop(job_id, None)
        key = (job.submit_time, job.job_id)
        if job.front:
            lane = self._front[job.rank]
            lk: object = job.rank
            store: dict = self._front
        else:
            lk = (job.rank, job.team, job.gpu_type, size_floor(job.total_gpus))
            lane = self._lanes[lk]
            store = self._lanes
        i = bisect_left(lane, key)
        del lane[i]
        if not lane:
            del store[lk]
        return job

    def placed_at(self, job: JobSpec, now: float) -> JobSpec:
        """``job.as_placed_at(now)``, the copy without a block limit made once per queued spec
        (the engine asks for it every cycle, for every job drawn)."""
        t = job.topology
        if t.max_blocks is None or t.max_blocks_wait_s is None or t.max_blocks_at(now - job.submit_time) is not None:
            return job
        got = self._placed.get(job.job_id)
        if got is not None and got[0] is job:
            return got[1]
        placed = job.as_placed_at(now)
        if self._jobs.get(job.job_id) is job:
            self._placed[job.job_id] = (job, placed)
        return placed

    def get(self, job_id: str) -> JobSpec | None:
        return self._jobs.get(job_id)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def __iter__(self) -> Iterator[JobSpec]:
        """Every queued job, in id order (a full scan: not for cycles)."""
        for jid in sorted(self._jobs):
            yield self._jobs[jid]

    def teams(self) -> tuple[str, ...]:
        teams = {k[1] for k in self._lanes}
        teams.update(self._jobs[jid].team for lane in self._front.values() for _, jid in lane)
        return tuple(sorted(teams))

    def lanes(self) -> dict[tuple[int, str, str, int], list[tuple[float, str]]]:
        return self._lanes

    def front(self) -> dict[int, list[tuple[float, str]]]:
        return self._front


def dominant_share(state: ClusterState, team: str, now: float) -> float:
    """max over GPU types of decayed GPU-hours / guarantee (inf when using a type without guarantee)."""
    best = 0.0
    for t in state.gpu_types():
        u = state.usage(team, t, now)
        g = state.quota(team, t).guaranteed
        if g > 0:
            s = u / g
        elif u > 1e-12:
            s = _INF
        else:
            s = 0.0
        if s > best:
            best = s
    return best


def fair_share_positions(state: ClusterState, teams: tuple[str, ...], now: float) -> dict[str, int]:
    """Team -> position (0 = most underserved), ties by team name."""
    ranked = sorted(teams, key=lambda t: (dominant_share(state, t, now), t))
    return {t: i for i, t in enumerate(ranked)}


def iter_order(
    queue: JobQueue,
    state: ClusterState,
    policy: Policy,
    now: float,
    lane_ok: Callable[[str, str, int], bool] | None = None,
    blocked: set[tuple[str, str, int]] | None = None,
) -> Iterator[JobSpec]:
    """Queued jobs in placement order, lazily (take as many as the lookahead allows), each as
    the engine places it at ``now`` (``JobSpec.as_placed_at``: past its ``max_blocks_wait_s``
    without a block limit; the same object every cycle, ``JobQueue.placed_at``).

    ``lane_ok(team, gpu_type, size_floor)`` is asked when a lane's next job comes up;
    if it says no (the team has less quota room left than the lane's smallest job)
    the rest of the lane is skipped and the triple is added to ``blocked``.
    """
    jobs = queue._jobs
    placed = queue.placed_at

    def get(jid: str) -> JobSpec:
        job = jobs[jid]
        t = job.topology
        return job if t.max_blocks is None or t.max_blocks_wait_s is None else placed(job, now)

    front = queue.front()
    lanes = queue.lanes()
    if policy.ordering is Ordering.FIFO:
        for rank in sorted(front):
            for _, jid in front[rank]:
                yield get(jid)
        yield from _merge(
            [(lane, 0.0, 0, k[1], k[2], k[3]) for k, lane in sorted(lanes.items())],
            jobs,
            placed,
            0.0,
            now,
            lane_ok,
            blocked,
        )
        return
    if policy.guarantees_before_classes and policy.ordering is Ordering.FAIR_SHARE:
        yield from _merge_across(queue, state, policy, now, get, lane_ok, blocked)
        return
    by_rank: dict[int, list[tuple[tuple[int, str, str, int], list[tuple[float, str]]]]] = {}
    for key, lane in lanes.items():
        by_rank.setdefault(key[0], []).append((key, lane))
    fair = policy.ordering is Ordering.FAIR_SHARE
    pos: dict[str, int] = {}
    if fair:
        pos = fair_share_positions(state, queue.teams(), now)
    step = policy.aging_step_per_hour / 3600.0 if fair else 0.0
    for rank in sorted(set(by_rank) | set(front)):
        for _, jid in front.get(rank, ()):
            yield get(jid)
        entries = []
        for (_, team, gpu_type, floor), lane in sorted(by_rank.get(rank, ()), key=lambda kv: kv[0]):
            if fair:
                below = 0 if state.used(team, gpu_type) < state.quota(team, gpu_type).guaranteed else 1
                entries.append((lane, float(pos[team]), below, team, gpu_type, floor))
            else:
                entries.append((lane, 0.0, 0, team, gpu_type, floor))
        yield from _merge(entries, jobs, placed, step, now, lane_ok, blocked, _below(state) if fair else None)


def _merge_across(
    queue: JobQueue,
    state: ClusterState,
    policy: Policy,
    now: float,
    get: Callable[[str], JobSpec],
    lane_ok: Callable[[str, str, int], bool] | None,
    blocked: set[tuple[str, str, int]] | None,
) -> Iterator[JobSpec]:
    """``Policy.guarantees_before_classes``: every job of a team below its guarantee before any
    job of a team at or above it, whatever the classes; within each half the usual order (class,
    front-of-class first, fair-share position less aging, submit). A team that reaches its
    guarantee with this cycle's placements goes behind the teams still below, as in ``_merge``."""
    jobs = queue._jobs
    pos = fair_share_positions(state, queue.teams(), now)
    step = policy.aging_step_per_hour / 3600.0

    below = _below(state)

    def at_or_above(team: str, gpu_type: str) -> int:
        return 0 if below(team, gpu_type) else 1

    # (lane, rank, front 0 / lane 1, fair-share base, team, gpu type, size floor); a class's front
    # lane is split by team and type (its jobs' teams differ), keeping its order
    entries: list[tuple[list[tuple[float, str]], int, int, float, str, str, int]] = []
    for rank, lane in sorted(queue.front().items()):
        parts: dict[tuple[str, str], list[tuple[float, str]]] = {}
        for item in lane:
            fj = jobs[item[1]]
            parts.setdefault((fj.team, fj.gpu_type), []).append(item)
        for (team, gpu_type), part in sorted(parts.items()):
            entries.append((part, rank, 0, 0.0, team, gpu_type, 0))
    for (rank, team, gpu_type, floor), lane in sorted(queue.lanes().items()):
        entries.append((lane, rank, 1, float(pos[team]), team, gpu_type, floor))
    heap: list[tuple[int, int, int, float, float, str, int, int]] = []
    for li, (lane, rank, kind, base, team, gpu_type, _) in enumerate(entries):
        if lane:
            submit, jid = lane[0]
            key = base - step * (now - submit) if kind else 0.0
            heap.append((at_or_above(team, gpu_type), rank, kind, key, submit, jid, li, 0))
    heapq.heapify(heap)
    pop, replace = heapq.heappop, heapq.heapreplace
    while heap:
        b, rank, kind, key, submit, jid, li, i = heap[0]
        lane, _, _, base, team, gpu_type, floor = entries[li]
        if b == 0 and at_or_above(team, gpu_type):
            replace(heap, (1, rank, kind, key, submit, jid, li, i))  # it reached its guarantee this cycle
            continue
        if kind and lane_ok is not None and not lane_ok(team, gpu_type, floor):
            if blocked is not None:
                blocked.add((team, gpu_type, floor))
            pop(heap)
            continue  # the rest of this lane cannot run this cycle
        yield get(jid)
        i += 1
        if i < len(lane):
            submit, jid2 = lane[i]
            key = base - step * (now - submit) if kind else 0.0
            replace(heap, (b, rank, kind, key, submit, jid2, li, i))
        else:
            pop(heap)


def _below(state: ClusterState) -> Callable[[str, str], bool]:
    def below(team: str, gpu_type: str) -> bool:
        return state.used(team, gpu_type) < state.quota(team, gpu_type).guaranteed

    return below


def _merge(
    entries: list[tuple[list[tuple[float, str]], float, int, str, str, int]],
    jobs: dict[str, JobSpec],
    placed: Callable[[JobSpec, float], JobSpec],
    step: float,
    now: float,
    lane_ok: Callable[[str, str, int], bool] | None = None,
    blocked: set[tuple[str, str, int]] | None = None,
    below_now: Callable[[str, str], bool] | None = None,
) -> Iterator[JobSpec]:
    """``below_now(team, gpu_type)``: re-asked when a lane that went first because its team
    was below its guarantee comes up; a team that reached it since (this cycle's placements
    only add usage, so a lane's key only grows) goes back in the heap behind those below."""
    heap: list[tuple[int, float, float, str, int, int]] = []
    for li, (lane, base, below, _, _, _) in enumerate(entries):
        if lane:
            submit, jid = lane[0]
            heap.append((below, base - step * (now - submit), submit, jid, li, 0))
    heapq.heapify(heap)
    # the top stays in the heap until its lane's next job replaces it (one sift, not two); keys
    # are distinct (job ids), so the order is the same whatever the heap's layout
    pop, replace = heapq.heappop, heapq.heapreplace
    while heap:
        below, key, submit, jid, li, i = heap[0]
        lane, base, _, team, gpu_type, floor = entries[li]
        if below == 0 and below_now is not None and not below_now(team, gpu_type):
            entries[li] = (lane, base, 1, team, gpu_type, floor)
            replace(heap, (1, key, submit, jid, li, i))
            continue
        if lane_ok is not None and not lane_ok(team, gpu_type, floor):
            if blocked is not None:
                blocked.add((team, gpu_type, floor))
            pop(heap)
            continue  # the rest of this lane cannot run this cycle
        job = jobs[jid]
        t = job.topology
        # (``get`` inlined: most jobs have no block limit to lift)
        yield job if t.max_blocks is None or t.max_blocks_wait_s is None else placed(job, now)
        i += 1
        if i < len(lane):
            submit, jid2 = lane[i]
            replace(heap, (entries[li][2], base - step * (now - submit), submit, jid2, li, i))
        else:
            pop(heap)
