"""/v1/jobs: submit, inspect, list, events, logs, explain, cancel, extend."""

from __future__ import annotations

import logging
import secrets
import time
from datetime import datetime
from typing import Annotated, Any

import asyncpg
from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import AfterValidator

from api import idempotency
from api.admission import admit, format_duration, parse_duration
from api.auth import current_principal
from api.deps import (
    JobId,
    decode_cursor,
    encode_cursor,
    gateway_of,
    page_size,
    pool_of,
    settings_of,
    visible_job,
)
from api.errors import ERROR_RESPONSES, ApiError
from api.failure import failure_view, rank_result
from api.gateway import ControlUnavailable, UpdateRejected, WorkflowClosed, WorkflowMissing
from api.logs_proxy import LogQuery, RankSource, job_log_stream
from api.schemas import (
    CancelAccepted,
    Explain,
    ExtendBody,
    ExtendGranted,
    JobEvents,
    JobList,
    JobSubmit,
    JobView,
    SubmitAccepted,
    storable,
)
from common.settings import Principal
from placement.lifecycle import TERMINAL, JobState
from store import job_states, jobs, lease_use, nodes, task_reports, teams
from store.audit import write_audit, write_job_event
from workflows.messages import CancelRequest, ExtendRequest

log = logging.getLogger("gpufleet.api")

router = APIRouter(prefix="/v1", tags=["jobs"], dependencies=[Depends(current_principal)], responses=ERROR_RESPONSES)

IdempotencyKey = Annotated[
    str,
    Header(
        alias="Idempotency-Key",
        description="required on every write: a unique string per logical request, reused on retries",
    ),
]
Reason = Annotated[str, Query(max_length=1000), AfterValidator(storable)]
QueryTeam = Annotated[str | None, Query(max_length=200), AfterValidator(lambda v: v if v is None else storable(v))]
Cursor = Annotated[str | None, Query(max_length=2000)]
Limit = Annotated[int | None, Query(ge=1, le=1_000_000, description="page size (at most the server's max page size)")]


def new_job_id() -> str:
    """Sortable by submit time (ms) with a random tail: ``j-<11 hex ms>-<8 hex>``."""
    return f"j-{int(time.time() * 1000):011x}-{secrets.token_hex(4)}"


def job_summary(row: asyncpg.Record) -> dict[str, Any]:
    return {
        "job_id": row["job_id"],
        "team": row["team"],
        "name": row["name"],
        "priority_class": row["priority_class"],
        "gpu_type": row["gpu_type"],
        "replicas": row["replicas"],
        "gpus_per_replica": row["gpus_per_replica"],
        "gpus": row["replicas"] * row["gpus_per_replica"],
        "state": row["state"],
        "attempt": row["attempt"],
        "submitted_at": row["submitted_at"],
        "started_at": row["started_at"],
        "finished_at": row["finished_at"],
        "queue_position": row["queue_position"] if row["state"] == JobState.QUEUED else None,
        "pending_reason": row["pending_reason"] if row["state"] == JobState.QUEUED else None,
        "max_runtime_s": row["max_runtime_s"],
        "nodes": list(row["nodes"] or []) if "nodes" in row else None,
    }


def job_view(row: asyncpg.Record, ranks: list[asyncpg.Record]) -> dict[str, Any]:
    queued = row["state"] == JobState.QUEUED
    spec = row["spec"] if isinstance(row["spec"], dict) else {}
    return {
        **job_summary(row),
        "nodes": list(dict.fromkeys(r["node_id"] for r in ranks)),
        "allocation": {
            "nodes": list(dict.fromkeys(r["node_id"] for r in ranks)),
            "blocks": list(dict.fromkeys(r["block_id"] for r in ranks)),
            "ranks": [
                {
                    "rank": r["rank"],
                    "node_id": r["node_id"],
                    "block_id": r["block_id"],
                    "gpu_indices": list(r["gpu_indices"]),
                    "lease_id": r["lease_id"],
                }
                for r in ranks
            ],
        },
        "last_checkpoint": row["last_checkpoint"],
        "last_checkpoint_at": row["last_checkpoint_at"],
        "preemptions": row["preemptions"],
        "extensions": row["extensions"],
        "max_runtime_s": row["max_runtime_s"],
        "exit_code": row["exit_code"],
        "queued_at": row["queued_at"],
        "pending_detail": row["pending_detail"] if queued else None,
        "expected_start": row["expected_start"] if queued else None,
        "submitted_by": row["submitted_by"],
        "workflow_started": row["workflow_started"],
        "spec": spec,
    }


