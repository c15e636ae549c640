"""Values of the placement engine: enums, job specs, quotas, the policy and the plan.

Everything here is an immutable value (frozen dataclasses, str enums) so drivers can
hash, compare, log and ship it. Ids are plain strings, time is float seconds (any
epoch, as long as the driver is consistent), GPU counts are ints.

Stable names other packages rely on (do not rename without changing them too):

* ``PriorityClass``: ``prod-serving`` > ``prod-batch`` > ``research`` > ``preemptible``.
* ``Pack``: ``block`` | ``node`` | ``any``.
* ``PendingReason``: ``quota``, ``capacity``, ``topology``, ``reservation``,
  ``hot_spare``, ``reserved``, ``lookahead``, ``node_health``, ``gpu_type``,
  ``preempting``, ``invalid``.
* ``PreemptReason``: ``priority`` (a higher class needs the GPUs), ``reclaim``
  (borrowed capacity taken back, by a team within its guarantee or by prod-serving).
* ``NodeHealth``: ``ready``, ``suspect``, ``down``, ``cordoned``, ``draining``,
  ``burn_in`` (only ``ready`` nodes take new placements).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, NamedTuple


class PriorityClass(StrEnum):
    PROD_SERVING = "prod-serving"
    PROD_BATCH = "prod-batch"
    RESEARCH = "research"
    PREEMPTIBLE = "preemptible"

    @property
    def rank(self) -> int:
        """0 is the highest class; a larger rank is a lower class."""
        return _CLASS_RANK[self]

    def __str__(self) -> str:
        return self.value


_CLASS_RANK = {
    PriorityClass.PROD_SERVING: 0,
    PriorityClass.PROD_BATCH: 1,
    PriorityClass.RESEARCH: 2,
    PriorityClass.PREEMPTIBLE: 3,
}
CLASSES_BY_RANK: tuple[PriorityClass, ...] = tuple(sorted(_CLASS_RANK, key=_CLASS_RANK.__getitem__))
SERVING_RANK = 0


class Pack(StrEnum):
    BLOCK = "block"  # as few network blocks as possible, at most max_blocks
    NODE = "node"  # every replica on one node
    ANY = "any"  # no constraint

    def __str__(self) -> str:
        return self.value


class NodeHealth(StrEnum):
    READY = "ready"
    SUSPECT = "suspect"
    DOWN = "down"
    CORDONED = "cordoned"
    DRAINING = "draining"
    BURN_IN = "burn_in"

    def __str__(self) -> str:
        return self.value


class PendingReason(StrEnum):
    QUOTA = "quota"  # over guarantee + borrow limit (or borrowing not allowed here)
    CAPACITY = "capacity"  # not enough free GPUs of its type
    TOPOLOGY = "topology"  # enough GPUs, but not in a shape it accepts (max_blocks, whole nodes, one node)
    RESERVATION = "reservation"  # the free GPUs are held by another job's reservation
    HOT_SPARE = "hot_spare"  # it would fit on the idle nodes held as hot spares for large gangs' restarts
    RESERVED = "reserved"  # it holds a reservation and waits for its expected start
    LOOKAHEAD = "lookahead"  # beyond the top-N considered this cycle
    NODE_HEALTH = "node_health"  # it would fit if unhealthy nodes were ready
    GPU_TYPE = "gpu_type"  # the cluster has no node of its GPU type
    PREEMPTING = "preempting"  # victims chosen for it are stopping (grace period)
    INVALID = "invalid"  # the shape can never be placed (gpus_per_replica > node size, pack=node > 1 node)

    def __str__(self) -> str:
        return self.value


class PreemptReason(StrEnum):
    PRIORITY = "priority"  # a job of a higher class needs the GPUs
    RECLAIM = "reclaim"  # borrowed capacity is taken back

    def __str__(self) -> str:
        return self.value


class ReservationKind(StrEnum):
    HEAD_OF_LINE = "head_of_line"  # a large gang that cannot fit holds the blocks it will use
    PREEMPTION = "preemption"  # nodes being cleared by preemption, held for the beneficiary

    def __str__(self) -> str:
        return self.value


class Ordering(StrEnum):
    FAIR_SHARE = "fair_share"  # docs/design.md: class, below-guarantee, fair-share position - aging, submit
    CLASS_FIFO = "class_fifo"  # class, then submit time
    FIFO = "fifo"  # submit time only, classes ignored

    def __str__(self) -> str:
        return self.value


class PlacementError(Exception):
    """Base class of the engine's typed errors."""


class UnknownNode(PlacementError, KeyError):
    pass


class UnknownJob(PlacementError, KeyError):
    pass


class AllocationConflict(PlacementError):
    """An allocation touched a GPU that is not free, a node that is not ready, or the wrong type."""


@dataclass(frozen=True, slots=True)
class Topology:
    """``max_blocks_wait_s``: how long (from submit) a ``pack=block`` job waits for
    ``max_blocks``; after that it takes the fewest blocks it can (Slurm's
    ``--switches=N@max-time``). None: ``max_blocks`` is a hard limit."""

    pack: Pack = Pack.ANY
    max_blocks: int | None = None
    max_blocks_wait_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pack, Pack):
            object.__setattr__(self, "pack", Pack(self.pack))
        if self.max_blocks is not None and self.max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        if self.max_blocks_wait_s is not None and not self.max_blocks_wait_s >= 0:
            raise ValueError("max_blocks_wait_s must be >= 0")

    def max_blocks_at(self, waited_s: float) -> int | None:
        """The block limit for a job that has waited ``waited_s`` since submit."""
        if self.max_blocks_wait_s is not None and waited_s >= self.max_blocks_wait_s:
            return None
        return self.max_blocks


