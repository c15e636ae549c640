"""``plan``: one placement cycle, pure. (``placement.commit`` records what the driver committed.)

A cycle, in order:

1. re-check borrowed flags of the (team, type) pairs whose usage or quota changed;
2. drop reservations whose owner left the queue, spares whose owner is gone, and
   refresh every head-of-line reservation's expected start;
3. replace lost replicas of running prod-serving jobs (alone, not as a gang);
4. walk the queue in order (``ordering.iter_order``), at most ``Policy.lookahead``
   jobs (lanes of teams without quota room are skipped whole): place on free capacity
   it may use (quota, reservations, hot spares, topology), else choose victims (if its
   class and quota allow), else reserve blocks (head-of-line large gang), else record
   why it waits;
5. then, even beyond the lookahead, the head of every lane of a team below its
   guarantee (its reclaim is planned in the first cycle that sees the need) and every
   reservation owner (capacity is held for it).

Everything is decided on the state tentatively and rolled back before ``plan``
returns, so the state is unchanged and equal inputs give equal plans (ties are
broken by ids, never by insertion order). ``placement.commit.apply`` then records what
the driver committed.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import replace

from placement import quota as quota_mod
from placement.model import (
    DEFAULT_POLICY,
    SERVING_RANK,
    JobSpec,
    NodeHealth,
    Pack,
    Pending,
    PendingReason,
    Placement,
    Plan,
    Policy,
    Preemption,
    PreemptReason,
    PriorityClass,
    Relabel,
    ReplicaSlot,
    Reservation,
    ReservationKind,
    Topology,
)
from placement.ordering import JobQueue, iter_order
from placement.reservations import (
    Exclusions,
    backfills_evictably,
    evictable_for,
    make_head_of_line,
    owner_borrows,
    plan_head_of_line,
    refresh_head_of_line,
    select_nodes,
)
from placement.state import ClusterState, RunningJob, _TypeIndex, indices_of, make_placement, mask_of
from placement.topology import (
    Search,
    Shape,
    choose_spares,
    find_placement,
    find_small_node,
    job_shape,
    too_few_free_nodes,
)
from placement.victims import (
    Mode,
    VictimChoice,
    VictimIndex,
    eligible_upper_bound,
    find_small,
    find_whole,
    lost_work,
    reason_for,
)

_INF = float("inf")
_NO_RANK = 4  # below every class rank (0-3): no such reservation
_NO_EXCL: frozenset[str] = frozenset()
_SHORT_OF_NODES = frozenset((PendingReason.CAPACITY, PendingReason.TOPOLOGY))  # a whole-node job short of free nodes
_NO_SPAN = (-math.inf, math.inf)  # without backfill a run time decides nothing


_PROD_BATCH_RANK = PriorityClass.PROD_BATCH.rank


# the pending detail of a job whose victims would lose too much work
# (Policy.class_preemption_max_lost_s, Policy.reclaim_max_lost_s)
HELD_FOR_VICTIMS_WORK = "waits for jobs to end rather than throw away its victims' work"


def _never_held_back(job: JobSpec, shape: Shape, ti: _TypeIndex) -> bool:
    """prod-serving, and prod-batch jobs within one node (the requirements' 2-minute p95 wait
    for small prod jobs): never kept waiting to spare victims' work."""
    return job.rank == SERVING_RANK or (job.rank <= _PROD_BATCH_RANK and shape.charge <= ti.node_gpus)


def plan(
    state: ClusterState, queue: JobQueue, policy: Policy = DEFAULT_POLICY, now: float = 0.0, *, dedupe: bool = True
) -> Plan:
    """One placement cycle. Leaves ``state`` and ``queue`` unchanged; returns a ``Plan``.

    ``dedupe=False`` decides every job afresh instead of repeating an equal job's decision
    (``_Cycle._decide``): the same plan, slower; the tests compare the two."""
    state.begin_tentative()
    try:
        return _Cycle(state, queue, policy, now, dedupe).run()
    finally:
        state.rollback()


def _fragments_detail(ti: _TypeIndex, shape: Shape, job: JobSpec) -> str:
    """What a job told ``topology`` lacks, where the free GPUs lie in parts of nodes: whole
    free nodes, or (one replica) enough free GPUs on one node. Empty otherwise (a block limit)."""
    if shape.whole:
        return f"needs {shape.nodes} whole free node(s), {ti.free_nodes} free" if ti.free_nodes < shape.nodes else ""
    if job.replicas == 1:
        most = max((f for f in range(ti.node_gpus + 1) if ti.buckets[f]), default=0)
        return f"needs {shape.total} free GPUs on one node, {most} at most"
    return ""