# --- submit -----------------------------------------------------------------------------


@router.post("/jobs", status_code=202, response_model=SubmitAccepted, summary="Submit a job")
async def submit_job(
    request: Request,
    job: JobSubmit,
    idempotency_key: IdempotencyKey,
    principal: Principal = Depends(current_principal),
) -> Any:
    """Admission-checked; the job row, its `submitted` event, its audit row and the
    idempotency key commit in one transaction, and that is all a submit does: the job waits
    in Postgres, and its workflow starts when the leader allocates its GPUs (its start and
    allocation in one workflow task), so a submit never waits on Temporal."""
    settings = settings_of(request)

    async def work(conn: asyncpg.Connection) -> idempotency.Outcome:
        max_runtime_s = await admit(conn, settings, principal, job)
        position = await jobs.estimate_queue_position(conn, job.priority_class, settings.placement_lookahead)
        job_id = new_job_id()
        gpus = job.replicas * job.gpus_per_replica
        spec = {
            "image": job.image,
            "command": list(job.command),
            "env": dict(job.env),
            "topology": job.topology.model_dump(),
            "checkpoint": job.checkpoint.model_dump(),
            "max_runtime": job.max_runtime,
        }
        await jobs.insert_job(
            conn,
            job_id=job_id,
            team=job.team,
            name=job.name,
            priority_class=job.priority_class,
            gpu_type=job.gpu_type,
            replicas=job.replicas,
            gpus_per_replica=job.gpus_per_replica,
            spec=spec,
            max_runtime_s=max_runtime_s,
            submitted_by=principal.name,
        )
        detail = {
            "team": job.team,
            "priority_class": job.priority_class,
            "gpu_type": job.gpu_type,
            "gpus": gpus,
            "replicas": job.replicas,
            "gpus_per_replica": job.gpus_per_replica,
            "max_runtime_s": max_runtime_s,
        }
        await write_job_event(conn, job_id, 1, "submitted", None, JobState.QUEUED, principal.name, "submitted", detail)
        await write_audit(conn, principal.name, "submit", job_id, None, detail)
        body = {
            "job_id": job_id,
            "state": JobState.QUEUED,
            "queue_position": position,
            "queue_position_estimated": True,
        }
        return idempotency.Outcome(202, body, headers={"Location": f"/v1/jobs/{job_id}"})

    return await idempotency.run(request, principal, idempotency_key, work)


# --- reads --------------------------------------------------------------------------------


@router.get("/jobs", response_model=JobList, summary="List jobs (newest first)")
async def list_jobs(
    request: Request,
    team: QueryTeam = None,
    state: JobState | None = None,
    cursor: Cursor = None,
    limit: Limit = None,
    principal: Principal = Depends(current_principal),
) -> Any:
    if not principal.admin:
        if team is not None and team != principal.team:
            raise ApiError(403, "forbidden", f"principal {principal.name} may list team {principal.team}'s jobs only")
        team = principal.team
    n = page_size(request, limit)
    after_raw = decode_cursor("jobs", cursor)
    after = None
    if after_raw is not None:
        try:
            after = (datetime.fromisoformat(after_raw[0]), str(after_raw[1]))
        except (ValueError, TypeError, IndexError) as e:
            raise ApiError(400, "invalid_cursor", "the cursor is not one this list returned") from e
    rows = await jobs.list_jobs(pool_of(request), team=team, state=state, after=after, limit=n + 1)
    next_cursor = None
    if len(rows) > n:
        rows = rows[:n]
        last = rows[-1]
        next_cursor = encode_cursor("jobs", [last["submitted_at"].isoformat(), last["job_id"]])
    return {"jobs": [job_summary(r) for r in rows], "next_cursor": next_cursor}