_ANY = Topology()


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What the engine needs to know about a job (queued or running).

    ``preemptible`` is ``checkpoint.preemptible``: the job can checkpoint and resume.
    A job that cannot is still preemptible by the class rules; all its work since
    start counts as lost. ``preemption_times`` are the times it was preempted (the
    engine counts those within ``Policy.preemption_window_s``). ``front`` puts a
    re-queued job (failed attempt, node failure) ahead of its class. ``avoid_nodes`` are
    the nodes where its earlier attempts failed first (the failing rank's node): the
    engine places it elsewhere when free capacity allows, and there only when not.
    """

    job_id: str
    team: str
    priority: PriorityClass
    gpu_type: str
    replicas: int = 1
    gpus_per_replica: int = 1
    topology: Topology = _ANY
    max_runtime_s: float = 86_400.0
    preemptible: bool = True
    grace_s: float = 30.0
    submit_time: float = 0.0
    attempt: int = 0
    started_at: float | None = None
    last_checkpoint_at: float | None = None
    preemption_times: tuple[float, ...] = ()
    front: bool = False
    avoid_nodes: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if not isinstance(self.priority, PriorityClass):
            object.__setattr__(self, "priority", PriorityClass(self.priority))
        if not isinstance(self.topology, Topology):
            t: Any = self.topology
            if isinstance(t, dict):
                object.__setattr__(self, "topology", Topology(**t))
            else:
                raise TypeError("topology must be a Topology or a dict")
        if not isinstance(self.preemption_times, tuple):
            object.__setattr__(self, "preemption_times", tuple(self.preemption_times))
        if not isinstance(self.avoid_nodes, frozenset):
            object.__setattr__(self, "avoid_nodes", frozenset(self.avoid_nodes))

    @property
    def total_gpus(self) -> int:
        return self.replicas * self.gpus_per_replica

    def as_placed_at(self, now: float) -> JobSpec:
        """The job as the engine places it at ``now``: past its ``max_blocks_wait_s`` its
        topology has no block limit (itself otherwise)."""
        t = self.topology
        if t.max_blocks is None or t.max_blocks_wait_s is None or t.max_blocks_at(now - self.submit_time) is not None:
            return self
        return replace(self, topology=Topology(t.pack, None))

    @property
    def rank(self) -> int:
        return _CLASS_RANK[self.priority]

    def start_protected(self, borrowed: bool, first_runs: bool) -> bool:
        """Does the start protection (``Policy.preemption_protect_s``) cover this job, when
        running, against a preemptor? Borrowed work never (always reclaimable); for a
        preemptor that may take ``first_runs`` (``Policy.first_runs_unprotected_min_gpus``),
        only a job that was preempted before."""
        return not borrowed and (not first_runs or bool(self.preemption_times))

    def preemptions_since(self, since: float) -> int:
        return sum(1 for t in self.preemption_times if t > since)

    def waited(self, now: float, wait_s: float | None) -> bool:
        """Has it been queued ``wait_s`` since submit by ``now``? (None: a rule that is off.)"""
        return wait_s is not None and now - self.submit_time >= wait_s


@dataclass(frozen=True, slots=True)
class Quota:
    """Per team and GPU type: GPUs guaranteed, and GPUs it may borrow beyond that."""

    guaranteed: int = 0
    borrow_limit: int = 0


@dataclass(frozen=True, slots=True)
class Policy:
    """The knobs. Baselines for the simulator are presets (see ``PRESETS``).

    * ``ordering``: ``fair_share`` (docs/design.md), ``class_fifo`` or ``fifo``.
    * ``topology``: False ignores blocks (first-fit by node id, max_blocks ignored).
    * ``reservations``: a head-of-line large gang that cannot fit reserves blocks.
    * ``backfill``: others may use reserved blocks if their max_runtime ends before
      the expected start; False keeps reserved blocks closed to everyone else.
    * ``preemption``: victims may be chosen; ``borrowing``: teams may exceed their
      guarantee on idle capacity (up to the borrow limit).
    * ``first_runs_unprotected_min_gpus``: a preemptor of at least this many GPUs may stop a
      guaranteed job within its ``preemption_protect_s`` if that job was never preempted:
      the requirements protect a job from being "preempted *again* within 30 minutes of
      starting", so a first run is fair game, and a young one loses little work. A gang
      that must clear many nodes otherwise waits up to 30 minutes for the youngest job on
      them while its team starves (seed 3's rl, sim/README.md). A job started again after a
      preemption keeps its protection. None: every guaranteed job is protected.
    * ``preemption_hold_s``: nodes cleared by preemption stay held for the beneficiary
      this long after its victims' grace ended (then released if it still cannot use them).
    * ``lookahead`` counts jobs evaluated for placement; jobs stopped by quota alone do
      not count (a lane whose team has no room is skipped whole), but at most
      ``scan_factor x lookahead`` jobs are drawn from the queue per cycle.
    * ``max_preemptions_per_cycle`` / ``max_victim_searches_per_cycle`` bound a cycle's
      preemption work; the first reclaim per cycle of each team below its guarantee is
      exempt (a reclaim is planned in the first cycle that sees the need).
    * ``reservation_replan_s``: a head-of-line reservation whose expected start slipped
      by more than this is re-planned on other blocks if they are earlier.
    * ``serving_borrows_idle``: False (docs/design.md) means prod-serving beyond its
      guarantee gets capacity only by reclaiming borrowed allocations.
    * ``serving_idle_guard`` (off): with ``serving_borrows_idle`` False, prod-serving beyond
      its guarantee may also take idle GPUs when the free GPUs left after it still cover
      this share of the guaranteed demand expected back (the borrowed-gang guard's
      forecast): serving is never preempted, so it takes only idle capacity whose owners
      are not expected back.
    * ``guarantee_gangs_first``: a whole-node job of >= ``reserve_min_gpus`` placed
      beyond its team's guarantee, that would fit the guarantee but for the team's
      smaller guaranteed jobs, runs guaranteed and those jobs are marked borrowed
      (``Plan.relabels``) — so a borrowed gang is not the cheapest reclaim victim.
    * ``victim_excess_cost``: victim choice for whole nodes counts every node a victim
      set frees beyond the need like one more victim (a gang is not preempted to make
      room for a few nodes). False: fewest victims per node freed, as before.
    * ``evictable_backfill``: borrowed work (any team's) of the owner's class or lower,
      may run on a head-of-line reservation's nodes whatever its max_runtime, when it finds
      no other room; the owner stops it (a reclaim, its grace) once the rest of its nodes
      are free, so reserved nodes do not idle while a gang drains.
    * ``borrowed_gangs_reclaim_lower``: a whole-node job of >= ``reserve_min_gpus`` beyond
      its team's guarantee may reclaim borrowed work of lower classes (never guaranteed
      work), before it reserves and drains.
    * ``guaranteed_gangs_reserve_first``: when every head-of-line slot of a GPU type is
      taken, a gang that runs guaranteed takes the slot of a same-class gang that would
      run borrowed (the queue already puts a team below its guarantee first).
    * ``guaranteed_gangs_outrank_borrowed``: the head-of-line slot goes to guarantees whatever
      the classes: a gang that runs guaranteed takes it from a borrowing gang of any class (not
      only its own, as above), and a borrowing gang no longer takes a guaranteed gang's slot for
      its higher class (it would take it back every cycle). Without it a team's research gang
      within its guarantee waited 11 h (``topology``) behind another team's borrowing
      4,096-GPU prod-batch gang holding the only slot with an expected start 9.4 h away (seed
      4's starved team, sim/README.md). Guaranteed gangs keep the class order among themselves.
    * ``class_preemption_max_lost_s``: the guaranteed victims of a job (lower-class work run
      within a guarantee; borrowed work stays always preemptible) lose at most this
      many seconds of the job's GPUs in work since their last checkpoint (or start); a dearer
      set is not taken and the job waits (a gang reserves and drains). 1,800 s: a 256-GPU job
      throws away at most 128 GPU-hours, the requirements' 30-minute protection of a fresh
      start counted in the job's GPUs. Without it a 512-GPU research job that cannot
      checkpoint was stopped three times in a day, 2-3 h into each run, each time for a
      prod-batch job that had just arrived (seed 4: 7 such stops of guaranteed research
      jobs lost 17% of the day's preemption loss). prod-serving, and prod-batch jobs within
      one node, are never held back. None: the rules' choice stands whatever it loses.
    * ``class_preemption_hold_s``: ``class_preemption_max_lost_s`` holds a job back only this
      long since its submit; then the rules' choice stands. (Only a job within its team's
      guarantee takes guaranteed victims.) Held back for good, research gangs of teams below
      their guarantees drained reservations while others borrowed: seed 6 starved 3 teams
      where it starves 1 without the cap and none with this hold.
    * ``reclaim_max_lost_s`` (1,800 s in ``gpufleet``, with ``reclaim_hold_small_only``): the
      same bound for a reclaim. The borrowed victims of a job lose at most this many seconds
      of the job's GPUs in work since their last checkpoint (or start); a dearer set is not
      taken and the job waits, for ``reclaim_hold_s`` since its submit at most, after which
      the rules' choice stands (borrowed work stays always preemptible). Reclaims of
      borrowed work are most of the preemption loss (seeds 4 and 5: 76% and 68%).
      prod-serving, and prod-batch jobs within one node, are never held back. None: the
      rules' choice stands whatever it loses (the baselines).
    * ``reclaim_hold_s``: ``reclaim_max_lost_s`` holds a job back only this long (300 s);
      with ``reclaim_hold_per_team`` (off: over week 1 it starved 5 teams, 3 per job), only
      while its team's oldest queued job of the GPU type is younger than that (a team whose
      jobs keep arriving is not held one hold after another).
    * ``reclaim_hold_small_only`` (on in ``gpufleet``): ``reclaim_max_lost_s`` holds back only
      jobs within one node (research and preemptible: prod-batch ones never are), which
      wait for other jobs to end; a gang reclaims as without the bound. On every job the
      bound held seed 9 under the 90% floor on all three fault draws (held gangs reserve and
      drain). Within one node: over five weeks (week 1 on three fault draws, weeks 2 and
      3) less lost to preemption on each (3.44% of allocated on average, 3.75 without the
      bound) and 6 teams starved (9), net of lost work +0.25 points on average; over seeds
      1-5 on three draws neutral (+0.01 points, as many starved teams); sim/README.md.
      False: every job the bound covers.
    * ``reclaim_hold_gang_victims_ratio`` (off): with ``reclaim_hold_small_only``, the bound
      holds back a job beyond one node too when the borrowed victims it would stop hold at
      least this many times its GPUs (a 64-GPU job stopping a 1,024-GPU borrowed gang).
      Over week 1 such reclaims, of 1,024-GPU-or-larger gangs for 9-1,023-GPU jobs, lost
      31,556 of the 140,023 GPU-hours lost to preemption (the simulator's log). A held job
      of ``reserve_min_gpus`` or more reserves meanwhile; on seeds 2 and 4 the changes all
      came from those (held below them only, both days came out as without the field). At
      8: less lost to preemption and more net on the weeks, and on average over the seed
      days, but seed 2 fell under the 90% floor while over capacity (88.93%) and more teams
      starved; sim/README.md. None: only ``reclaim_hold_small_only`` decides.
    * ``guarantees_before_classes`` (on in ``gpufleet``, with the bounded small-job guard
      below): the queue puts every job of a team below its guarantee before any job of a
      team at or above it, whatever the classes (the requirements' "a team below its
      guarantee is always scheduled before a team above it", read across classes); the class
      order stands within each half. Over seeds 1-5 on three fault draws each it starved 5
      teams (11 before) and netted 0.24 points more on average; over week 1 on three draws
      5 (15), netting 0.26 less (sim/README.md). False: classes first (the baselines).
    * ``claim_borrowed_reservations_after_s``: a job that runs guaranteed and has waited
      this long since submit may use the nodes a borrowing gang of another team holds
      (head-of-line): borrowed capacity yields to guarantees, the gang's start slips.
      None: reservations hold against guaranteed work too.
    * ``reclaim_small_borrowed_after_s``: a job within its team's guarantee that has waited
      this long since submit may also reclaim other teams' borrowed jobs of *higher* classes
      (never prod-serving) smaller than ``reserve_min_gpus``. None: only borrowed work of its
      own class and lower classes (docs/design.md's victims).
    * ``reclaim_higher_borrowed_gangs``: a whole-node gang of ``reserve_min_gpus`` or more
      within its team's guarantee, past ``reclaim_small_borrowed_after_s`` since its submit
      and since its own last preemption, also reclaims other teams' borrowed gangs of higher
      classes (never prod-serving) no larger than itself. The requirements make borrowed
      capacity always preemptible and reclaimed within minutes; without it such a gang waits
      (reserving, draining) for those gangs to end while its team starves (seeds 3 and 4,
      sim/README.md). No larger: a gang is not stopped for a smaller one. Not just preempted:
      a gang stopped for a higher class and requeued would otherwise stop another team's gang
      at once, and that one the next (seen on seed 2). False (the default; tried and left
      off, docs/design.md: no team starved on seeds 1-5, but the 7-day run starved one more
      team and lost more to preemption): small jobs only.
    * ``reclaim_wait_per_team``: ``reclaim_small_borrowed_after_s`` is counted from the
      team's oldest queued job of the GPU type that fits what is left of its guarantee (by
      the team's whole use at the cycle's start, as the starvation yardstick judges it), not
      only from the job's own submit: a team whose small jobs keep arriving, each waiting its
      own 300 s, stays below its guarantee for as long as they keep coming. Jobs that would
      run borrowed do not count (a first form counted any queued job, so a team with a gang
      waiting for hours beyond its guarantee reclaimed at once with every small job). False:
      per job.
    * ``borrowed_apart``: a small job (within one node) goes first to the best-fitting partly
      used node whose running jobs all share its borrowed flag, then as before (best fit
      among partly used nodes, then a free node): borrowed work kept off nodes with
      guaranteed work leaves whole nodes a reclaim can clear. False (the default; tried and
      left off, docs/design.md): best fit whatever the neighbours.
    * ``spares_yield_after_s``: a job that runs guaranteed, has waited this long since
      submit and fits nowhere else but on the idle nodes held as hot spares takes the spare
      nodes it needs, one at a time from the largest pool (the plan's ``spares_taken``); the
      gangs keep the rest. None (the default; docs/design.md, tried and left off): spares
      are held against everyone.
    * ``idle_victims_first``: a borrowed job whose GPUs the agents read idle (below
      ``idle_gpu_util_pct`` for ``idle_gpu_after_s``) is the cheapest victim: it does no work
      to lose. The driver marks such jobs (``ClusterState.set_idle``) only under this field;
      the simulator has no GPU readings, so it never does.
    * ``unsaved_borrow_guard``: a job that cannot checkpoint (it loses all its work when
      reclaimed) starts borrowed only if, after it, its type's free GPUs still cover this
      share of the guaranteed demand expected back: per team, its recent peak demand
      (``ClusterState.set_demand_forecast``, the driver's data) within its guarantee, less
      what it uses now. Such a job waits (``capacity``) rather than start into capacity its
      owners are likely to reclaim; jobs that checkpoint borrow as before. None: off (in
      every preset: on seeds 1-3 it starved more teams, sim/README.md).
    * ``borrowed_gang_guard``: borrowed *gangs*, where most GPU-hours lost to reclaim are,
      run only on free capacity: a whole-node job of >= ``reserve_min_gpus`` that would run
      borrowed (not prod-serving, holding no reservation of its own, its team at or over its
      guarantee) starts only on free GPUs that cover it and still leave this share of the
      guaranteed demand expected back (as above; its own team expects none). Otherwise it
      waits (``capacity``): it neither reclaims lower classes' borrowed work
      (``borrowed_gangs_reclaim_lower``) nor reserves and drains nodes for itself, so no
      work is stopped, and no node held idle, for a gang its owners would reclaim. 0.5 in
      ``gpufleet`` (on seeds 1-3 it cut GPU-hours lost to preemption by 42-48% and raised
      allocation net of lost work on each, sim/README.md); None: off (the baselines).
    * ``gang_guard_reserved`` (off): ``borrowed_gang_guard`` holds back a borrowed gang that
      holds its own head-of-line reservation too, and drops that reservation. A gang reserved
      while its team was below its guarantee, or while little demand was expected back, ran
      borrowed once its nodes drained, past the guard, and was reclaimed within minutes. Off:
      fewer teams starved over the week, but seeds 6 and 9 lost net and the 90% floor
      (sim/README.md).
    * ``borrowed_guard_min_gpus`` (1 in ``gpufleet``): ``borrowed_gang_guard`` holds back any borrowed job
      of at least this many GPUs, whatever its shape, not only whole-node gangs of
      ``reserve_min_gpus``. At 1 the week starved fewer teams and lost less to preemption,
      but on the public trace (guarantees adding up to the whole small cluster) the guard
      kept GPUs idle beside queued work for hours (docs/design.md, sim/README.md). None:
      gangs only.
    * ``borrowed_guard_max_share`` (0.01 in ``gpufleet``): ``borrowed_guard_min_gpus`` holds back only jobs of
      at most this share of their type's GPUs. On a pool of thousands of GPUs the free GPUs
      the guard keeps are a sliver; on the public trace's 48 one 8-GPU pod is a sixth of it,
      and the guard kept a third of the cluster idle. None: any size.
    * ``borrowed_guard_prod_hold_s`` (60 s in ``gpufleet``): ``borrowed_guard_min_gpus`` holds back a
      prod-batch job (below the gang size) only until it has waited this long, for the
      2-minute p95 of small prod jobs. None: as long as the guard says.
    * ``align_node_ends`` (off): a small job goes to the partly used node it would not keep
      busy past its jobs' expected ends (start + max_runtime), best fit among those; else to
      the one it keeps busy the least longer. Nodes whose jobs end together come free
      whole, for gangs and 8-GPU jobs. It scans every partly used node that fits (best fit
      stops at the first). Seed 2 passed the 90% floor and seed 5's gangs waited less, but
      the week lost more to preemption (4.20%, 3.73) and netted less; sim/README.md.
      False: best fit, the first node in the fullest bucket.
    * ``evictable_backfill_min_s`` (off): ``evictable_backfill`` uses a reservation's nodes
      only while its owner's expected start (the nodes' free times, its evictable backfill
      counted as gone) is more than this far off. Seen on seed 3: a 1,024-GPU borrowed gang
      backfilled onto a gang's reserved nodes in the cycle the owner's last nodes came free
      (the queue put it first), and was stopped for the owner one second later; its restart
      then backed off. Over seeds 1-5 on three fault draws it won nothing past the margins
      and starved more teams (the expected start comes from max_runtime; owners are often
      ready long before it); sim/README.md. None: whenever the owner is not running.
    * ``evictable_backfill_saving_only`` (off): ``evictable_backfill`` only for jobs that can
      checkpoint; one that cannot loses every second it ran when the owner stops it.
      ``evictable_backfill_max_gpus`` (off): only for jobs of at most this many GPUs. Seen
      on seed 4: stopped evictable backfill lost a third of the day's work lost to
      preemption, nearly all of it jobs of 64 GPUs or more, over a quarter jobs that cannot
      checkpoint. Over seeds 1-5 on three fault draws neither won past the margins: the
      loss fell on about half the runs and rose on the rest, where the run took another
      course (seed 1, which had little evictable backfill, lost more to reclaims of other
      borrowed work); sim/README.md. False / None: any borrowed job of the owner's class or
      lower.
    * ``preempt_within_team_use`` (off): reclaim rights judged by the team's whole use. A
      job labelled guaranteed (not prod-serving) whose team's use, borrowed jobs included,
      plus the job passes the guarantee preempts as work beyond the guarantee does: a
      whole-node gang of ``reserve_min_gpus`` or more takes lower classes' borrowed work
      (``borrowed_gangs_reclaim_lower``), anything else waits. Flags are per job, so a team
      whose borrowed gang does not fit its guarantee keeps its guaranteed use low and its
      next small job reclaims other teams' work. Seed 3's starvation ended and seed 2 passed
      the 90% floor, but seed 5 starved a team and the week 6 (4); sim/README.md. False:
      the job's label decides.
    * ``guaranteed_reservations_hold`` (off): a higher class's work that would run borrowed
      may not take the nodes a head-of-line reservation holds for a gang that would run
      guaranteed, neither as its last resort when placed nor for a preemption (the
      requirements' "a team below its guarantee is always scheduled before a team above
      it"). Seen on seed 3: a team's guaranteed research gang drained 32 nodes, another
      team's borrowed prod-batch jobs took them, and the gang's drain began again
      elsewhere. Guaranteed higher-class work keeps the last resort. False: any higher
      class may (docs/design.md's reservations).
    * ``borrowed_restart_backoff_s``: a job preempted ``n`` times within
      ``preemption_window_s`` (not prod-serving, holding no reservation of its own) starts
      borrowed again only ``n`` x this long after its last preemption, unless the free GPUs
      left after it cover all the guaranteed demand expected back (as above, share 1):
      otherwise it waits (``capacity``, "borrowed restart backs off"). Within its team's
      guarantee it starts at once. 1,800 s in ``gpufleet``, with ``pooled_demand_forecast``
      (alone it held seed 2 under the 90% floor while over capacity; together, on seeds 1-7
      and the week, fewer teams starved and less work was lost, sim/README.md); None: off
      (the baselines).
    * ``pooled_demand_forecast``: the borrow guards and the restart backoff expect back at most the
      teams' combined recent peak demand within their guarantees, less what they use within
      them now (``ClusterState.returning_demand``), not the sum of each team's own recent
      peak: teams peak at different times. True in ``gpufleet``, with
      ``borrowed_restart_backoff_s`` (alone it lost more to preemption on seeds 4 and 5,
      sim/README.md); False: the sum (the baselines).
    * ``returning_demand_less_reserved`` (off): the guaranteed demand expected back counts
      GPUs reserved for a team's jobs as used by it: the reservation already holds room for
      that demand, and the guards would otherwise keep free room for it a second time.
      Tried, left off: less room kept let more borrowed work start into reclaims (week 1
      lost 4.27% to preemption and starved 5 teams; 3.57% and 1 by default; with
      ``reclaim_hold_gang_victims_ratio`` at 8, 3.51% and 3; sim/README.md). False: the
      reserved demand is expected back too.
    * ``drain_reclaims_borrowed`` (off): a whole-node gang that reserves while within its
      team's guarantee counts other teams' borrowed work of its class or lower already on
      candidate nodes as gone (it may reclaim that work), in choosing its blocks and nodes
      and their expected start, and reclaims it once the rest of its nodes are free, as it
      does evictable backfill (``Reservation.evicts_borrowed``). Week 1's starved nlp: its
      1,024-GPU research gang, no victim set able to clear 128 whole nodes in 5 blocks,
      drained for hours while 1,100-1,600 GPUs of other teams' research work ran borrowed.
      Tried, left off: seeds 1-5 moved -0.88 to +0.64 points net and seed 5 starved a team
      (sim/README.md). False: a drain waits for the jobs on its nodes to end.
    * ``spread_before_preempt``: a job that runs guaranteed and has a block limit it would
      outwait (``Topology.max_blocks_wait_s`` set, not yet past) takes free nodes beyond the
      limit at once when enough are free but not within it, instead of preempting or
      reclaiming other jobs (whose work since their last checkpoint is lost) to keep to it.
      It runs spread (slower where spreading costs: the simulator's ``--spread-slowdown``).
      False: it keeps to its limit (preempting where it may) until the wait lapses.
    * ``preempt_patience_s``: while its team's oldest queued job of the GPU type was
      submitted less than this ago, a job preempts (or reclaims) only victims that lose
      little: at most ``patience_max_lost_s`` of work per GPU since their last checkpoint
      (or start). Otherwise it waits, neither preempting nor reserving, for jobs to end or
      for cheaper victims (a job that just checkpointed); after that the rules' choice
      stands whatever it costs. Counted per team, not per job, so a team whose jobs keep
      arriving is not held back one patience after another. prod-serving, and prod-batch
      jobs within one node (the requirements' 2-minute p95 for small prod jobs), are never
      held back. None: off.
    * ``checkpoint_wait_s``: a job submitted less than this ago whose chosen victims would
      lose most of their work (by GPU-seconds) to a preemption now, and whose next checkpoints
      are due before that wait ends (each one's pace: the time between its last two
      checkpoints in this run), waits for them instead of preempting (``capacity``, "waits for
      its victims' checkpoints"; a gang reserves meanwhile, ``reserved``, as without victims). The
      victims keep working meanwhile; it waits only if the work saved exceeds the GPU-seconds
      the chosen nodes' free GPUs stand idle until then. prod-serving and prod-batch jobs
      within one node are never held back, nor a job holding nodes cleared for it. None: off.
    """

    lookahead: int = 2000
    ordering: Ordering = Ordering.FAIR_SHARE
    aging_step_per_hour: float = 1.0
    topology: bool = True
    reservations: bool = True
    backfill: bool = True
    preemption: bool = True
    borrowing: bool = True
    serving_borrows_idle: bool = False
    reserve_min_gpus: int = 64
    max_reservations_per_type: int = 1
    hot_spare_fraction: float = 0.015
    hot_spare_min_gpus: int = 1024
    preemption_protect_s: float = 1800.0
    first_runs_unprotected_min_gpus: int | None = None
    daily_preemption_budget: int = 3
    preemption_window_s: float = 86_400.0
    preemption_hold_s: float = 300.0
    max_preemptions_per_cycle: int = 256
    max_victim_searches_per_cycle: int = 32
    scan_factor: int = 4
    reservation_replan_s: float = 600.0
    guarantee_gangs_first: bool = True
    victim_excess_cost: bool = True
    evictable_backfill: bool = True
    borrowed_gangs_reclaim_lower: bool = True
    guaranteed_gangs_reserve_first: bool = True
    claim_borrowed_reservations_after_s: float | None = 300.0
    reclaim_small_borrowed_after_s: float | None = 300.0
    idle_victims_first: bool = True
    unsaved_borrow_guard: float | None = None
    borrowed_gang_guard: float | None = 0.5
    borrowed_restart_backoff_s: float | None = 1800.0
    pooled_demand_forecast: bool = True
    spread_before_preempt: bool = False
    preempt_patience_s: float | None = None
    patience_max_lost_s: float = 300.0
    spares_yield_after_s: float | None = None
    reclaim_higher_borrowed_gangs: bool = False
    reclaim_wait_per_team: bool = False
    borrowed_apart: bool = False
    checkpoint_wait_s: float | None = None
    guaranteed_gangs_outrank_borrowed: bool = True
    class_preemption_max_lost_s: float | None = 1800.0
    class_preemption_hold_s: float = 300.0
    guarantees_before_classes: bool = True
    gang_guard_reserved: bool = False
    serving_idle_guard: float | None = None
    borrowed_guard_min_gpus: int | None = 1
    preempt_within_team_use: bool = False
    guaranteed_reservations_hold: bool = False
    borrowed_guard_max_share: float | None = 0.01
    borrowed_guard_prod_hold_s: float | None = 60.0
    align_node_ends: bool = False
    evictable_backfill_min_s: float | None = None
    evictable_backfill_saving_only: bool = False
    evictable_backfill_max_gpus: int | None = None
    reclaim_max_lost_s: float | None = 1800.0
    reclaim_hold_s: float = 300.0
    reclaim_hold_per_team: bool = False
    reclaim_hold_small_only: bool = True
    reclaim_hold_gang_victims_ratio: float | None = None
    returning_demand_less_reserved: bool = False
    drain_reclaims_borrowed: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.ordering, Ordering):
            object.__setattr__(self, "ordering", Ordering(self.ordering))
        if self.lookahead < 0:
            raise ValueError("lookahead must be >= 0")

    @property
    def reads_demand_forecast(self) -> bool:
        """Does the engine read ``ClusterState.set_demand_forecast`` under this policy? (A
        driver keeps a ``placement.forecast.DemandWindow`` only then.)"""
        return (
            self.unsaved_borrow_guard is not None
            or self.borrowed_gang_guard is not None
            or self.borrowed_restart_backoff_s is not None
            or self.serving_idle_guard is not None
        )


DEFAULT_POLICY = Policy()

# gpufleet's own refinements (placement/README.md): the baselines run without them
_NO_REFINEMENTS: dict[str, Any] = {
    "guarantee_gangs_first": False,
    "victim_excess_cost": False,
    "evictable_backfill": False,
    "borrowed_gangs_reclaim_lower": False,
    "guaranteed_gangs_reserve_first": False,
    "claim_borrowed_reservations_after_s": None,
    "reclaim_small_borrowed_after_s": None,
    "unsaved_borrow_guard": None,
    "borrowed_gang_guard": None,
    "borrowed_restart_backoff_s": None,
    "pooled_demand_forecast": False,
    "spread_before_preempt": False,
    "preempt_patience_s": None,
    "spares_yield_after_s": None,
    "reclaim_higher_borrowed_gangs": False,
    "reclaim_wait_per_team": False,
    "borrowed_apart": False,
    "checkpoint_wait_s": None,
    "guaranteed_gangs_outrank_borrowed": False,
    "class_preemption_max_lost_s": None,
    "guaranteed_reservations_hold": False,
    "borrowed_guard_max_share": None,
    "borrowed_guard_prod_hold_s": None,
    "align_node_ends": False,
    "evictable_backfill_min_s": None,
    "evictable_backfill_saving_only": False,
    "evictable_backfill_max_gpus": None,
    "reclaim_max_lost_s": None,
    "reclaim_hold_gang_victims_ratio": None,
    "returning_demand_less_reserved": False,
    "drain_reclaims_borrowed": False,
    "guarantees_before_classes": False,
    "borrowed_guard_min_gpus": None,
    "first_runs_unprotected_min_gpus": None,
}

PRESETS: dict[str, Policy] = {
    # the policy docs/design.md describes
    "gpufleet": DEFAULT_POLICY,
    # plain FIFO over every class, first fit, no reservations/backfill/preemption; quotas still apply
    "fifo_first_fit": Policy(
        ordering=Ordering.FIFO,
        topology=False,
        reservations=False,
        backfill=False,
        preemption=False,
        **_NO_REFINEMENTS,
    ),
    # everything but topology awareness, reservations and backfill
    "no_topology_no_reservation": Policy(topology=False, reservations=False, backfill=False, **_NO_REFINEMENTS),
    # classic EASY backfill: one reservation per GPU type, backfill, no borrowing, no preemption
    "easy_backfill": Policy(
        ordering=Ordering.CLASS_FIFO,
        borrowing=False,
        preemption=False,
        reservations=True,
        backfill=True,
        **_NO_REFINEMENTS,
    ),
}


@dataclass(frozen=True, slots=True)
class ReplicaSlot:
    """Where one replica runs: its node and the GPU indices it uses there."""

    replica: int
    node_id: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class NodeGpus:
    """GPU indices a placement holds on one node (a whole node for jobs of >= node-size GPUs)."""

    node_id: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Placement:
    """One gang placement (or, with ``replacement``, lost replicas of a running prod-serving job).

    ``nodes`` lists node -> GPU indices held (one allocation row each, all carrying
    ``borrowed``); ``slots`` says which replica uses which of them. ``spare_nodes``
    are whole nodes kept free for this gang's restarts (hot spares).
    """

    job_id: str
    gpu_type: str
    nodes: tuple[NodeGpus, ...]
    slots: tuple[ReplicaSlot, ...]
    blocks: tuple[str, ...]
    borrowed: bool
    gpus: int
    spare_nodes: tuple[str, ...] = ()
    replacement: bool = False
    backfill: bool = False

    def gpu_keys(self) -> list[tuple[str, int]]:
        return [(n.node_id, g) for n in self.nodes for g in n.gpus]


@dataclass(frozen=True, slots=True)
class Preemption:
    victim: str
    beneficiary: str
    reason: PreemptReason
    grace_s: float
    victim_borrowed: bool


@dataclass(frozen=True, slots=True)
class Reservation:
    """Capacity held for one job: whole ``blocks`` (head-of-line) or ``nodes`` (preemption).

    Only the owner may use it, plus jobs of a strictly higher class (head-of-line only), plus (with
    backfill) jobs whose max_runtime ends by ``expected_start``.
    """

    job_id: str
    gpu_type: str
    kind: ReservationKind
    blocks: tuple[str, ...]
    nodes: tuple[str, ...]
    nodes_needed: int
    gpus: int
    priority_rank: int
    expected_start: float
    created_at: float
    team: str = ""  # the owner's team
    evicts_backfill: bool = False  # head-of-line: borrowed work may backfill and is evicted when ready
    # head-of-line, owner within its guarantee (Policy.drain_reclaims_borrowed): other teams'
    # borrowed work of its class or lower already on its nodes counts as gone and is reclaimed when ready
    evicts_borrowed: bool = False


@dataclass(frozen=True, slots=True)
class Relabel:
    """A running job's borrowed flag changed (quota re-check)."""

    job_id: str
    borrowed: bool


class Pending(NamedTuple):
    """Why a job was not placed this cycle (a named tuple: cheap to make by the thousand)."""

    job_id: str
    reason: PendingReason
    detail: str = ""


@dataclass(frozen=True)
class Plan:
    """The output of one cycle. Jobs neither placed nor in ``pending`` were beyond the lookahead,
    or covered by ``quota_blocked``: (team, GPU type, floor) means that team's jobs of that
    type with at least ``floor`` GPUs were skipped, the team having less quota room left.

    ``reservations`` is the complete set after this plan (apply replaces the state's
    set with it). ``quota_checked`` lists the (team, gpu_type) pairs whose borrowed
    flags were re-checked (``relabels`` holds the changes).
    """

    now: float
    placements: tuple[Placement, ...] = ()
    preemptions: tuple[Preemption, ...] = ()
    reservations: tuple[Reservation, ...] = ()
    pending: tuple[Pending, ...] = ()
    relabels: tuple[Relabel, ...] = ()
    dropped_spares: tuple[str, ...] = ()
    spares_taken: tuple[str, ...] = ()  # spare nodes released from their pools (Policy.spares_yield_after_s)
    quota_checked: tuple[tuple[str, str], ...] = ()
    quota_blocked: tuple[tuple[str, str, int], ...] = ()
    considered: int = 0
    # of ``considered``, the decisions taken afresh; the rest repeated an equal job's answer
    # within the cycle (speed only: not compared, ``plan(dedupe=False)`` decides all afresh)
    decided_afresh: int = field(default=0, compare=False)
    _index: dict[str, Pending] = field(default_factory=dict, compare=False, repr=False, hash=False)

    def __post_init__(self) -> None:
        self._index.update((p.job_id, p) for p in self.pending)

    def reason(self, job_id: str) -> PendingReason | None:
        """Why a queued job was not placed: None if placed, ``lookahead`` if not considered.

        Prefer ``reason_for(job)``: it also knows the (team, GPU type) pairs whose queue
        lanes were skipped because the team had no quota room (``quota``).
        """
        p = self._index.get(job_id)
        if p is not None:
            return p.reason
        for pl in self.placements:
            if pl.job_id == job_id:
                return None
        return PendingReason.LOOKAHEAD

    def reason_for(self, job: JobSpec) -> PendingReason | None:
        r = self.reason(job.job_id)
        if r is PendingReason.LOOKAHEAD:
            for team, gpu_type, floor in self.quota_blocked:
                if team == job.team and gpu_type == job.gpu_type and job.total_gpus >= floor:
                    return PendingReason.QUOTA
        return r

    def placement(self, job_id: str) -> Placement | None:
        for pl in self.placements:
            if pl.job_id == job_id:
                return pl
        return None
