"""The job routes: submit, read, list, events, explain, cancel, extend."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.service import RPCError, RPCStatusCode

from store import allocations, leadership
from store.audit import write_job_event
from tests.api.conftest import ADMIN, ALPHA, BETA, auth, new_key, start_as_placed, submit
from tests.foundation.builders import gang
from tests.support import force_job_state


async def test_submit_commits_job_event_audit_and_key_and_starts_no_workflow(client, pool, temporal_env, task_queue):
    r = await submit(client, name="first", env={"LR": "0.1"})
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["state"] == "QUEUED" and body["queue_position"] == 1
    job_id = body["job_id"]
    assert r.headers["location"] == f"/v1/jobs/{job_id}"
    row = await pool.fetchrow("SELECT * FROM jobs WHERE job_id = $1", job_id)
    assert row["state"] == "QUEUED" and row["team"] == "alpha" and row["submitted_by"] == "alice"
    assert row["max_runtime_s"] == 7200 and row["replicas"] == 1 and row["gpus_per_replica"] == 4
    assert row["spec"]["image"] == "registry/llm:1" and row["spec"]["env"] == {"LR": "0.1"}
    assert row["spec"]["checkpoint"] == {"preemptible": True, "grace_seconds": 30.0}
    # the job waits in Postgres: its workflow starts with its allocation (the leader's)
    assert row["workflow_started"] is False
    with pytest.raises(RPCError) as e:
        await temporal_env.client.get_workflow_handle(job_id).describe()
    assert e.value.status == RPCStatusCode.NOT_FOUND
    ev = await pool.fetch("SELECT * FROM job_events WHERE job_id = $1", job_id)
    assert [(e["event"], e["from_state"], e["to_state"], e["actor"]) for e in ev] == [
        ("submitted", None, "QUEUED", "alice")
    ]
    audit = await pool.fetch("SELECT * FROM audit WHERE subject = $1", job_id)
    assert [(a["actor"], a["action"]) for a in audit] == [("alice", "submit")]
    assert await pool.fetchval("SELECT status FROM idempotency_keys WHERE principal = 'alice'") == "done"


async def test_get_job_shows_state_allocation_and_pending_reason(client, pool):
    job_id = (await submit(client, replicas=2, gpus_per_replica=8)).json()["job_id"]
    await pool.execute(
        "UPDATE jobs SET queue_position = 3, pending_reason = 'capacity', pending_detail = 'needs 16 GPUs',"
        " expected_start = now() + interval '1 hour' WHERE job_id = $1",
        job_id,
    )
    r = await client.get(f"/v1/jobs/{job_id}", headers=auth(ALPHA))
    assert r.status_code == 200
    j = r.json()
    assert j["state"] == "QUEUED" and j["attempt"] == 1 and j["queue_position"] == 3
    assert j["pending_reason"] == "capacity" and j["pending_detail"] == "needs 16 GPUs" and j["expected_start"]
    assert j["allocation"] == {"nodes": [], "blocks": [], "ranks": []}
    assert j["started_at"] is None and j["last_checkpoint"] is None and j["preemptions"] == 0
    # placement commits the gang: the allocation shows nodes and blocks
    epoch = await leadership.acquire_leadership(pool, scope="placement", holder="t", grpc_addr="x", ttl_s=30)
    await allocations.commit_gang(
        pool,
        scope="placement",
        epoch=epoch,
        job_id=job_id,
        attempt=1,
        placements=gang(("b0-n0", tuple(range(8))), ("b1-n0", tuple(range(8)))),
    )
    j = (await client.get(f"/v1/jobs/{job_id}", headers=auth(ALPHA))).json()
    assert j["state"] == "STARTING" and j["queue_position"] is None and j["pending_reason"] is None
    assert j["allocation"]["nodes"] == ["b0-n0", "b1-n0"] and j["allocation"]["blocks"] == ["b0", "b1"]
    assert [r["rank"] for r in j["allocation"]["ranks"]] == [0, 1]


async def test_other_team_cannot_see_a_job_and_unknown_is_404(client):
    job_id = (await submit(client)).json()["job_id"]
    for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/events", f"/v1/jobs/{job_id}/explain"):
        r = await client.get(path, headers=auth(BETA))
        assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"
        assert (await client.get(path, headers=auth(ADMIN))).status_code == 200
    r = await client.get("/v1/jobs/j-nope", headers=auth(ADMIN))
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"


async def test_list_pages_with_opaque_cursors_and_filters(client, pool):
    ids = [(await submit(client, name=f"n{i}")).json()["job_id"] for i in range(5)]
    beta = (await submit(client, token=BETA, team="beta")).json()["job_id"]
    await force_job_state(pool, "UPDATE jobs SET state = 'RUNNING' WHERE job_id = $1", ids[0])
    seen, cursor = [], None
    while True:
        params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        r = await client.get("/v1/jobs", params=params, headers=auth(ALPHA))
        assert r.status_code == 200
        page = r.json()
        assert len(page["jobs"]) <= 2
        seen += [j["job_id"] for j in page["jobs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(ids))  # newest first, own team only
    r = await client.get("/v1/jobs", params={"state": "RUNNING"}, headers=auth(ALPHA))
    assert [j["job_id"] for j in r.json()["jobs"]] == [ids[0]]
    r = await client.get("/v1/jobs", headers=auth(ADMIN))
    assert {j["job_id"] for j in r.json()["jobs"]} == set(ids) | {beta}
    r = await client.get("/v1/jobs", params={"team": "beta"}, headers=auth(ALPHA))
    assert r.status_code == 403
    r = await client.get("/v1/jobs", params={"cursor": "garbage!"}, headers=auth(ALPHA))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_cursor"
    r = await client.get("/v1/jobs", params={"limit": 501}, headers=auth(ALPHA))
    assert r.status_code == 422 and r.json()["error"]["code"] == "page_size_too_large"
    r = await client.get("/v1/jobs", params={"state": "BOGUS"}, headers=auth(ALPHA))
    assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error"


async def test_events_timeline_pages(client, pool):
    job_id = (await submit(client)).json()["job_id"]
    for i, ev in enumerate(["scheduled", "preempted", "node_failed", "restarted"]):
        await write_job_event(pool, job_id, 1 + i // 2, ev, "QUEUED", "STARTING", "placement", f"r{i}")
    r = await client.get(f"/v1/jobs/{job_id}/events", params={"limit": 3}, headers=auth(ALPHA))
    page = r.json()
    assert [e["event"] for e in page["events"]] == ["submitted", "scheduled", "preempted"]
    r = await client.get(f"/v1/jobs/{job_id}/events", params={"cursor": page["next_cursor"]}, headers=auth(ALPHA))
    assert [e["event"] for e in r.json()["events"]] == ["node_failed", "restarted"]
    assert r.json()["next_cursor"] is None


async def test_explain_reads_what_placement_published(client, pool):
    job_id = (await submit(client, replicas=2, gpus_per_replica=8)).json()["job_id"]
    r = await client.get(f"/v1/jobs/{job_id}/explain", headers=auth(ALPHA))
    e = r.json()
    assert e["pending"] is True and e["pending_reason"] is None and "next placement cycle" in e["message"]
    assert e["waiting_for"]["gpus_requested"] == 16 and e["waiting_for"]["gpus_free_of_type"] == 32
    assert e["waiting_for"]["team_quota_headroom"] == 32
    await pool.execute(
        "UPDATE jobs SET queue_position = 2, pending_reason = 'reserved', pending_detail = 'blocks b0,b1',"
        " expected_start = '2030-01-01T00:00:00Z' WHERE job_id = $1",
        job_id,
    )
    e = (await client.get(f"/v1/jobs/{job_id}/explain", headers=auth(ALPHA))).json()
    assert e["pending_reason"] == "reserved" and e["queue_position"] == 2 and e["waiting_for"]["jobs_ahead"] == 1
    assert e["expected_start"].startswith("2030-01-01") and "reservation" in e["message"]
    assert "2030-01-01" in e["message"] and "blocks b0,b1" in e["message"]
    # waiting on fragments: the shape it asked for (no block limit named when it set none) and
    # the whole nodes it lacks
    await pool.execute(
        "UPDATE jobs SET pending_reason = 'topology', pending_detail = 'needs 2 whole free node(s), 0 free',"
        " expected_start = NULL WHERE job_id = $1",
        job_id,
    )
    e = (await client.get(f"/v1/jobs/{job_id}/explain", headers=auth(ALPHA))).json()
    assert e["message"] == (
        "enough h100 GPUs are free, but not in the shape the job accepts (pack=any)"
        " (needs 2 whole free node(s), 0 free); position 2 in the queue"
    )
    await force_job_state(pool, "UPDATE jobs SET state = 'FAILED', exit_code = 3 WHERE job_id = $1", job_id)
    e = (await client.get(f"/v1/jobs/{job_id}/explain", headers=auth(ALPHA))).json()
    assert e["pending"] is False and e["message"] == "the job finished: FAILED (exit code 3)"


async def test_cancel_signals_the_workflow_and_audits(client, pool, temporal_env, worker):
    job_id = (await submit(client)).json()["job_id"]
    key = new_key()
    r = await client.delete(f"/v1/jobs/{job_id}", params={"reason": "wrong data"}, headers=auth(ALPHA, key))
    assert r.status_code == 202 and r.json() == {"job_id": job_id, "state": "CANCELLING"}
    result = await asyncio.wait_for(temporal_env.client.get_workflow_handle(job_id).result(), 20)
    assert result == "CANCELLED by alice: wrong data"
    audit = await pool.fetch("SELECT actor, action, reason FROM audit WHERE subject = $1 ORDER BY id", job_id)
    assert [tuple(a) for a in audit] == [("alice", "submit", None), ("alice", "cancel_request", "wrong data")]
    # a retry with the same key replays; the other team cannot cancel it
    again = await client.delete(f"/v1/jobs/{job_id}", params={"reason": "wrong data"}, headers=auth(ALPHA, key))
    assert again.status_code == 202 and again.headers["idempotent-replayed"] == "true"
    assert (await client.delete(f"/v1/jobs/{job_id}", headers=auth(BETA, new_key()))).status_code == 404


async def test_cancel_of_a_finished_job_is_409_and_writes_nothing(client, pool):
    job_id = (await submit(client)).json()["job_id"]
    await force_job_state(pool, "UPDATE jobs SET state = 'SUCCEEDED' WHERE job_id = $1", job_id)
    r = await client.delete(f"/v1/jobs/{job_id}", headers=auth(ALPHA, new_key()))
    assert r.status_code == 409
    err = r.json()["error"]
    assert err["code"] == "job_terminal" and "SUCCEEDED" in err["message"]
    assert await pool.fetchval("SELECT count(*) FROM audit WHERE action = 'cancel_request'") == 0
    assert await pool.fetchval("SELECT count(*) FROM idempotency_keys") == 1  # the submit's only


async def test_cancel_of_a_queued_job_starts_its_workflow_with_the_cancel(
    client, pool, temporal_env, worker, task_queue
):
    job_id = (await submit(client)).json()["job_id"]  # queued: no workflow yet
    r = await client.delete(f"/v1/jobs/{job_id}", headers=auth(ALPHA, new_key()))
    assert r.status_code == 202, r.text
    result = await temporal_env.client.get_workflow_handle(job_id).result()
    assert result.startswith("CANCELLED by alice")
    # a job whose run closed is never run again (REJECT_DUPLICATE): the API reports it finished
    other = (await submit(client)).json()["job_id"]
    await start_as_placed(temporal_env, task_queue, other)
    await temporal_env.client.get_workflow_handle(other).terminate("test")
    r = await client.delete(f"/v1/jobs/{other}", headers=auth(ALPHA, new_key()))
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_terminal"


async def test_extend_asks_the_workflow(client, pool, worker, temporal_env, task_queue):
    job_id = (await submit(client)).json()["job_id"]
    r = await client.post(f"/v1/jobs/{job_id}:extend", json={"by": "1h"}, headers=auth(ALPHA, new_key()))
    assert r.status_code == 409 and r.json()["error"]["code"] == "extension_not_running"  # no workflow yet
    await start_as_placed(temporal_env, task_queue, job_id)
    r = await client.post(
        f"/v1/jobs/{job_id}:extend", json={"by": "1h", "reason": "almost done"}, headers=auth(ALPHA, new_key())
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert (
        body["granted"] is True and body["code"] == "granted" and body["extensions_used"] == 1 and body["new_deadline"]
    )
    audit = await pool.fetchrow("SELECT actor, reason, detail FROM audit WHERE action = 'extend_request'")
    assert audit["actor"] == "alice" and audit["reason"] == "almost done" and audit["detail"]["seconds"] == 3600
    r = await client.post(f"/v1/jobs/{job_id}:extend", json={"by": "3h"}, headers=auth(ALPHA, new_key()))
    assert r.status_code == 409 and r.json()["error"]["code"] == "extension_too_long"
    r = await client.post(f"/v1/jobs/{job_id}:extend", json={"by": "soon"}, headers=auth(ALPHA, new_key()))
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_duration"
    await pool.execute("UPDATE jobs SET extensions = 2 WHERE job_id = $1", job_id)
    r = await client.post(f"/v1/jobs/{job_id}:extend", json={"by": "1h"}, headers=auth(ALPHA, new_key()))
    assert r.status_code == 409 and r.json()["error"]["code"] == "extension_too_many"
    await force_job_state(pool, "UPDATE jobs SET state = 'CANCELLED' WHERE job_id = $1", job_id)
    r = await client.post(f"/v1/jobs/{job_id}:extend", json={"by": "1h"}, headers=auth(ALPHA, new_key()))
    assert r.status_code == 409 and r.json()["error"]["code"] == "job_terminal"


async def test_extend_without_a_reachable_control_plane_is_503(client, pool, temporal_env, task_queue):
    # no worker polls this test's task queue: the update is never accepted
    job_id = (await submit(client)).json()["job_id"]
    await start_as_placed(temporal_env, task_queue, job_id)
    r = await client.post(f"/v1/jobs/{job_id}:extend", json={"by": "1h"}, headers=auth(ALPHA, new_key()))
    assert r.status_code == 503 and r.json()["error"]["code"] == "control_plane_unavailable"
    assert await pool.fetchval("SELECT count(*) FROM audit WHERE action = 'extend_request'") == 0


@pytest.mark.parametrize("who", [ALPHA, ADMIN])
async def test_me(client, who):
    r = await client.get("/v1/me", headers=auth(who))
    assert r.status_code == 200 and r.json()["admin"] is (who == ADMIN)


async def test_submit_while_temporal_is_down_is_still_202(settings, pool, cluster):
    import httpx

    from api.main import create_app

    down = settings.model_copy(update={"temporal_address": "127.0.0.1:1", "api_temporal_timeout_s": 1.0})
    app = create_app(down, pool=pool)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api.test") as c:
        r = await submit(c)
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        row = await pool.fetchrow("SELECT state, workflow_started FROM jobs WHERE job_id = $1", job_id)
        assert (row["state"], row["workflow_started"]) == ("QUEUED", False)
        # reads come from Postgres only
        assert (await c.get(f"/v1/jobs/{job_id}", headers=auth(ALPHA))).status_code == 200
        assert (await c.get(f"/v1/jobs/{job_id}/explain", headers=auth(ALPHA))).status_code == 200
        assert (await c.get("/v1/teams/alpha/queue", headers=auth(ALPHA))).status_code == 200
        # a cancel needs the control plane: 503, nothing recorded, retry later with the same key
        r = await c.delete(f"/v1/jobs/{job_id}", headers=auth(ALPHA, "k-cancel"))
        assert r.status_code == 503 and r.json()["error"]["code"] == "control_plane_unavailable"
        assert await pool.fetchval("SELECT count(*) FROM audit WHERE action = 'cancel_request'") == 0


async def test_a_replayed_submit_answers_the_first_response_and_adds_nothing(client, pool):
    key = new_key()
    first = (await submit(client, key=key)).json()
    r = await submit(client, key=key)
    assert r.status_code == 202 and r.json() == first and r.headers.get("idempotent-replayed") == "true"
    assert await pool.fetchval("SELECT count(*) FROM jobs") == 1


async def test_a_block_limit_with_a_wait_is_stored_and_reaches_the_engine(client, pool):
    from control.leader.state import spec_from_row

    topo = {"pack": "block", "max_blocks": 1, "max_blocks_wait_seconds": 300}
    r = await submit(client, topology=topo)
    assert r.status_code == 202, r.text
    row = await pool.fetchrow("SELECT * FROM jobs WHERE job_id = $1", r.json()["job_id"])
    assert row["spec"]["topology"] == topo
    spec = spec_from_row(row, 30.0)
    assert spec.topology.max_blocks == 1 and spec.topology.max_blocks_wait_s == 300
    before = await pool.fetchval("SELECT count(*) FROM jobs")
    for bad in (
        {"pack": "block", "max_blocks_wait_seconds": 300},
        {"pack": "any", "max_blocks": 1, "max_blocks_wait_seconds": 1},
    ):
        r = await submit(client, topology=bad)
        assert r.status_code == 422 and r.json()["error"]["code"] == "validation_error", r.text
        assert "max_blocks_wait_seconds" in r.text
    assert await pool.fetchval("SELECT count(*) FROM jobs") == before
