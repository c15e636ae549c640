"""What happened, read by the checker from the three places that record it, with its own code:

* Postgres, with its own SQL (it imports none of ``store``, ``control``, ``api``,
  ``workflows``, ``activities``: an import-linter contract keeps it so): jobs, job events,
  the whole lease history, allocation rows, audit rows, idempotency keys, the leader row,
  nodes, the job state table, agents' stored reports (``task_reports``, where that table
  exists) and the rows leaders publish with their epoch;
* Temporal's visibility: every workflow execution, its start and close time and status;
* the agents' records on disk (``<state>/agent/<node>/leases/<lease>/``): the task as
  received, when its rank started (``supervisor.json``), how it ended (``exit.json``), when
  the control plane acknowledged the end (``reported.json``) and why it was stopped
  (``stop.json``). The file names are the agent's layout (``worker_agent.statefiles``; a
  test keeps these names equal to its).

Every time is wall-clock seconds since the epoch (one machine, one clock).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg

# the agent's state dir layout (worker_agent/statefiles.py)
TASK = "task.json"
SUPERVISOR = "supervisor.json"
EXIT = "exit.json"
REPORTED = "reported.json"
STOP = "stop.json"

TERMINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT"})


def _ts(value: datetime | None) -> float | None:
    return None if value is None else value.timestamp()


def _json(value: Any) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return {}


@dataclass(frozen=True)
class JobRow:
    job_id: str
    name: str | None
    team: str
    submitted_by: str
    priority_class: str
    replicas: int
    state: str
    attempt: int
    submitted_at: float
    finished_at: float | None
    # why a job not yet finished waits, as placement last said (the report's unfinished_at_end)
    pending_reason: str | None = None
    pending_detail: str | None = None


@dataclass(frozen=True)
class JobEvent:
    id: int
    job_id: str
    attempt: int
    event: str
    from_state: str | None
    to_state: str | None
    reason: str | None
    detail: Mapping[str, Any]
    actor: str
    at: float


@dataclass(frozen=True)
class LeaseRow:
    lease_id: str
    job_id: str
    attempt: int
    rank: int
    node_id: str
    gpus: tuple[int, ...]
    epoch: int
    live: bool
    created_at: float
    released_at: float | None
    release_reason: str | None


@dataclass(frozen=True)
class AllocationRow:
    node_id: str
    gpu: int
    lease_id: str


@dataclass(frozen=True)
class AuditRow:
    id: int
    at: float
    actor: str
    action: str
    subject: str
    reason: str | None
    detail: Mapping[str, Any]


@dataclass(frozen=True)
class IdempotencyRow:
    principal: str
    key: str
    status: str
    response_code: int | None
    job_id: str | None


@dataclass(frozen=True)
class LeaderRow:
    scope: str
    epoch: int
    holder: str
    acquired_at: float
    expires_at: float


@dataclass(frozen=True)
class EpochRow:
    """A row a leader publishes with its epoch (reservations, hot spares): the latest write."""

    table: str
    subject: str
    epoch: int
    at: float


@dataclass(frozen=True)
class TaskReport:
    lease_id: str
    job_id: str
    attempt: int
    rank: int
    state: str
    exit_code: int | None
    received_at: float


@dataclass(frozen=True)
class WorkflowRun:
    workflow_id: str
    run_id: str
    status: str  # RUNNING, COMPLETED, CONTINUED_AS_NEW, FAILED, TERMINATED, ...
    start_time: float
    close_time: float | None


@dataclass(frozen=True)
class RankRecord:
    """One lease dir of one node's agent: the rank as the agent recorded it."""

    node_id: str
    lease_id: str
    job_id: str
    attempt: int
    rank: int
    gpus: tuple[int, ...]
    epoch: int
    started_at: float | None  # the rank process started (None: it never did)
    exit_state: str | None  # EXITED, STOPPED, FENCED, LOST (None: no exit on record: running)
    exit_code: int | None
    exit_reason: str
    exit_by: str  # "supervisor" or "agent"
    finished_at: float | None
    reported_at: float | None  # the control plane acknowledged the end
    stop_reason: str | None  # why it was asked to stop (stop.json), if it was

    def running_interval(self, now: float) -> tuple[float, float] | None:
        """When the rank ran: from its start to its exit (or ``now`` when no exit is on record)."""
        if self.started_at is None:
            return None
        end = self.finished_at if self.finished_at is not None else now
        return (self.started_at, max(self.started_at, end))


