"""Payloads of the job and placement workflows: one frozen dataclass per boundary.

The API starts ``JobWorkflow`` with ``JobInput`` (workflow id = job id) on the
control task queue and talks to it only through the signals and updates named
here, so these names are a contract between api/, control/ and workflows/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

JOB_WORKFLOW = "JobWorkflow"
PLACEMENT_WORKFLOW = "PlacementWorkflow"
PLACEMENT_WORKFLOW_ID = "gpufleet-placement"

# signal / update / query names on JobWorkflow
SIGNAL_ALLOCATED = "allocated"
SIGNAL_TASK_STATUS = "task_status"
SIGNAL_CANCEL = "cancel"
SIGNAL_PREEMPT = "preempt"
UPDATE_EXTEND = "extend"
QUERY_STATUS = "status"

# signal on PlacementWorkflow: something changed, run a cycle now
SIGNAL_WAKE = "wake"


@dataclass(frozen=True)
class JobInput:
    job_id: str
    attempt: int = 1
    # carried across continue-as-new so a resumed attempt knows where it stands
    resume_from: str | None = None


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
class WakeRequest:
    reason: str


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
