"""Idempotency-Key (IETF draft) on every write: required, scoped to the caller,
first response replayed, 422 on a different request, 409 while in flight, expiry."""

from __future__ import annotations

import asyncio
import random

import asyncpg

from tests.api.conftest import ADMIN, ALPHA, auth, job_body, new_key, start_as_placed, submit
from tests.support import eventually


async def test_key_is_required_on_every_write(client, pool):
    job_id = (await submit(client)).json()["job_id"]
    writes = [
        ("POST", "/v1/jobs", job_body(), ALPHA),
        ("DELETE", f"/v1/jobs/{job_id}", None, ALPHA),
        ("POST", f"/v1/jobs/{job_id}:extend", {"by": "1h"}, ALPHA),
        ("PUT", "/v1/teams/alpha/quota", {"gpu_type": "h100", "guaranteed": 8, "reason": "r"}, ADMIN),
        ("POST", "/v1/nodes/b0-n0:drain", {"reason": "r"}, ADMIN),
    ]
    for method, path, body, token in writes:
        r = await client.request(method, path, json=body, headers=auth(token))
        assert r.status_code == 400, (method, path, r.text)
        assert r.json()["error"]["code"] == "idempotency_key_missing"
        r = await client.request(method, path, json=body, headers=auth(token) | {"Idempotency-Key": "x" * 300})
        assert r.status_code == 400 and r.json()["error"]["code"] == "idempotency_key_invalid"
    assert await pool.fetchval("SELECT count(*) FROM jobs") == 1


async def test_retry_replays_the_first_response(client, pool):
    key = new_key()
    first = await submit(client, key=key)
    again = await submit(client, key=key)
    assert first.status_code == again.status_code == 202
    assert again.json() == first.json()
    assert again.headers["idempotent-replayed"] == "true" and "idempotent-replayed" not in first.headers
    assert await pool.fetchval("SELECT count(*) FROM jobs") == 1
    # the JSON body is compared canonically: key order and whitespace do not matter
    body = job_body()
    raw = "{" + ", ".join(f'"{k}": {__import__("json").dumps(v)}' for k, v in reversed(list(body.items()))) + "}"
    r = await client.post("/v1/jobs", content=raw, headers=auth(ALPHA, key) | {"Content-Type": "application/json"})
    assert r.status_code == 202 and r.json() == first.json()


async def test_quoted_structured_field_key_is_the_same_key(client, pool):
    first = await submit(client, key="abc-123")
    again = await client.post("/v1/jobs", json=job_body(), headers=auth(ALPHA) | {"Idempotency-Key": '"abc-123"'})
    assert again.json()["job_id"] == first.json()["job_id"]


async def test_same_key_with_a_different_body_is_422(client, pool):
    key = new_key()
    first = await submit(client, key=key)
    r = await submit(client, key=key, replicas=2)
    assert r.status_code == 422
    assert r.json()["error"]["code"] == "idempotency_key_reused"
    # ... or on another route
    r = await client.delete(f"/v1/jobs/{first.json()['job_id']}", headers=auth(ALPHA, key))
    assert r.status_code == 422 and r.json()["error"]["code"] == "idempotency_key_reused"
    assert await pool.fetchval("SELECT count(*) FROM jobs") == 1


async def test_keys_are_scoped_to_the_caller(client, pool):
    a = await submit(client, key="shared")
    b = await submit(client, token=ADMIN, key="shared")
    assert a.status_code == b.status_code == 202 and a.json()["job_id"] != b.json()["job_id"]


async def test_while_the_first_is_in_flight_a_retry_gets_409(client, pool, db_dsn):
    key = new_key()
    blocker = await asyncpg.connect(db_dsn)
    try:
        tx = blocker.transaction()
        await tx.start()
        # holds the first request inside its transaction, after it claimed the key
        await blocker.execute("LOCK TABLE jobs IN EXCLUSIVE MODE")
        first = asyncio.create_task(submit(client, key=key))

        async def claimed() -> bool:
            return bool(
                await blocker.fetchval(
                    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
                    " WHERE NOT l.granted AND l.relation = 'jobs'::regclass"
                )
            )

        await eventually(claimed, what="first request waiting inside its transaction")
        r = await submit(client, key=key)
        assert r.status_code == 409
        assert r.json()["error"]["code"] == "idempotency_key_in_flight" and r.headers["retry-after"] == "1"
        await tx.rollback()
    finally:
        await blocker.close()
    done = await asyncio.wait_for(first, 10)
    assert done.status_code == 202
    r = await submit(client, key=key)
    assert r.status_code == 202 and r.json() == done.json()


