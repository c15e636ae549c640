"""Request and response shapes of the public API (add fields, never rename these).

Every string a client sends is bounded and must be storable in Postgres (no NUL,
no lone surrogates); every number is bounded, so nothing a client sends can reach
the database as an overflow.
"""

from __future__ import annotations

import unicodedata
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    RootModel,
    StringConstraints,
    Tag,
    field_validator,
    model_validator,
)

from common.contracts import denied_env_key
from common.image_ref import FORM, parse_image_ref
from placement import NodeHealth, PriorityClass

# the platform's vocabularies, from the engine (placement/): one spelling everywhere
PRIORITY_CLASSES = tuple(c.value for c in PriorityClass)
NodeState = NodeHealth  # a node's state, as a query parameter


def storable(s: str) -> str:
    """Postgres text cannot hold NUL, and UTF-8 cannot encode lone surrogates."""
    if "\x00" in s:
        raise ValueError("must not contain NUL characters")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError("must be valid Unicode text") from e
    return s


# Trojan Source: embeddings, overrides and isolates reorder how text displays (a name or a
# command that reads differently in a terminal than it runs)
BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_ARGUMENT_WHITESPACE = frozenset("\t\n")


def _no_controls(s: str, allowed: frozenset[str]) -> str:
    storable(s)
    for i, c in enumerate(s):
        if c in BIDI_CONTROLS:
            raise ValueError(f"must not contain bidirectional control characters (U+{ord(c):04X} at {i})")
        if unicodedata.category(c) == "Cc" and c not in allowed:
            raise ValueError(f"must not contain control characters (U+{ord(c):04X} at {i})")
    return s


def plain_text(s: str) -> str:
    """A name or a reason: printable, no control or bidi characters (terminals, logs, audit)."""
    return _no_controls(s, frozenset())


def argument_text(s: str) -> str:
    """A command argument or env value: tabs and newlines allowed (scripts), no other controls."""
    return _no_controls(s, _ARGUMENT_WHITESPACE)


def image_reference(s: str) -> str:
    parse_image_ref(s)  # ImageRefError is a ValueError: a 422 naming the field
    return s


# bounded strings that Postgres can store (no NUL, no lone surrogates); name: Str<max>[_<min>]
_STORABLE = AfterValidator(storable)
Str32_1 = Annotated[str, StringConstraints(min_length=1, max_length=32), _STORABLE]
Str63_1 = Annotated[str, StringConstraints(min_length=1, max_length=63), _STORABLE]
Str64_1 = Annotated[str, StringConstraints(min_length=1, max_length=64), _STORABLE]
PlainText200 = Annotated[str, StringConstraints(max_length=200), AfterValidator(plain_text)]
PlainText1000 = Annotated[str, StringConstraints(max_length=1000), AfterValidator(plain_text)]
PlainText1000_1 = Annotated[str, StringConstraints(min_length=1, max_length=1000), AfterValidator(plain_text)]
Argument4096 = Annotated[str, StringConstraints(max_length=4096), AfterValidator(argument_text)]
Argument8192 = Annotated[str, StringConstraints(max_length=8192), AfterValidator(argument_text)]
ImageReference = Annotated[
    str,
    StringConstraints(min_length=1, max_length=512),
    AfterValidator(image_reference),
    Field(description=f"an OCI image reference, {FORM}, from an allowed registry"),
]
EnvKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")]
DurationValue = Annotated[
    str | Annotated[int, Field(ge=1, le=10**9)],
    Field(description='a duration: "72h", "90m", "1d12h", "3600s" or a number of seconds'),
]


class Topology(BaseModel):
    """Where the job's replicas may land in the network (docs/design.md, Placement)."""

    model_config = ConfigDict(extra="forbid")
    pack: Literal["block", "node", "any"] = Field(
        "any",
        description="block: the fewest network blocks (multi-node gangs that talk a lot); node: one node;"
        " any: wherever GPUs are free",
        examples=["block"],
    )
    max_blocks: int | None = Field(
        None, ge=1, le=10_000, description="with pack=block, the most blocks the job may span", examples=[1]
    )
    max_blocks_wait_seconds: float | None = Field(
        None,
        ge=0,
        le=30 * 86_400,
        allow_inf_nan=False,
        description="how long (from submit) to wait for max_blocks before taking the fewest blocks free;"
        " unset: max_blocks is a hard limit",
        examples=[600],
    )

    @model_validator(mode="after")
    def _wait_needs_a_limit(self) -> Topology:
        if self.max_blocks_wait_seconds is not None and (self.pack != "block" or self.max_blocks is None):
            raise ValueError("max_blocks_wait_seconds needs pack=block and max_blocks")
        return self


