"""The discrete-event core: one policy over one workload, driving the ``placement`` engine.

The loop keeps what the live leader keeps (``ClusterState``, ``JobQueue``) and plays
the shell's part around ``placement.plan`` / ``placement.apply``:

* **arrival**: the job is queued;
* **cycle**: ``plan`` then ``apply`` (everything commits); placements start at once
  (``SimOptions.start_latency_s`` later if set), preemptions send SIGTERM: the victim
  stops at the end of its grace period (or finishes first, if it would), loses the work
  since its last checkpoint and is re-queued (attempt + 1, same submit time); the loss is
  also priced by the SIGTERM cost model (``sim.costs``, reported beside; the schedule is
  the same);
* **completion**: the attempt's work is done (SUCCEEDED) or its max_runtime is reached
  (TIMED_OUT, per attempt as ``RunningJob.end_time`` assumes);
* **spread placement** (``SimOptions.spread_slowdown``, off by default): a gang placed in
  more blocks than its ``max_blocks`` (and than the fewest that hold it) runs that much
  slower: its collectives cross the oversubscribed links between blocks. The extra GPU
  time is reported as lost (``Metrics.lost_spread``);
* **checkpoint**: ``state.set_checkpoint`` (victim choice prefers least lost work);
* **failure**: ``placement.fail_node``: every gang on the node is released and
  re-queued at the front of its class from its last checkpoint; prod-serving loses
  only the replicas there (the next plan replaces them); the node is repaired, passes
  burn-in and returns ``ready``;
* **wake**: a head-of-line reservation's expected start, a preemption hold expiring,
  or an idle tick (``SimOptions.idle_tick_s``) while jobs wait;
* **drain** (``SimOptions.drain_s``): after the window the loop goes on without arrivals
  or new faults until every job submitted in the window has started (or ``drain_s`` has
  passed). Only those first starts are measured there (the wait of a job queued at the
  window's end is then its wait, not its wait so far); everything else is measured over
  the window.

Cycles run only after something changed (arrival, completion, stop, failure, repair,
wake) and at most once per ``SimOptions.cycle_interval_s`` (1 s) of simulated time;
all events at one instant are applied before the cycle of that instant.

No randomness here: the workload and the fault schedule are drawn beforehand, so a
run is a pure function of its inputs (wall-clock timings are kept apart, under
``timing``).
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

from placement import (
    ClusterState,
    JobQueue,
    JobSpec,
    NodeHealth,
    Pack,
    Plan,
    Policy,
    PriorityClass,
    ReservationKind,
    Topology,
    apply,
    check_plan,
    check_state,
    fail_node,
    plan,
    requeue_spec,
)
from placement.forecast import DemandForecast
from sim.costs import restart_s, saves_on_sigterm
from sim.failures import Fault
from sim.metrics import Metrics
from sim.records import JobRecord
from sim.workload import SimJob, Workload

# event kinds, in the order they are handled at one instant (the cycle comes last)
END, STOP, FAULT, HEALTH, CKPT, ARRIVAL, WAKE, CYCLE = range(8)

_INF = math.inf


@dataclass(frozen=True, slots=True)
class SimOptions:
    cycle_interval_s: float = 1.0  # at most one cycle per this much simulated time
    idle_tick_s: float = 60.0  # while jobs wait, run a cycle at least this often (0: never)
    start_latency_s: float = 0.0  # placement committed -> ranks running (work starts)
    # extra wall time per unit of work for a gang spread beyond its max_blocks: 0.1 = 10% slower
    spread_slowdown: float = 0.0
    # after the window: keep running (no arrivals, no new faults) up to this long, until every
    # job submitted in the window has started, so its wait is measured rather than cut off
    drain_s: float = 48 * 3600.0
    sample_s: float = 300.0  # bucket width of the allocation time series
    check_every: int = 0  # run check_plan / check_state every N cycles (0: never)
    keep_log: bool = False  # record a readable event log (tests)


class InvariantViolation(AssertionError):
    pass


def job_spec(job: SimJob) -> JobSpec:
    topo = Topology(Pack(job.pack), job.max_blocks, job.max_blocks_wait_s)
    return JobSpec(
        job_id=job.job_id,
        team=job.team,
        priority=PriorityClass(job.priority),  # what JobSpec.__post_init__ would convert it to
        gpu_type=job.gpu_type,
        replicas=job.replicas,
        gpus_per_replica=job.gpus_per_replica,
        topology=topo,
        max_runtime_s=job.max_runtime_s,
        preemptible=job.checkpoint_s is not None,
        grace_s=job.grace_s,
        submit_time=job.submit,
    )


def charge_of(job: SimJob, node_gpus: int) -> int:
    total = job.gpus
    if total < node_gpus:
        return total
    per = max(1, node_gpus // job.gpus_per_replica)
    return -(-job.replicas // per) * node_gpus


def build_state(workload: Workload) -> tuple[ClusterState, list[str]]:
    state = ClusterState()
    node_ids = []
    for nid, bid, gtype, gpus in workload.cluster.node_ids():
        state.add_node(nid, bid, gtype, gpus)
        node_ids.append(nid)
    for team in workload.teams:
        for gtype, g, b in team.quotas:
            state.set_quota(team.name, gtype, guaranteed=g, borrow_limit=b)
    return state, node_ids


class Simulation:
    def __init__(
        self,
        workload: Workload,
        policy: Policy,
        name: str = "policy",
        faults: tuple[Fault, ...] = (),
        options: SimOptions | None = None,
        seed: int = 0,
    ) -> None:
        self.workload = workload
        self.seed = seed  # picks the jobs that save on SIGTERM in the second cost model (sim.costs)
        self.policy = policy
        self.name = name
        self.faults = faults
        self.opt = options or SimOptions()
        self.state, self.node_ids = build_state(workload)
        self.queue = JobQueue()
        self.recs: dict[str, JobRecord] = {}
        self.heap: list[tuple] = []
        self.seq = 0
        self.now = -workload.warmup
        self.last_cycle = -_INF
        self.cycle_pending = False
        self.dirty = False
        self.next_tick = _INF
        self.wakes: set[float] = set()
        self.hol: set[str] = set()
        self.cycles = 0
        self.unstarted = 0  # window jobs not started yet (in the drain)
        self.log: list[str] = []
        self.plans: list[Plan] = []
        self.observer: Callable[[Simulation, Plan], None] | None = None  # called after each cycle
        self.metrics = Metrics(workload, self.state, self.opt.sample_s)
        self.metrics.cycle_interval = self.opt.cycle_interval_s
        self.metrics.recs = self.recs
        self.metrics.respect_topology = policy.topology
        self.cycle_s: list[float] = []
        self.wall_s = 0.0
        self._node_gpus = {t: workload.cluster.node_gpus(t) for t in workload.cluster.gpu_types()}
        # each team's recent demand, only for a policy that reads it (Policy.reads_demand_forecast)
        self.demand = DemandForecast() if policy.reads_demand_forecast else None
        self.queued_by_team: dict[tuple[str, str], int] = {}
        self.team_types = sorted({(t.name, g) for t in workload.teams for g, _, _ in t.quotas})

    # ------------------------------------------------------------------ events

    def _push(self, t: float, kind: int, a: object = None, b: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, a, b))

    def _note(self, msg: str) -> None:
        if self.opt.keep_log:
            self.log.append(f"{self.now:10.1f} {msg}")

    def _mark(self) -> None:
        """Something changed: make sure a cycle runs (now, or once the interval allows)."""
        self.dirty = True
        if not self.cycle_pending:
            t = max(self.now, self.last_cycle + self.opt.cycle_interval_s)
            self._push(t, CYCLE)
            self.cycle_pending = True

    def run(self, progress: Callable[[float], None] | None = None, progress_every_s: float = 3600.0) -> dict:
        wl = self.workload
        end = wl.end
        for job in wl.jobs:
            if job.submit >= end:
                continue
            rec = JobRecord(job, job_spec(job), charge_of(job, self._node_gpus[job.gpu_type]))
            rec.saves_on_sigterm = saves_on_sigterm(job.job_id, self.seed, job.checkpoint_s is not None)
            self.recs[job.job_id] = rec
            self._push(job.submit, ARRIVAL, rec)
        for f in self.faults:
            if -wl.warmup <= f.time < end:
                self._push(f.time, FAULT, f)
        gc.collect()
        gc.freeze()
        t0 = time.perf_counter()
        m = self.metrics
        try:
            self._loop(end, progress, progress_every_s)
            m.advance(end)
            self.now = end
            for rec in self.recs.values():
                if rec.phase in ("running", "stopping"):
                    self._spread_loss(rec, end)  # still running: its slow part so far
            m.close_window(self.recs.values())
            self.unstarted = m.queued_at_window_end
            if self.opt.drain_s > 0 and self.unstarted:
                self._loop(end + self.opt.drain_s, None, progress_every_s)
            # a job never started has waited until the run stopped
            m.stopped_at = end + self.opt.drain_s if self.unstarted else self.now
        finally:
            gc.unfreeze()
        self.wall_s = time.perf_counter() - t0
        if progress is not None:
            progress(1.0)
        return self.result()

    def _loop(self, until: float, progress: Callable[[float], None] | None, progress_every_s: float) -> None:
        """Handle events before ``until``; in the drain, stop once every window job has started."""
        wl = self.workload
        span = wl.end + wl.warmup
        next_progress = -wl.warmup + progress_every_s
        heap = self.heap
        pop = heapq.heappop
        m = self.metrics
        draining = m.closed
        while heap:
            t = heap[0][0]
            if t >= until or (draining and not self.unstarted):
                break
            t, kind, _, a, b = pop(heap)
            if t > self.now:
                m.advance(t)
                self.now = t
                if progress is not None and t >= next_progress:
                    progress((t + wl.warmup) / span)
                    next_progress = t + progress_every_s
            if kind == CYCLE:
                self.cycle_pending = False
                if self.dirty:
                    self._cycle()
            elif kind == ARRIVAL:
                self._arrive(a)
            elif kind == END:
                self._end(a, b)
            elif kind == STOP:
                self._stop(a, b)
            elif kind == CKPT:
                self._checkpoint(a, b)
            elif kind == FAULT:
                self._fault(a)
            elif kind == HEALTH:
                self._health(a, b)
            elif kind == WAKE:
                self.wakes.discard(t)
                if t == self.next_tick:
                    self.next_tick = _INF
                self._mark()

    # ------------------------------------------------------------------ handlers

    def _queued_charge(self, rec: JobRecord, sign: int) -> None:
        if self.demand is not None:
            key = (rec.job.team, rec.job.gpu_type)
            self.queued_by_team[key] = self.queued_by_team.get(key, 0) + sign * rec.charge

    def _forecast(self, now: float) -> None:
        """Each team's demand (running + queued GPUs) into the window, its recent peaks to the
        engine (``Policy.reads_demand_forecast``), as the leader does."""
        assert self.demand is not None
        st = self.state
        self.demand.observe(now, st, {k: st.used(*k) + self.queued_by_team.get(k, 0) for k in self.team_types})
        self.demand.apply(st, now)

    def _arrive(self, rec: JobRecord) -> None:
        rec.phase = "queued"
        self.queue.push(rec.spec)
        self.metrics.queued(rec, +1)
        self._queued_charge(rec, +1)
        self._note(f"arrive {rec.job.job_id} {rec.job.priority} {rec.job.gpus}g team={rec.job.team}")
        self._mark()

    def _differs_from_fresh(self, p: Plan, now: float) -> str:
        """Where ``p`` differs from this cycle's plan with no decision repeated for an equal job
        (``plan(dedupe=False)``), or "" where it does not: repeating a decision is only a
        speed-up, so any difference is an engine fault (one was found this way on seed 3)."""
        fresh = plan(self.state, self.queue, self.policy, now, dedupe=False)
        if fresh == p:
            return ""
        for a, b in zip(fresh.pending, p.pending, strict=False):
            if a != b:
                return f"afresh {a}, repeated {b}"
        for name in ("placements", "preemptions", "reservations", "relabels", "pending"):
            if getattr(fresh, name) != getattr(p, name):
                return f"{name}: afresh {len(getattr(fresh, name))}, repeated {len(getattr(p, name))}"
        return "other fields"

    def _cycle(self) -> None:
        now = self.now
        self.dirty = False
        self.last_cycle = now
        self.cycles += 1
        check = self.opt.check_every and self.cycles % self.opt.check_every == 0
        t0 = time.perf_counter()
        if self.demand is not None:
            self._forecast(now)
        p = plan(self.state, self.queue, self.policy, now)
        t1 = time.perf_counter()
        if check:
            errs = check_plan(self.state, p, self.queue, self.policy, respect_topology=self.policy.topology)
            if errs:
                raise InvariantViolation(f"{self.name} t={now}: plan: {errs[:5]}")
            differs = self._differs_from_fresh(p, now)
            if differs:
                raise InvariantViolation(f"{self.name} t={now}: plan differs from deciding every job afresh: {differs}")
        started = [pl for pl in p.placements if not pl.replacement]
        apply(self.state, p, self.queue, now)
        self.cycle_s.append(t1 - t0 + time.perf_counter() - t1)
        if check:
            errs = check_state(
                self.state,
                respect_topology=self.policy.topology,
                soft_limits_lapse=self.policy.spread_before_preempt,
            )
            if errs:
                raise InvariantViolation(f"{self.name} t={now}: state: {errs[:5]}")
        if self.opt.keep_log:
            self.plans.append(p)
        if self.observer is not None:
            self.observer(self, p)
        m = self.metrics
        for pl in started:
            self._start(self.recs[pl.job_id], pl)
        for pl in p.placements:
            if pl.replacement:
                m.replacements += 1
                self._note(f"replace {pl.job_id} on {[n.node_id for n in pl.nodes]}")
        for pr in p.preemptions:
            self._preempt(pr)
        # head-of-line reservations: made, kept until the owner starts, or dropped while it waits
        hol = {r.job_id for r in p.reservations if r.kind is ReservationKind.HEAD_OF_LINE}
        # an owner stopping the evictable backfill on its nodes holds them as a preemption reservation
        hol |= {r.job_id for r in p.reservations if r.kind is ReservationKind.PREEMPTION and r.job_id in self.hol}
        for jid in hol - self.hol:
            m.reservation_made(jid, now)
        for jid in self.hol - hol:
            rec = self.recs[jid]
            m.reservation_gone(jid, now, owner_started=rec.phase != "queued")
        self.hol = hol
        # wake-ups: a reservation's expected start, a preemption hold running out
        for res in p.reservations:
            if res.kind is ReservationKind.HEAD_OF_LINE:
                w = res.expected_start
            else:
                w = res.expected_start + self.policy.preemption_hold_s + 1.0
            if now < w < _INF and w not in self.wakes:
                self.wakes.add(w)
                self._push(w, WAKE)
        if len(self.queue) and self.opt.idle_tick_s > 0:
            w = now + self.opt.idle_tick_s
            if self.next_tick == _INF or self.next_tick <= now:
                self.next_tick = w
                self._push(w, WAKE)
        m.after_cycle(now, self.queue, p)

    def _start(self, rec: JobRecord, pl) -> None:
        now = self.now
        job = rec.job
        m = self.metrics
        m.queued(rec, -1)
        self._queued_charge(rec, -1)
        if rec.first_start is None:
            rec.first_start = now
            m.first_start(rec, now)
            if m.closed and rec.job.submit >= 0:
                self.unstarted -= 1
        else:
            m.restart(rec, now)
        m.placed(rec, pl, now)
        rec.phase = "running"
        rec.token += 1
        rec.attempt_start = now
        rec.work_start = now + self.opt.start_latency_s
        rec.last_ckpt = None
        rec.sigterm_at = None
        if job.checkpoint_s is None:
            rec.saved = 0.0
        rec.pace = self._pace(job, pl)
        remaining = max(0.0, job.work_s - rec.saved) * rec.pace
        # max_runtime counts from RUNNING (every rank started), as the job workflow's timer does
        if remaining <= job.max_runtime_s:
            self._push(rec.work_start + remaining, END, rec, (rec.token, "succeeded"))
        else:
            self._push(rec.work_start + job.max_runtime_s, END, rec, (rec.token, "timed_out"))
        if job.checkpoint_s is not None and job.checkpoint_s < remaining:
            self._push(rec.work_start + job.checkpoint_s, CKPT, rec, rec.token)
        if rec.reclaim_at is not None:
            m.reclaimed(rec, now - rec.reclaim_at, rec.reclaim_grace)
            rec.reclaim_at = None
        rec.reclaim_grace = 0.0
        self._note(
            f"start {job.job_id} attempt={rec.spec.attempt} on {len(pl.nodes)} nodes blocks={list(pl.blocks)}"
            f" borrowed={pl.borrowed}{' backfill' if pl.backfill else ''}"
        )

    def _pace(self, job: SimJob, pl) -> float:
        """Wall seconds per second of work: > 1 for a gang spread beyond what it asked for.

        A gang's ``max_blocks`` says how far it may spread at full speed; the engine may
        place it wider (a policy without topology, or past ``max_blocks_wait_s``), and then
        its traffic crosses the links between blocks.
        """
        slow = self.opt.spread_slowdown
        if not slow or job.max_blocks is None:
            return 1.0
        allowed = max(job.max_blocks, self.workload.cluster.min_blocks(job.gpu_type, len(pl.nodes)))
        return 1.0 + slow if len(pl.blocks) > allowed else 1.0

    def _progress_saved(self, rec: JobRecord) -> float:
        """Work saved by the running attempt's newest checkpoint."""
        if rec.job.checkpoint_s is None or rec.last_ckpt is None:
            return rec.saved
        return rec.saved + max(0.0, rec.last_ckpt - rec.work_start) / rec.pace

    def _spread_loss(self, rec: JobRecord, kept_until: float) -> None:
        """Charge the slow part of the attempt's kept work, [work_start, kept_until].

        Work thrown away after ``kept_until`` is already lost to preemption or failure.
        """
        if rec.pace > 1.0:
            span = max(0.0, kept_until - max(rec.work_start, 0.0))
            self.metrics.lost_spread(rec.charge * span * (1.0 - 1.0 / rec.pace) / 3600.0)

    def _preempt(self, pr) -> None:
        now = self.now
        rec = self.recs[pr.victim]
        ben = self.recs[pr.beneficiary]
        rec.phase = "stopping"
        rec.sigterm_at = now
        self._push(now + pr.grace_s, STOP, rec, rec.token)
        self.metrics.preempted(rec, pr, now)
        if pr.victim_borrowed and ben.reclaim_at is None:
            ben.reclaim_at = now
        # the bound's grace is that of every victim stopping for it (borrowed or not): it starts
        # when the last is gone, as the engine's preemption reservation expects (now + max grace)
        ben.reclaim_grace = max(ben.reclaim_grace, pr.grace_s)
        self._note(f"preempt {pr.victim} for {pr.beneficiary} reason={pr.reason.value} borrowed={pr.victim_borrowed}")

    def _release_and_requeue(self, rec: JobRecord, *, preempted: bool, front: bool, lost_from: float) -> float:
        now = self.now
        saved = self._progress_saved(rec)
        ckpt_at = rec.last_ckpt
        if rec.job.checkpoint_s is not None and ckpt_at is not None:
            self._spread_loss(rec, ckpt_at)
        lost_h = rec.charge * max(0.0, now - lost_from) / 3600.0
        rec.saved = saved if rec.job.checkpoint_s is not None else 0.0
        rec.token += 1
        spec = requeue_spec(
            rec.spec,
            rec.sigterm_at if preempted and rec.sigterm_at is not None else now,
            preempted=preempted,
            front=front,
            checkpoint_at=ckpt_at,
        )
        rec.spec = spec
        rec.phase = "queued"
        rec.sigterm_at = None
        self.queue.push(spec)
        self.metrics.queued(rec, +1)
        self._queued_charge(rec, +1)
        return lost_h

    def _end(self, rec: JobRecord, b) -> None:
        token, outcome = b
        if token != rec.token or rec.phase not in ("running", "stopping"):
            return
        self.state.release(rec.job.job_id, self.now)
        self._spread_loss(rec, self.now)
        rec.phase = "done"
        rec.token += 1
        rec.end_kind = outcome
        self.metrics.ended(rec, outcome, self.now)
        self._note(f"end {rec.job.job_id} {outcome}")
        self._mark()

    def _stop(self, rec: JobRecord, token: int) -> None:
        if token != rec.token or rec.phase != "stopping":
            return
        self.state.release(rec.job.job_id, self.now)
        lost_from = rec.saved_at() if rec.job.checkpoint_s is not None else rec.attempt_start
        sigterm_at = rec.sigterm_at
        lost_h = self._release_and_requeue(rec, preempted=True, front=False, lost_from=lost_from)
        rec.preemptions += 1
        # the SIGTERM model: a job that saves on SIGTERM loses its grace and its restart instead
        saved = rec.saves_on_sigterm and sigterm_at is not None
        alt_h = self._sigterm_saver_loss(rec, cast(float, sigterm_at)) if saved else lost_h
        self.metrics.lost_preemption(rec, lost_h, alt_h, saved)
        self._note(f"stopped {rec.job.job_id} lost={lost_h:.2f} GPU-h (sigterm model {alt_h:.2f})")
        self._mark()

    def _sigterm_saver_loss(self, rec: JobRecord, sigterm_at: float) -> float:
        """GPU-hours a preemption costs a job that saves on SIGTERM: its grace, then its restart."""
        return rec.charge * (max(0.0, self.now - sigterm_at) + restart_s(rec.job.gpus)) / 3600.0

    def _checkpoint(self, rec: JobRecord, token: int) -> None:
        if token != rec.token or rec.phase != "running":
            return
        now = self.now
        rec.last_ckpt = now
        self.state.set_checkpoint(rec.job.job_id, now)
        # CKPT events are only pushed for jobs that checkpoint (checkpoint_s not None)
        nxt = now + cast(float, rec.job.checkpoint_s)
        remaining = (rec.job.work_s - rec.saved) * rec.pace - (now - rec.work_start)
        if nxt - now < remaining:
            self._push(nxt, CKPT, rec, rec.token)

    def _fault(self, f: Fault) -> None:
        nid = self.node_ids[f.node_index]
        st = self.state
        if st.node_health(nid) is not NodeHealth.READY:
            self.metrics.faults_dropped += 1
            return
        health = NodeHealth.CORDONED if f.kind == "gpu" else NodeHealth.DOWN
        res = fail_node(st, nid, self.now, health)
        m = self.metrics
        m.fault(nid, f, res)
        for jid in res.released:
            rec = self.recs[jid]
            if rec.phase == "stopping":
                # it was already stopping for a preemption: that preemption ends here
                lost_from = rec.saved_at() if rec.job.checkpoint_s is not None else rec.attempt_start
                lost_h = self._release_and_requeue(rec, preempted=True, front=True, lost_from=lost_from)
                rec.preemptions += 1
                # the fault comes before the save at the grace's end: both models lose the same
                m.lost_preemption(rec, lost_h, lost_h, False)
            else:
                lost_from = rec.saved_at() if rec.job.checkpoint_s is not None else rec.attempt_start
                lost_h = self._release_and_requeue(rec, preempted=False, front=True, lost_from=lost_from)
                rec.failures += 1
                m.lost_failure(rec, lost_h)
        self._note(f"fault {f.kind} {nid}: released {list(res.released)} degraded {list(res.degraded)}")
        self._push(self.now + f.repair_s, HEALTH, nid, (NodeHealth.BURN_IN, f.burn_in_s))
        self._mark()

    def _health(self, nid: str, b) -> None:
        health, burn_in = b
        self.state.set_node_health(nid, health)
        self.metrics.health_changed()
        if health is NodeHealth.BURN_IN:
            self._push(self.now + burn_in, HEALTH, nid, (NodeHealth.READY, 0.0))
        else:
            self._mark()
        self._note(f"node {nid} {health.value}")

    # ------------------------------------------------------------------ result

    def result(self) -> dict:
        out = self.metrics.summary(self.recs, self.policy, self.cycles)
        out["timing"] = {
            "wall_s": round(self.wall_s, 2),
            "cycle_ms": _timing(self.cycle_s),
            "speedup_vs_real_time": round((self.workload.end + self.workload.warmup) / self.wall_s, 1)
            if self.wall_s > 0
            else None,
        }
        return out


def _timing(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p99": None, "max": None, "mean": None}
    s = sorted(xs)
    n = len(s)

    def q(p: float) -> float:
        return round(1000.0 * s[min(n - 1, max(0, math.ceil(p * n) - 1))], 3)

    return {"p50": q(0.5), "p99": q(0.99), "max": round(1000.0 * s[-1], 3), "mean": round(1000.0 * sum(s) / n, 3)}
