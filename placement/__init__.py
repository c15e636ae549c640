"""gpufleet's pure scheduling core: no I/O, no clock, no randomness (docs/design.md, Placement).

Driving it (the live leader and the simulator do the same)::

    from placement import ClusterState, JobQueue, JobSpec, Policy, plan, apply

    state = ClusterState()                       # rebuild on startup / takeover
    state.add_node("n001", "b01", "h100")        # 8 GPUs by default
    state.set_quota("vision", "h100", guaranteed=64, borrow_limit=64)
    state.set_usage("vision", "h100", gpu_hours=1234.0, as_of=now)
    state.allocate(running_spec, committed_placement, now)   # what already runs
    queue = JobQueue()
    queue.push(JobSpec("j1", "vision", "research", "h100", replicas=4, gpus_per_replica=8))

    p = plan(state, queue, Policy(), now)        # a Plan value; state and queue unchanged
    # commit p.placements (one transaction per gang), p.preemptions, p.reservations ...
    apply(state, p, queue, now, committed={...})  # record what committed

Events between cycles go straight to the state: ``state.release(job_id, now)`` (job
ended or stopped), ``fail_node(state, node_id, now)`` / ``state.set_node_health``,
``state.release_replicas`` (a prod-serving replica lost), ``state.set_checkpoint``,
``state.set_quota``; re-queue a preempted job with ``requeue_spec``.
Time is float seconds; ids are strings. ``Plan.reason(job_id)`` says why a job waits
(``lookahead`` for jobs beyond the top ``Policy.lookahead``).

The job state table is ``placement.lifecycle`` (``TRANSITIONS``, ``transition``).
``placement.invariants`` checks a state or a plan (tests, simulator).
Baseline policies for the simulator: ``PRESETS`` (``gpufleet``, ``fifo_first_fit``,
``no_topology_no_reservation``, ``easy_backfill``).
"""

from placement.commit import (
    Checkpointed,
    Event,
    JobEnded,
    NodeFailure,
    NodeHealthChanged,
    ReplicasLost,
    apply,
    apply_event,
    fail_node,
    requeue_spec,
)
from placement.engine import plan
from placement.invariants import check_plan, check_state
from placement.lifecycle import (
    ACTIVE,
    TERMINAL,
    TRANSITIONS,
    InvalidTransition,
    JobEvent,
    JobState,
    can_transition,
    transition,
)
from placement.model import (
    DEFAULT_POLICY,
    PRESETS,
    AllocationConflict,
    JobSpec,
    NodeGpus,
    NodeHealth,
    Ordering,
    Pack,
    Pending,
    PendingReason,
    Placement,
    PlacementError,
    Plan,
    Policy,
    Preemption,
    PreemptReason,
    PriorityClass,
    Quota,
    Relabel,
    ReplicaSlot,
    Reservation,
    ReservationKind,
    Topology,
    UnknownJob,
    UnknownNode,
)
from placement.ordering import JobQueue, fair_share_positions, iter_order
from placement.state import ClusterState, RunningJob
from placement.topology import Shape, job_shape

__all__ = [
    "ACTIVE",
    "DEFAULT_POLICY",
    "PRESETS",
    "TERMINAL",
    "TRANSITIONS",
    "AllocationConflict",
    "Checkpointed",
    "ClusterState",
    "Event",
    "InvalidTransition",
    "JobEnded",
    "JobEvent",
    "JobQueue",
    "JobSpec",
    "JobState",
    "NodeFailure",
    "NodeGpus",
    "NodeHealth",
    "NodeHealthChanged",
    "Ordering",
    "Pack",
    "Pending",
    "PendingReason",
    "Placement",
    "PlacementError",
    "Plan",
    "Policy",
    "PreemptReason",
    "Preemption",
    "PriorityClass",
    "Quota",
    "Relabel",
    "ReplicaSlot",
    "ReplicasLost",
    "Reservation",
    "ReservationKind",
    "RunningJob",
    "Shape",
    "Topology",
    "UnknownJob",
    "UnknownNode",
    "apply",
    "apply_event",
    "can_transition",
    "check_plan",
    "check_state",
    "fail_node",
    "fair_share_positions",
    "iter_order",
    "job_shape",
    "plan",
    "requeue_spec",
    "transition",
]