@dataclass(frozen=True)
class History:
    read_at: float
    jobs: Mapping[str, JobRow]
    events: tuple[JobEvent, ...]
    leases: tuple[LeaseRow, ...]
    allocations: tuple[AllocationRow, ...]
    audit: tuple[AuditRow, ...]
    idempotency: tuple[IdempotencyRow, ...]
    leader: tuple[LeaderRow, ...]
    nodes: Mapping[str, str]  # node_id -> state
    edges: frozenset[tuple[str, str]]  # the job state table (job_state_changes)
    epoch_rows: tuple[EpochRow, ...] = ()
    task_reports: tuple[TaskReport, ...] | None = None  # None: no such table (yet)
    workflows: Mapping[str, tuple[WorkflowRun, ...]] | None = None  # None: visibility unreadable
    ranks: tuple[RankRecord, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)

    def events_of(self, job_id: str) -> list[JobEvent]:
        return [e for e in self.events if e.job_id == job_id]


# ---------------------------------------------------------------------------- Postgres


async def _table_columns(conn: asyncpg.Connection, table: str) -> set[str]:
    rows = await conn.fetch(
        "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema() AND table_name = $1",
        table,
    )
    return {r["column_name"] for r in rows}


async def read_postgres(dsn: str, scope: str | None = None) -> dict[str, Any]:
    """Every row the checker judges, read in one repeatable-read snapshot."""
    conn = await asyncpg.connect(dsn, timeout=30)
    try:
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            out: dict[str, Any] = {"notes": []}
            out["jobs"] = {
                r["job_id"]: JobRow(
                    r["job_id"],
                    r["name"],
                    r["team"],
                    r["submitted_by"],
                    r["priority_class"],
                    r["replicas"],
                    r["state"],
                    r["attempt"],
                    r["submitted_at"].timestamp(),
                    _ts(r["finished_at"]),
                    r["pending_reason"],
                    r["pending_detail"],
                )
                for r in await conn.fetch(
                    "SELECT job_id, name, team, submitted_by, priority_class, replicas, state, attempt,"
                    " submitted_at, finished_at, pending_reason, pending_detail FROM jobs"
                )
            }
            out["events"] = tuple(
                JobEvent(
                    r["id"],
                    r["job_id"],
                    r["attempt"],
                    r["event"],
                    r["from_state"],
                    r["to_state"],
                    r["reason"],
                    _json(r["detail"]),
                    r["actor"],
                    r["at"].timestamp(),
                )
                for r in await conn.fetch(
                    "SELECT id, job_id, attempt, event, from_state, to_state, reason, detail::text AS detail, actor, at"
                    " FROM job_events ORDER BY id"
                )
            )
            out["leases"] = tuple(
                LeaseRow(
                    r["lease_id"],
                    r["job_id"],
                    r["attempt"],
                    r["rank"],
                    r["node_id"],
                    tuple(r["gpu_indices"]),
                    r["epoch"],
                    r["state"] == "live",
                    r["created_at"].timestamp(),
                    _ts(r["released_at"]),
                    r["release_reason"],
                )
                for r in await conn.fetch(
                    "SELECT lease_id, job_id, attempt, rank, node_id, gpu_indices, epoch, state, created_at,"
                    " released_at, release_reason FROM leases ORDER BY created_at, lease_id"
                )
            )
            out["allocations"] = tuple(
                AllocationRow(r["node_id"], r["gpu_index"], r["lease_id"])
                for r in await conn.fetch("SELECT node_id, gpu_index, lease_id FROM allocations")
            )
            out["audit"] = tuple(
                AuditRow(
                    r["id"],
                    r["at"].timestamp(),
                    r["actor"],
                    r["action"],
                    r["subject"],
                    r["reason"],
                    _json(r["detail"]),
                )
                for r in await conn.fetch(
                    "SELECT id, at, actor, action, subject, reason, detail::text AS detail FROM audit ORDER BY id"
                )
            )
            out["idempotency"] = tuple(
                IdempotencyRow(
                    r["principal"],
                    r["key"],
                    r["status"],
                    r["response_code"],
                    _json(r["response_body"]).get("job_id"),
                )
                for r in await conn.fetch(
                    "SELECT principal, key, status, response_code, response_body::text AS response_body"
                    " FROM idempotency_keys"
                )
            )
            leader_sql = "SELECT scope, epoch, holder, acquired_at, expires_at FROM leader"
            leader_rows = await (
                conn.fetch(leader_sql + " WHERE scope = $1", scope) if scope else conn.fetch(leader_sql)
            )
            out["leader"] = tuple(
                LeaderRow(
                    r["scope"], r["epoch"], r["holder"], r["acquired_at"].timestamp(), r["expires_at"].timestamp()
                )
                for r in leader_rows
            )
            out["nodes"] = {r["node_id"]: r["state"] for r in await conn.fetch("SELECT node_id, state FROM nodes")}
            out["edges"] = frozenset(
                (r["from_state"], r["to_state"])
                for r in await conn.fetch("SELECT from_state, to_state FROM job_state_changes")
            )
            epoch_rows: list[EpochRow] = []
            for table, subject in (("reservations", "job_id"), ("hot_spares", "node_id")):
                if {"epoch", "updated_at", subject} <= await _table_columns(conn, table):
                    for r in await conn.fetch(f"SELECT {subject} AS subject, epoch, updated_at FROM {table}"):
                        epoch_rows.append(EpochRow(table, r["subject"], r["epoch"], r["updated_at"].timestamp()))
            out["epoch_rows"] = tuple(epoch_rows)
            cols = await _table_columns(conn, "task_reports")
            wanted = {"lease_id", "job_id", "attempt", "rank", "state", "exit_code", "received_at"}
            if not cols:
                out["task_reports"] = None
                out["notes"].append(
                    "no task_reports table: a success is on record when the agents' exits were acknowledged"
                    " (reported.json) or the job's 'succeeded' event was written"
                )
            elif not wanted <= cols:
                out["task_reports"] = None
                out["notes"].append(f"task_reports lacks {sorted(wanted - cols)}: not read")
            else:
                out["task_reports"] = tuple(
                    TaskReport(
                        r["lease_id"],
                        r["job_id"],
                        r["attempt"],
                        r["rank"],
                        r["state"],
                        r["exit_code"],
                        r["received_at"].timestamp(),
                    )
                    for r in await conn.fetch(
                        "SELECT lease_id, job_id, attempt, rank, state, exit_code, received_at FROM task_reports"
                    )
                )
            return out
    finally:
        await conn.close()


