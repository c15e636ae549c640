"""GET /metrics on the API: no auth; request counters and latency by route template; the cluster
gauges equal what SQL counts on a seeded cluster; with the database down the request metrics
still answer and gpufleet_cluster_scrape_ok is 0."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from api.main import create_app
from api.metrics import METRIC_NAMES
from store import nodes
from tests.api.cluster_seed import EXPECTED_GPUS, seed_cluster_states
from tests.api.conftest import ALPHA, auth


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, frozenset(labels.items())), 0.0)


def family_names(text: str) -> set[str]:
    names = set()
    for f in text_string_to_metric_families(text):
        names.add(f.name + ("_total" if f.type == "counter" else ""))
    return names


async def scrape(client: httpx.AsyncClient) -> str:
    r = await client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return r.text


async def test_request_counters_move_by_route_template_not_raw_path(client):
    before = await scrape(client)
    for _ in range(3):
        assert (await client.get("/v1/jobs/job-does-not-exist", headers=auth(ALPHA))).status_code == 404
    assert (await client.get("/v1/me", headers=auth(ALPHA))).status_code == 200
    assert (await client.get("/v1/me")).status_code == 401
    assert (await client.get("/no/such/path/123")).status_code == 404
    assert (await client.get("/ui/")).status_code == 200
    after = await scrape(client)
    req = "gpufleet_api_requests_total"

    def moved(**labels: str) -> float:
        return value(after, req, **labels) - value(before, req, **labels)

    assert moved(route="/v1/jobs/{job_id}", method="GET", status="404") == 3
    assert moved(route="/v1/me", method="GET", status="200") == 1
    assert moved(route="/v1/me", method="GET", status="401") == 1
    assert moved(route="unmatched", method="GET", status="404") == 1
    assert moved(route="/ui", method="GET", status="200") == 1
    assert value(after, "gpufleet_api_request_duration_seconds_count", route="/v1/jobs/{job_id}", method="GET") >= 3
    assert "job-does-not-exist" not in after and "/no/such/path" not in after  # raw paths never become labels
    assert value(after, req, route="/metrics", method="GET", status="200") >= 1


async def test_cluster_gauges_equal_what_sql_counts(app, client, pool, cluster):
    await seed_cluster_states(pool)
    text = await scrape(client)
    assert family_names(text) >= set(METRIC_NAMES)
    assert value(text, "gpufleet_cluster_scrape_ok") == 1
    for state, n in EXPECTED_GPUS.items():
        assert value(text, "gpufleet_cluster_gpus", gpu_type="h100", state=state) == n, state
    gpus_total = sum(v for (name, _), v in samples(text).items() if name == "gpufleet_cluster_gpus")
    assert gpus_total == await pool.fetchval("SELECT sum(gpus) FROM nodes")

    rows = await pool.fetch("SELECT gpu_type, team, borrowed, count(*) AS n FROM allocations GROUP BY 1, 2, 3")
    assert len(rows) == 3
    for r in rows:
        labels = {"gpu_type": r["gpu_type"], "team": r["team"], "borrowed": "true" if r["borrowed"] else "false"}
        assert value(text, "gpufleet_cluster_allocated_gpus", **labels) == r["n"], labels

    queued = {
        r["priority_class"]: r["n"]
        for r in await pool.fetch("SELECT priority_class, count(*) AS n FROM jobs WHERE state = 'QUEUED' GROUP BY 1")
    }
    for cls in ("prod-serving", "prod-batch", "research", "preemptible"):
        assert value(text, "gpufleet_cluster_queued_jobs", priority_class=cls) == queued.get(cls, 0), cls

    idle = await nodes.free_gpus(pool, "h100")
    assert value(text, "gpufleet_cluster_idle_gpus", gpu_type="h100") == idle == 26
    rate = app.state.settings.gpu_hour_usd
    assert value(text, "gpufleet_cluster_idle_gpu_cost_usd_per_hour") == idle * rate

    busy_idle = {
        r["team"]: r["n"]
        for r in await pool.fetch(
            "SELECT j.team, sum(cardinality(l.gpu_indices)) AS n FROM leases l JOIN jobs j USING (job_id)"
            " WHERE l.state = 'live' AND l.idle_since IS NOT NULL GROUP BY 1"
        )
    }
    assert busy_idle == {"alpha": 2, "beta": 8}
    for team, n in busy_idle.items():
        assert value(text, "gpufleet_cluster_allocated_idle_gpus", team=team) == n
    # aggregate counts only: no job ids
    for job_id in ("a-run", "a-borrow", "b-run", "a-idle", "a-big", "b-wait", "a-wait"):
        assert job_id not in text


async def test_database_down_still_answers_with_request_metrics(settings):
    """No pool (the database was never reached), then a pool whose server is gone."""
    from common.db import create_pool

    for pool in (None, await create_pool("postgresql://x:y@127.0.0.1:1/none", min_size=0, max_size=1, timeout=2)):
        app = create_app(settings, pool=pool)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api.test") as c:
            await c.get("/healthz")
            text = await scrape(c)
        assert value(text, "gpufleet_cluster_scrape_ok") == 0
        assert value(text, "gpufleet_api_requests_total", route="/healthz", method="GET", status="503") == 1
        assert "gpufleet_cluster_gpus" not in text
        if pool is not None:
            await pool.close()


async def test_each_app_has_its_own_registry(settings, pool):
    a, b = create_app(settings, pool=pool), create_app(settings, pool=pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://a") as ca:
        await ca.get("/v1/me")
        text_a = await scrape(ca)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=b), base_url="http://b") as cb:
        text_b = await scrape(cb)
    assert value(text_a, "gpufleet_api_requests_total", route="/v1/me", method="GET", status="401") == 1
    assert value(text_b, "gpufleet_api_requests_total", route="/v1/me", method="GET", status="401") == 0
