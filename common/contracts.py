"""Messages that cross a process boundary between control and the node agents.

One frozen dataclass in and one out at every Temporal boundary (activities on a
node's task queue), and the same shapes on the gRPC stream (proto/ mirrors them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum


class TaskState(StrEnum):
    STARTED = "STARTED"  # the rank process is running
    EXITED = "EXITED"  # the rank exited by itself; exit_code says how
    STOPPED = "STOPPED"  # stopped on request (StopTask), after SIGTERM or SIGKILL
    FENCED = "FENCED"  # killed by its supervisor: lease unconfirmed too long
    LOST = "LOST"  # the node rebooted (new boot id) or the rank vanished
    REJECTED = "REJECTED"  # the command was refused (stale epoch, bad GPUs)


@dataclass(frozen=True)
class StartTask:
    lease_id: str
    job_id: str
    attempt: int
    epoch: int
    node_id: str
    rank: int
    world_size: int
    image: str
    command: list[str]
    gpu_indices: list[int]
    master_addr: str
    master_port: int
    env: dict[str, str] = field(default_factory=dict)
    checkpoint_dir: str = ""
    resume_from: str | None = None


@dataclass(frozen=True)
class StartTaskResult:
    lease_id: str
    epoch: int
    accepted: bool
    pid: int | None = None
    already_running: bool = False
    reason: str = ""


@dataclass(frozen=True)
class StopTask:
    lease_id: str
    epoch: int
    node_id: str
    grace_seconds: float
    reason: str


@dataclass(frozen=True)
class StopTaskResult:
    lease_id: str
    epoch: int
    accepted: bool
    exit_code: int | None = None
    checkpoint_uri: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class TaskStatus:
    """What an agent reports about one rank; the leader forwards it to the job."""

    node_id: str
    lease_id: str
    job_id: str
    attempt: int
    epoch: int
    rank: int
    state: TaskState
    at: datetime
    exit_code: int | None = None
    checkpoint_uri: str | None = None
    step: int | None = None
    boot_id: str = ""
    seq: int = 0