# ---------------------------------------------------------------------------- Temporal


async def read_workflows(client: Any, timeout_s: float = 60.0) -> dict[str, tuple[WorkflowRun, ...]]:
    """Every workflow execution Temporal's visibility lists, by workflow id (runs by start time)."""
    import asyncio

    runs: dict[str, list[WorkflowRun]] = defaultdict(list)

    async def collect() -> None:
        async for wf in client.list_workflows(page_size=1000):
            status = wf.status.name if wf.status is not None else "UNKNOWN"
            runs[wf.id].append(WorkflowRun(wf.id, wf.run_id, status, wf.start_time.timestamp(), _ts(wf.close_time)))

    await asyncio.wait_for(collect(), timeout_s)
    return {k: tuple(sorted(v, key=lambda r: r.start_time)) for k, v in runs.items()}


# ---------------------------------------------------------------------------- agents


def _read(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def read_agent_records(state_dir: Path) -> tuple[RankRecord, ...]:
    """Every lease dir of every node's agent under ``state_dir``."""
    out: list[RankRecord] = []
    root = Path(state_dir) / "agent"
    if not root.is_dir():
        return ()
    for node_dir in sorted(root.iterdir()):
        leases = node_dir / "leases"
        if not leases.is_dir():
            continue
        for d in sorted(leases.iterdir()):
            task = _read(d / TASK)
            if task is None:
                continue  # a tombstone (stopped before it started) or a start being written
            sup = _read(d / SUPERVISOR) or {}
            ex = _read(d / EXIT)
            rep = _read(d / REPORTED)
            stop = _read(d / STOP)
            started = sup.get("started_at") if sup.get("rank_pid") else None
            out.append(
                RankRecord(
                    node_id=str(task.get("node_id") or node_dir.name),
                    lease_id=str(task.get("lease_id") or d.name),
                    job_id=str(task.get("job_id", "")),
                    attempt=int(task.get("attempt") or 0),
                    rank=int(task.get("rank") or 0),
                    gpus=tuple(int(g) for g in task.get("gpu_indices") or ()),
                    epoch=int(task.get("epoch") or 0),
                    started_at=float(started) if started is not None else None,
                    exit_state=str(ex["state"]) if ex and ex.get("state") else None,
                    exit_code=ex.get("exit_code") if ex else None,
                    exit_reason=str((ex or {}).get("reason") or ""),
                    exit_by=str((ex or {}).get("by") or "supervisor"),
                    finished_at=float(ex["finished_at"]) if ex and ex.get("finished_at") is not None else None,
                    reported_at=float(rep["at"]) if rep and rep.get("at") is not None else None,
                    stop_reason=str(stop.get("reason") or "") if stop else None,
                )
            )
    return tuple(out)


# ---------------------------------------------------------------------------- all of it


async def load(dsn: str, state_dir: Path, *, temporal_client: Any | None, scope: str | None = None) -> History:
    """Read the history now: Temporal's visibility first (a workflow that ends meanwhile then
    finds its job terminal in Postgres, never the other way round), Postgres in one snapshot,
    then the agents' records."""
    import time

    notes: list[str] = []
    workflows: dict[str, tuple[WorkflowRun, ...]] | None = None
    if temporal_client is not None:
        try:
            workflows = await read_workflows(temporal_client)
        except Exception as e:  # judged as unknown by the invariants that need it
            notes.append(f"Temporal visibility unreadable: {type(e).__name__}: {e}")
    else:
        notes.append("no Temporal client: visibility not read")
    pg = await read_postgres(dsn, scope)
    notes.extend(pg.pop("notes"))
    ranks = read_agent_records(state_dir)
    return History(read_at=time.time(), workflows=workflows, ranks=ranks, notes=tuple(notes), **pg)
