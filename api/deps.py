"""Request-scoped helpers: the pool, the gateway, settings, opaque cursors, page sizes,
and loading a job the caller may see."""

from __future__ import annotations

import base64
import json
from typing import Annotated, Any

import asyncpg
from fastapi import Path, Request
from pydantic import AfterValidator

from api.auth import can_see_team
from api.errors import ApiError
from api.gateway import TemporalGateway
from api.schemas import storable
from common.settings import Principal, Settings
from store import jobs, tx

JobId = Annotated[str, Path(min_length=1, max_length=200), AfterValidator(storable)]
NodeId = Annotated[str, Path(min_length=1, max_length=200), AfterValidator(storable)]
TeamName = Annotated[str, Path(min_length=1, max_length=200), AfterValidator(storable)]


def settings_of(request: Request) -> Settings:
    return request.app.state.settings


def pool_of(request: Request) -> asyncpg.Pool:
    pool = request.app.state.pool
    if pool is None:
        raise ApiError(503, "database_unavailable", "the API has no database connection yet; retry later")
    return pool


def gateway_of(request: Request) -> TemporalGateway:
    return request.app.state.gateway


def page_size(request: Request, limit: int | None) -> int:
    s = settings_of(request)
    if limit is None:
        return min(s.default_page_size, s.max_page_size)
    if limit > s.max_page_size:
        raise ApiError(
            422,
            "page_size_too_large",
            f"limit {limit} is above the largest page ({s.max_page_size})",
            {"max_page_size": s.max_page_size},
        )
    return limit


def encode_cursor(kind: str, values: list[Any]) -> str:
    raw = json.dumps({"k": kind, "v": values}, separators=(",", ":"), default=str).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(kind: str, cursor: str | None) -> list[Any] | None:
    if cursor is None or cursor == "":
        return None
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        data = json.loads(raw)
        if not isinstance(data, dict) or data.get("k") != kind or not isinstance(data.get("v"), list):
            raise ValueError("wrong cursor kind")
        return data["v"]
    except (ValueError, TypeError, UnicodeDecodeError) as e:
        raise ApiError(400, "invalid_cursor", "the cursor is not one this list returned") from e


def job_not_found(job_id: str) -> ApiError:
    return ApiError(404, "job_not_found", f"no job {job_id}")


async def visible_job(db: tx.Db, principal: Principal, job_id: str) -> asyncpg.Record:
    """The job row, or 404 when it does not exist or belongs to another team
    (a team cannot learn which job ids other teams have)."""
    job = await jobs.get_job(db, job_id)
    if job is None or not can_see_team(principal, job["team"]):
        raise job_not_found(job_id)
    return job