class Checkpoint(BaseModel):
    """How the job survives preemption: SIGTERM, a grace period to checkpoint, then a resume."""

    model_config = ConfigDict(extra="forbid")
    preemptible: bool = Field(
        False,
        description="the job can checkpoint and resume: it gets SIGTERM and grace_seconds to write a checkpoint"
        " to GPUFLEET_CHECKPOINT_DIR, and its next attempt gets GPUFLEET_RESUME_FROM",
        examples=[True],
    )
    grace_seconds: float = Field(
        30.0,
        ge=0,
        le=86_400,
        allow_inf_nan=False,
        description="seconds between SIGTERM and SIGKILL when the job is preempted or cancelled",
        examples=[30],
    )


# A job the demo cluster (`make up`: 4 blocks x 4 nodes x 8 h100; team pretrain) accepts.
JOB_SUBMIT_EXAMPLE: dict[str, Any] = {
    "team": "pretrain",
    "name": "llm-pretrain-demo",
    "priority_class": "research",
    "image": "registry/demo:1",
    "command": ["python3", "-c", "import os; print('hello from rank', os.environ['RANK'])"],
    "gpu_type": "h100",
    "replicas": 2,
    "gpus_per_replica": 8,
    "topology": {"pack": "block", "max_blocks": 1},
    "max_runtime": "1h",
    "checkpoint": {"preemptible": True, "grace_seconds": 30},
    "env": {"WANDB_MODE": "offline"},
}


