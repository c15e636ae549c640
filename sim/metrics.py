"""What a run measures, over the window ``[0, Workload.end)`` (warm-up excluded).

* allocation: GPUs held by jobs (running or stopping in their grace period; hot spares
  count as idle) as a share of healthy GPUs (nodes ``ready``), time-weighted, overall
  and while demand exceeds capacity (held + queued GPUs > healthy GPUs), and net of the
  GPU-hours lost to preemption and failures (work held, then thrown away) and to spread
  placement;
* idle GPU-hours (healthy, not held) and their cost at ``GPU_HOUR_USD``;
* queue wait (first start - submit) p50/p95/p99 by class and by size bucket. A job still
  queued when the window ends is followed into the drain (``SimOptions.drain_s``) until it
  starts; one still queued when the run stops counts with its wait so far and is reported
  as ``censored``. Without a drain, a policy that never starts a gang reports a shorter
  wait for it than one that starts it late;
* per team: max wait, and starvation: the team uses less than its guarantee, has queued
  work that fits in what is left of it, and another team borrows capacity that work may
  take back (docs/design.md victims: borrowed work of the same or a lower class); more than
  ``STARVED_AFTER_S`` of that in a row is starvation. The looser figure (any team
  borrows anything, whatever its class) is reported too, and a stricter one beside it
  (not instead: starvation above is the yardstick): starvation while the free GPUs of the
  type (hot spares not counted) plus that reclaimable borrowed capacity add up to the
  team's smallest such job, so that by GPU count alone the rules let it start. Where they
  do not, the wait is bound by the victim rules (capacity held by another team's borrowed
  work of a higher class), not by a choice the scheduler could have made. Stricter again,
  beside both: starvation while one such job's shape fits nodes that are free or hold only
  work it may take back (``sim.placeable``: whole nodes within its block limit, judged once
  a minute); where the GPUs suffice and the nodes do not, topology keeps the work waiting;
* GPU-hours lost to preemption (GPUs x time since the last checkpoint, or since start
  for a job that cannot checkpoint, up to the end of the grace period; split by cause,
  victim size and the victim's age at its SIGTERM), to failures, and
  to spread placement (the extra time a gang spread beyond its max_blocks runs, when the
  run models it: ``SimOptions.spread_slowdown``); beside them, the same causes priced by
  the SIGTERM cost model (``sim.costs``: a job that saves on SIGTERM loses its grace and
  its restart time instead);
* jobs balance at the window's end, over jobs submitted in it (warm-up jobs excluded):
  submitted = finished + running (or stopping) + queued (never started) + requeued
  (started, then preempted or failed, and queued again); ``outcomes`` counts window jobs
  only, ``outcomes_of_warmup_jobs`` the warm-up jobs that ended in the window;
* borrowed-GPU reclaim time: from the cycle that preempts borrowed work for a job to
  that job's start (reclaims begun in the window, even if the job starts in the drain);
  the bound is the grace of the victims stopping for it (all of them, borrowed or not:
  it starts when the last is gone) + 2 cycles;
* large gangs (>= 1,024 GPUs): blocks spanned vs the fewest blocks that could hold
  them, and max_blocks;
* what waits beside the idle GPUs while demand exceeds capacity: at each such snapshot, the
  queued GPUs of the last cycle's pending jobs by class, whether they would run borrowed or
  guaranteed, size, and pending reason (its detail with the numbers taken out), as a mean per
  snapshot (``idle.queued_while_demand_exceeds_capacity``): which rule or shape keeps the
  free GPUs from the work;
* preemptions per job; cycles.

Everything but the waits (and the placements of the jobs they wait for) is measured over
the window; the drain after it only finishes the waits.

Percentiles are nearest-rank; every float is rounded so equal runs give equal JSON.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence

from placement import ClusterState, NodeHealth, Policy
from placement.quota import beyond_guarantee
from sim.costs import restart_s
from sim.placeable import NodeRoom
from sim.records import JobRecord
from sim.workload import CLASSES, SIZE_BUCKETS, Workload, size_bucket

GPU_HOUR_USD = 2.0
STARVED_AFTER_S = 600.0
NODES_JUDGED_EVERY_S = 60.0  # how often starving work's fit on nodes is judged (sim.placeable)
LARGE_GANG_GPUS = 1024
_INF = float("inf")


_NUMBERS = re.compile(r"\d[\d,.]*")  # a pending detail's numbers, taken out to group by kind
_QUEUED_KINDS = 12  # kinds of queued work listed beside idle GPUs (the rest summed)


def pct(sorted_xs: Sequence[float], p: float) -> float | None:
    if not sorted_xs:
        return None
    n = len(sorted_xs)
    return sorted_xs[min(n - 1, max(0, math.ceil(p * n) - 1))]


def r(x: float | None, nd: int = 3) -> float | None:
    if x is None:
        return None
    if x == math.inf:
        return None
    return round(float(x), nd)


def dist(xs: list[float], censored: int = 0) -> dict:
    s = sorted(xs)
    return {
        "n": len(s),
        "p50": r(pct(s, 0.50), 1),
        "p95": r(pct(s, 0.95), 1),
        "p99": r(pct(s, 0.99), 1),
        "max": r(s[-1], 1) if s else None,
        "mean": r(sum(s) / len(s), 1) if s else None,
        "censored": censored,
    }


# a preempted job's age at its SIGTERM (since the attempt started), for lost_gpu_hours.preemption_by
AGE_BUCKETS = ("<30m", "30m-2h", ">=2h")
# what stopped it: the preemption's reason and whether the victim ran borrowed
CAUSES = ("reclaim_of_borrowed", "reclaim_of_guaranteed", "priority_of_borrowed", "priority_of_guaranteed")


def age_bucket(age_s: float) -> str:
    return "<30m" if age_s < 1800.0 else ("30m-2h" if age_s < 7200.0 else ">=2h")


def _episode(longest: dict[str, float], episodes: Counter, team: str, d: float) -> None:
    """A closed span of starvation of ``d`` seconds: the team's longest, and an episode past the line."""
    if d > longest.get(team, 0.0):
        longest[team] = d
    if d > STARVED_AFTER_S:
        episodes[team] += 1