class _Cycle:
    def __init__(self, state: ClusterState, queue: JobQueue, policy: Policy, now: float, dedupe: bool = True) -> None:
        self.state = state
        self.queue = queue
        self.policy = policy
        self.now = now
        self.placements: list[Placement] = []
        self.preemptions: list[Preemption] = []
        self.pending: list[Pending] = []
        self.relabels: list[Relabel] = []
        self.dropped_spares: list[str] = []
        self.spares_taken: list[str] = []  # spare nodes released for guaranteed work (Plan.spares_taken)
        self.memo: dict[tuple, PendingReason] = {}
        self.victim_memo: set[tuple] = set()
        self.reserve_memo: set[tuple] = set()
        self.head_of_line: dict[tuple[str, int], list[Reservation]] = {}  # (type, res_version) -> head-of-line
        # a victim search that failed (or whose choice was held back: then the pending detail)
        self.preempt_fail: dict[tuple, str] = {}
        self.reclaimed: set[tuple[str, str]] = set()
        self.waiting_since: dict[tuple[str, str], float] | None = None  # per (team, type), built on first use
        # per (team, type): its oldest queued job within its guarantee (reclaim_wait_per_team)
        self.fitting_since: dict[tuple[str, str], float] = {}
        # (res_version, reservations' expected starts sorted, max_runtime -> span) for _backfill_span
        self.backfill_spans: tuple[int, list[float], dict[float, tuple[float, float]]] = (-1, [], {})
        self.victim_index: dict[tuple[str, Mode], VictimIndex] = {}  # per (type, mode without team)
        self.victims_left = policy.max_preemptions_per_cycle
        self.searches_left = policy.max_victim_searches_per_cycle
        self.considered = 0
        self.quota_only = False
        self.try_memo: dict[tuple, PendingReason] = {}
        self.blocked: set[tuple[str, str, int]] = set()
        self.lane_cache: dict[tuple[str, str], int] = {}
        self.excl_cache: dict[tuple, Exclusions] = {}
        self.lower_res: dict[tuple[str, int], int] = {}
        self.evict_res: dict[tuple[str, int], int] = {}  # highest class (lowest rank) evictably backfillable
        self.excl_version = -1
        self.evictable_placement = False  # the last _try_place used evictable backfill
        self.awaits_checkpoints = False  # the last _preempt waits for its victims' checkpoints
        self.held_detail = ""  # the last _preempt's choice was held back as too costly: why
        self.claim_team: str | None = None  # Exclusions.claim_team for the job being decided
        self.returning: dict[tuple[str, int, int], int] = {}  # (type, placements so far, reservations) -> back
        self.dedupe = dedupe
        # equal job -> (epoch, reason, detail, quota only) of a decision that only pended
        self.decided: dict[tuple, tuple[tuple[int, ...], PendingReason, str, bool]] = {}
        self.side_effects = 0  # decisions that may have touched state outside the epoch's counts
        self.decided_afresh = 0  # Plan.decided_afresh

    # ------------------------------------------------------------------ cycle

    def run(self) -> Plan:
        state, now = self.state, self.now
        if self.policy.reclaim_wait_per_team:
            # before any placement moves a team's use: check_plan reads the same from the
            # state and queue it is given
            self.fitting_since = quota_mod.within_guarantee_since(state, self.queue)
        state.promote(now, self.policy.preemption_protect_s, self.policy.first_runs_unprotected_min_gpus is not None)
        checked = state.quota_dirty()
        for team, gpu_type in checked:
            self.relabels.extend(quota_mod.relabel(state, team, gpu_type))
        self._housekeeping()
        self._replacements()
        limit = self.policy.lookahead
        seen: set[str] = set()
        if limit > 0:
            counted = drawn = 0
            scan_limit = limit * max(1, self.policy.scan_factor)
            for job in iter_order(self.queue, state, self.policy, now, self._lane_ok, self.blocked):
                seen.add(job.job_id)
                self.considered += 1
                drawn += 1
                if self._consider(job):
                    counted += 1
                if counted >= limit or drawn >= scan_limit:
                    break
            # a team below its guarantee must get its reclaim planned in the first cycle that sees
            # the need: the head of each of its lanes is looked at even beyond the lookahead
            for (_rank, team, gpu_type, _), lane in sorted(self.queue.lanes().items()):
                if state.used(team, gpu_type) >= state.quota(team, gpu_type).guaranteed:
                    continue
                for _, jid in lane:  # the lane's seen jobs are a prefix: skip them
                    if jid not in seen:
                        seen.add(jid)
                        self.considered += 1
                        self._consider(self.queue._jobs[jid])
                        break
            # owners of reservations (capacity held for them) are looked at even beyond the lookahead
            for res in sorted(state.reservations(), key=lambda r: (r.priority_rank, r.created_at, r.job_id)):
                queued = self.queue.get(res.job_id)
                if queued is not None and res.job_id not in seen and state.reservation(res.job_id) is not None:
                    seen.add(queued.job_id)
                    self.considered += 1
                    self._consider(queued)
        return Plan(
            now=now,
            placements=tuple(self.placements),
            preemptions=tuple(self.preemptions),
            reservations=state.reservations(),
            pending=tuple(self.pending),
            relabels=tuple(self.relabels),
            dropped_spares=tuple(self.dropped_spares),
            spares_taken=tuple(self.spares_taken),
            quota_checked=checked,
            quota_blocked=tuple(sorted(self.blocked)),
            considered=self.considered,
            decided_afresh=self.decided_afresh,
        )

    def _housekeeping(self) -> None:
        state, now = self.state, self.now
        for res in state.reservations():
            if res.job_id not in self.queue or state.is_running(res.job_id) or state.type_index(res.gpu_type) is None:
                state.remove_reservation(res.job_id)
                continue
            if res.kind is ReservationKind.PREEMPTION:
                if not state._awaiting.get(res.job_id) and now > res.expected_start + self.policy.preemption_hold_s:
                    state.remove_reservation(res.job_id)  # its victims are long gone: stop holding
                continue
            if res.kind is ReservationKind.HEAD_OF_LINE:
                # node-level: re-chosen in its blocks (a node that came free replaces a busy one)
                nodes, es = refresh_head_of_line(state, res, now)
                if es == _INF:
                    state.remove_reservation(res.job_id)  # its blocks can no longer hold it: re-planned
                    continue
                if es > now and es > res.expected_start + 1.0:
                    # it slipped (a node failed, a higher class took a reserved node): other blocks may be earlier
                    owner_job = self.queue.get(res.job_id)
                    ti = state.type_index(res.gpu_type)
                    got = plan_head_of_line(state, ti, owner_job, res.nodes_needed, now) if owner_job and ti else None
                    if got is not None and got[1] + self.policy.reservation_replan_s < es:
                        nodes2, raw = select_nodes(state, got[0], res.nodes_needed, res.job_id)
                        if raw != _INF:
                            state.add_reservation(
                                replace(res, blocks=got[0], nodes=nodes2, expected_start=max(raw, now))
                            )
                            continue
                if es != res.expected_start or nodes != res.nodes:
                    state.add_reservation(replace(res, nodes=nodes, expected_start=es))
        for owner in state.spare_owners():
            if not state.is_running(owner) and owner not in self.queue:
                state.release_spares(owner)
                self.dropped_spares.append(owner)

    def _lane_ok(self, team: str, gpu_type: str, floor: int) -> bool:
        """Has the team quota room for the lane's smallest job (else the lane is skipped)?"""
        key = (team, gpu_type)
        room = self.lane_cache.get(key)
        if room is None:
            room = self.lane_cache[key] = self._room(team, gpu_type) if gpu_type in self.state._types else 1 << 60
        return room >= floor

    def _room(self, team: str, gpu_type: str) -> int:
        state = self.state
        q = state.quota(team, gpu_type)
        a = state._acct.get((team, gpu_type))
        used, gused = (a.used, a.gused) if a is not None else (0, 0)
        room = q.guaranteed - gused
        if self.policy.borrowing:
            room = max(room, q.borrow_limit - (used - gused))
        return room

    def _excl(
        self, job: JobSpec, class_rule: bool = True, evictably: bool = False, borrowed: bool = False
    ) -> Exclusions:
        """Reservation owners whose nodes ``job`` may not use (shared per cycle by equal jobs).
        ``borrowed``: the job would run borrowed (``Policy.guaranteed_reservations_hold``)."""
        state = self.state
        if state.res_free_version != self.excl_version:
            self.excl_cache.clear()
            self.excl_version = state.res_free_version
        own = job.job_id if job.job_id in state._reservations else None
        span = self._backfill_span(job)
        borrowed = borrowed and class_rule and self.policy.guaranteed_reservations_hold
        key = (job.gpu_type, job.rank, span, class_rule, own, evictably, self.claim_team, borrowed)
        ex = self.excl_cache.get(key)
        if ex is None:
            ex = self.excl_cache[key] = Exclusions(
                state, job, self.now, self.policy, class_rule, evictably, self.claim_team, span, borrowed
            )
        return ex

    def _evictable_reservation(self, job: JobSpec) -> bool:
        """Is there a head-of-line reservation of the job's type it could backfill evictably?
        (Asked for every borrowed job that found no room: the answer is kept per reservation set.)"""
        state = self.state
        key = (job.gpu_type, state.res_version)
        got = self.evict_res.get(key)
        if got is None:
            got = self.evict_res[key] = min(
                (
                    r.priority_rank
                    for r in state._reservations.values()
                    if r.gpu_type == job.gpu_type and r.evicts_backfill and r.kind is ReservationKind.HEAD_OF_LINE
                ),
                default=_NO_RANK,
            )
        return got <= job.rank

    def _lower_class_reservation(self, job: JobSpec) -> bool:
        """Does some reservation of the job's type belong to a lower class (usable as a last resort)?"""
        state = self.state
        key = (job.gpu_type, state.res_version)
        got = self.lower_res.get(key)
        if got is None:
            got = self.lower_res[key] = max(
                (r.priority_rank for r in state._reservations.values() if r.gpu_type == job.gpu_type), default=-1
            )
        return got > job.rank

    def _classify(self, job: JobSpec, charge: int) -> bool | None:
        """``quota.classify``, inlined for the hot loop: False guaranteed, True borrowed, None quota."""
        state = self.state
        key = (job.team, job.gpu_type)
        q = state._quota.get(key)
        a = state._acct.get(key)
        g, b = (q.guaranteed, q.borrow_limit) if q is not None else (0, 0)
        used, gused = (a.used, a.gused) if a is not None else (0, 0)
        if gused + charge <= g:
            return False
        if self.policy.borrowing and used - gused + charge <= b:
            return True
        return None

    def _reclaim_likely(self, gpu_type: str, ti: _TypeIndex, charge: int, guard: float) -> bool:
        """Would a borrowed start of ``charge`` GPUs eat into the free GPUs that the guaranteed
        demand expected back (``ClusterState.returning_demand`` x ``guard``) will want?"""
        less_reserved = self.policy.returning_demand_less_reserved
        key = (gpu_type, len(self.placements), self.state.res_version if less_reserved else 0)
        back = self.returning.get(key)
        if back is None:
            back = self.returning[key] = self.state.returning_demand(
                gpu_type, self.policy.pooled_demand_forecast, less_reserved
            )
        return ti.free_gpus - charge < guard * back

    def _gang_reclaim_likely(self, job: JobSpec, ti: _TypeIndex, charge: int, guard: float) -> bool:
        """``Policy.borrowed_gang_guard``: may this borrowed gang not start now? It may start
        only on free GPUs that cover it and leave ``guard`` x the guaranteed demand expected
        back (``_reclaim_likely``); one that does not fit the free GPUs waits too (it neither
        reclaims lower classes nor reserves: no drain for a gang its owners would reclaim).
        A team below its guarantee is never held back (its gang may run guaranteed after a
        relabel, ``guarantee_gangs_first``, and its unused guarantee is its own); a team at or
        over it expects nothing back itself, so what counts is other teams' demand."""
        if not self._reclaim_likely(job.gpu_type, ti, charge, guard):
            return False
        q = self.state._quota.get((job.team, job.gpu_type))
        a = self.state._acct.get((job.team, job.gpu_type))
        return q is None or (a.used if a is not None else 0) >= q.guaranteed

    def _guard_covers(self, shape: Shape, ti: _TypeIndex, job: JobSpec) -> bool:
        """Is a job of this shape one ``borrowed_gang_guard`` may hold back? Whole-node gangs of
        ``reserve_min_gpus`` or more; under ``borrowed_guard_min_gpus`` also any job of at least
        that many GPUs that is at most ``borrowed_guard_max_share`` of its type's GPUs, and
        (prod-batch) has waited less than ``borrowed_guard_prod_hold_s``."""
        policy = self.policy
        if shape.whole and shape.charge >= policy.reserve_min_gpus:
            return True
        small_min = policy.borrowed_guard_min_gpus
        if small_min is None or shape.charge < small_min:
            return False
        share = policy.borrowed_guard_max_share
        if share is not None and shape.charge > share * ti.total_gpus:
            return False
        return not (job.rank == _PROD_BATCH_RANK and job.waited(self.now, policy.borrowed_guard_prod_hold_s))

    def _backing_off(self, job: JobSpec) -> int:
        """``Policy.borrowed_restart_backoff_s``: the preemptions the job backs off after, so
        that it may not start borrowed yet (while its owners' demand is expected back); 0:
        none. After ``n`` preemptions within ``preemption_window_s`` it waits ``n`` x the
        backoff from the last one: a job reclaimed again and again loses the work of every
        short run."""
        base = self.policy.borrowed_restart_backoff_s
        times = job.preemption_times
        if base is None or not times:
            return 0
        n = job.preemptions_since(self.now - self.policy.preemption_window_s)
        return n if n > 0 and self.now - times[-1] < n * base else 0

    def _spreads_first(self, job: JobSpec, borrowed: bool) -> bool:
        """``Policy.spread_before_preempt``: a job that runs guaranteed (so would preempt or
        reclaim for room), with a block limit it may outwait (``max_blocks_wait_s``)."""
        t = job.topology
        return (
            self.policy.spread_before_preempt
            and self.policy.preemption
            and not borrowed
            and job.rank != SERVING_RANK
            and t.max_blocks is not None
            and t.max_blocks_wait_s is not None
        )

    def _patient(self, job: JobSpec, shape: Shape, ti: _TypeIndex) -> bool:
        """Does it wait for capacity to free (``Policy.preempt_patience_s``) before preempting?"""
        patience = self.policy.preempt_patience_s
        if patience is None or _never_held_back(job, shape, ti):
            return False
        # counted from the team's oldest queued job of the type, not the job's own submit: a
        # team whose jobs keep arriving would otherwise wait for ever, one patience at a time
        return self.now - self._team_waiting_since(job.team, job.gpu_type) < patience

    def _over_in_use(self, job: JobSpec, shape: Shape) -> bool:
        """``Policy.preempt_within_team_use``: would the team's whole use (its borrowed jobs
        too) plus this job pass its guarantee? (Not prod-serving: its guarantee is its own.)"""
        if not self.policy.preempt_within_team_use or job.rank == SERVING_RANK:
            return False
        state = self.state
        return state.used(job.team, job.gpu_type) + shape.charge > state.quota(job.team, job.gpu_type).guaranteed

    def _small_reclaim_due(self, job: JobSpec) -> bool:
        """May this job (within its team's guarantee) reclaim small borrowed jobs of higher
        classes (``Policy.reclaim_small_borrowed_after_s``)? With ``reclaim_wait_per_team``
        the wait counts from the team's oldest queued job of the type that fits its
        guarantee (at the cycle's start), so a team whose jobs keep arriving is not held
        back one wait after another while others borrow."""
        wait = self.policy.reclaim_small_borrowed_after_s
        if wait is None:
            return False
        if job.waited(self.now, wait):
            return True
        if not self.policy.reclaim_wait_per_team:
            return False
        return self.now - self.fitting_since.get((job.team, job.gpu_type), self.now) >= wait

    def _higher_gangs_upto(self, job: JobSpec, shape: Shape) -> int:
        """``Policy.reclaim_higher_borrowed_gangs``: the largest higher-class borrowed gang this
        job (within its guarantee, past its small-reclaim wait) may reclaim: its own size if it
        is a whole-node gang of ``reserve_min_gpus`` or more that was not itself preempted within
        ``reclaim_small_borrowed_after_s``; 0: none."""
        policy = self.policy
        if not (policy.reclaim_higher_borrowed_gangs and shape.whole and shape.charge >= policy.reserve_min_gpus):
            return 0
        return shape.charge if self._reclaim_settled(job) else 0

    def _reclaim_settled(self, job: JobSpec) -> bool:
        """Not preempted within ``reclaim_small_borrowed_after_s``: a gang just stopped for a
        higher class, requeued within its guarantee, does not at once stop another team's gang
        (seen on seed 2: the reclaims chained from team to team)."""
        times = job.preemption_times
        return not times or self.now - times[-1] >= (self.policy.reclaim_small_borrowed_after_s or 0.0)

    def _team_waiting_since(self, team: str, gpu_type: str) -> float:
        """The submit time of the team's oldest queued job of this GPU type (this cycle's queue)."""
        since = self.waiting_since
        if since is None:
            since = self.waiting_since = {}
            queue = self.queue
            for (_rank, t, g, _floor), lane in queue.lanes().items():
                if lane and lane[0][0] < since.get((t, g), math.inf):
                    since[(t, g)] = lane[0][0]
            for lane in queue.front().values():
                for submit, jid in lane:
                    fj = queue._jobs[jid]
                    if submit < since.get((fj.team, fj.gpu_type), math.inf):
                        since[(fj.team, fj.gpu_type)] = submit
        return since.get((team, gpu_type), self.now)

    def _too_costly(self, victims: tuple[str, ...]) -> bool:
        """Would these victims lose more than ``Policy.patience_max_lost_s`` of work per GPU?"""
        running, now = self.state._running, self.now
        lost = gpus = 0.0
        for vid in victims:
            rj = running[vid]
            lost += lost_work(rj, now)
            gpus += rj.charge
        return lost > gpus * self.policy.patience_max_lost_s

    def _class_preemption_too_costly(
        self, job: JobSpec, shape: Shape, ti: _TypeIndex, victims: tuple[str, ...]
    ) -> bool:
        """``Policy.class_preemption_max_lost_s``: would the guaranteed victims (lower-class work run
        within a guarantee; borrowed work is always preemptible) lose more work than that many
        seconds of the job's GPUs, while the job is younger than ``class_preemption_hold_s``?
        (Only a job within its own team's guarantee takes guaranteed victims.)"""
        policy = self.policy
        cap = policy.class_preemption_max_lost_s
        if cap is None or _never_held_back(job, shape, ti) or job.waited(self.now, policy.class_preemption_hold_s):
            return False
        return self._victims_lost(victims, borrowed=False) > cap * shape.charge

    def _reclaim_too_costly(self, job: JobSpec, shape: Shape, ti: _TypeIndex, victims: tuple[str, ...]) -> bool:
        """``Policy.reclaim_max_lost_s``: would the borrowed victims lose more work than that many
        seconds of the job's GPUs, while the job is younger than ``reclaim_hold_s`` (and, with
        ``reclaim_hold_small_only``, within one node or, with
        ``reclaim_hold_gang_victims_ratio``, stopping borrowed work that many times its size)?"""
        policy = self.policy
        cap = policy.reclaim_max_lost_s
        if cap is None or _never_held_back(job, shape, ti):
            return False
        if (
            policy.reclaim_hold_small_only
            and shape.charge > ti.node_gpus
            and not self._stops_much_larger(shape, victims)
        ):
            # a gang is not held (it would reserve and drain meanwhile), unless it would stop
            # borrowed work many times its size (reclaim_hold_gang_victims_ratio)
            return False
        if self._reclaim_hold_over(job):  # (after the cheap tests: per team it reads the queue)
            return False
        return self._victims_lost(victims, borrowed=True) > cap * shape.charge

    def _stops_much_larger(self, shape: Shape, victims: tuple[str, ...]) -> bool:
        """``Policy.reclaim_hold_gang_victims_ratio``: would the borrowed victims hold at least
        that many times the job's GPUs?"""
        ratio = self.policy.reclaim_hold_gang_victims_ratio
        if ratio is None:
            return False
        running = self.state._running
        return sum(rj.charge for rj in (running[vid] for vid in victims) if rj.borrowed) >= ratio * shape.charge

    def _victims_lost(self, victims: tuple[str, ...], borrowed: bool) -> float:
        """GPU-seconds of work the borrowed (or the guaranteed) victims would lose."""
        running, now = self.state._running, self.now
        return sum(lost_work(rj, now) for rj in (running[vid] for vid in victims) if rj.borrowed == borrowed)

    def _reclaim_held(self, job: JobSpec) -> bool:
        """Could ``reclaim_max_lost_s`` still hold this job back (a memo key's part)?"""
        return self.policy.reclaim_max_lost_s is not None and not self._reclaim_hold_over(job)

    def _reclaim_hold_over(self, job: JobSpec) -> bool:
        """Has the job waited ``reclaim_hold_s``, or with ``reclaim_hold_per_team`` its team's
        oldest queued job of the type? (Per job, a team whose jobs keep arriving waits one hold
        after another.)"""
        policy, now = self.policy, self.now
        if job.waited(now, policy.reclaim_hold_s):
            return True
        return (
            policy.reclaim_hold_per_team
            and now - self._team_waiting_since(job.team, job.gpu_type) >= policy.reclaim_hold_s
        )

    def _pend(self, job: JobSpec, reason: PendingReason, detail: str = "") -> None:
        self.pending.append(Pending(job.job_id, reason, detail))

    # ------------------------------------------------------------------ one job

    def _consider(self, job: JobSpec) -> bool:
        """Decide for one job; False when only its quota stopped it (it does not count
        against the lookahead)."""
        self.quota_only = False
        self._decide(job)
        return not self.quota_only

    def _epoch(self) -> tuple[int, int, int, int, int]:
        """Moves whenever this cycle changes the state a decision reads (``_decide``)."""
        return (
            len(self.placements),
            len(self.preemptions),
            self.state.res_version,
            len(self.relabels),
            self.side_effects,
        )

    def _decide(self, job: JobSpec) -> None:
        """Decide for one job, or repeat the decision of an equal job taken earlier in the
        cycle when that one only pended and nothing has changed since.

        Most of a busy cycle's jobs wait for the same reason as the equal job before them
        (same team, class, shape, topology, reservations it may backfill by the time it would
        end, and waiting thresholds crossed), and a decision that changed nothing reads only
        those and the state, so the answer is the same; jobs with state of their own (a
        reservation, spares, victims stopping for them) are always decided afresh.
        ``dedupe=False`` turns this off (the tests compare; ``Plan.decided_afresh`` counts).
        """
        state, policy, now = self.state, self.policy, self.now
        job = job.as_placed_at(now)  # past its max_blocks_wait_s: no block limit
        jid = job.job_id
        key = None
        if (
            self.dedupe
            and jid not in state._reservations
            and jid not in state._spares
            and not state._awaiting.get(jid)
            and jid not in state._running
        ):
            key = (
                job.team,
                job.gpu_type,
                job.priority,
                job.replicas,
                job.gpus_per_replica,
                job.topology,
                self._backfill_span(job),
                policy.unsaved_borrow_guard is not None and job.preemptible,
                backfills_evictably(job, policy),
                job.waited(now, policy.claim_borrowed_reservations_after_s),
                job.waited(now, policy.reclaim_small_borrowed_after_s),
                job.waited(now, policy.spares_yield_after_s),
                self._backing_off(job),  # its count is in the pending detail
                policy.reclaim_higher_borrowed_gangs and self._reclaim_settled(job),
                job.waited(now, policy.checkpoint_wait_s),
                job.waited(now, policy.class_preemption_hold_s),
                self._reclaim_held(job),
                job.waited(now, policy.borrowed_guard_prod_hold_s),
            )
            epoch = self._epoch()
            hit = self.decided.get(key)
            if hit is not None and hit[0] == epoch:
                self.quota_only = hit[3]
                self.pending.append(Pending(jid, hit[1], hit[2]))
                return
        elif jid in state._spares:
            # its spares are released for the try and held again, out of and back into the
            # blocks' indexes: the epoch's counts do not see that, so equal jobs decide afresh
            # after it (a caution; an owner's changed reservation moves res_version, and the
            # victims it stops, the preemptions)
            self.side_effects += 1
        n = len(self.pending)
        self.decided_afresh += 1
        self._decide_afresh(job)
        if key is not None and len(self.pending) == n + 1 and self._epoch() == epoch:
            p = self.pending[-1]
            self.decided[key] = (epoch, p.reason, p.detail, self.quota_only)

    def _backfill_span(self, job: JobSpec) -> tuple[float, float]:
        """What the job's max_runtime decides (``reservations.may_use``): it may backfill the
        reservations that start at or after it would end. The reservations' expected starts
        either side of that end, (last before, first at or after), name the set, so jobs with
        other run times in the same span decide alike, in every memo a decision reads (a
        decision repeated for an equal job must cost what deciding it afresh would: a memo
        keyed by the run time let each equal job search for victims again, spending the
        cycle's search budget, where the repeat spent none). As values, not a count: a
        reservation made later in the cycle splits a span rather than renumbering the others,
        so a span still names one set of the reservations that stood when it was first used."""
        if not self.policy.backfill:
            return _NO_SPAN
        state = self.state
        version, starts, spans = self.backfill_spans
        if version != state.res_version:
            starts, spans = sorted(r.expected_start for r in state._reservations.values()), {}
            self.backfill_spans = (state.res_version, starts, spans)
        span = spans.get(job.max_runtime_s)
        if span is None:
            cut = bisect_left(starts, self.now + job.max_runtime_s)
            span = spans[job.max_runtime_s] = (
                starts[cut - 1] if cut else -math.inf,
                starts[cut] if cut < len(starts) else math.inf,
            )
        return span

    def _decide_afresh(self, job: JobSpec) -> None:
        state, policy = self.state, self.policy
        self.claim_team = None
        self.awaits_checkpoints = False
        self.held_detail = ""
        ti = state._types.get(job.gpu_type)
        if ti is None:
            self._pend(job, PendingReason.GPU_TYPE)
            return
        if job.job_id in state._running:
            self._pend(job, PendingReason.INVALID, "already running")
            return
        shape = job_shape(job, ti.node_gpus)
        if isinstance(shape, str):
            self._pend(job, PendingReason.INVALID, shape)
            return
        borrowed = self._classify(job, shape.charge)
        claims = borrowed is False and job.waited(self.now, policy.claim_borrowed_reservations_after_s)
        self.claim_team = job.team if claims else None
        if borrowed is None:
            if state.reservation(job.job_id) is not None:
                state.remove_reservation(job.job_id)  # it cannot run now: hold nothing for it
            self._pend(job, PendingReason.QUOTA)
            self.quota_only = True
            return
        serving = job.rank == SERVING_RANK
        if (
            borrowed
            and policy.unsaved_borrow_guard is not None
            and not job.preemptible
            and not serving
            and shape.charge < policy.reserve_min_gpus
            and self._reclaim_likely(job.gpu_type, ti, shape.charge, policy.unsaved_borrow_guard)
        ):
            self._pend(job, PendingReason.CAPACITY, "kept free for guaranteed demand expected back")
            return
        own_res = state.reservation(job.job_id)
        backs_off = self._backing_off(job) if borrowed and own_res is None and not serving else 0
        if backs_off and self._reclaim_likely(job.gpu_type, ti, shape.charge, 1.0):
            self._pend(job, PendingReason.CAPACITY, f"borrowed restart backs off after {backs_off} preemptions")
            return
        if (
            borrowed
            and policy.borrowed_gang_guard is not None
            and (own_res is None or (policy.gang_guard_reserved and own_res.kind is ReservationKind.HEAD_OF_LINE))
            and not serving
            and self._guard_covers(shape, ti, job)
            and self._gang_reclaim_likely(job, ti, shape.charge, policy.borrowed_gang_guard)
        ):
            if own_res is not None:
                state.remove_reservation(job.job_id)  # it would run borrowed into a likely reclaim
            self._pend(job, PendingReason.CAPACITY, "kept free for guaranteed demand expected back")
            return
        spare_nodes = state.release_spares(job.job_id) if job.job_id in state._spares else ()
        own_spares = bool(spare_nodes)
        restrict = None
        try_free = True
        if serving and borrowed and not policy.serving_borrows_idle:
            # beyond its guarantee prod-serving only takes capacity reclaimed from borrowed allocations
            if own_res is not None and own_res.kind is ReservationKind.PREEMPTION:
                restrict = frozenset(own_res.nodes)
            elif policy.serving_idle_guard is None or self._reclaim_likely(
                job.gpu_type, ti, shape.charge, policy.serving_idle_guard
            ):
                try_free = False
        fail: PendingReason | None = PendingReason.QUOTA
        if try_free:
            fail, placed = self._try_place(job, ti, shape, borrowed, restrict, own_spares)
            if placed is None and fail is PendingReason.TOPOLOGY and self._spreads_first(job, borrowed):
                # free nodes enough, but not within its (soft) block limit: run spread now rather
                # than preempt someone to keep to the limit
                loose = replace(job, topology=Topology(job.topology.pack, None))
                _, placed = self._try_place(loose, ti, shape, borrowed, restrict, own_spares)
                if placed is not None:
                    job = loose
            if placed is not None:
                if (
                    borrowed
                    and not serving
                    and shape.whole
                    and policy.guarantee_gangs_first
                    and not self.evictable_placement
                ):
                    placed = self._guarantee_gang(job, shape, placed)
                self._commit(job, placed, own_res)
                return
        for nid in spare_nodes:  # not placed: its spares stay held for it
            state.hold_spare(nid, job.job_id)
        if fail is not None and self._kept_off_spares(ti, shape, fail):
            fail = PendingReason.HOT_SPARE
            if not borrowed and job.waited(self.now, policy.spares_yield_after_s):
                taken = self._take_spares(ti, shape)
                if taken:
                    _, placed = self._try_place(job, ti, shape, borrowed, restrict, False)
                    if placed is not None:
                        self._commit(job, placed, own_res)
                        return
                    self._give_back_spares(taken)
        short = fail in _SHORT_OF_NODES if shape.whole else fail is PendingReason.CAPACITY
        if short and self._would_fit_healthy(ti, shape):
            fail = PendingReason.NODE_HEALTH
        if state._awaiting.get(job.job_id):
            self._pend(job, PendingReason.PREEMPTING)
            return
        if (
            own_res is not None
            and own_res.evicts_backfill
            and own_res.kind is ReservationKind.HEAD_OF_LINE
            and self._evict_backfill(job, ti, shape, own_res, borrowed)
        ):
            self._pend(job, PendingReason.PREEMPTING, "stopping backfill on its reserved nodes")
            return
        mode = None
        if not borrowed and self._over_in_use(job, shape):
            # Policy.preempt_within_team_use: its team's use (borrowed jobs too) plus the job
            # passes the guarantee: it preempts as work beyond the guarantee does
            if policy.borrowed_gangs_reclaim_lower and shape.whole and shape.charge >= policy.reserve_min_gpus:
                mode = Mode(job.rank, True, job.team)
        elif not borrowed:
            due = self._small_reclaim_due(job)
            first = policy.first_runs_unprotected_min_gpus
            mode = Mode(
                job.rank,
                False,
                job.team,
                due,
                self._higher_gangs_upto(job, shape) if due else 0,
                first is not None and job.total_gpus >= first,
            )
        elif serving or (
            policy.borrowed_gangs_reclaim_lower and shape.whole and shape.charge >= policy.reserve_min_gpus
        ):
            # beyond its guarantee: only borrowed work of lower classes (prod-serving: of any class)
            mode = Mode(job.rank, True, job.team)
        patient = mode is not None and self._patient(job, shape, ti)
        if mode is not None and policy.preemption and self._preempt(job, ti, shape, mode, patient):
            self._pend(job, PendingReason.PREEMPTING)
            return
        if (
            policy.reservations
            and shape.whole
            and shape.charge >= policy.reserve_min_gpus
            and not (serving and borrowed and not policy.serving_borrows_idle)
        ):
            if own_res is not None and own_res.kind is ReservationKind.HEAD_OF_LINE:
                self._pend(job, PendingReason.RESERVED)
                return
            # within its patience it drains nothing either: others use what frees meanwhile
            if not patient and self._reserve(job, ti, shape, borrowed):
                self._pend(job, PendingReason.RESERVED)
                return
        if self.awaits_checkpoints:  # (a gang above reserves meanwhile: the drain starts now)
            self._pend(job, PendingReason.CAPACITY, "waits for its victims' checkpoints")
            return
        if own_res is not None and own_res.kind is ReservationKind.PREEMPTION and fail is not PendingReason.QUOTA:
            self._pend(job, PendingReason.PREEMPTING, "waiting for reclaimed nodes")
            return
        if own_res is not None and own_res.kind is ReservationKind.HEAD_OF_LINE:
            state.remove_reservation(job.job_id)  # it may no longer wait on it (e.g. now beyond its quota)
        if fail is PendingReason.TOPOLOGY:
            self._pend(job, fail, _fragments_detail(ti, shape, job))
            return
        reason = fail or PendingReason.CAPACITY
        self._pend(job, reason, self.held_detail if reason is PendingReason.CAPACITY else "")

    def _try_place(
        self,
        job: JobSpec,
        ti: _TypeIndex,
        shape: Shape,
        borrowed: bool,
        restrict: frozenset[str] | None,
        own_spares: bool,
    ) -> tuple[PendingReason | None, Placement | None]:
        state, policy = self.state, self.policy
        self.evictable_placement = False
        if shape.whole:
            if ti.free_nodes < shape.nodes:
                return too_few_free_nodes(ti, shape), None
        elif ti.free_gpus < shape.total:
            return PendingReason.CAPACITY, None
        if not state._reservations:
            return self._search(job, ti, shape, borrowed, restrict, own_spares, _NO_EXCL)
        t = job.topology
        own = job.job_id in state._reservations
        # borrowed work may run on a reservation's nodes until their owner is ready for them
        evictably = borrowed and policy.evictable_backfill and backfills_evictably(job, policy)
        tkey = (
            job.gpu_type,
            job.gpus_per_replica,
            job.replicas,
            t.pack,
            t.max_blocks,
            job.rank,
            self._backfill_span(job),
            restrict,
            state.res_free_version,
            evictably,
            self.claim_team,
        )
        if not own and not own_spares:
            hit = self.try_memo.get(tkey)
            if hit is not None:
                return hit, None
        strict = self._excl(job, class_rule=False)
        fail, placed = self._search(job, ti, shape, borrowed, restrict, own_spares, strict)
        if placed is None:
            # last resort: blocks reserved for lower classes (which would rather be preempted)
            if self._lower_class_reservation(job):
                loose = self._excl(job, borrowed=borrowed)
                fail2, placed = self._search(job, ti, shape, borrowed, restrict, own_spares, loose)
                if placed is None and fail is PendingReason.RESERVATION:
                    fail = fail2
        if placed is None and evictably and self._evictable_reservation(job):
            ev = self._excl(job, evictably=True)
            _, placed = self._search(job, ti, shape, borrowed, restrict, own_spares, ev)
            self.evictable_placement = placed is not None
        if placed is None and not own and not own_spares:
            self.try_memo[tkey] = fail  # type: ignore[assignment]
        return fail, placed

    def _search(
        self,
        job: JobSpec,
        ti: _TypeIndex,
        shape: Shape,
        borrowed: bool,
        restrict: frozenset[str] | None,
        own_spares: bool,
        excl: Exclusions | frozenset[str],
    ) -> tuple[PendingReason | None, Placement | None]:
        state, policy = self.state, self.policy
        t = job.topology
        key = (
            job.gpu_type,
            shape.whole,
            shape.nodes,
            shape.total,
            job.gpus_per_replica,
            job.replicas,
            t.pack,
            t.max_blocks,
            excl.key if isinstance(excl, Exclusions) else None,
            restrict,
            state.res_free_version,
        )
        memo_ok = not own_spares
        if memo_ok:
            hit = self.memo.get(key)
            if hit is not None:
                return hit, None
        search, r = self._find(job, ti, shape, borrowed, restrict, excl, job.avoid_nodes)
        if isinstance(r, PendingReason) and job.avoid_nodes:
            # nothing fits past the nodes its attempts failed on: those rather than none (what
            # the memo keeps is then what a search that avoids nothing finds, for any job)
            search, r = self._find(job, ti, shape, borrowed, restrict, excl, frozenset())
        if isinstance(r, PendingReason):
            if memo_ok:
                self.memo[key] = r
            return r, None
        if shape.whole:
            spares = choose_spares(search, job, shape, [n.node_id for n in r.nodes], policy)
            if spares:
                r = replace(r, spare_nodes=tuple(sorted(spares)))
        if state._node_res:
            owners = {o for n in r.nodes for o in state._node_res.get(n.node_id, ())} - {job.job_id}
            if owners:
                r = replace(r, backfill=True)
        return None, r

    def _find(
        self,
        job: JobSpec,
        ti: _TypeIndex,
        shape: Shape,
        borrowed: bool,
        restrict: frozenset[str] | None,
        excl: Exclusions | frozenset[str],
        avoid: frozenset[str],
    ) -> tuple[Search, Placement | PendingReason]:
        search = Search(self.state, ti, excl, restrict, avoid)
        if self.policy.align_node_ends:
            search.end = self.now + job.max_runtime_s
        return search, find_placement(search, job, shape, borrowed, self.policy)

    def _guarantee_gang(self, job: JobSpec, shape: Shape, placed: Placement) -> Placement:
        """A gang that fits its team's guarantee but for the team's smaller guaranteed jobs runs
        guaranteed, and those (newest first among the smallest) are marked borrowed instead.

        Per-job flags make a team's large gang borrowed whenever a few of its small jobs
        hold part of the guarantee; a borrowed gang is the cheapest reclaim victim (one job
        frees many nodes) and each restart costs a drain. Moving the flag to the small jobs
        keeps guaranteed usage within the guarantee and leaves cheap work reclaimable.
        """
        state = self.state
        if shape.charge < self.policy.reserve_min_gpus:
            return placed
        key = (job.team, job.gpu_type)
        q = state._quota.get(key)
        a = state._acct.get(key)
        if q is None or a is None or shape.charge > q.guaranteed:
            return placed
        need = a.gused + shape.charge - q.guaranteed
        running = state._running
        cands = []
        for jid in a.jobs:
            rj = running[jid]
            if (
                not rj.borrowed
                and rj.preempting_for is None
                and rj.rank != SERVING_RANK
                and rj.charge < shape.charge
                and rj.started_at < self.now  # not placed by this cycle (relabels apply before placements)
            ):
                cands.append((rj.charge, -rj.started_at, jid))
        cands.sort()
        picked: list[str] = []
        got = 0
        for c, _, jid in cands:
            if got >= need:
                break
            picked.append(jid)
            got += c
        if got < need or a.used - a.gused + got > q.borrow_limit:
            return placed
        for jid in picked:
            state.set_borrowed(jid, True)
            self.relabels.append(Relabel(jid, True))
        if picked:
            self.victim_index.clear()  # borrowed now: victims the indexes do not hold
        return replace(placed, borrowed=False)

    def _commit(self, job: JobSpec, placed: Placement, own_res: Reservation | None) -> None:
        state = self.state
        state.allocate(job, placed, self.now)
        self.lane_cache.pop((job.team, job.gpu_type), None)
        if own_res is not None:
            state.remove_reservation(job.job_id)
        self.placements.append(placed)

    def _kept_off_spares(self, ti: _TypeIndex, shape: Shape, fail: PendingReason) -> bool:
        """Would the job fit if the idle nodes held as hot spares were free? (Then it is told
        ``hot_spare``, not ``capacity`` while those nodes sit idle.) A small job that found no
        node of its shape (``topology``) fits on any spare node, which is a whole free node."""
        if not ti.spare_nodes:
            return False
        if shape.whole:  # short of whole free nodes, fragments or not (``too_few_free_nodes``)
            return fail in _SHORT_OF_NODES and ti.free_nodes < shape.nodes <= ti.free_nodes + ti.spare_nodes
        if fail is PendingReason.CAPACITY:
            return ti.free_gpus < shape.total <= ti.free_gpus + ti.spare_gpus
        return fail is PendingReason.TOPOLOGY and shape.total <= ti.node_gpus

    def _take_spares(self, ti: _TypeIndex, shape: Shape) -> list[tuple[str, str]]:
        """Release from their gangs' pools the hot spares ``shape`` needs beyond the free
        capacity (for guaranteed work that waited ``Policy.spares_yield_after_s``), one node at
        a time from the largest pool, so every gang keeps spares as long as it can. Empty
        when the spares would not cover the need."""
        state = self.state
        self.side_effects += 1  # taken, and given back if the job still does not fit
        if shape.whole:
            need = shape.nodes - ti.free_nodes
        else:
            need = max(1, -(-(shape.total - ti.free_gpus) // ti.node_gpus))
        # a gang placed this cycle holds its spares only once the plan is applied (after
        # the plan's dropped spares): those stay
        placed_now = {p.job_id for p in self.placements}
        pools: list[tuple[str, list[str]]] = []
        for owner in state.spare_owners():
            if owner in placed_now:
                continue
            nodes = [nid for nid in state.spares(owner) if state._nodes[nid].gpu_type == ti.gpu_type]
            if nodes:
                pools.append((owner, nodes))
        if sum(len(p) for _, p in pools) < need:
            return []
        taken: list[tuple[str, str]] = []
        for _ in range(need):
            owner, pool = max(pools, key=lambda p: (len(p[1]), p[0]))
            taken.append((pool.pop(), owner))
        for nid, _ in taken:
            state.drop_spare(nid)
        self.spares_taken.extend(nid for nid, _ in taken)
        # more room than the memoised searches saw: forget their failures
        self.memo.clear()
        self.try_memo.clear()
        self.victim_memo.clear()
        self.reserve_memo.clear()
        self.preempt_fail.clear()
        self.victim_index.clear()
        return taken

    def _give_back_spares(self, taken: list[tuple[str, str]]) -> None:
        """The job did not fit even with them: the (still free) nodes go back to their pools."""
        for nid, owner in taken:
            self.state.hold_spare(nid, owner)
        del self.spares_taken[-len(taken) :]

    def _would_fit_healthy(self, ti: _TypeIndex, shape: Shape) -> bool:
        if shape.whole:
            return ti.free_nodes < shape.nodes <= ti.free_nodes + ti.unready_idle_nodes
        return ti.free_gpus < shape.total <= ti.free_gpus + ti.unready_idle_gpus

    # ------------------------------------------------------------------ preemption

    def _preempt(self, job: JobSpec, ti: _TypeIndex, shape: Shape, mode: Mode, patient: bool) -> bool:
        state = self.state
        # the first reclaim per cycle of a team below its guarantee is not held back by the
        # per-cycle caps (so it is planned in the first cycle that sees the need)
        tkey = (job.team, job.gpu_type)
        reclaim = (
            not mode.borrowed_only
            and tkey not in self.reclaimed
            and state.used(job.team, job.gpu_type) < state.quota(job.team, job.gpu_type).guaranteed
        )
        if not reclaim and (self.victims_left <= 0 or self.searches_left <= 0):
            return False
        t = job.topology
        fkey = (
            job.gpu_type,
            mode,
            job.gpus_per_replica,
            job.replicas,
            t.pack,
            t.max_blocks,
            self._backfill_span(job),
            job.job_id in state._reservations,
            state.res_free_version,
            self.claim_team,
            patient,
            job.waited(self.now, self.policy.class_preemption_hold_s),  # (the cost cap holds it back till then)
            self._reclaim_held(job),  # (and the reclaim's)
        )
        held = self.preempt_fail.get(fkey)
        if held is not None:
            self.held_detail = held
            return False
        if reclaim:
            self.reclaimed.add(tkey)  # one uncapped attempt per team and cycle, found or not
        if not self._preempt_search(job, ti, shape, mode, reclaim, patient):
            if not self.awaits_checkpoints:  # (a wait depends on the job's own submit time)
                self.preempt_fail[fkey] = self.held_detail
            return False
        return True

    def _preempt_search(
        self, job: JobSpec, ti: _TypeIndex, shape: Shape, mode: Mode, reclaim: bool, patient: bool
    ) -> bool:
        state, policy, now = self.state, self.policy, self.now
        if ti.free_gpus + eligible_upper_bound(ti, mode) < shape.charge:
            return False
        excl = self._excl(job, borrowed=mode.borrowed_only)
        t = job.topology
        mkey = (job.gpu_type, mode, shape.whole, shape.nodes, shape.total, t.pack, t.max_blocks, excl.key)
        if mkey in self.victim_memo:
            return False
        self.searches_left -= 1
        search = Search(state, ti, excl)
        use_free = not (mode.borrowed_only and job.rank == SERVING_RANK and not policy.serving_borrows_idle)
        limit = max(self.victims_left, shape.nodes if shape.whole else 8) if reclaim else self.victims_left
        # shared by every team: built without the own-team rule (a superset of the victims this
        # job may take; the searches drop its team's own borrowed work)
        shared = Mode(mode.rank, mode.borrowed_only, "", mode.higher_small, mode.higher_gangs, mode.first_runs)
        ckey = (job.gpu_type, shared)
        index = self.victim_index.get(ckey)
        if index is None:
            index = self.victim_index[ckey] = VictimIndex(state, ti, shared, now, policy)
        if shape.whole:
            choice = find_whole(state, search, shape, t.pack, t.max_blocks, mode, now, policy, index, limit, use_free)
        else:
            choice = find_small(state, search, shape.total, mode, now, policy, limit, index, use_free)
        if choice is None or len(choice.victims) > limit:
            self.victim_memo.add(mkey)
            return False
        if patient and self._too_costly(choice.victims):
            return False  # it waits for jobs to end (or for cheaper victims) within its patience
        if self._class_preemption_too_costly(job, shape, ti, choice.victims) or self._reclaim_too_costly(
            job, shape, ti, choice.victims
        ):
            # it waits (a gang reserves) for jobs to end rather than throw that work away
            self.held_detail = HELD_FOR_VICTIMS_WORK
            return False
        if self._checkpoints_due(job, shape, ti, choice):
            self.awaits_checkpoints = True
            return False
        self.victims_left = max(0, self.victims_left - len(choice.victims))
        for vid in choice.victims:
            rj = state.running(vid)
            self.preemptions.append(Preemption(vid, job.job_id, reason_for(rj, mode), rj.spec.grace_s, rj.borrowed))
            state.mark_preempting(vid, job.job_id)
        self._hold_cleared(job, shape, choice.blocks, choice.nodes, choice.grace_s)
        return True

    def _checkpoints_due(self, job: JobSpec, shape: Shape, ti: _TypeIndex, choice: VictimChoice) -> bool:
        """``Policy.checkpoint_wait_s``: would waiting for the victims' checkpoints due before
        the job has waited that long save most of their lost work, and more GPU-seconds of it
        than the free GPUs of the chosen nodes stand idle meanwhile? A job holding nodes
        cleared for it (a preemption reservation) never waits."""
        wait = self.policy.checkpoint_wait_s
        if wait is None or _never_held_back(job, shape, ti):
            return False
        state, now = self.state, self.now
        res = state.reservation(job.job_id)
        if res is not None and res.kind is ReservationKind.PREEMPTION:
            return False
        until = job.submit_time + wait
        if until <= now:
            return False
        running = state._running
        total = saved = 0.0
        last_due = now
        for vid in choice.victims:
            rj = running[vid]
            lost = lost_work(rj, now)
            total += lost
            every, last = rj.ckpt_every, rj.last_checkpoint_at
            if every is not None and last is not None and rj.spec.preemptible and now < last + every <= until:
                saved += lost
                last_due = max(last_due, last + every)
        if saved <= 0.0 or 2.0 * saved < total:
            return False
        idle = sum(state._nodes[nid].nfree for nid in choice.nodes) * (last_due - now)
        return saved > idle

    def _evict_backfill(self, job: JobSpec, ti: _TypeIndex, shape: Shape, res: Reservation, borrowed: bool) -> bool:
        """The owner of a head-of-line reservation whose nodes are all free or held only by its
        evictable backfill stops that backfill (a reclaim) and holds the nodes until it is gone.
        Other teams' borrowed work that was there first (``Reservation.evicts_borrowed``) is
        reclaimed only while the owner runs within its guarantee."""
        state, now = self.state, self.now
        nodes = res.nodes
        if len(nodes) < shape.nodes:
            return False
        search = Search(state, ti, self._excl(job))
        running = state._running
        victims: set[str] = set()
        for nid in nodes:
            node = state._nodes.get(nid)
            if node is None or node.health is not NodeHealth.READY or node.spare_of is not None or not search.ok(nid):
                return False
            for jid in node.jobs:
                rj = running[jid]
                if not evictable_for(rj, res) or rj.started_at >= now:
                    return False  # still busy (or stopping for another job): wait
                if borrowed and rj.started_at < res.created_at:
                    return False  # a reclaim of work there first needs the owner within its guarantee
                victims.add(jid)
        if not victims:
            return False  # all free: the placement search decides
        grace = 0.0
        for vid in sorted(victims):
            rj = running[vid]
            self.preemptions.append(Preemption(vid, job.job_id, PreemptReason.RECLAIM, rj.spec.grace_s, True))
            state.mark_preempting(vid, job.job_id)
            grace = max(grace, rj.spec.grace_s)
        self.victims_left = max(0, self.victims_left - len(victims))
        self._hold_cleared(job, shape, res.blocks, nodes, grace)
        return True

    def _hold_cleared(
        self, job: JobSpec, shape: Shape, blocks: tuple[str, ...], nodes: tuple[str, ...], grace: float
    ) -> None:
        """Hold the nodes being cleared for ``job`` (a preemption reservation) until its victims,
        given ``grace`` to stop, are gone."""
        now = self.now
        self.state.add_reservation(
            Reservation(
                job_id=job.job_id,
                gpu_type=job.gpu_type,
                kind=ReservationKind.PREEMPTION,
                blocks=blocks,
                nodes=nodes,
                nodes_needed=shape.nodes,
                gpus=shape.charge,
                priority_rank=job.rank,
                expected_start=now + grace,
                created_at=now,
                team=job.team,
            )
        )

    # ------------------------------------------------------------------ reservations

    def _reserve(self, job: JobSpec, ti: _TypeIndex, shape: Shape, borrowed: bool) -> bool:
        state, policy, now = self.state, self.policy, self.now
        # the type's head-of-line reservations, kept while the reservation set stands: a busy
        # cycle asks for every gang that may reserve, and most reservations are preemptions'
        hkey = (job.gpu_type, state.res_version)
        mine = self.head_of_line.get(hkey)
        if mine is None:
            mine = self.head_of_line[hkey] = [
                r for r in state.reservations() if r.gpu_type == job.gpu_type and r.kind is ReservationKind.HEAD_OF_LINE
            ]
        if len(mine) >= policy.max_reservations_per_type:
            # the slot goes to a lower class's gang, or (a guaranteed gang) to a borrowing one
            # of its class: seen, a team's guaranteed 4,096-GPU gang never started in 2.4 h
            # while another team's borrowing gang held the only slot. With
            # guaranteed_gangs_outrank_borrowed, to a borrowing one of any class, and a
            # borrowing gang never takes a guaranteed one's (it would take it back each cycle)
            outrank = policy.guaranteed_gangs_outrank_borrowed
            weaker = [
                r
                for r in mine
                if (r.priority_rank > job.rank and not (outrank and borrowed and not owner_borrows(state, r)))
                or (
                    not borrowed
                    and (outrank or (policy.guaranteed_gangs_reserve_first and r.priority_rank == job.rank))
                    and owner_borrows(state, r)
                )
            ]
            if not weaker:
                return False
            if outrank:
                weakest = max(weaker, key=lambda r: (owner_borrows(state, r), r.priority_rank, r.created_at, r.job_id))
            else:
                weakest = max(weaker, key=lambda r: (r.priority_rank, owner_borrows(state, r), r.created_at, r.job_id))
            state.remove_reservation(weakest.job_id)
        t = job.topology
        mkey = (job.gpu_type, shape.nodes, t.pack, t.max_blocks)
        if mkey in self.reserve_memo:
            return False
        # Policy.drain_reclaims_borrowed: a gang within its guarantee counts other teams' borrowed
        # work it may reclaim as gone, both in choosing its blocks and nodes and once it holds them
        drain = policy.drain_reclaims_borrowed and policy.evictable_backfill and not borrowed
        proto = (
            make_head_of_line(job, (), shape.nodes, shape.charge, now, now, evicts_backfill=True, evicts_borrowed=True)
            if drain
            else None
        )
        got = plan_head_of_line(state, ti, job, shape.nodes, now, proto)
        if got is None:
            self.reserve_memo.add(mkey)  # no blocks can ever hold it (unhealthy, reserved): same for its shape
            return False
        # exactly the nodes it needs, those that free soonest in those blocks
        nodes, raw = select_nodes(state, got[0], shape.nodes, job.job_id, proto)
        if raw == _INF:
            self.reserve_memo.add(mkey)
            return False
        blocks, start = got[0], max(raw, now)
        state.add_reservation(
            make_head_of_line(
                job,
                blocks,
                shape.nodes,
                shape.charge,
                start,
                now,
                nodes,
                evicts_backfill=policy.evictable_backfill,
                evicts_borrowed=drain,
            )
        )
        return True

    # ------------------------------------------------------------------ prod-serving replicas

    def _replacements(self) -> None:
        state, policy, now = self.state, self.policy, self.now
        for jid in state.degraded_jobs():
            rj = state.running(jid)
            ti = state.type_index(rj.gpu_type)
            if ti is None:
                continue
            missing = sorted(state._missing.get(jid, ()))
            search = Search(state, ti, self._excl(rj.spec))
            p = _replace_replicas(state, search, rj, missing, policy)
            if p is not None:
                state.place_replicas(p, now)
                self.placements.append(p)


def _replace_replicas(
    state: ClusterState, search: Search, rj: RunningJob, missing: list[int], policy: Policy
) -> Placement | None:
    """New homes for the lost replicas of a running job, within its topology (best effort,
    partial is fine: each replica is replaced alone)."""
    job = rj.spec
    ti = search.ti
    gpr = job.gpus_per_replica
    topo = job.topology
    held: list[tuple[str, tuple[int, ...]]] = []
    slots: list[ReplicaSlot] = []
    blocks_now = set(rj.blocks)
    max_b = topo.max_blocks if topo.pack is Pack.BLOCK and topo.max_blocks and policy.topology else None
    if topo.pack is Pack.NODE and rj.held:
        search = Search(state, ti, search.excl, frozenset(rj.held))  # back onto its node
    elif max_b is not None and len(blocks_now) >= max_b:
        search = Search(state, ti, search.excl, frozenset(n for b in blocks_now for n in state._blocks[b].nodes))
    if rj.whole:
        per = ti.node_gpus // gpr
        want = math.ceil(len(missing) / per)
        nodes: list[str] = []
        order = sorted(blocks_now) + [
            b for _, b in sorted((c, b) for b, c in ti.blocks_free.items()) if b not in blocks_now
        ]
        used_blocks = set(blocks_now)
        for bid in order:
            if bid not in ti.blocks_free:
                continue
            if bid not in used_blocks and max_b is not None and len(used_blocks) >= max_b:
                continue
            got = search.block_nodes(bid, want - len(nodes))
            if got:
                used_blocks.add(bid)
                nodes.extend(got)
            if len(nodes) >= want:
                break
        if not nodes:
            return None
        all_gpus = tuple(range(ti.node_gpus))
        for i, node_id in enumerate(nodes):
            held.append((node_id, all_gpus))
            for j, r in enumerate(missing[i * per : (i + 1) * per]):
                slots.append(ReplicaSlot(r, node_id, all_gpus[j * gpr : (j + 1) * gpr]))
    elif topo.pack is Pack.NODE:
        # one node for every replica: the one it still runs on, or (all lost) a node for them all
        need = gpr * len(missing)
        nid = find_small_node(search, need, policy) if need <= ti.node_gpus else None
        if nid is None:
            return None
        gpus = indices_of(state._nodes[nid].free_mask)[:need]
        held.append((nid, gpus))
        for i, r in enumerate(missing):
            slots.append(ReplicaSlot(r, nid, gpus[i * gpr : (i + 1) * gpr]))
    else:
        taken: dict[str, int] = {}
        used_blocks = set(blocks_now)
        for r in missing:
            nid = find_small_node(search, gpr, policy)
            if nid is None:
                break
            node = state._nodes[nid]
            if node.block not in used_blocks:
                if max_b is not None and len(used_blocks) >= max_b:
                    break
                used_blocks.add(node.block)
                if max_b is not None and len(used_blocks) >= max_b:
                    search = Search(
                        state, ti, search.excl, frozenset(n for b in used_blocks for n in state._blocks[b].nodes)
                    )
            # pick GPUs, then take them so the next replica sees the node's new free set
            gpus = indices_of(node.free_mask)[:gpr]
            taken[nid] = taken.get(nid, 0) | mask_of(gpus)
            state._take(node, mask_of(gpus), "\0replacement")
            slots.append(ReplicaSlot(r, nid, gpus))
        for nid, m in taken.items():
            state._give(state._nodes[nid], m, "\0replacement")
            held.append((nid, tuple(sorted(g for s in slots if s.node_id == nid for g in s.gpus))))
        if not slots:
            return None
    blocks = [state._nodes[n].block for n, _ in held]
    return make_placement(job, held, slots, blocks, rj.borrowed, sum(len(g) for _, g in held), replacement=True)