class JobSubmit(BaseModel):
    """A job: a gang of `replicas` ranks with `gpus_per_replica` GPUs each, started together."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [JOB_SUBMIT_EXAMPLE]})
    team: Str63_1 = Field(description="the team the job runs (and is charged) under; yours", examples=["pretrain"])
    priority_class: Str32_1 = Field(
        description="prod-serving, prod-batch, research or preemptible (highest first); higher classes may"
        " preempt lower ones",
        examples=["research"],
    )
    image: ImageReference = Field(examples=["registry/demo:1"])
    command: list[Argument4096] = Field(
        min_length=1,
        max_length=256,
        description="argv of each rank (no shell); the rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,"
        " MASTER_PORT and GPUFLEET_* variables",
        examples=[["python3", "train.py", "--lr", "3e-4"]],
    )
    gpu_type: Str64_1 = Field(description="the GPU type every rank runs on", examples=["h100"])
    replicas: int = Field(ge=1, le=100_000, description="ranks in the gang (one per node slot)", examples=[2])
    gpus_per_replica: int = Field(ge=1, le=8, description="GPUs each rank gets (on one node)", examples=[8])
    topology: Topology = Field(default_factory=Topology, description="where the ranks may land")
    max_runtime: DurationValue | None = Field(
        None, description="required: the job is stopped after it; capped per priority class", examples=["4h"]
    )
    checkpoint: Checkpoint = Field(default_factory=Checkpoint, description="preemption and checkpointing")
    env: dict[EnvKey, Argument8192] = Field(
        default_factory=dict,
        max_length=256,
        description="the ranks' env; keys that change loading or the platform's own are refused",
        examples=[{"WANDB_MODE": "offline"}],
    )
    name: PlainText200 | None = Field(None, description="a label shown in lists", examples=["llm-pretrain"])

    @field_validator("env")
    @classmethod
    def _env_keys_allowed(cls, env: dict[str, str]) -> dict[str, str]:
        denied = sorted(k for k in env if denied_env_key(k))
        if denied:
            raise ValueError(
                f"may not set {', '.join(denied)}: these change how programs load or are set by the platform"
            )
        return env


class SubmitAccepted(BaseModel):
    job_id: str = Field(description="the job's id", examples=["j-0f3c9a1b2d"])
    state: str = Field(description="QUEUED", examples=["QUEUED"])
    queue_position: int | None = Field(
        None,
        description="1-based; an estimate (class, then submit time) until the next placement cycle publishes one",
        examples=[3],
    )
    queue_position_estimated: bool = Field(True, description="queue_position is an estimate, not yet published")


class RankAllocation(BaseModel):
    rank: int = Field(description="the rank (RANK in its env)", examples=[0])
    node_id: str = Field(description="the node it runs on", examples=["b0-n0"])
    block_id: str = Field(description="the node's network block", examples=["b0"])
    gpu_indices: list[int] = Field(description="GPUs of the node it holds", examples=[[0, 1, 2, 3, 4, 5, 6, 7]])
    lease_id: str = Field(description="the lease (one rank of one attempt on one node)")


class Allocation(BaseModel):
    nodes: list[str] = Field(description="nodes the live attempt holds", examples=[["b0-n0", "b0-n1"]])
    blocks: list[str] = Field(description="their blocks", examples=[["b0"]])
    ranks: list[RankAllocation] = Field(default_factory=list, description="each rank's node and GPUs")


class JobSummary(BaseModel):
    job_id: str = Field(description="the job's id", examples=["j-0f3c9a1b2d"])
    team: str = Field(description="the team it runs under", examples=["pretrain"])
    name: str | None = Field(None, description="its label", examples=["llm-pretrain"])
    priority_class: str = Field(description="prod-serving, prod-batch, research or preemptible", examples=["research"])
    gpu_type: str = Field(examples=["h100"], description="the GPU type it runs on")
    replicas: int = Field(description="ranks in the gang", examples=[2])
    gpus_per_replica: int = Field(description="GPUs per rank", examples=[8])
    gpus: int = Field(description="replicas x gpus_per_replica", examples=[16])
    state: str = Field(
        description="QUEUED, STARTING, RUNNING, PREEMPTING, CANCELLING, SUCCEEDED, FAILED, CANCELLED ...",
        examples=["RUNNING"],
    )
    attempt: int = Field(description="1 for the first run; +1 per restart (preemption, node failure)", examples=[1])
    submitted_at: datetime = Field(description="when it was submitted")
    started_at: datetime | None = Field(None, description="when its current attempt started running")
    finished_at: datetime | None = Field(None, description="when it ended (terminal states)")
    queue_position: int | None = Field(None, description="1-based position in the queue (QUEUED only)", examples=[3])
    pending_reason: str | None = Field(
        None, description="why it waits (QUEUED only): capacity, quota, topology, ...", examples=["capacity"]
    )
    max_runtime_s: float | None = Field(
        None, description="how long it may run, in seconds, extensions included", examples=[14400]
    )
    nodes: list[str] | None = Field(
        None, description="nodes its live attempt holds (lists; a job's allocation has them per rank)"
    )


class GpuUse(BaseModel):
    """What the job's GPUs are doing, from the agents' readings (docs/design.md, Observability)."""

    gpu_util: float | None = Field(None, description="mean SM use (%) over the live attempt's GPUs, last reading")
    gpus: int = Field(description="GPUs the live attempt holds")
    idle_gpus: int = Field(description="of those, GPUs whose use stayed below the idle threshold long enough")
    idle: bool = Field(description="allocated but idle: every GPU below the idle threshold for idle_gpu_after_s")
    idle_since: datetime | None = Field(None, description="when the whole job went idle")


class RankResult(BaseModel):
    """How one rank of an attempt ended, as its node's agent reported it (kept after the node is gone)."""

    rank: int = Field(description="the rank (RANK in its env)", examples=[0])
    attempt: int = Field(description="the attempt it ran in", examples=[1])
    node_id: str = Field(description="the node the rank ran on")
    lease_id: str = Field(description="its lease (one rank of one attempt on one node)")
    state: str = Field(
        description="EXITED (ended by itself), STOPPED (a cancel, preemption or failed attempt stopped it),"
        " FENCED (killed itself: its lease went unconfirmed), LOST (its node or process was lost), REJECTED"
    )
    exit_code: int | None = Field(None, description="the rank's exit code; 128 + N when signal N killed it")
    signal: int | None = Field(None, description="the signal that killed the rank, when one did")
    signal_name: str | None = Field(None, description="the signal's name, e.g. SIGKILL")
    reason: str | None = Field(None, description="why it was ended when not by itself (the stop's reason, a fence)")
    stderr_tail: str = Field("", description="the last lines of the rank's stderr (at most 20 lines / 4 KiB)")
    finished_at: str | None = Field(None, description="when the agent saw it end (ISO 8601, the node's clock)")


