"""What a chaos run did, in the run's own words: the workload's submissions, the faults it
injected and the leader rows it saw. The checker reads these beside what the platform
recorded (``chaos.history``); times are wall-clock seconds (``time.time()``), the clock
Postgres, Temporal and the agents' records use on one machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

# every fault kind a run injects, in the order reports list them
FAULT_KINDS = (
    "agent_kill",
    "agent_stop",
    "leader_stop",
    "leader_kill",
    "temporal_restart",
    "postgres_restart",
    "xid",
    "rank_hang",
)
# kinds a run injects only on a stack with a Postgres standby (``--ha``), besides the others
HA_FAULT_KINDS = ("postgres_failover",)
ALL_FAULT_KINDS = FAULT_KINDS + HA_FAULT_KINDS
# faults that hit nodes (their agent or their GPUs): a rank may die of these
NODE_FAULTS = frozenset({"agent_kill", "agent_stop", "xid", "rank_hang"})
# faults of the control plane alone: no running rank may die of these
CONTROL_FAULTS = frozenset({"leader_stop", "leader_kill", "temporal_restart", "postgres_restart", "postgres_failover"})


@dataclass(frozen=True)
class Submission:
    """One logical submission of the workload: every request sent with one Idempotency-Key.

    ``name`` is unique per logical submission, so the jobs it created can be found without
    trusting the API's answers."""

    key: str
    principal: str
    team: str
    name: str
    kind: str
    priority_class: str
    replicas: int
    gpus_per_replica: int
    first_sent_at: float
    statuses: tuple[int, ...] = ()  # HTTP status of every request sent (0: no response)
    job_ids: tuple[str, ...] = ()  # the job id of every 202
    cancel_requested_at: float | None = None

    @property
    def accepted(self) -> bool:
        return 202 in self.statuses

    @property
    def sends(self) -> int:
        return len(self.statuses)


@dataclass(frozen=True)
class Fault:
    """One injected fault: when it began, when the harness undid it, what it hit."""

    kind: str
    started_at: float
    ended_at: float
    target: str
    nodes: tuple[str, ...] = ()  # the nodes whose agent or GPUs it hit (node faults)
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class LeaderSample:
    """A leader row as the harness saw it (one per epoch: the latest sample of it)."""

    epoch: int
    holder: str
    acquired_at: float
    expires_at: float
    first_seen_at: float
    last_seen_at: float


@dataclass(frozen=True)
class RunRecord:
    submissions: tuple[Submission, ...] = ()
    faults: tuple[Fault, ...] = ()
    leaders: tuple[LeaderSample, ...] = ()
    started_at: float = 0.0
    faults_ended_at: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RunRecord:
        return cls(
            submissions=tuple(
                Submission(**{**s, "statuses": tuple(s["statuses"]), "job_ids": tuple(s["job_ids"])})
                for s in d.get("submissions", ())
            ),
            faults=tuple(Fault(**{**f, "nodes": tuple(f["nodes"])}) for f in d.get("faults", ())),
            leaders=tuple(LeaderSample(**x) for x in d.get("leaders", ())),
            started_at=float(d.get("started_at", 0.0)),
            faults_ended_at=float(d.get("faults_ended_at", 0.0)),
        )
