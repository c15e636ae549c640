"""``GET /metrics`` on the API (no auth: Prometheus scrapes it; aggregate counts only, no job
ids, no secrets). Each app has its own ``CollectorRegistry``:

* request counts and latency by route template (never the raw path), method and status,
  recorded by ``MetricsMiddleware`` (outside the edge middleware, so 413s and 500s count);
* the cluster read from Postgres at scrape time (``store.cluster_view``), so one scrape of any
  API replica answers "how full are we" even while no leader runs. When the database cannot
  be read, the request metrics still answer and ``gpufleet_cluster_scrape_ok`` is 0.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from store.cluster_view import GPU_STATES, PRIORITY_CLASSES, ClusterView, read_cluster

log = logging.getLogger("gpufleet.api")

# every metric family /metrics exposes, as exposed (counters with their _total): dashboards test against it
REQUESTS = "gpufleet_api_requests_total"
REQUEST_SECONDS = "gpufleet_api_request_duration_seconds"
CLUSTER_GPUS = "gpufleet_cluster_gpus"
ALLOCATED_GPUS = "gpufleet_cluster_allocated_gpus"
QUEUED_JOBS = "gpufleet_cluster_queued_jobs"
IDLE_GPUS = "gpufleet_cluster_idle_gpus"
IDLE_COST = "gpufleet_cluster_idle_gpu_cost_usd_per_hour"
ALLOCATED_IDLE_GPUS = "gpufleet_cluster_allocated_idle_gpus"
SCRAPE_OK = "gpufleet_cluster_scrape_ok"
METRIC_NAMES: tuple[str, ...] = (
    REQUESTS,
    REQUEST_SECONDS,
    CLUSTER_GPUS,
    ALLOCATED_GPUS,
    QUEUED_JOBS,
    IDLE_GPUS,
    IDLE_COST,
    ALLOCATED_IDLE_GPUS,
    SCRAPE_OK,
)
SCRAPE_TIMEOUT_S = 5.0
UNMATCHED = "unmatched"  # the route label of a request no route matched (a 404): raw paths never become labels


class ClusterCollector(Collector):
    """Gauges of the last cluster read; ``/metrics`` reads, then renders without awaiting between."""

    def __init__(self) -> None:
        self.view: ClusterView | None = None

    def describe(self) -> list[Metric]:
        return [GaugeMetricFamily(name, name) for name in METRIC_NAMES if name.startswith("gpufleet_cluster_")]

    def collect(self) -> Iterator[Metric]:
        return self._families(self.view)

    @staticmethod
    def _families(view: ClusterView | None) -> Iterator[Metric]:
        ok = GaugeMetricFamily(SCRAPE_OK, "1 when this scrape read the cluster from Postgres, 0 when it could not")
        ok.add_metric([], 1.0 if view is not None else 0.0)
        yield ok
        if view is None:
            return
        gpus = GaugeMetricFamily(
            CLUSTER_GPUS, f"GPUs by type and state ({', '.join(GPU_STATES)})", labels=["gpu_type", "state"]
        )
        for (gpu_type, state), n in sorted(view.gpu_counts().items()):
            gpus.add_metric([gpu_type, state], n)
        yield gpus
        alloc = GaugeMetricFamily(
            ALLOCATED_GPUS,
            "GPUs allocated, by type, team and whether borrowed",
            labels=["gpu_type", "team", "borrowed"],
        )
        for (gpu_type, team, borrowed), n in sorted(view.allocated().items()):
            alloc.add_metric([gpu_type, team, "true" if borrowed else "false"], n)
        yield alloc
        queued = GaugeMetricFamily(QUEUED_JOBS, "queued jobs by priority class", labels=["priority_class"])
        by_class = {q.priority_class: q.jobs_queued for q in view.queue}
        for c in PRIORITY_CLASSES:
            queued.add_metric([c], by_class.get(c, 0))
        yield queued
        idle = GaugeMetricFamily(
            IDLE_GPUS, "healthy, schedulable, unallocated GPUs (free, reserved, hot spare)", labels=["gpu_type"]
        )
        for gpu_type, n in sorted(view.idle_gpus().items()):
            idle.add_metric([gpu_type], n)
        yield idle
        yield GaugeMetricFamily(IDLE_COST, "idle GPUs x gpu_hour_usd", value=view.idle_cost_usd_per_hour)
        busy_idle = GaugeMetricFamily(
            ALLOCATED_IDLE_GPUS, "GPUs of live leases whose use the leader marked idle, by team", labels=["team"]
        )
        for team, n in sorted(view.allocated_idle.items()):
            busy_idle.add_metric([team], n)
        yield busy_idle


class ApiMetrics:
    """The app's registry, its request metrics and its cluster collector (``app.state.metrics``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            REQUESTS.removesuffix("_total"),
            "API requests by route template, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            REQUEST_SECONDS,
            "API request latency by route template and method",
            ["route", "method"],
            registry=self.registry,
        )
        self.cluster = ClusterCollector()
        self.registry.register(self.cluster)

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route, method).observe(seconds)


def route_label(scope: dict[str, Any], root_path_before: str) -> str:
    """The template of the route that served the request (``/v1/jobs/{job_id}``), a mount's
    prefix (``/ui``), or ``unmatched``."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str):
        return path
    root = scope.get("root_path", "")
    if isinstance(root, str) and root != root_path_before and root.startswith(root_path_before):
        return root[len(root_path_before) :] or UNMATCHED
    return UNMATCHED


class MetricsMiddleware:
    """Pure ASGI: times each HTTP request and counts it by route template, method and status."""

    def __init__(self, app: Any, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        root_before = scope.get("root_path", "")
        status = 500  # an exception that escapes before a response starts

        async def send_wrapper(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.observe(
                route_label(scope, root_before), scope.get("method", ""), status, time.perf_counter() - started
            )


router = APIRouter(tags=["system"])


@router.get(
    "/metrics",
    summary="Prometheus metrics (no auth): API requests and the cluster's fill, aggregate counts only",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "the Prometheus text format"}},
)
async def metrics(request: Request) -> Response:
    m: ApiMetrics = request.app.state.metrics
    view: ClusterView | None = None
    pool = request.app.state.pool
    if pool is not None:
        try:
            view = await asyncio.wait_for(
                read_cluster(pool, gpu_hour_usd=request.app.state.settings.gpu_hour_usd, jobs_per_class=0),
                SCRAPE_TIMEOUT_S,
            )
        except Exception as e:  # any failure to read the cluster: the request metrics still answer
            log.warning("/metrics: cannot read the cluster: %s", e)
    # no await from here on: a concurrent scrape cannot swap the view under this one
    m.cluster.view = view
    try:
        body = generate_latest(m.registry)
    finally:
        m.cluster.view = None
    return Response(body, media_type=CONTENT_TYPE_LATEST)