class FailureCause(BaseModel):
    """Why the job's latest ended attempt did not succeed, and whether the platform runs it again."""

    kind: Literal["failed", "infrastructure", "preempted", "cancelled", "timed_out"] = Field(
        description="failed: the job's own failure (counts against max_failed_attempts); infrastructure: a node"
        " or rank was lost, fenced or refused (does not count); preempted; cancelled; timed_out (max_runtime)"
    )
    attempt: int = Field(description="the attempt that ended")
    rank: int | None = Field(
        None, description="the failing rank: the first to exit non-zero by itself, else the first lost"
    )
    node_id: str | None = Field(None, description="the node the failing rank ran on")
    state: str | None = Field(None, description="how the failing rank ended (see RankResult.state)")
    exit_code: int | None = Field(None, description="the failing rank's exit code")
    signal: int | None = Field(None, description="the signal that killed the failing rank, when one did")
    signal_name: str | None = Field(None, description="the signal's name, e.g. SIGKILL")
    stderr_tail: str = Field("", description="the last lines of the failing rank's stderr")
    reason: str | None = Field(None, description="the reason recorded when the attempt ended (job events)")
    will_retry: bool = Field(description="whether the platform runs the job again")
    retry: str = Field(description='"yes (attempt 2 of 3)" or "no: <why>"')
    attempts_left: int | None = Field(
        None, description="for a job's own failure: attempts it may still fail (this one included) before FAILED"
    )
    summary: str = Field(description="the cause in one paragraph")


class JobView(JobSummary):
    allocation: Allocation = Field(description="where the live attempt runs (empty when it holds no GPUs)")
    last_checkpoint: str | None = Field(
        None, description="URI of the newest complete checkpoint; the next attempt resumes from it"
    )
    last_checkpoint_at: datetime | None = Field(None, description="when it was reported")
    preemptions: int = Field(description="times the job was preempted", examples=[0])
    extensions: int = Field(description="runtime extensions granted", examples=[0])
    max_runtime_s: float = Field(description="how long it may run, in seconds, extensions included", examples=[14400])
    exit_code: int | None = Field(None, description="the job's exit code once it ended", examples=[0])
    queued_at: datetime = Field(description="when it (last) entered the queue")
    pending_detail: str | None = Field(None, description="a sentence on why it waits (QUEUED only)")
    expected_start: datetime | None = Field(None, description="the scheduler's estimate of its start (QUEUED only)")
    submitted_by: str = Field(description="the principal that submitted it", examples=["alice"])
    workflow_started: bool = Field(description="its workflow was started (the control plane owns it)")
    spec: dict[str, Any] = Field(description="the submitted spec, as stored")
    gpu_use: GpuUse | None = Field(None, description="what its GPUs do; null when it holds none")
    rank_results: list[RankResult] = Field(
        default_factory=list, description="how each rank of the newest attempt with an ended rank ended"
    )
    failure: FailureCause | None = Field(
        None, description="why the latest ended attempt did not succeed; null when none failed"
    )


class JobList(BaseModel):
    jobs: list[JobSummary] = Field(description="newest first")
    next_cursor: str | None = Field(None, description="pass as ?cursor= for the next page; null on the last")


class JobEvent(BaseModel):
    id: int
    attempt: int
    event: str
    from_state: str | None = None
    to_state: str | None = None
    reason: str | None = None
    detail: dict[str, Any] = Field(default_factory=dict)
    actor: str
    at: datetime


class JobEvents(BaseModel):
    job_id: str
    events: list[JobEvent]
    next_cursor: str | None = None


class CancelAccepted(BaseModel):
    job_id: str
    state: Literal["CANCELLING"] = "CANCELLING"


class ExtendBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    by: DurationValue = Field(description="how much longer the job may run")
    reason: PlainText1000 = ""


class ExtendGranted(BaseModel):
    job_id: str
    granted: bool
    code: str
    message: str
    new_deadline: datetime | None = None
    extensions_used: int = 0


class WaitingFor(BaseModel):
    gpus_requested: int
    gpus_free_of_type: int = Field(description="GPUs of the job's type on ready nodes with no live allocation")
    team_quota_headroom: int = Field(description="guaranteed + borrow limit - GPUs the team holds, for this type")
    jobs_ahead: int | None = None


class Explain(BaseModel):
    job_id: str
    state: str
    pending: bool
    queue_position: int | None = None
    pending_reason: str | None = None
    pending_detail: str | None = None
    expected_start: datetime | None = None
    message: str
    waiting_for: WaitingFor | None = None
    gpu_use: GpuUse | None = None
    failure: FailureCause | None = Field(
        None, description="why the latest ended attempt did not succeed and whether it is retried"
    )