@router.get("/jobs/{job_id}", response_model=JobView, summary="One job: state, attempt, allocation, queue position")
async def get_job(request: Request, job_id: JobId, principal: Principal = Depends(current_principal)) -> Any:
    pool = pool_of(request)
    row = await visible_job(pool, principal, job_id)
    ranks = await jobs.job_ranks(pool, job_id, row["attempt"])
    results, failure = await _failure(request, pool, row)
    view = job_view(row, ranks)
    if view["exit_code"] is None and failure is not None and row["state"] == JobState.FAILED:
        view["exit_code"] = failure["exit_code"]  # a job that failed before its rank's code was recorded
    return {**view, "gpu_use": await _gpu_use(pool, job_id), "rank_results": results, "failure": failure}


async def _failure(request: Request, pool: Any, row: Any) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Each rank's end in the newest attempt that has one, and why the latest ended attempt
    did not succeed (``api.failure``): from Postgres alone, so it answers after the node is gone."""
    settings = settings_of(request)
    ends = await task_reports.rank_ends(pool, row["job_id"])
    last_end = await job_states.last_attempt_end(pool, row["job_id"])
    faults = 0
    if row["state"] not in TERMINAL:
        faults = await job_states.job_faults_within(pool, row["job_id"], settings.failure_window_s)
    failure = failure_view(row, ends, last_end, faults, settings)
    if failure is not None and (not ends or ends[0].attempt != failure["attempt"]):
        ends = await task_reports.rank_ends(pool, row["job_id"], failure["attempt"])
        failure = failure_view(row, ends, last_end, faults, settings)
    return [rank_result(e) for e in ends], failure


async def _gpu_use(pool: Any, job_id: str) -> dict[str, Any] | None:
    use = await lease_use.job_gpu_use(pool, job_id)
    if use is None:
        return None
    return {
        "gpu_util": use.gpu_util,
        "gpus": use.gpus,
        "idle_gpus": use.idle_gpus,
        "idle": use.idle_since is not None,
        "idle_since": use.idle_since,
    }


@router.get("/jobs/{job_id}/events", response_model=JobEvents, summary="The job's timeline")
async def job_events(
    request: Request,
    job_id: JobId,
    cursor: Cursor = None,
    limit: Limit = None,
    principal: Principal = Depends(current_principal),
) -> Any:
    pool = pool_of(request)
    await visible_job(pool, principal, job_id)
    n = page_size(request, limit)
    after_raw = decode_cursor("events", cursor)
    try:
        after_id = int(after_raw[0]) if after_raw else 0
    except (ValueError, TypeError) as e:
        raise ApiError(400, "invalid_cursor", "the cursor is not one this list returned") from e
    if not (0 <= after_id < 2**63):
        raise ApiError(400, "invalid_cursor", "the cursor is not one this list returned")
    rows = await jobs.list_events(pool, job_id, after_id=after_id, limit=n + 1)
    next_cursor = None
    if len(rows) > n:
        rows = rows[:n]
        next_cursor = encode_cursor("events", [rows[-1]["id"]])
    events = [{**dict(r), "detail": r["detail"] if isinstance(r["detail"], dict) else {}} for r in rows]
    return {"job_id": job_id, "events": events, "next_cursor": next_cursor}


_PENDING_TEXT = {
    "quota": "team {team} holds as many {gpu_type} GPUs as its guarantee and borrow limit allow",
    "capacity": "not enough free {gpu_type} GPUs ({free} free on ready nodes, {need} needed)",
    "topology": "enough {gpu_type} GPUs are free, but not in the shape the job accepts ({shape})",
    "reservation": "the free GPUs are held for another job's reservation",
    "hot_spare": "the free {gpu_type} GPUs are held idle as hot spares (for a large gang's restarts)",
    "reserved": "the job holds a reservation for the blocks it will use",
    "lookahead": "the job is beyond the jobs the scheduler considers each cycle",
    "node_health": "it would fit if unhealthy nodes were ready",
    "gpu_type": "the cluster has no ready node of type {gpu_type}",
    "preempting": "lower-priority jobs are being preempted to make room (grace period)",
    "invalid": "the job's shape can never be placed on this cluster",
}


def _shape_text(topo: dict) -> str:
    """The job's placement constraints as a user wrote them (a block limit only if set)."""
    text = f"pack={topo.get('pack', 'any')}"
    if topo.get("max_blocks") is not None:
        text += f", max_blocks={topo['max_blocks']}"
    return text


