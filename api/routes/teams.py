"""/v1/teams/{team}: quota (read; admin write), priority classes (read; admin write), queue."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any

import asyncpg
from fastapi import APIRouter, Body, Depends, Header, Query, Request

from api import idempotency
from api.auth import current_principal, require_admin, require_team_access
from api.deps import TeamName, decode_cursor, encode_cursor, page_size, pool_of
from api.errors import ERROR_RESPONSES, ApiError
from api.schemas import PRIORITY_CLASSES, PriorityClassesSet, QuotaBody, TeamPriorityClasses, TeamQueue, TeamQuota
from common.settings import Principal
from store import nodes, teams, tx

router = APIRouter(prefix="/v1", tags=["teams"], dependencies=[Depends(current_principal)], responses=ERROR_RESPONSES)

IdempotencyKey = Annotated[str, Header(alias="Idempotency-Key", description="required on every write")]
TEAM_NAME = re.compile(r"^[a-z][a-z0-9-]{0,62}$")


def _unknown_team(team: str) -> ApiError:
    return ApiError(404, "unknown_team", f"there is no team {team!r}")


async def _known_team(db: tx.Db, team: str) -> None:
    if not await teams.team_exists(db, team):
        raise _unknown_team(team)


@router.get("/teams/{team}/quota", response_model=TeamQuota, summary="The team's quota and usage per GPU type")
async def get_quota(request: Request, team: TeamName, principal: Principal = Depends(current_principal)) -> Any:
    require_team_access(principal, team)
    pool = pool_of(request)
    await _known_team(pool, team)
    return await teams.team_usage(pool, team)


@router.put(
    "/teams/{team}/quota", response_model=TeamQuota, summary="Set the team's quota for one or more GPU types (admin)"
)
async def put_quota(
    request: Request,
    team: TeamName,
    body: Annotated[
        QuotaBody,
        Body(
            openapi_examples={
                "by_gpu_type": {
                    "summary": "several GPU types at once (the reason defaults to 'set by <admin>')",
                    "value": {"h100": {"guaranteed": 64, "borrow_limit": 128}},
                },
                "single": {
                    "summary": "one GPU type, with a reason",
                    "value": {"gpu_type": "h100", "guaranteed": 64, "reason": "Q3 rebalance"},
                },
            }
        ),
    ],
    idempotency_key: IdempotencyKey,
    principal: Principal = Depends(require_admin),
) -> Any:
    """Two shapes: ``{"gpu_type": "h100", "guaranteed": 64, "borrow_limit": 128, "reason": "..."}``
    (the reason is required) or ``{"h100": {"guaranteed": 64, "borrow_limit": 128, "reason": "..."}, ...}``
    (several GPU types in one transaction; each reason defaults to "set by <admin>"). An unset
    borrow_limit keeps the current one (0 for a new GPU type). Audited per GPU type with the
    admin and the reason; creates the team if it is new. Lowering a guarantee re-marks the
    team's newest allocations as borrowed in the same transaction."""
    entries = body.entries(default_reason=f"set by {principal.name}")

    async def work(conn: asyncpg.Connection) -> idempotency.Outcome:
        if not TEAM_NAME.fullmatch(team):
            raise ApiError(
                422, "invalid_team_name", "a team name is lowercase letters, digits and dashes, starting with a letter"
            )
        changes: list[tuple[teams.TeamQuota, str]] = []
        for gpu_type, guaranteed, borrow_limit, reason in entries:
            if not await nodes.gpu_type_exists(conn, gpu_type):
                raise ApiError(422, "unknown_gpu_type", f"this cluster has no GPU type {gpu_type!r}")
            if borrow_limit is None:
                current = await teams.get_quota(conn, team, gpu_type)
                borrow_limit = current["borrow_limit"] if current else 0
            changes.append((teams.TeamQuota(team, gpu_type, guaranteed, borrow_limit), reason))
        await teams.set_quotas(conn, changes, actor=principal.name)
        return idempotency.Outcome(200, await teams.team_usage(conn, team))

    return await idempotency.run(request, principal, idempotency_key, work)