async def test_a_first_attempt_whose_session_died_mid_request_leaves_the_key_free(client, pool, db_dsn):
    """The API process serving the first attempt dies inside its transaction (key claimed, job
    not yet written: here its Postgres session is ended, as a killed process's is). Nothing
    of it commits; the client's retry, with the same key (on any API process), submits once."""
    key = new_key()
    blocker = await asyncpg.connect(db_dsn)
    try:
        tx = blocker.transaction()
        await tx.start()
        await blocker.execute("LOCK TABLE jobs IN EXCLUSIVE MODE")
        first = asyncio.create_task(submit(client, key=key))

        async def waiting() -> int | None:
            return await blocker.fetchval(
                "SELECT l.pid FROM pg_locks l WHERE NOT l.granted AND l.relation = 'jobs'::regclass LIMIT 1"
            )

        pid = await eventually(waiting, what="first request waiting inside its transaction")
        assert await blocker.fetchval("SELECT pg_terminate_backend($1)", pid)
        failed = await asyncio.wait_for(first, 10)
        assert failed.status_code >= 500  # what that client would have seen, had its process lived
        await tx.rollback()
    finally:
        await blocker.close()
    assert await pool.fetchval("SELECT count(*) FROM idempotency_keys WHERE key = $1", key) == 0
    r = await submit(client, key=key)
    assert r.status_code == 202 and "idempotent-replayed" not in r.headers
    again = await submit(client, key=key)
    assert again.status_code == 202 and again.json() == r.json() and again.headers["idempotent-replayed"] == "true"
    assert await pool.fetchval("SELECT count(*) FROM jobs") == 1


async def test_an_extend_retried_after_its_update_applied_extends_once(
    app, client, pool, worker, temporal_env, task_queue
):
    """The first attempt's update reached the workflow, then its API process died before the
    transaction committed (nothing stored for the key). The retry, with the same key, sends
    the update under the same id: Temporal answers with the first result, no second extension."""
    from api.routes.jobs import extend_update_id
    from workflows.messages import ExtendRequest

    job_id = (await submit(client)).json()["job_id"]
    await start_as_placed(temporal_env, task_queue, job_id)
    key = new_key()
    alice = app.state.settings.api_tokens[ALPHA]
    first = await app.state.gateway.extend_job(
        job_id, ExtendRequest(actor=alice.name, seconds=3600, reason=""), update_id=extend_update_id(alice, key)
    )
    assert first.granted and first.extensions_used == 1
    r = await client.post(f"/v1/jobs/{job_id}:extend", json={"by": "1h"}, headers=auth(ALPHA, key))
    assert r.status_code == 200 and r.json()["extensions_used"] == 1, r.text
    # a new request (a new key) is a second extension
    r = await client.post(f"/v1/jobs/{job_id}:extend", json={"by": "1h"}, headers=auth(ALPHA, new_key()))
    assert r.status_code == 200 and r.json()["extensions_used"] == 2, r.text


async def test_expired_keys_may_be_reused(client, pool):
    key = new_key()
    first = await submit(client, key=key)
    ttl = await pool.fetchval("SELECT extract(epoch FROM expires_at - created_at) FROM idempotency_keys")
    assert ttl >= 24 * 3600
    await pool.execute("UPDATE idempotency_keys SET expires_at = now() - interval '1 second'")
    r = await submit(client, key=key, replicas=2)  # a different body: no 422 once expired
    assert r.status_code == 202 and r.json()["job_id"] != first.json()["job_id"]
    assert await pool.fetchval("SELECT count(*) FROM jobs") == 2


async def test_a_rejected_request_stores_nothing_and_the_key_is_free(client, pool):
    key = new_key()
    r = await submit(client, key=key, image="evil/x:1")
    assert r.status_code == 422 and r.json()["error"]["code"] == "image_not_allowed"
    assert await pool.fetchval("SELECT count(*) FROM idempotency_keys") == 0
    assert (await submit(client, key=key)).status_code == 202


async def test_200_concurrent_submits_with_50_keys_create_exactly_50_jobs(client, pool):
    keys = [new_key() for _ in range(50)]
    plan = keys * 4
    random.Random(7).shuffle(plan)

    conflicts = 0

    async def one(key: str):
        # a client that retries 409 (in flight) with the same key, as the draft asks
        async def answered():
            nonlocal conflicts
            r = await submit(client, key=key)
            conflicts += r.status_code == 409
            return r.status_code != 409 and (key, r)

        return await eventually(answered, timeout=10, interval=0.05, what=f"an answer to {key} other than 409")

    results = await asyncio.gather(*(one(k) for k in plan))
    assert {r.status_code for _, r in results} == {202}
    replayed = sum(r.headers.get("idempotent-replayed") == "true" for _, r in results)
    print(f"150 duplicates: {replayed} replayed, {conflicts} answers 409 in flight (then retried)")
    assert replayed == 150
    by_key: dict[str, set[str]] = {}
    for key, r in results:
        by_key.setdefault(key, set()).add(r.json()["job_id"])
    assert all(len(ids) == 1 for ids in by_key.values())
    assert await pool.fetchval("SELECT count(*) FROM jobs") == 50
    assert await pool.fetchval("SELECT count(*) FROM job_events WHERE event = 'submitted'") == 50
    assert await pool.fetchval("SELECT count(*) FROM audit WHERE action = 'submit'") == 50
    assert await pool.fetchval("SELECT count(DISTINCT key) FROM idempotency_keys WHERE status = 'done'") == 50