@router.get("/jobs/{job_id}/explain", response_model=Explain, summary="Why the job is pending and what it waits for")
async def explain_job(request: Request, job_id: JobId, principal: Principal = Depends(current_principal)) -> Any:
    """Read from what each placement cycle publishes to Postgres: answers while the
    control plane is down."""
    pool = pool_of(request)
    row = await visible_job(pool, principal, job_id)
    state = row["state"]
    out: dict[str, Any] = {"job_id": job_id, "state": state, "pending": state == JobState.QUEUED}
    _, failure = await _failure(request, pool, row)
    out["failure"] = failure
    if state != JobState.QUEUED:
        if state in TERMINAL:
            code = row["exit_code"] if row["exit_code"] is not None else (failure or {}).get("exit_code")
            exit_code = f" (exit code {code})" if code is not None else ""
            out["message"] = f"the job finished: {state}{exit_code}"
            if failure is not None:
                out["message"] += ". " + failure["summary"]
        else:
            out["message"] = {
                JobState.STARTING: "GPUs are allocated and the ranks are starting",
                JobState.RUNNING: f"the job is running (attempt {row['attempt']})",
                JobState.PREEMPTING: "the job is being preempted; it checkpoints and is re-queued",
                JobState.CANCELLING: "the job is being cancelled",
            }.get(state, state)
            use = await _gpu_use(pool, job_id)
            out["gpu_use"] = use
            if use is not None and use["idle"]:
                s = request.app.state.settings
                out["message"] += (
                    f"; allocated but idle: its {use['gpus']} GPUs read below {s.idle_gpu_util_pct:g}% SM use"
                    f" since {use['idle_since'].isoformat()}"
                )
            elif use is not None and use["gpu_util"] is not None:
                out["message"] += f"; its GPUs read {use['gpu_util']:.0f}% SM use"
            if failure is not None:
                out["message"] += ". Before: " + failure["summary"]
        return out
    need = row["replicas"] * row["gpus_per_replica"]
    free = await nodes.free_gpus(pool, row["gpu_type"])
    usage = (await teams.team_usage(pool, row["team"])).get(row["gpu_type"])
    headroom = 0 if usage is None else usage["guaranteed"] + usage["borrow_limit"] - usage["in_use"]
    spec = row["spec"] if isinstance(row["spec"], dict) else {}
    topo = spec.get("topology") or {}
    reason = row["pending_reason"]
    if reason is None:
        message = "the job waits for the next placement cycle to rank it"
    else:
        template = _PENDING_TEXT.get(reason, "pending: " + reason)
        message = template.format(
            team=row["team"],
            gpu_type=row["gpu_type"],
            free=free,
            need=need,
            shape=_shape_text(topo),
        )
    if row["pending_detail"]:
        message += f" ({row['pending_detail']})"
    if row["queue_position"] is not None:
        message += f"; position {row['queue_position']} in the queue"
    if row["expected_start"] is not None:
        message += f"; expected to start at {row['expected_start'].isoformat()}"
    if failure is not None:
        message += ". Before: " + failure["summary"]
    out.update(
        {
            "queue_position": row["queue_position"],
            "pending_reason": reason,
            "pending_detail": row["pending_detail"],
            "expected_start": row["expected_start"],
            "message": message,
            "waiting_for": {
                "gpus_requested": need,
                "gpus_free_of_type": max(0, int(free)),
                "team_quota_headroom": headroom,
                "jobs_ahead": None if row["queue_position"] is None else max(0, row["queue_position"] - 1),
            },
        }
    )
    return out