def _classes_view(team: str, classes: tuple[str, ...] | None) -> dict[str, Any]:
    return {
        "team": team,
        "priority_classes": None if classes is None else list(classes),
        "allowed": list(PRIORITY_CLASSES if classes is None else classes),
    }


@router.get(
    "/teams/{team}/priority-classes",
    response_model=TeamPriorityClasses,
    summary="The priority classes the team may submit in",
)
async def get_priority_classes(
    request: Request, team: TeamName, principal: Principal = Depends(current_principal)
) -> Any:
    require_team_access(principal, team)
    rights = await teams.entitlement(pool_of(request), team)
    if rights is None:
        raise _unknown_team(team)
    return _classes_view(team, rights.priority_classes)


@router.put(
    "/teams/{team}/priority-classes",
    response_model=TeamPriorityClasses,
    summary="Set the priority classes the team may submit in (admin)",
)
async def put_priority_classes(
    request: Request,
    team: TeamName,
    body: Annotated[
        PriorityClassesSet,
        Body(
            openapi_examples={
                "restrict": {
                    "summary": "a research team: no production classes",
                    "value": {"priority_classes": ["research", "preemptible"], "reason": "research team"},
                },
                "lift": {
                    "summary": "every class again",
                    "value": {"priority_classes": None, "reason": "now also runs production"},
                },
            }
        ),
    ],
    idempotency_key: IdempotencyKey,
    principal: Principal = Depends(require_admin),
) -> Any:
    """prod-serving is never preempted and preempts every other class, so which team may submit
    in which class is the operator's call. A team with no entitlement set may submit in every
    class. Audited with the admin, the reason and the old and new sets. Applies to submissions
    from now on: jobs already queued or running keep their class."""
    classes = body.classes()

    async def work(conn: asyncpg.Connection) -> idempotency.Outcome:
        if not await teams.set_priority_classes(conn, team, classes, actor=principal.name, reason=body.reason):
            raise _unknown_team(team)
        return idempotency.Outcome(200, _classes_view(team, classes))

    return await idempotency.run(request, principal, idempotency_key, work)


@router.get("/teams/{team}/queue", response_model=TeamQueue, summary="The team's queued jobs in order, and its usage")
async def get_queue(
    request: Request,
    team: TeamName,
    cursor: Annotated[str | None, Query(max_length=2000)] = None,
    limit: Annotated[int | None, Query(ge=1, le=1_000_000)] = None,
    principal: Principal = Depends(current_principal),
) -> Any:
    require_team_access(principal, team)
    pool = pool_of(request)
    await _known_team(pool, team)
    n = page_size(request, limit)
    raw = decode_cursor("queue", cursor)
    after = None
    if raw is not None:
        try:
            after = (int(raw[0]), int(raw[1]), datetime.fromisoformat(raw[2]), str(raw[3]))
        except (ValueError, TypeError, IndexError) as e:
            raise ApiError(400, "invalid_cursor", "the cursor is not one this list returned") from e
        if not all(-(2**31) <= v < 2**31 for v in after[:2]):
            raise ApiError(400, "invalid_cursor", "the cursor is not one this list returned")
    rows = await teams.team_queue(pool, team, after=after, limit=n + 1)
    next_cursor = None
    if len(rows) > n:
        rows = rows[:n]
        last = rows[-1]
        pos = last["queue_position"] if last["queue_position"] is not None else 2147483647
        next_cursor = encode_cursor(
            "queue", [pos, last["class_rank"], last["submitted_at"].isoformat(), last["job_id"]]
        )
    jobs = [{k: r[k] for k in r.keys() if k != "class_rank"} for r in rows]
    return {
        "team": team,
        "usage": await teams.team_usage(pool, team),
        "counts": await teams.team_state_counts(pool, team),
        "jobs": jobs,
        "next_cursor": next_cursor,
    }
