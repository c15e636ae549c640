"""Messages that cross a process boundary between control and the node agents.

One frozen dataclass in and one out at every Temporal boundary (activities on a
node's task queue), and the same shapes on the gRPC stream (proto/ mirrors them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from temporalio import activity


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
    team: str = ""  # whose rank: the agent runs it as that job's and team's user (node.rank_user)
    team_rank_id: int | None = None  # the team's number in the store; its group is agent_rank_id_base + it
    job_rank_id: int | None = None  # the job's number in the store; its user is agent_rank_id_base + it


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
    # how the rank ended, as its supervisor recorded it: EXITED when it ended by itself
    # before the stop reached it (its work may be done), STOPPED or FENCED when it was ended
    state: str | None = None


# --- what a job's env may not set (the API refuses it at submit; the agent drops it anyway) ---

# variables that change how programs load or start, or that would impersonate the platform
DENIED_ENV_KEYS = frozenset(
    {"LD_PRELOAD", "LD_AUDIT", "LD_LIBRARY_PATH", "LD_BIND_NOW", "LD_DEBUG", "LD_PROFILE", "PYTHONSTARTUP",
     "PYTHONHOME", "PYTHONINSPECT", "BASH_ENV", "ENV", "PROMPT_COMMAND", "IFS", "PERL5OPT", "NODE_OPTIONS",
     "CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
     "MASTER_ADDR", "MASTER_PORT", "HOME", "TMPDIR", "USER", "LOGNAME"}
)  # fmt: skip
DENIED_ENV_PREFIXES = ("GPUFLEET_", "LD_", "DYLD_")


def denied_env_key(key: str) -> bool:
    """Whether a job's env may not set ``key``: it changes loading, or it is the platform's."""
    return key in DENIED_ENV_KEYS or key.startswith(DENIED_ENV_PREFIXES)


# --- a node's activities (on its task queue): typed interfaces, implemented by worker_agent.node ---

START_TASK = "start_task"
STOP_TASK = "stop_task"


@activity.defn(name=START_TASK)
async def start_task(req: StartTask) -> StartTaskResult:
    """Start one rank under its supervisor; idempotent on lease id + epoch. The interface
    workflows call; a node agent registers the implementation under the same name."""
    raise NotImplementedError("an interface: the node agent implements it")


@activity.defn(name=STOP_TASK)
async def stop_task(req: StopTask) -> StopTaskResult:
    """Stop one rank: SIGTERM, the grace period to checkpoint, SIGKILL at its end."""
    raise NotImplementedError("an interface: the node agent implements it")


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
    # a terminal report's cause, stored in task_reports for the user (not forwarded to the job)
    signal: int | None = None  # the signal that killed the rank
    stderr_tail: str = ""  # the last lines of its stderr (bounded)
    reason: str = ""  # why it ended when not by itself (a stop's reason, a fence)


# --- heartbeats (docs/design.md, Health): what the leader reads from its heartbeat table ---


@dataclass(frozen=True)
class GpuReport:
    """One GPU in a heartbeat. Numeric fields are None where NVML does not support them."""

    index: int
    health: str  # "ok" | "degraded" | "failed" | "unknown"
    sm_util: float | None = None
    mem_util: float | None = None
    mem_used: int | None = None
    mem_total: int | None = None
    temperature_c: float | None = None
    ecc_sbe: int | None = None
    ecc_dbe: int | None = None
    xids: tuple[int, ...] = ()
    faults: tuple[str, ...] = ()
    uuid: str = ""


@dataclass(frozen=True)
class RunningLeaseReport:
    """A rank the agent runs, with its progress (steps for hang detection, checkpoints for lost work)."""

    lease_id: str
    job_id: str
    epoch: int
    attempt: int
    rank: int
    pid: int | None = None
    step: int | None = None
    step_age_s: float = 0.0
    checkpoint_uri: str | None = None
    checkpoint_step: int | None = None
    gpu_indices: tuple[int, ...] = ()
    unconfirmed_s: float = 0.0


@dataclass(frozen=True)
class HeartbeatReport:
    node_id: str
    boot_id: str
    seq: int
    sent_at: datetime
    gpus: tuple[GpuReport, ...] = ()
    running: tuple[RunningLeaseReport, ...] = ()
    free_disk_bytes: int = 0
    cached_images: tuple[str, ...] = ()
    agent_addr: str = ""
    node_faults: tuple[str, ...] = ()  # what keeps the node from hosting new ranks (worker_agent.node_fitness)