@router.get(
    "/jobs/{job_id}/logs",
    response_class=StreamingResponse,
    summary="Ranks' output (stdout, stderr or both, by time), proxied from their nodes' agents",
    responses={
        200: {
            "content": {
                "text/plain": {"schema": {"type": "string"}, "example": "[stdout] out\n[stderr] boom\n"},
                "application/x-ndjson": {
                    "schema": {"type": "string"},
                    "example": '{"rank":0,"stream":"stderr","time":"2025-01-01T00:00:00.123456+00:00",'
                    '"line":"boom","partial":false}\n',
                },
            },
            "description": "the output, one line per record: text (with `[rank N] ` and `[stdout] `/`[stderr] `"
            " prefixes when several ranks or both streams are asked for; one stream of one rank exactly as"
            " written) or NDJSON (format=ndjson)",
        }
    },
)
async def job_logs(
    request: Request,
    job_id: JobId,
    rank: Annotated[
        int | None, Query(ge=0, le=1_000_000, description="which rank (default 0; not with all_ranks)")
    ] = None,
    all_ranks: Annotated[
        bool, Query(description="every rank of the attempt, merged by time, each line prefixed with its rank")
    ] = False,
    attempt: Annotated[
        int | None, Query(ge=1, le=1_000_000, description="default: the newest attempt with this rank")
    ] = None,
    stream: Annotated[
        str,
        Query(
            pattern="^(stdout|stderr|all)$",
            description="stdout, stderr, or all: both interleaved by the time each line was written, each line"
            " prefixed with its stream",
        ),
    ] = "all",
    tail: Annotated[
        int | None, Query(ge=0, le=100_000, description="only the last N lines (then, with follow, new ones)")
    ] = None,
    follow: Annotated[
        bool, Query(description="keep the response open and send new output until the ranks end (the job's end)")
    ] = False,
    format: Annotated[
        str,
        Query(
            pattern="^(text|ndjson)$",
            description="text, or ndjson: one JSON object a line (rank, stream, time, line, partial)",
        ),
    ] = "text",
    offset: Annotated[
        int, Query(ge=0, le=2**53, description="leave out the first N bytes of the response (to resume a dropped one)")
    ] = 0,
    principal: Principal = Depends(current_principal),
) -> Any:
    if all_ranks and rank is not None:
        raise ApiError(400, "bad_request", "ask for one rank (rank=N) or for all_ranks=true, not both")
    pool = pool_of(request)
    job = await visible_job(pool, principal, job_id)
    first = await jobs.find_rank_lease(pool, job_id, rank or 0, attempt)
    if first is None:
        which = f"attempt {attempt}" if attempt else "any attempt"
        raise ApiError(404, "logs_not_found", f"job {job_id} has no rank {rank or 0} in {which} (not scheduled yet?)")
    leases = [(rank or 0, first)]
    if all_ranks:
        for r in range(1, int(job["replicas"])):
            lease = await jobs.find_rank_lease(pool, job_id, r, first["attempt"])
            if lease is not None:
                leases.append((r, lease))
    for _, lease in leases:
        if not lease["agent_addr"]:
            raise ApiError(
                503, "agent_unreachable", f"node {lease['node_id']} has no registered agent address to read logs from"
            )
    sources = [RankSource(r, x["lease_id"], x["node_id"], x["agent_addr"]) for r, x in leases]
    query = LogQuery(stream=stream, tail=tail, follow=follow, fmt=format, all_ranks=all_ranks)
    body = await job_log_stream(settings_of(request), sources, query, skip=offset)
    return StreamingResponse(
        body,
        media_type="application/x-ndjson" if format == "ndjson" else "text/plain; charset=utf-8",
        headers={
            "X-Lease-Id": ",".join(s.lease_id for s in sources),
            "X-Attempt": str(first["attempt"]),
            "Cache-Control": "no-store",
        },
    )


# --- cancel, extend -------------------------------------------------------------------------