class QuotaEntry(BaseModel):
    guaranteed: int = Field(description="GPUs of this type the team is guaranteed", examples=[64])
    in_use: int = Field(description="GPUs of this type the team holds now (guaranteed and borrowed)", examples=[16])
    borrowed: int = Field(description="of in_use, GPUs held beyond the guarantee (always preemptible)", examples=[0])
    borrow_limit: int = Field(description="idle GPUs beyond the guarantee the team may borrow", examples=[128])


class TeamQuota(RootModel[dict[str, QuotaEntry]]):
    """GPU type -> quota and usage, e.g. {"h100": {"guaranteed", "in_use", "borrowed", ...}}."""


class TeamPriorityClasses(BaseModel):
    """The priority classes a team may submit in."""

    team: str = Field(examples=["pretrain"])
    priority_classes: list[PriorityClass] | None = Field(
        description="the entitlement an admin set, in class order; null: none set, every class allowed",
        examples=[["research", "preemptible"]],
    )
    allowed: list[PriorityClass] = Field(
        description="the classes admission accepts from this team now", examples=[["research", "preemptible"]]
    )


class PriorityClassesSet(BaseModel):
    """An entitlement write: the classes a team may submit in (null: every class), and why."""

    model_config = ConfigDict(extra="forbid")
    priority_classes: Annotated[list[PriorityClass], Field(min_length=1, max_length=4)] | None = Field(
        description="the classes the team may submit in; null lifts the restriction (every class)",
        examples=[["research", "preemptible"]],
    )
    reason: PlainText1000_1 = Field(description="recorded in the audit row", examples=["research team: no prod work"])

    def classes(self) -> tuple[str, ...] | None:
        """The set in class order (highest first), duplicates dropped; None: every class."""
        if self.priority_classes is None:
            return None
        return tuple(c.value for c in sorted(set(self.priority_classes), key=lambda c: c.rank))


class QuotaSet(BaseModel):
    """One GPU type's quota: {"gpu_type": "h100", "guaranteed": 64, "reason": "..."}."""

    model_config = ConfigDict(extra="forbid")
    gpu_type: Str64_1 = Field(description="the GPU type", examples=["h100"])
    guaranteed: int = Field(ge=0, le=10_000_000, description="GPUs of this type guaranteed", examples=[64])
    borrow_limit: int | None = Field(
        None, ge=0, le=10_000_000, description="unset = keep the current one (0 if new)", examples=[128]
    )
    reason: PlainText1000_1 = Field(description="recorded in the audit row", examples=["Q3 rebalance"])


class QuotaLimits(BaseModel):
    """One GPU type's entry in the map shape of a quota write."""

    model_config = ConfigDict(extra="forbid")
    guaranteed: int = Field(ge=0, le=10_000_000, description="GPUs of this type guaranteed", examples=[3072])
    borrow_limit: int | None = Field(
        None, ge=0, le=10_000_000, description="unset = keep the current one (0 if new)", examples=[1024]
    )
    reason: PlainText1000_1 | None = Field(
        None, description='recorded in the audit row; default "set by <admin>"', examples=["Q3 rebalance"]
    )


QuotaMap = Annotated[
    dict[Str64_1, QuotaLimits],
    Field(
        min_length=1,
        max_length=64,
        description='GPU type -> its quota, e.g. {"h100": {"guaranteed": 3072, "borrow_limit": 1024}}',
    ),
]


def _quota_shape(v: Any) -> str:
    if isinstance(v, QuotaSet) or (isinstance(v, dict) and "gpu_type" in v):
        return "single"
    return "by_gpu_type"


class QuotaBody(
    RootModel[
        Annotated[
            Annotated[QuotaSet, Tag("single")] | Annotated[QuotaMap, Tag("by_gpu_type")],
            Discriminator(_quota_shape),
        ]
    ]
):
    """A quota write: one GPU type ({"gpu_type", "guaranteed", "borrow_limit"?, "reason"}) or several at once
    ({"h100": {"guaranteed", "borrow_limit"?, "reason"?}, ...}), applied in one transaction."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"h100": {"guaranteed": 64, "borrow_limit": 128}},
                {"gpu_type": "h100", "guaranteed": 64, "reason": "Q3 rebalance"},
            ]
        }
    )

    def entries(self, default_reason: str) -> list[tuple[str, int, int | None, str]]:
        """(gpu_type, guaranteed, borrow_limit or None, reason) per GPU type, in the body's order."""
        b = self.root
        if isinstance(b, QuotaSet):
            return [(b.gpu_type, b.guaranteed, b.borrow_limit, b.reason)]
        return [(g, q.guaranteed, q.borrow_limit, q.reason or default_reason) for g, q in b.items()]


