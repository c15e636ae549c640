"""Record what the driver committed on the state: a plan (``apply``), or an event between
cycles (``apply_event``: a job ended, a node changed health, replicas were lost, a job
checkpointed; ``fail_node``: a node is lost), and the spec a stopped job is queued again
with (``requeue_spec``). ``placement.engine.plan`` decides; this module only records."""

from __future__ import annotations

from dataclasses import dataclass, replace

from placement.model import SERVING_RANK, JobSpec, NodeHealth, Plan
from placement.ordering import JobQueue
from placement.state import ClusterState


def apply(
    state: ClusterState,
    plan: Plan,
    queue: JobQueue | None,
    now: float,
    committed: set[str] | frozenset[str] | None = None,
    jobs: dict[str, JobSpec] | None = None,
) -> None:
    """Record a committed plan: relabels, dropped spares and spare nodes taken, placements
    (removed from ``queue``), preemptions, reservations.

    ``committed``: job ids whose placement / victim ids whose preemption actually
    committed (None: all). Job specs come from ``queue`` (or ``jobs``).
    """
    for rl in plan.relabels:
        if state.is_running(rl.job_id):
            state.set_borrowed(rl.job_id, rl.borrowed)
    state.mark_quota_checked(plan.quota_checked)
    for owner in plan.dropped_spares:
        state.release_spares(owner)
    for nid in plan.spares_taken:
        state.drop_spare(nid)
    for p in plan.placements:
        if committed is not None and p.job_id not in committed:
            continue
        if p.replacement:
            state.place_replicas(p, now)
            continue
        spec = None
        if queue is not None:
            spec = queue.get(p.job_id)
        if spec is None and jobs is not None:
            spec = jobs.get(p.job_id)
        if spec is None:
            raise KeyError(f"no spec for {p.job_id}: pass the queue or jobs")
        state.allocate(spec, p, now)
        if queue is not None:
            queue.remove(p.job_id)
    for pr in plan.preemptions:
        if committed is not None and pr.victim not in committed:
            continue
        rj = state.get_running(pr.victim)
        if rj is not None and rj.preempting_for is None:
            state.mark_preempting(pr.victim, pr.beneficiary)
    state.set_reservations(plan.reservations)


# ---------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class JobEnded:
    """The job's gang is gone (finished, failed, cancelled, stopped after preemption)."""

    job_id: str
    keep_spares: bool = False


@dataclass(frozen=True, slots=True)
class NodeHealthChanged:
    node_id: str
    health: NodeHealth


@dataclass(frozen=True, slots=True)
class ReplicasLost:
    job_id: str
    replicas: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Checkpointed:
    job_id: str
    at: float


Event = JobEnded | NodeHealthChanged | ReplicasLost | Checkpointed


@dataclass(frozen=True, slots=True)
class NodeFailure:
    """What ``fail_node`` did: gangs released (re-queue them, front of class), serving jobs degraded."""

    released: tuple[str, ...]
    degraded: tuple[str, ...]


def apply_event(state: ClusterState, event: Event, now: float) -> tuple[str, ...]:
    """Apply one event; returns the jobs it touched."""
    if isinstance(event, JobEnded):
        if state.is_running(event.job_id):
            state.release(event.job_id, now, keep_spares=event.keep_spares)
            return (event.job_id,)
        return ()
    if isinstance(event, NodeHealthChanged):
        return state.set_node_health(event.node_id, event.health)
    if isinstance(event, ReplicasLost):
        state.release_replicas(event.job_id, event.replicas, now)
        return (event.job_id,)
    if isinstance(event, Checkpointed):
        state.set_checkpoint(event.job_id, event.at)
        return (event.job_id,)
    raise TypeError(f"unknown event {event!r}")


def fail_node(state: ClusterState, node_id: str, now: float, health: NodeHealth = NodeHealth.DOWN) -> NodeFailure:
    """A node is lost: mark it, release every gang on it (keeping its hot spares for the
    restart) and drop only the lost replicas of prod-serving jobs."""
    jobs = state.set_node_health(node_id, health)
    released, degraded = [], []
    for jid in jobs:
        rj = state.running(jid)
        if rj.rank == SERVING_RANK:
            lost = [r for r, (n, _) in rj.slots.items() if n == node_id]
            state.release_replicas(jid, lost, now)
            degraded.append(jid)
        else:
            state.release(jid, now, keep_spares=True)
            released.append(jid)
    return NodeFailure(tuple(released), tuple(degraded))


def requeue_spec(
    job: JobSpec, now: float, *, preempted: bool = False, front: bool = False, checkpoint_at: float | None = None
) -> JobSpec:
    """The spec to queue again after a preemption (attempt + 1, same submit time, preemption
    recorded) or a failed attempt (``front``: ahead of its class)."""
    times = job.preemption_times + ((now,) if preempted else ())
    return replace(
        job,
        attempt=job.attempt + 1,
        started_at=None,
        last_checkpoint_at=checkpoint_at if checkpoint_at is not None else job.last_checkpoint_at,
        preemption_times=times,
        front=front,
    )
