"""Payloads of the job workflow: one frozen dataclass per Temporal boundary.

The API and the leader start ``JobWorkflow`` with ``JobInput`` (workflow id = job id)
on the control task queue and talk to it only through its signals, update and query;
its activities take and return the dataclasses below. Names recorded in histories
(workflow, signal and activity names, dataclass fields) may grow, never be renamed:
the committed histories under tests/replay pin them.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from common.contracts import TaskStatus
from placement.lifecycle import JobState

JOB_WORKFLOW = "JobWorkflow"

# signal / update / query names on JobWorkflow
SIGNAL_ALLOCATED = "allocated"
SIGNAL_TASK_STATUS = "task_status"
SIGNAL_CANCEL = "cancel"
SIGNAL_PREEMPT = "preempt"
SIGNAL_NODE_FAILED = "node_failed"  # from the health monitor: a node under this attempt failed
SIGNAL_EARLIER_SUCCESS = "earlier_attempt_succeeded"  # from report delivery: late exits of every rank
UPDATE_EXTEND = "extend"
QUERY_STATUS = "status"

# the control activities of JobWorkflow (local activities: short Postgres writes)
ACT_LOAD_JOB = "load_job"
ACT_MARK_RUNNING = "mark_running"
ACT_MARK_CANCELLING = "mark_cancelling"
ACT_FINISH_JOB = "finish_job"
ACT_REQUEUE_JOB = "requeue_job"
ACT_EXTEND_JOB = "extend_job"
ACT_RESTART_REPLICA = "restart_replica"


@dataclass(frozen=True)
class JobLabels:
    """What operators filter job histories by (workflows/search_attributes.py): set as search
    attributes by whoever starts the workflow."""

    team: str
    priority_class: str
    gpu_type: str
    gpus: int
    submitted_at: float  # unix seconds


@dataclass(frozen=True)
class JobInput:
    job_id: str
    attempt: int = 1
    # carried across continue-as-new so a resumed attempt knows where it stands
    resume_from: str | None = None
    # set only by a continue-as-new in the middle of a running attempt (long histories)
    carry: RunCarry | None = None
    # signals the previous run received but did not act on, handed to the next run
    cancel: CancelRequest | None = None
    earlier_success: EarlierAttemptSucceeded | None = None
    allocation: Allocation | None = None
    # set by a starter that registered gpufleet's search attributes and set them at start:
    # this run keeps their state and attempt current (runs recorded without it never upsert)
    labels: JobLabels | None = None


@dataclass(frozen=True)
class CancelRequest:
    actor: str
    reason: str = "cancelled by user"


@dataclass(frozen=True)
class ExtendRequest:
    actor: str
    seconds: float
    reason: str = ""


@dataclass(frozen=True)
class ExtendResult:
    granted: bool
    code: str  # "granted", "too_many", "too_long", "delays_reservation", "not_running"
    message: str
    new_deadline: datetime | None = None
    extensions_used: int = 0


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    state: str
    attempt: int
    epoch: int | None = None
    ranks_started: int = 0
    ranks_total: int = 0
    deadline: datetime | None = None
    leases: list[str] = field(default_factory=list)
    checkpoint: str | None = None  # the newest checkpoint every rank has (what a new attempt resumes from)


@dataclass(frozen=True)
class RankPlacement:
    """One rank of an allocated gang: where it runs and the lease that owns its GPUs."""

    rank: int
    node_id: str
    gpu_indices: list[int]
    lease_id: str
    task_queue: str


@dataclass(frozen=True)
class Allocation:
    """Signal ``allocated``: placement committed this attempt's gang under ``epoch``.

    Idempotent on (attempt, epoch): the workflow keeps the first one per attempt,
    so a re-signal after a lost signal (or from a new leader) changes nothing."""

    job_id: str
    attempt: int
    epoch: int
    ranks: list[RankPlacement]
    master_addr: str = "127.0.0.1"
    master_port: int = 29500


@dataclass(frozen=True)
class PreemptRequest:
    """Signal ``preempt``: placement marked this attempt PREEMPTING under ``epoch``."""

    job_id: str
    attempt: int
    epoch: int
    reason: str = "preempted"
    by_job: str | None = None


@dataclass(frozen=True)
class TaskStatusBatch:
    """Signal ``task_status``: the agents' reports for one job, batched by the leader."""

    statuses: list[TaskStatus]


@dataclass(frozen=True)
class JobResult:
    job_id: str
    state: str
    attempt: int
    exit_code: int | None = None
    reason: str = ""


@dataclass(frozen=True)
class LoadJob:
    job_id: str