def _track(
    since_by: dict[tuple[str, str], float],
    key: tuple[str, str],
    on: bool,
    now: float,
    close: Callable[[tuple[str, str], float, float], None],
) -> None:
    """A condition's span for ``key``: opened at ``now`` when it starts, closed when it ends."""
    since = since_by.get(key)
    if on:
        if since is None:
            since_by[key] = now
    elif since is not None:
        close(key, since, now)


class Metrics:
    def __init__(self, workload: Workload, state: ClusterState, sample_s: float) -> None:
        self.wl = workload
        self.state = state
        self.end = workload.end
        self.sample_s = sample_s
        self.t = -workload.warmup
        self.stale = True
        self.next_snap = 0.0
        self.snaps: list[tuple[int, int, int, bool]] = []
        self.last_pending: tuple = ()  # the last cycle's Plan.pending
        self.over_queued: Counter = Counter()  # queued GPUs by kind (see _tally_queued), summed over snapshots
        self.over_queued_snaps = 0
        self.over_queued_idle = 0  # idle GPUs summed over those snapshots
        self.alloc = 0
        self.healthy = 0
        self.queued_charge = 0
        self.q_by_team: dict[tuple[str, str, int], Counter] = {}
        # the same queues job by job, oldest first: job id -> (queued at, charge)
        self.q_jobs: dict[tuple[str, str, int], dict[str, tuple[float, int]]] = {}
        # integrals over the window
        self.i_time = 0.0
        self.i_alloc = 0.0
        self.i_healthy = 0.0
        self.i_over_time = 0.0
        self.i_over_alloc = 0.0
        self.i_over_healthy = 0.0
        nb = max(1, math.ceil(self.end / sample_s)) if self.end > 0 else 1
        self.b_alloc = [0.0] * nb
        self.b_healthy = [0.0] * nb
        self.b_demand = [0.0] * nb
        # events
        self.waits_first: dict[str, float] = {}
        self.preempt_by_reason: Counter = Counter()
        self.preempt_borrowed = 0
        self.preempt_per_job: Counter = Counter()
        # victim -> (cause, size bucket, age bucket) from its SIGTERM until its loss is counted
        self.pre_cause: dict[str, tuple[str, str, str]] = {}
        self.lost_pre_by: tuple[dict[str, float], ...] = ({}, {}, {})  # by cause, victim size, victim age
        self.reclaims: list[tuple[float, float]] = []  # (time to start, bound)
        self.lost_pre_h = 0.0
        # the SIGTERM cost model (sim.costs): preemption losses re-priced, savers and the rest apart
        self.lost_pre_sig_h = 0.0
        self.lost_pre_sig_saved_h = 0.0
        self.lost_pre_sig_restart_h = 0.0
        self.lost_pre_sig_not_saved_h = 0.0
        self.pre_saved = 0
        self.pre_not_saved = 0
        self.lost_fail_h = 0.0
        self.lost_spread_h = 0.0
        self.outcomes: Counter = Counter()  # jobs submitted in the window that ended in it
        self.outcomes_warmup: Counter = Counter()  # warm-up jobs that ended in the window
        self.useful_h = 0.0
        self.large: list[dict] = []
        self.faults_in_window = 0
        self.faults_dropped = 0
        self.gangs_failed = 0
        self.serving_degraded = 0
        self.replacements = 0
        self.restarts = 0
        self.backfills = 0
        self.starving_since: dict[tuple[str, str], float] = {}
        self.below_since: dict[tuple[str, str], float] = {}
        self.recs: dict[str, JobRecord] | None = None
        self.res_since: dict[str, float] = {}
        self.res_made = self.res_started = self.res_dropped = 0
        self.res_held_s: list[float] = []
        self.res_dropped_held_s = 0.0
        self.next_reason_sample = 0.0
        self.spares_taken = 0  # hot spare nodes released to guaranteed work (Policy.spares_yield_after_s)
        self.starving_reasons: Counter = Counter()
        self.below_max: dict[str, float] = {}
        self.starved_max: dict[str, float] = {}
        self.starved_episodes: Counter = Counter()
        # the same episodes, counted only while free + reclaimable GPUs could hold the job
        self.starving_capacity_since: dict[tuple[str, str], float] = {}
        self.starved_capacity_max: dict[str, float] = {}
        self.starved_capacity_episodes: Counter = Counter()
        # and only while the job's shape fits nodes free or holding work it may take back
        # (sim.placeable): the figure above ignores topology
        self.starving_nodes_since: dict[tuple[str, str], float] = {}
        self.starved_nodes_max: dict[str, float] = {}
        self.starved_nodes_episodes: Counter = Counter()
        self.nodes_judged: dict[tuple[str, str], tuple[float, bool]] = {}
        self.node_room: dict[str, tuple[float, NodeRoom]] = {}
        self.respect_topology = True  # the policy's ``topology`` (set by the simulation)
        # the same episodes, job by job: while a team starves, since when its oldest waiting job
        # that fits its guarantee has waited in the episode (the later of its queueing and the
        # episode's start)
        self.job_starving_since: dict[tuple[str, str], float] = {}
        self.starved_job_max: dict[str, float] = {}
        self.starved_job_episodes: Counter = Counter()
        self.cycle_interval = 1.0
        self.closed = False  # the window has ended: only first starts (waits) are still measured
        self.stopped_at = self.end  # when the run stopped (the end of the drain, if any)
        self.queued_at_window_end = 0  # never started by the window's end
        self.running_at_window_end = 0  # running or stopping in its grace period
        self.stopping_at_window_end = 0  # of those, stopping
        self.requeued_at_window_end = 0  # started, then preempted or failed, and queued again
        self.done_at_window_end = 0  # ended (the phase, beside the outcome events that count them)
        self.other_at_window_end = 0  # none of the above (the balance does not hold then)
        self._teams = [(t.name, gt, g) for t in workload.teams for gt, g, _ in t.quotas]

    # ------------------------------------------------------------------ step functions

    def _refresh(self) -> None:
        st = self.state
        self.alloc = st.allocated_gpus()
        self.healthy = st.healthy_gpus()
        self.stale = False

    def advance(self, t: float) -> None:
        if self.next_snap <= t and self.next_snap < self.end:
            self._snapshot()
            self.next_snap = (math.floor(t / self.sample_s) + 1) * self.sample_s
        a, b = max(self.t, 0.0), min(t, self.end)
        self.t = t
        if b <= a:
            if self.stale and t >= 0:
                self._refresh()
            return
        if self.stale:
            self._refresh()
        dt = b - a
        alloc, healthy = self.alloc, self.healthy
        demand = alloc + self.queued_charge
        self.i_time += dt
        self.i_alloc += alloc * dt
        self.i_healthy += healthy * dt
        if demand > healthy:
            self.i_over_time += dt
            self.i_over_alloc += alloc * dt
            self.i_over_healthy += healthy * dt
        w = self.sample_s
        k = int(a // w)
        x = a
        nb = len(self.b_alloc)
        while x < b and k < nb:
            y = min(b, (k + 1) * w)
            d = y - x
            self.b_alloc[k] += alloc * d
            self.b_healthy[k] += healthy * d
            self.b_demand[k] += demand * d
            x = y
            k += 1

    def _snapshot(self) -> None:
        """Where the idle healthy GPUs are right now: hot spares, free nodes held by
        reservations, anything else free (fragments, quota, nothing to run)."""
        if self.stale:
            self._refresh()
        st = self.state
        spare = 0
        for owner in st.spare_owners():
            for nid in st.spares(owner):
                spare += len(st.node_free(nid))
        reserved = 0
        seen: set[str] = set()
        for res in st.reservations():
            for nid in st.reservation_nodes(res):
                if nid in seen:
                    continue
                seen.add(nid)
                if st.node_health(nid) is NodeHealth.READY and st.node_spare_of(nid) is None:
                    reserved += len(st.node_free(nid))
        idle = max(0, self.healthy - self.alloc)
        over = self.alloc + self.queued_charge > self.healthy
        self.snaps.append((idle, spare, reserved, over))
        if over and idle > 0 and self.recs is not None:
            self._tally_queued(idle)

    def _tally_queued(self, idle: int) -> None:
        """What waits beside idle GPUs: the last cycle's pending jobs still queued, by kind."""
        st, recs, tally = self.state, self.recs, self.over_queued
        assert recs is not None
        self.over_queued_snaps += 1
        self.over_queued_idle += idle
        for pe in self.last_pending:
            rec = recs.get(pe.job_id)
            if rec is None or rec.phase != "queued":
                continue
            team, gt, charge = rec.job.team, rec.job.gpu_type, rec.charge
            flag = "borrowed" if beyond_guarantee(st, team, gt, charge) else "guaranteed"
            key = f"{rec.job.priority}/{flag}/{size_bucket(charge)}/{pe.reason.value}"
            if pe.detail:
                key += ": " + _NUMBERS.sub("N", pe.detail)
            tally[key] += charge

    def close_window(self, recs) -> None:
        """The window has ended; from here on only first starts count (the drain)."""
        for key, since in list(self.starving_since.items()):
            self._close_starving(key, since, self.end)
        for key, since in list(self.below_since.items()):
            self._close_below(key, since, self.end)
        for key, since in list(self.starving_capacity_since.items()):
            self._close_starving_capacity(key, since, self.end)
        for key, since in list(self.starving_nodes_since.items()):
            self._close_starving_nodes(key, since, self.end)
        for key, since in list(self.job_starving_since.items()):
            self._close_job_starving(key, since, self.end)
        for rec in recs:
            if rec.job.submit < 0:
                continue
            if rec.phase in ("running", "stopping"):
                self.running_at_window_end += 1
                self.stopping_at_window_end += rec.phase == "stopping"
            elif rec.phase == "queued":
                if rec.first_start is None:
                    self.queued_at_window_end += 1
                else:
                    self.requeued_at_window_end += 1
            elif rec.phase == "done":
                self.done_at_window_end += 1
            else:
                self.other_at_window_end += 1
        self.closed = True

    # ------------------------------------------------------------------ hooks

    def queued(self, rec: JobRecord, sign: int) -> None:
        self.queued_charge += sign * rec.charge
        key = (rec.job.team, rec.job.gpu_type, rec.spec.rank)
        c = self.q_by_team.get(key)
        if c is None:
            c = self.q_by_team[key] = Counter()
        c[rec.charge] += sign
        if c[rec.charge] <= 0:
            del c[rec.charge]
        jobs = self.q_jobs.setdefault(key, {})
        if sign > 0:
            jobs[rec.job.job_id] = (self.t, rec.charge)
        else:
            jobs.pop(rec.job.job_id, None)

    def first_start(self, rec: JobRecord, now: float) -> None:
        self.stale = True

    def restart(self, rec: JobRecord, now: float) -> None:
        self.stale = True
        if now >= 0 and not self.closed:
            self.restarts += 1

    def placed(self, rec: JobRecord, pl, now: float) -> None:
        self.stale = True
        if now < 0:
            return
        if pl.backfill and not self.closed:
            self.backfills += 1
        job = rec.job
        if job.gpus >= LARGE_GANG_GPUS:
            nodes = len(pl.nodes)
            mn = self.wl.cluster.min_blocks(job.gpu_type, nodes)
            nb = len(pl.blocks)
            ok = nb <= mn or (job.max_blocks is not None and nb <= job.max_blocks)
            self.large.append(
                {
                    "job": job.job_id,
                    "gpus": job.gpus,
                    "class": job.priority,
                    "blocks": nb,
                    "min_blocks": mn,
                    "max_blocks": job.max_blocks,
                    "ok": ok,
                    "attempt": rec.spec.attempt,
                }
            )

    def reservation_made(self, job_id: str, now: float) -> None:
        self.res_since[job_id] = now
        if now >= 0 and not self.closed:
            self.res_made += 1

    def reservation_gone(self, job_id: str, now: float, owner_started: bool) -> None:
        since = self.res_since.pop(job_id, now)
        if now < 0 or self.closed:
            return
        if owner_started:
            self.res_started += 1
            self.res_held_s.append(now - since)
        else:
            self.res_dropped += 1
            self.res_dropped_held_s += now - since

    def preempted(self, rec: JobRecord, pr, now: float) -> None:
        cause = f"{pr.reason.value}_of_{'borrowed' if pr.victim_borrowed else 'guaranteed'}"
        self.pre_cause[rec.job.job_id] = (cause, size_bucket(rec.job.gpus), age_bucket(now - rec.attempt_start))
        if now < 0 or self.closed:
            return
        self.preempt_by_reason[pr.reason.value] += 1
        if pr.victim_borrowed:
            self.preempt_borrowed += 1
        self.preempt_per_job[rec.job.job_id] += 1

    def reclaimed(self, rec: JobRecord, dt: float, grace: float) -> None:
        # a reclaim begun in the window counts, even if the job starts in the drain
        if 0.0 <= rec.attempt_start - dt < self.end:
            self.reclaims.append((dt, grace + 2 * self.cycle_interval))

    def ended(self, rec: JobRecord, outcome: str, now: float) -> None:
        self.stale = True
        if now >= 0 and not self.closed:
            (self.outcomes if rec.job.submit >= 0 else self.outcomes_warmup)[outcome] += 1

    def lost_preemption(self, rec: JobRecord, h: float, h_sigterm: float, saved_on_sigterm: bool) -> None:
        """A preemption's loss: ``h`` by today's accounting, ``h_sigterm`` by the SIGTERM model."""
        self.stale = True
        cause = self.pre_cause.pop(rec.job.job_id, None)
        if self.t >= 0 and not self.closed:
            self.lost_pre_h += h
            self.lost_pre_sig_h += h_sigterm
            if cause is not None:
                for split, key in zip(self.lost_pre_by, cause, strict=True):
                    split[key] = split.get(key, 0.0) + h
            if saved_on_sigterm:
                self.pre_saved += 1
                self.lost_pre_sig_saved_h += h_sigterm
                self.lost_pre_sig_restart_h += rec.charge * restart_s(rec.job.gpus) / 3600.0
            else:
                self.pre_not_saved += 1
                self.lost_pre_sig_not_saved_h += h_sigterm

    def lost_failure(self, rec: JobRecord, h: float) -> None:
        self.stale = True
        if self.t >= 0 and not self.closed:
            self.lost_fail_h += h

    def lost_spread(self, h: float) -> None:
        """GPU-hours a spread gang held beyond what its work needed (measured window only)."""
        self.stale = True
        if not self.closed:
            self.lost_spread_h += h

    def fault(self, nid: str, f, res) -> None:
        self.stale = True
        if self.t >= 0 and not self.closed:
            self.faults_in_window += 1
            self.gangs_failed += len(res.released)
            self.serving_degraded += len(res.degraded)

    def health_changed(self) -> None:
        self.stale = True

    def after_cycle(self, now: float, queue, plan=None) -> None:
        self.stale = True
        if plan is not None:
            self.last_pending = plan.pending
        if now < 0 or self.closed:
            return
        st = self.state
        if plan is not None and plan.spares_taken:
            self.spares_taken += len(plan.spares_taken)
        if plan is not None and now >= self.next_reason_sample and self.recs is not None:
            self._sample_starving_reasons(now, plan, self.recs)
        # reclaimable borrowed GPUs per (type, class rank): the engine's victim lists (borrowed,
        # not prod-serving, not already stopping), whatever their age
        reclaimable: dict[str, tuple[int, ...]] = {gt: st.borrowed_gpus_by_class(gt) for gt in st.gpu_types()}
        teams = self._teams
        borrowed = [st.borrowed_used(team, gt) for team, gt, _ in teams]
        any_borrow: dict[str, int] = {}
        for (_, gt, _), b in zip(teams, borrowed, strict=True):
            any_borrow[gt] = any_borrow.get(gt, 0) + b
        # (called every simulated cycle: locals, no per-team tuples)
        q_by_team, starving_since, below_since = self.q_by_team, self.starving_since, self.below_since
        capacity_since = self.starving_capacity_since
        q_jobs, job_since = self.q_jobs, self.job_starving_since
        free: dict[str, int] = {}
        for (team, gt, g), own_b in zip(teams, borrowed, strict=True):
            strict = loose = capacity = False
            oldest = _INF  # when the oldest queued job that fits the guarantee, of a starving class, was queued
            cap_ranks: list[int] = []  # the classes whose waiting work free + reclaimable GPUs could hold
            used = 0
            if g > 0:
                used = st.used(team, gt)
                if used < g:
                    for rank in range(4):
                        c = q_by_team.get((team, gt, rank))
                        if not c or used + min(c) > g:
                            continue
                        if any_borrow.get(gt, 0) - own_b > 0:
                            loose = True
                        # capacity this class may take back: borrowed work of the same or a lower class
                        others = sum(reclaimable[gt][max(rank, 1) :]) - own_b
                        if others > 0:
                            strict = True
                            for at, charge in q_jobs[(team, gt, rank)].values():
                                if used + charge <= g:
                                    oldest = min(oldest, at)
                                    break
                            if gt not in free:
                                free[gt] = st.free_gpus(gt)
                            if free[gt] + others >= min(c):
                                capacity = True
                                cap_ranks.append(rank)
            key = (team, gt)
            _track(starving_since, key, strict, now, self._close_starving)
            _track(below_since, key, loose, now, self._close_below)
            _track(capacity_since, key, capacity, now, self._close_starving_capacity)
            if capacity:
                nodes = self._nodes_suffice(key, used, g, cap_ranks, now)
            else:
                nodes = False
                self.nodes_judged.pop(key, None)
            _track(self.starving_nodes_since, key, nodes, now, self._close_starving_nodes)
            js = job_since.get(key)
            if strict:
                start = max(starving_since[key], oldest)
                if js is not None and js != start:
                    self._close_job_starving(key, js, now)  # its oldest such job started (or left)
                job_since[key] = start
            elif js is not None:
                self._close_job_starving(key, js, now)

    def _sample_starving_reasons(self, now: float, plan, recs: dict[str, JobRecord]) -> None:
        """Once a minute while a team starves: why its work that fits its guarantee waits."""
        starving = {k[0]: k for k, since in self.starving_since.items() if now - since > STARVED_AFTER_S}
        if not starving:
            return
        self.next_reason_sample = now + 60.0
        st = self.state
        for pe in plan.pending:
            rec = recs.get(pe.job_id)
            if rec is None:
                continue
            key = starving.get(rec.job.team)
            if key is None or key[1] != rec.job.gpu_type:
                continue
            if st.used(*key) + rec.charge <= st.quota(*key).guaranteed:
                self.starving_reasons[f"{rec.job.priority}/{pe.reason.value}"] += 1

    def _close_below(self, key: tuple[str, str], since: float, now: float) -> None:
        del self.below_since[key]
        d = now - since
        if d > self.below_max.get(key[0], 0.0):
            self.below_max[key[0]] = d

    def _close_starving(self, key: tuple[str, str], since: float, now: float) -> None:
        del self.starving_since[key]
        _episode(self.starved_max, self.starved_episodes, key[0], now - since)

    def _close_starving_capacity(self, key: tuple[str, str], since: float, now: float) -> None:
        del self.starving_capacity_since[key]
        _episode(self.starved_capacity_max, self.starved_capacity_episodes, key[0], now - since)

    def _nodes_suffice(self, key: tuple[str, str], used: int, g: int, ranks: list[int], now: float) -> bool:
        """Could one of the team's waiting jobs that fit its guarantee, of ``ranks``, be placed
        on nodes free or holding work it may take back (``sim.placeable``)? Judged at most once
        per ``NODES_JUDGED_EVERY_S`` per team and type (a node census costs a pass over the
        type's nodes); between judgements the last answer holds."""
        last = self.nodes_judged.get(key)
        if last is not None and now - last[0] < NODES_JUDGED_EVERY_S:
            return last[1]
        ok = False
        if self.recs is not None:
            room = self.node_room.get(key[1])
            if room is None or room[0] != now:
                room = self.node_room[key[1]] = (now, NodeRoom(self.state, key[1], self.respect_topology))
            seen: set[tuple] = set()
            for rank in ranks:
                for jid, (_, charge) in self.q_jobs[(key[0], key[1], rank)].items():
                    if used + charge > g:
                        continue
                    spec = self.recs[jid].spec.as_placed_at(now)
                    t = spec.topology
                    shape = (spec.gpus_per_replica, spec.replicas, t.pack, t.max_blocks, spec.rank)
                    if shape in seen:
                        continue
                    seen.add(shape)
                    if room[1].fits(spec, now):
                        ok = True
                        break
                if ok:
                    break
        self.nodes_judged[key] = (now, ok)
        return ok

    def _close_starving_nodes(self, key: tuple[str, str], since: float, now: float) -> None:
        del self.starving_nodes_since[key]
        _episode(self.starved_nodes_max, self.starved_nodes_episodes, key[0], now - since)

    def _close_job_starving(self, key: tuple[str, str], since: float, now: float) -> None:
        del self.job_starving_since[key]
        _episode(self.starved_job_max, self.starved_job_episodes, key[0], now - since)

    # ------------------------------------------------------------------ summary

    def _queued_beside_idle(self) -> dict | None:
        """Mean queued GPUs per over-capacity snapshot with idle GPUs, by kind (the top
        ``_QUEUED_KINDS``; the rest summed)."""
        n = self.over_queued_snaps
        if not n:
            return None
        ranked = sorted(self.over_queued.items(), key=lambda kv: (-kv[1], kv[0]))
        top, rest = ranked[:_QUEUED_KINDS], ranked[_QUEUED_KINDS:]
        return {
            "snapshots": n,
            "idle_gpus_mean": r(self.over_queued_idle / n, 1),
            "queued_gpus_mean": r(sum(self.over_queued.values()) / n, 1),
            "by_kind_gpus_mean": {k: r(v / n, 1) for k, v in top},
            "other_kinds_gpus_mean": r(sum(v for _, v in rest) / n, 1),
        }

    def _breakdown(self) -> dict:
        """Mean share of healthy GPUs idle, by where they sit (snapshots every sample_s)."""
        out: dict[str, dict[str, float | None] | None] = {}
        for label, keep in (("overall", lambda o: True), ("while_demand_exceeds_capacity", lambda o: o)):
            rows = [x for x in self.snaps if keep(x[3])]
            if not rows or not self.healthy:
                out[label] = None
                continue
            n = len(rows)
            h = self.i_healthy / self.i_time if self.i_time else self.healthy
            idle = sum(x[0] for x in rows) / n
            spare = sum(x[1] for x in rows) / n
            res = sum(x[2] for x in rows) / n
            out[label] = {
                "snapshots": n,
                "hot_spares": r(100.0 * spare / h, 2),
                "reserved_for_large_gangs": r(100.0 * res / h, 2),
                "other_free": r(100.0 * max(0.0, idle - spare - res) / h, 2),
            }
        return out

    def _balance(self, submitted: int) -> dict:
        """submitted = finished + running + queued + requeued at the window's end.

        ``finished`` counts the jobs' end events (``outcomes``), the rest their phases at the
        window's end, and ``submitted`` the workload's window jobs, so ``holds`` checks the
        event accounting against the state; ``requeued`` are jobs started, then preempted or
        failed and queued again.
        """
        finished = sum(self.outcomes.values())
        parts = finished + self.running_at_window_end + self.queued_at_window_end + self.requeued_at_window_end
        return {
            "submitted": submitted,
            "finished": finished,
            "running": self.running_at_window_end,
            "of_which_stopping": self.stopping_at_window_end,
            "queued": self.queued_at_window_end,
            "requeued": self.requeued_at_window_end,
            "holds": parts == submitted and finished == self.done_at_window_end and not self.other_at_window_end,
        }

    def summary(self, recs: dict[str, JobRecord], policy: Policy, cycles: int) -> dict:
        end = self.end
        if not self.closed:
            self.close_window(recs.values())
        waits_class: dict[str, list[float]] = {c: [] for c in CLASSES}
        cens_class: Counter = Counter()
        waits_size: dict[str, list[float]] = {b: [] for b in SIZE_BUCKETS}
        cens_size: Counter = Counter()
        waits_cs: dict[tuple[str, str], list[float]] = {}
        team_max: dict[str, float] = {}
        team_jobs: Counter = Counter()
        large_waits: list[float] = []
        large_cens = 0
        submitted = started = never_started = 0
        per_job_pre: list[int] = []
        all_waits: dict[str, list[float]] = {c: [] for c in CLASSES}
        for rec in recs.values():
            job = rec.job
            if not (0.0 <= job.submit < end):
                continue
            submitted += 1
            if rec.first_start is not None:
                w = rec.first_start - job.submit
                started += 1
                cens = False
                per_job_pre.append(self.preempt_per_job.get(job.job_id, 0))
            else:
                w = self.stopped_at - job.submit
                cens = True
                never_started += 1
            cls, sb = job.priority, size_bucket(job.gpus)
            waits_class.setdefault(cls, []).append(w)
            all_waits.setdefault(cls, []).append(w)
            waits_size[sb].append(w)
            waits_cs.setdefault((cls, sb), []).append(w)
            if cens:
                cens_class[cls] += 1
                cens_size[sb] += 1
            if job.gpus >= LARGE_GANG_GPUS:
                large_waits.append(w)
                large_cens += cens
            team_jobs[job.team] += 1
            if w > team_max.get(job.team, -1.0):
                team_max[job.team] = w
        self.wait_samples = all_waits  # for plots (not in the JSON)
        healthy_h = self.i_healthy / 3600.0
        alloc_h = self.i_alloc / 3600.0
        idle_h = healthy_h - alloc_h
        over_idle_h = (self.i_over_healthy - self.i_over_alloc) / 3600.0
        teams = {}
        for t in self.wl.teams:
            name = t.name
            teams[name] = {
                "guaranteed": {gt: g for gt, g, _ in t.quotas},
                "jobs": team_jobs.get(name, 0),
                "max_wait_s": r(team_max.get(name), 1),
                "longest_starving_s": r(self.starved_max.get(name, 0.0), 1),
                "longest_below_guarantee_while_any_team_borrows_s": r(self.below_max.get(name, 0.0), 1),
                "starved": self.starved_episodes.get(name, 0) > 0,
                "longest_starving_while_capacity_suffices_s": r(self.starved_capacity_max.get(name, 0.0), 1),
                "starved_while_capacity_suffices": self.starved_capacity_episodes.get(name, 0) > 0,
                "longest_starving_while_nodes_suffice_s": r(self.starved_nodes_max.get(name, 0.0), 1),
                "starved_while_nodes_suffice": self.starved_nodes_episodes.get(name, 0) > 0,
                "longest_job_starving_s": r(self.starved_job_max.get(name, 0.0), 1),
                "starved_by_one_job": self.starved_job_episodes.get(name, 0) > 0,
            }
        rec_s = sorted(d for d, _ in self.reclaims)
        over_bound = sum(1 for d, b in self.reclaims if d > b + 1e-9)
        unresolved = sum(1 for rec in recs.values() if rec.reclaim_at is not None and rec.phase == "queued")
        large_ok = sum(1 for x in self.large if x["ok"])
        large_min = sum(1 for x in self.large if x["blocks"] <= x["min_blocks"])
        pj = sorted(per_job_pre)
        series_t = []
        series_alloc = []
        series_demand = []
        for k in range(len(self.b_alloc)):
            hh = self.b_healthy[k]
            series_t.append(r(k * self.sample_s / 3600.0, 4))
            series_alloc.append(r(100.0 * self.b_alloc[k] / hh, 2) if hh > 0 else None)
            series_demand.append(r(100.0 * self.b_demand[k] / hh, 2) if hh > 0 else None)
        return {
            "allocation": {
                "healthy_gpu_pct": r(100.0 * self.i_alloc / self.i_healthy, 2) if self.i_healthy else None,
                "healthy_gpu_pct_while_demand_exceeds_capacity": r(100.0 * self.i_over_alloc / self.i_over_healthy, 2)
                if self.i_over_healthy
                else None,
                "hours_demand_exceeds_capacity": r(self.i_over_time / 3600.0, 3),
                "healthy_gpu_hours": r(healthy_h, 1),
                "allocated_gpu_hours": r(alloc_h, 1),
                # allocation counts work that preemption and failures later throw away, and the
                # extra time of spread gangs; this is what is left once those are taken out
                "healthy_gpu_pct_net_of_lost_work": r(
                    100.0 * (alloc_h - self.lost_pre_h - self.lost_fail_h - self.lost_spread_h) / healthy_h, 2
                )
                if self.i_healthy
                else None,
                # the same, with preemptions priced by the SIGTERM model (sim.costs; restarts
                # are charged as lost GPU-hours of the same allocation)
                "healthy_gpu_pct_net_of_lost_work_sigterm_model": r(
                    100.0 * (alloc_h - self.lost_pre_sig_h - self.lost_fail_h - self.lost_spread_h) / healthy_h, 2
                )
                if self.i_healthy
                else None,
            },
            "idle": {
                "gpu_hours": r(idle_h, 1),
                "breakdown_pct_of_healthy": self._breakdown(),
                "hot_spare_nodes_taken_by_guaranteed_work": self.spares_taken,
                "cost_usd": r(idle_h * GPU_HOUR_USD, 0),
                "gpu_hours_while_demand_exceeds_capacity": r(over_idle_h, 1),
                "cost_usd_while_demand_exceeds_capacity": r(over_idle_h * GPU_HOUR_USD, 0),
                "queued_while_demand_exceeds_capacity": self._queued_beside_idle(),
            },
            "wait_s": {
                "by_class": {c: dist(waits_class.get(c, []), cens_class.get(c, 0)) for c in CLASSES},
                "by_size": {b: dist(waits_size[b], cens_size.get(b, 0)) for b in SIZE_BUCKETS},
                "by_class_and_size": {c: {b: dist(waits_cs.get((c, b), [])) for b in SIZE_BUCKETS} for c in CLASSES},
                "large_gangs": dist(large_waits, large_cens),
            },
            "teams": teams,
            "starved_teams": sorted(n for n, v in teams.items() if v["starved"]),
            # beside the yardstick above: the starved teams whose job free + reclaimable GPUs
            # could hold by count (the rest waited on capacity the victim rules keep from them)
            "starved_teams_while_capacity_suffices": sorted(
                n for n, v in teams.items() if v["starved_while_capacity_suffices"]
            ),
            # narrower still: only while the job's shape fits nodes free or holding work it may
            # take back (sim.placeable); the rest waited on topology or the victim rules
            "starved_teams_while_nodes_suffice": sorted(
                n for n, v in teams.items() if v["starved_while_nodes_suffice"]
            ),
            # and the starved teams one of whose jobs itself waited past the line (not a stream of
            # jobs each waiting less, one after another, that keeps the team's span open)
            "starved_teams_by_one_job": sorted(n for n, v in teams.items() if v["starved_by_one_job"]),
            # once a minute while a team starves: class/pending reason of its work that fits its guarantee
            "starving_work_reasons": dict(sorted(self.starving_reasons.items(), key=lambda kv: (-kv[1], kv[0]))),
            "lost_gpu_hours": {
                "preemption": r(self.lost_pre_h, 3),
                "failures": r(self.lost_fail_h, 3),
                "spread_placement": r(self.lost_spread_h, 3),
                "preemption_pct_of_allocated": r(100.0 * self.lost_pre_h / alloc_h, 3) if alloc_h else None,
                # the same preemption GPU-hours split three ways: by what stopped the job, by its
                # size, and by how long it had run when stopped (young borrowed work reclaimed
                # is a borrowed start that did not pay)
                "preemption_by": {
                    "cause": {c: r(self.lost_pre_by[0].get(c, 0.0), 3) for c in CAUSES},
                    "victim_size": {b: r(self.lost_pre_by[1].get(b, 0.0), 3) for b in SIZE_BUCKETS},
                    "victim_age_at_sigterm": {a: r(self.lost_pre_by[2].get(a, 0.0), 3) for a in AGE_BUCKETS},
                },
            },
            # the second cost model, beside the default one above (sim.costs): a job that saves on
            # SIGTERM loses its grace and its restart, one that cannot its work since its checkpoint
            "lost_gpu_hours_sigterm_model": {
                "preemption": r(self.lost_pre_sig_h, 3),
                "failures": r(self.lost_fail_h, 3),
                "spread_placement": r(self.lost_spread_h, 3),
                "preemption_pct_of_allocated": r(100.0 * self.lost_pre_sig_h / alloc_h, 3) if alloc_h else None,
                "preemption_saved_on_sigterm": r(self.lost_pre_sig_saved_h, 3),
                "of_which_restart": r(self.lost_pre_sig_restart_h, 3),
                "preemption_not_saved": r(self.lost_pre_sig_not_saved_h, 3),
                "preemptions_saved_on_sigterm": self.pre_saved,
                "preemptions_not_saved": self.pre_not_saved,
            },
            "reclaim": {
                "count": len(self.reclaims),
                "p50_s": r(pct(rec_s, 0.5), 2),
                "p99_s": r(pct(rec_s, 0.99), 2),
                "max_s": r(rec_s[-1], 2) if rec_s else None,
                "over_grace_plus_2_cycles": over_bound,
                "unresolved_at_end": unresolved,
            },
            "large_gangs": {
                "placements": len(self.large),
                "in_min_blocks": large_min,
                "in_min_blocks_or_within_max_blocks": large_ok,
                "violations": [x for x in self.large if not x["ok"]][:20],
                "mean_blocks": r(sum(x["blocks"] for x in self.large) / len(self.large), 3) if self.large else None,
                "mean_min_blocks": r(sum(x["min_blocks"] for x in self.large) / len(self.large), 3)
                if self.large
                else None,
            },
            "head_of_line_reservations": {
                "made": self.res_made,
                "owner_started": self.res_started,
                "held_until_start_s": dist(self.res_held_s),
                # dropped while the owner still waits: the drain so far is lost to it
                "dropped_while_owner_waits": self.res_dropped,
                "dropped_after_holding_h_total": r(self.res_dropped_held_s / 3600.0, 2),
            },
            "preemptions": {
                "total": sum(self.preempt_by_reason.values()),
                "by_reason": dict(sorted(self.preempt_by_reason.items())),
                "of_borrowed": self.preempt_borrowed,
                "per_job_mean": r(sum(pj) / len(pj), 4) if pj else None,
                "per_job_p99": pct(pj, 0.99),
                "per_job_max": pj[-1] if pj else None,
                "jobs_preempted": sum(1 for x in pj if x),
            },
            "jobs": {
                "submitted": submitted,
                "started": started,
                # at the window's end, jobs submitted in it (warm-up jobs excluded)
                "balance": self._balance(submitted),
                "still_queued_at_window_end": self.queued_at_window_end,
                "never_started": never_started,
                "running_at_window_end": self.running_at_window_end,
                "drain_h": r((self.stopped_at - end) / 3600.0, 3),
                "outcomes": dict(sorted(self.outcomes.items())),
                "outcomes_of_warmup_jobs": dict(sorted(self.outcomes_warmup.items())),
                "restarts": self.restarts,
                "backfill_placements": self.backfills,
                "serving_replicas_replaced": self.replacements,
            },
            "failures": {
                "faults": self.faults_in_window,
                "faults_on_unready_nodes_dropped": self.faults_dropped,
                "gangs_failed": self.gangs_failed,
                "serving_jobs_degraded": self.serving_degraded,
            },
            "cycles": cycles,
            "series": {
                "sample_s": self.sample_s,
                "t_h": series_t,
                "alloc_pct": series_alloc,
                "demand_pct": series_demand,
            },
        }
