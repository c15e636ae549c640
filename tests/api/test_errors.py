"""One JSON error shape everywhere, no stack traces to clients, size limits, /healthz."""

from __future__ import annotations

import asyncpg
import httpx
import pytest

from api.errors import translate_exception
from api.main import create_app
from store import jobs
from tests.api.conftest import ALPHA, auth, job_body, new_key, submit


def assert_error_shape(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details", "request_id"}
    assert body["error"]["code"] == code and body["error"]["request_id"] == r.headers["x-request-id"]
    assert "Traceback" not in r.text and 'File "' not in r.text
    return body["error"]


async def test_unknown_route_and_method(client):
    assert_error_shape(await client.get("/v2/nothing", headers=auth(ALPHA)), 404, "not_found")
    assert_error_shape(await client.patch("/v1/jobs", headers=auth(ALPHA)), 405, "method_not_allowed")


async def test_malformed_json_and_wrong_types(client):
    headers = auth(ALPHA, new_key()) | {"Content-Type": "application/json"}
    assert_error_shape(await client.post("/v1/jobs", content=b"{not json", headers=headers), 400, "malformed_json")
    err = assert_error_shape(await submit(client, replicas="many"), 422, "validation_error")
    assert err["details"][0]["loc"] == ["body", "replicas"]


async def test_request_size_limit(settings, pool, cluster):
    app = create_app(settings.model_copy(update={"max_request_bytes": 2000}), pool=pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        big = job_body(env={f"K{i}": "x" * 100 for i in range(50)})
        assert_error_shape(await c.post("/v1/jobs", json=big, headers=auth(ALPHA, new_key())), 413, "request_too_large")

        async def chunks():  # no Content-Length: counted as it streams
            for _ in range(10):
                yield b"x" * 500

        r = await c.post("/v1/jobs", content=chunks(), headers=auth(ALPHA, new_key()))
        assert_error_shape(r, 413, "request_too_large")
    assert await pool.fetchval("SELECT count(*) FROM jobs") == 0


async def test_internal_errors_are_500_with_the_shape_and_no_trace(client, monkeypatch, caplog):
    async def boom(*a, **k):
        raise RuntimeError("secret internals: password=hunter2")

    monkeypatch.setattr(jobs, "get_job", boom)
    r = await client.get("/v1/jobs/j-1", headers=auth(ALPHA))
    err = assert_error_shape(r, 500, "internal_error")
    assert "hunter2" not in r.text and err["request_id"] in err["message"]
    assert "hunter2" in caplog.text  # logged server-side with the traceback


async def test_database_down_is_503(settings, pool, cluster):
    from common.db import create_pool

    dead = await create_pool("postgresql://nobody@127.0.0.1:1/nothing", min_size=0)  # nothing listens there
    app = create_app(settings, pool=dead)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert_error_shape(await c.get("/v1/jobs", headers=auth(ALPHA)), 503, "database_unavailable")
        assert_error_shape(await c.get("/healthz"), 503, "database_unavailable")
    await dead.close()


async def test_healthz(client):
    r = await client.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok", "database": "ok"}


async def test_nul_in_path_and_query_is_a_client_error(client):
    for path in ("/v1/jobs/a%00b", "/v1/nodes/a%00b", "/v1/teams/a%00b/quota", "/v1/jobs?team=a%00b"):
        r = await client.get(path, headers=auth(ALPHA))
        assert 400 <= r.status_code < 500, (path, r.text)
        assert r.json()["error"]["code"]


async def test_create_app_reads_settings_from_the_environment(monkeypatch, db_dsn):
    monkeypatch.setenv("GPUFLEET_DATABASE_URL", db_dsn)
    monkeypatch.setenv("GPUFLEET_API_TOKENS", '{"t1": {"name": "env-admin", "admin": true}}')
    app = create_app()
    assert app.state.settings.database_url == db_dsn and app.state.tokens.lookup("t1").name == "env-admin"


@pytest.mark.parametrize(
    "exc",
    [
        asyncpg.exceptions.TargetServerAttributeNotMatched("None of the hosts match the target attribute requirement"),
        asyncpg.exceptions.AdminShutdownError("terminating connection due to administrator command"),
        asyncpg.exceptions.CrashShutdownError("terminating connection because of crash of another server process"),
        ConnectionRefusedError(111, "Connection refused"),
        asyncpg.exceptions._base.InternalClientError("cannot switch to state 15; another operation (2) is in progress"),
    ],
)
def test_a_database_failover_is_a_503_to_retry_not_a_500(exc: BaseException) -> None:
    # a Postgres failover (issue 24): between the primary's death and the standby's promotion
    # no host of the multi-host DSN takes writes; clients retry a 503 with the same key
    assert translate_exception(exc) == (503, "database_unavailable", "the database is unreachable; retry later", None)