@router.delete("/jobs/{job_id}", status_code=202, response_model=CancelAccepted, summary="Cancel a job")
async def cancel_job(
    request: Request,
    job_id: JobId,
    idempotency_key: IdempotencyKey,
    reason: Reason = "cancelled by user",
    principal: Principal = Depends(current_principal),
) -> Any:
    """Signals `cancel` to the job's workflow and records the request in the audit
    trail; the workflow stops the ranks and records the state change."""
    pool = pool_of(request)
    gateway = gateway_of(request)

    async def work(conn: asyncpg.Connection) -> idempotency.Outcome:
        job = await visible_job(conn, principal, job_id)
        if job["state"] in TERMINAL:
            raise ApiError(
                409, "job_terminal", f"job {job_id} already finished ({job['state']})", {"state": job["state"]}
            )
        await write_audit(
            conn, principal.name, "cancel_request", job_id, reason, {"state": job["state"], "attempt": job["attempt"]}
        )
        try:
            await gateway.cancel_job(job_id, CancelRequest(actor=principal.name, reason=reason or "cancelled by user"))
        except WorkflowClosed as e:
            raise ApiError(409, "job_terminal", f"job {job_id} already finished") from e
        except ControlUnavailable as e:
            raise ApiError(
                503, "control_plane_unavailable", "the control plane is unreachable; retry the cancel with the same key"
            ) from e

        async def after() -> None:
            if not job["workflow_started"]:
                await jobs.mark_workflow_started(pool, [job_id])  # signal-with-start started it

        return idempotency.Outcome(202, {"job_id": job_id, "state": JobState.CANCELLING}, after_commit=after)

    return await idempotency.run(request, principal, idempotency_key, work)


def extend_update_id(principal: Principal, key: str | None) -> str:
    """The Temporal update id of an extend: one per (caller, idempotency key), as the key is."""
    return f"extend:{principal.name}:{idempotency.validate_key(key)}"


@router.post("/jobs/{job_id}:extend", response_model=ExtendGranted, summary="Ask for more runtime")
async def extend_job(
    request: Request,
    job_id: JobId,
    body: ExtendBody,
    idempotency_key: IdempotencyKey,
    principal: Principal = Depends(current_principal),
) -> Any:
    """The job's workflow decides (extensions are capped in number and size, and may
    not delay a reservation); a refusal is a 409 whose code says why."""
    settings = settings_of(request)
    gateway = gateway_of(request)

    async def work(conn: asyncpg.Connection) -> idempotency.Outcome:
        job = await visible_job(conn, principal, job_id)
        if job["state"] in TERMINAL:
            raise ApiError(
                409, "job_terminal", f"job {job_id} already finished ({job['state']})", {"state": job["state"]}
            )
        try:
            seconds = parse_duration(body.by)
        except ValueError as e:
            raise ApiError(422, "invalid_duration", str(e)) from e
        if job["extensions"] >= settings.max_extensions:
            raise ApiError(
                409,
                "extension_too_many",
                f"job {job_id} already had {job['extensions']} extensions (at most {settings.max_extensions})",
            )
        request_ = ExtendRequest(actor=principal.name, seconds=seconds, reason=body.reason)
        try:
            result = await gateway.extend_job(job_id, request_, update_id=extend_update_id(principal, idempotency_key))
        except WorkflowMissing as e:
            raise ApiError(409, "extension_not_running", f"job {job_id} is not running yet") from e
        except WorkflowClosed as e:
            raise ApiError(409, "job_terminal", f"job {job_id} already finished") from e
        except UpdateRejected as e:
            raise ApiError(422, "extension_rejected", f"the extension was rejected: {e}") from e
        except ControlUnavailable as e:
            raise ApiError(
                503, "control_plane_unavailable", "the control plane is unreachable; retry with the same key"
            ) from e
        if not result.granted:
            raise ApiError(
                409,
                f"extension_{result.code}",
                result.message or f"the extension was refused ({result.code})",
                {"extensions_used": result.extensions_used},
            )
        await write_audit(
            conn,
            principal.name,
            "extend_request",
            job_id,
            body.reason or None,
            {
                "seconds": seconds,
                "by": format_duration(seconds),
                "new_deadline": result.new_deadline.isoformat() if result.new_deadline else None,
                "granted": True,
            },
        )
        out = {
            "job_id": job_id,
            "granted": True,
            "code": result.code,
            "message": result.message,
            "new_deadline": result.new_deadline,
            "extensions_used": result.extensions_used,
        }
        return idempotency.Outcome(200, out)

    return await idempotency.run(request, principal, idempotency_key, work)