class QueueEntry(BaseModel):
    job_id: str = Field(description="the job's id", examples=["j-0f3c9a1b2d"])
    name: str | None = Field(None, description="its label")
    priority_class: str = Field(description="its priority class", examples=["research"])
    gpu_type: str = Field(description="the GPU type it waits for", examples=["h100"])
    gpus: int = Field(description="GPUs it needs", examples=[16])
    state: str = Field(description="QUEUED", examples=["QUEUED"])
    queue_position: int | None = Field(None, description="1-based position (null until a cycle ranks it)")
    pending_reason: str | None = Field(None, description="why it waits", examples=["capacity"])
    expected_start: datetime | None = Field(None, description="the scheduler's estimate of its start")
    submitted_at: datetime = Field(description="when it was submitted")


class TeamQueue(BaseModel):
    team: str = Field(description="the team", examples=["pretrain"])
    usage: dict[str, QuotaEntry] = Field(description="GPU type -> the team's quota and use")
    counts: dict[str, int] = Field(description="jobs of the team by live state")
    jobs: list[QueueEntry] = Field(description="queued jobs in queue order")
    next_cursor: str | None = Field(None, description="pass as ?cursor= for the next page; null on the last")


class NodeSummary(BaseModel):
    node_id: str
    block_id: str
    gpu_type: str
    gpus: int
    gpus_allocated: int
    state: str
    status: str = Field(
        "",
        description="the state and what it waits for before it moves on, e.g. `burn_in (waiting for 1 rank to exit)`",
        examples=["burn_in (waiting for 1 rank to exit)", "draining (2 jobs to finish or be evicted)"],
    )
    waiting_for: str | None = Field(
        None, description="what the state waits for (None when ready): ranks to exit, jobs to finish, a heartbeat"
    )
    live_ranks: int = Field(0, description="ranks on the node whose leases are live (not yet confirmed gone)")
    reason: str | None = Field(None, description="why it entered its state (the health monitor's or an admin's)")
    drain_evict: bool = False
    updated_at: datetime = Field(description="when it entered its state")
    hot_spare: bool = Field(False, description="held free by the leader as a hot spare for a large gang's restarts")
    hot_spare_for: str | None = Field(
        None, description="the job it is held for (another team's job id is shown to admins only)"
    )


class NodeList(BaseModel):
    nodes: list[NodeSummary]
    next_cursor: str | None = None
    hot_spares: int = Field(0, description="nodes held as hot spares under this list's filters (all pages)")


class NodeLease(BaseModel):
    lease_id: str | None = Field(None, description="hidden for other teams' leases unless admin")
    job_id: str | None = None
    team: str | None = None
    attempt: int | None = None
    rank: int | None = None
    gpu_indices: list[int]
    epoch: int | None = None


class NodeGpu(BaseModel):
    index: int
    allocated: bool
    borrowed: bool | None = None
    job_id: str | None = None


class NodeView(NodeSummary):
    task_queue: str | None = None
    agent_addr: str | None = None
    gpu_slots: list[NodeGpu]
    leases: list[NodeLease]


class DrainBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: PlainText1000_1
    evict: bool = Field(False, description="also stop the node's running jobs (the health monitor acts on it)")


class DrainAccepted(BaseModel):
    node_id: str
    state: str
    previous_state: str
    reason: str
    evict: bool


class ReturnBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: PlainText1000_1


class ReturnAccepted(BaseModel):
    node_id: str
    state: str
    previous_state: str
    reason: str


class CredentialBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: PlainText1000_1


class CredentialIssued(BaseModel):
    node_id: str
    credential: str | None = Field(
        description="the node's new credential, shown once (a replay of the request shows null: issue again to rotate)"
    )
    log_key: str | None = Field(
        description="the key the node's log endpoint checks the API's log tokens with (GPUFLEET_AGENT_LOG_KEYS);"
        " shown with the credential"
    )
    issued_at: datetime


class CredentialRevoked(BaseModel):
    node_id: str
    revoked: bool = Field(description="false when the node had no live credential")


class Me(BaseModel):
    name: str
    team: str | None = None
    admin: bool


class Health(BaseModel):
    status: str
    database: str
