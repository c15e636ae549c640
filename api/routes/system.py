"""/healthz (no auth) and /v1/me."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from api.auth import current_principal
from api.errors import ERROR_RESPONSES, ErrorBody, error_body
from api.schemas import Health, Me
from common.settings import Principal
from store import tx

public = APIRouter(tags=["system"])
router = APIRouter(prefix="/v1", tags=["system"], dependencies=[Depends(current_principal)], responses=ERROR_RESPONSES)


@public.get(
    "/healthz",
    response_model=Health,
    summary="Liveness and database reachability (no auth)",
    responses={503: {"model": ErrorBody, "description": "the database is unreachable"}},
)
async def healthz(request: Request) -> Any:
    pool = request.app.state.pool
    try:
        if pool is None:
            raise ConnectionError("no pool")
        await asyncio.wait_for(tx.ping(pool), 5.0)
    except Exception:  # any failure to reach the database is "unavailable" here
        return JSONResponse(error_body("database_unavailable", "the database is unreachable"), status_code=503)
    return {"status": "ok", "database": "ok"}


@router.get("/me", response_model=Me, summary="Who the bearer token stands for")
async def me(principal: Principal = Depends(current_principal)) -> Any:
    return {"name": principal.name, "team": principal.team, "admin": principal.admin}
