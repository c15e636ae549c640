"""The public REST API: ``create_app(settings=None, *, pool=None, temporal_client=None)``.

Stateless: any number of replicas. Without an injected pool, the app's lifespan
opens one from ``settings.database_url``; without an injected Temporal client, one
is created on first use through ``common.temporal.connect`` (and retried while
Temporal is unreachable: reads and submits keep working).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import asyncpg
from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from temporalio.client import Client

from api import metrics
from api.auth import TokenTable
from api.errors import install_error_handlers
from api.gateway import TemporalGateway
from api.middleware import EdgeMiddleware
from api.rate_limits import EdgeLimits
from api.routes import cluster, jobs, nodes, system, teams
from common.db import create_pool, pool_deadlines
from common.settings import Settings

log = logging.getLogger("gpufleet.api")
UI_DIR = Path(__file__).parent / "ui"

DESCRIPTION = """\
Submit, inspect, cancel and extend jobs on the shared GPU cluster; read quotas,
queues and nodes. Every `/v1` route needs `Authorization: Bearer <token>`; every
write needs an `Idempotency-Key` header (retries with the same key replay the
first response). Errors are `{"error": {"code", "message", "details", "request_id"}}`.
"""


def create_app(
    settings: Settings | None = None,
    *,
    pool: asyncpg.Pool | None = None,
    temporal_client: Client | None = None,
) -> FastAPI:
    settings = settings if settings is not None else Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned: asyncpg.Pool | None = None
        if app.state.pool is None:
            if not settings.database_url:
                raise RuntimeError("the API needs GPUFLEET_DATABASE_URL (`gpufleet up` sets it for its children)")
            # min_size=0: the API starts (and /healthz answers 503) while the database is down
            owned = await create_pool(
                settings.database_url, min_size=0, max_size=settings.db_pool_max, timeout=10, **pool_deadlines(settings)
            )
            app.state.pool = owned
        try:
            yield
        finally:
            if owned is not None:
                app.state.pool = None
                await owned.close()

    app = FastAPI(title="gpufleet", version="1", description=DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings
    app.state.pool = pool
    app.state.gateway = TemporalGateway(settings, temporal_client)
    app.state.tokens = TokenTable(settings)
    app.state.limits = EdgeLimits(settings)
    install_error_handlers(app)
    app.add_middleware(EdgeMiddleware, max_request_bytes=settings.max_request_bytes)
    app.state.metrics = metrics.ApiMetrics()
    app.add_middleware(metrics.MetricsMiddleware, metrics=app.state.metrics)  # outermost: sees every status
    app.include_router(system.public)
    app.include_router(system.router)
    app.include_router(jobs.router)
    app.include_router(teams.router)
    app.include_router(nodes.router)
    app.include_router(cluster.router)
    app.include_router(metrics.router)
    # the cluster map page: static files, no build step; it logs in with a bearer token itself
    app.mount("/ui", StaticFiles(directory=UI_DIR, html=True), name="ui")
    return app


def route_table(app: FastAPI) -> list[tuple[str, str]]:
    """(METHOD, path template) of every route the app serves, HEAD left out.

    Newer FastAPI keeps included routers lazily (``app.routes`` holds the inclusions),
    so walk them through ``iter_route_contexts`` where it exists."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:  # older FastAPI: app.routes is already flat
        contexts: list[Any] = list(app.routes)
    else:
        contexts = list(iter_route_contexts(app.routes))
    table: list[tuple[str, str]] = []
    for r in contexts:
        path = getattr(r, "path", None)
        for method in sorted(getattr(r, "methods", None) or ()):
            if method != "HEAD" and path is not None:
                table.append((method, path))
    return table