@dataclass(frozen=True)
class JobSnapshot:
    """What a JobWorkflow run needs from Postgres, plus the settings it runs under
    (read in the activity, so they are recorded in history and replay deterministically)."""

    job_id: str
    exists: bool
    state: str = JobState.QUEUED
    attempt: int = 1
    team: str = ""
    # the team's and the job's numbers in the store (teams.rank_id, jobs.rank_id): agents run
    # the job's ranks as uid agent_rank_id_base + the job's, gid + the team's. Snapshots
    # recorded before a column lack it: None.
    team_rank_id: int | None = None
    job_rank_id: int | None = None
    priority_class: str = "research"
    replicas: int = 1
    gpus_per_replica: int = 1
    image: str = ""
    command: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    max_runtime_s: float = 3600.0
    original_max_runtime_s: float = 3600.0
    extensions: int = 0
    last_checkpoint: str | None = None
    checkpoint_dir: str = ""
    preemptible: bool = False
    grace_s: float = 30.0
    gang_start_timeout_s: float = 600.0
    start_task_timeout_s: float = 60.0
    stop_margin_s: float = 10.0
    max_extensions: int = 2
    max_extension_fraction: float = 0.25
    # StartTask carries the gang start timeout (no gang timer). Snapshots recorded before
    # this field lack it and fall back to the workflow.patched marker (workflows/job.py).
    gang_timeout_in_start: bool = False
    # set when the job already holds a live gang (a new run found it STARTING or later)
    allocation: Allocation | None = None
    # when the attempt started RUNNING (a new run that adopts a running gang keeps its deadline)
    started_at: datetime | None = None


@dataclass(frozen=True)
class JobTransition:
    """A job state write by the workflow: guarded by attempt (and the expected states),
    idempotent (re-applying a done transition is a no-op that reports the state)."""

    job_id: str
    attempt: int
    to_state: str
    reason: str = ""
    actor: str = "workflow"
    epoch: int | None = None
    exit_code: int | None = None
    checkpoint_uri: str | None = None


@dataclass(frozen=True)
class TransitionResult:
    applied: bool
    state: str
    attempt: int
    released: int = 0


@dataclass(frozen=True)
class RequeueJob:
    """End an attempt that did not finish: release its gang and queue attempt + 1
    (or FAILED after too many failures the job caused itself)."""

    job_id: str
    attempt: int
    cause: str  # "preempted" | "failed"
    reason: str
    job_fault: bool = False
    checkpoint_uri: str | None = None
    epoch: int | None = None
    actor: str = "workflow"


@dataclass(frozen=True)
class RequeueResult:
    state: str  # QUEUED, or FAILED (too many failures), or a terminal state already there
    attempt: int  # the attempt now current
    resume_from: str | None = None
    applied: bool = True


@dataclass(frozen=True)
class ExtendJob:
    job_id: str
    attempt: int
    seconds: float
    actor: str
    reason: str
    running_since: datetime
    request_id: str = ""  # the update's id: a retried activity returns the first answer


@dataclass(frozen=True)
class RankCarry:
    rank: int
    started: bool
    exited: bool
    exit_code: int | None = None
    outcome: str = ""
    restarts: int = 0
    checkpoints: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RunCarry:
    """A running attempt's state, carried across a continue-as-new that keeps it running."""

    attempt: int
    allocation: Allocation
    running_since: datetime
    deadline: datetime
    ranks: list[RankCarry]
    checkpoint: str | None = None


@dataclass(frozen=True)
class EarlierAttemptSucceeded:
    """Signal ``earlier_attempt_succeeded``: every rank of ``attempt`` (an attempt recovered
    from a silent node) had exited 0; the reports came when the node was heard again. The
    job has finished: the current attempt is stopped and the job SUCCEEDED."""

    job_id: str
    attempt: int
    reason: str = ""


@dataclass(frozen=True)
class NodeFailed:
    """Signal ``node_failed``: the node is lost (down, fatal Xid, hang). The attempt is
    ended as a failure that does not count against the job (front of its class).
    ``more_nodes``: other nodes of the attempt found failed at the same time (a block's,
    judged in one pass of the health monitor): one signal for all of them."""

    job_id: str
    attempt: int
    node_id: str
    reason: str = "node failed"
    more_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class RestartReplica:
    job_id: str
    attempt: int
    rank: int
    failed_lease_id: str
    reason: str


@dataclass(frozen=True)
class RestartedReplica:
    ok: bool
    placement: RankPlacement | None = None


def rendezvous_port(job_id: str, attempt: int) -> int:
    """One rendezvous port per gang attempt (many simulated nodes share a host)."""
    return 20000 + zlib.crc32(f"{job_id}.{attempt}".encode()) % 20000


def rendezvous_host(agent_addr: str | None) -> str:
    """The host rank 0's agent advertises (where the gang rendezvous), else loopback."""
    if agent_addr:
        host = agent_addr.rsplit(":", 1)[0] if ":" in agent_addr else agent_addr
        if host and host not in ("0.0.0.0", "::"):
            return host
    return "127.0.0.1"


def allocation_from_leases(
    job_id: str,
    attempt: int,
    leases: Sequence[Mapping[str, Any]],
    queue_of: Callable[[str, str | None], str],
) -> Allocation | None:
    """The ``allocated`` signal of a committed gang, from its live lease rows (lease_id,
    rank, node_id, gpu_indices, epoch, task_queue, agent_addr); ``queue_of(node_id,
    recorded_queue)`` names each node's task queue. None when no lease is live."""
    if not leases:
        return None
    ordered = sorted(leases, key=lambda r: r["rank"])
    return Allocation(
        job_id=job_id,
        attempt=attempt,
        epoch=int(max(r["epoch"] for r in ordered)),
        ranks=[
            RankPlacement(
                rank=r["rank"],
                node_id=r["node_id"],
                gpu_indices=list(r["gpu_indices"]),
                lease_id=r["lease_id"],
                task_queue=queue_of(r["node_id"], r["task_queue"]),
            )
            for r in ordered
        ],
        master_addr=rendezvous_host(ordered[0]["agent_addr"]),
        master_port=rendezvous_port(job_id, attempt),
    )
