"""Quotas (read, admin write with an audited reason), team queues, nodes and drains."""

from __future__ import annotations

from store import allocations, leadership
from tests.api.conftest import ADMIN, ALPHA, BETA, auth, new_key, submit
from tests.foundation.builders import gang


async def leader(pool) -> int:
    epoch = await leadership.acquire_leadership(pool, scope="placement", holder="t", grpc_addr="x", ttl_s=60)
    return epoch or await pool.fetchval("SELECT epoch FROM leader")


async def running(client, pool, node: str, gpus: tuple[int, ...], token=ALPHA, team="alpha") -> str:
    job_id = (await submit(client, token=token, team=team, gpus_per_replica=len(gpus))).json()["job_id"]
    await allocations.commit_gang(
        pool, scope="placement", epoch=await leader(pool), job_id=job_id, attempt=1, placements=gang((node, gpus))
    )
    return job_id


async def test_quota_shows_guarantee_use_and_borrowing(client, pool):
    r = await client.get("/v1/teams/alpha/quota", headers=auth(ALPHA))
    assert r.status_code == 200
    assert r.json() == {"h100": {"guaranteed": 16, "in_use": 0, "borrowed": 0, "borrow_limit": 16}}
    await running(client, pool, "b0-n0", tuple(range(8)))
    q = (await client.get("/v1/teams/alpha/quota", headers=auth(ALPHA))).json()["h100"]
    assert (q["in_use"], q["borrowed"]) == (8, 0)
    assert (await client.get("/v1/teams/alpha/quota", headers=auth(BETA))).status_code == 403
    r = await client.get("/v1/teams/ghosts/quota", headers=auth(ADMIN))
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_team"


async def test_admin_sets_a_quota_with_an_audited_reason_and_borrowed_flags_follow(client, pool):
    await running(client, pool, "b0-n0", tuple(range(8)))
    await running(client, pool, "b0-n1", tuple(range(8)))
    key = new_key()
    body = {"gpu_type": "h100", "guaranteed": 8, "reason": "rebalance for Q3"}
    r = await client.put("/v1/teams/alpha/quota", json=body, headers=auth(ADMIN, key))
    assert r.status_code == 200, r.text
    # borrow_limit kept; the newest 8 GPUs are now borrowed (invariant 4)
    assert r.json() == {"h100": {"guaranteed": 8, "in_use": 16, "borrowed": 8, "borrow_limit": 16}}
    audit = await pool.fetchrow(
        "SELECT actor, reason, detail FROM audit WHERE action = 'quota_change' ORDER BY id DESC"
    )
    assert audit["actor"] == "root" and audit["reason"] == "rebalance for Q3"
    assert audit["detail"]["old"]["guaranteed"] == 16 and audit["detail"]["new"]["guaranteed"] == 8
    again = await client.put("/v1/teams/alpha/quota", json=body, headers=auth(ADMIN, key))
    assert again.json() == r.json() and again.headers["idempotent-replayed"] == "true"
    assert await pool.fetchval("SELECT count(*) FROM audit WHERE action = 'quota_change' AND actor = 'root'") == 1
    # a team token is refused whatever the body
    r = await client.put("/v1/teams/alpha/quota", json=body, headers=auth(ALPHA, new_key()))
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
    # a new team is created by its first quota
    r = await client.put(
        "/v1/teams/vision/quota",
        json={"gpu_type": "h100", "guaranteed": 4, "borrow_limit": 4, "reason": "new team"},
        headers=auth(ADMIN, new_key()),
    )
    assert r.status_code == 200 and r.json()["h100"]["guaranteed"] == 4
    for team, b, code in (
        ("Bad_Name", {"gpu_type": "h100"}, "invalid_team_name"),
        ("alpha", {"gpu_type": "tpu"}, "unknown_gpu_type"),
    ):
        r = await client.put(
            f"/v1/teams/{team}/quota", json=b | {"guaranteed": 1, "reason": "x"}, headers=auth(ADMIN, new_key())
        )
        assert r.status_code == 422 and r.json()["error"]["code"] == code
    r = await client.put(
        "/v1/teams/alpha/quota", json={"gpu_type": "h100", "guaranteed": 1}, headers=auth(ADMIN, new_key())
    )
    assert r.status_code == 422  # the reason is required


async def test_queue_lists_positions_and_usage(client, pool):
    ids = [(await submit(client, name=f"q{i}")).json()["job_id"] for i in range(3)]
    await running(client, pool, "b1-n0", (0, 1, 2, 3))
    await pool.execute("UPDATE jobs SET queue_position = 2 WHERE job_id = $1", ids[0])
    await pool.execute("UPDATE jobs SET queue_position = 1 WHERE job_id = $1", ids[2])
    r = await client.get("/v1/teams/alpha/queue", params={"limit": 2}, headers=auth(ALPHA))
    assert r.status_code == 200
    q = r.json()
    assert [j["job_id"] for j in q["jobs"]] == [ids[2], ids[0]]
    assert q["counts"]["QUEUED"] == 3 and q["counts"]["STARTING"] == 1
    assert q["usage"]["h100"]["in_use"] == 4
    r = await client.get("/v1/teams/alpha/queue", params={"cursor": q["next_cursor"]}, headers=auth(ALPHA))
    assert [j["job_id"] for j in r.json()["jobs"]] == [ids[1]] and r.json()["next_cursor"] is None
    assert (await client.get("/v1/teams/alpha/queue", headers=auth(BETA))).status_code == 403


async def test_nodes_list_and_detail(client, pool):
    alpha_job = await running(client, pool, "b0-n0", (0, 1))
    await running(client, pool, "b0-n0", (4, 5), token=BETA, team="beta")
    r = await client.get("/v1/nodes", params={"limit": 3}, headers=auth(ALPHA))
    page = r.json()
    assert [n["node_id"] for n in page["nodes"]] == ["b0-n0", "b0-n1", "b1-n0"]
    assert page["nodes"][0]["gpus_allocated"] == 4 and page["nodes"][0]["state"] == "ready"
    r = await client.get("/v1/nodes", params={"cursor": page["next_cursor"]}, headers=auth(ALPHA))
    assert [n["node_id"] for n in r.json()["nodes"]] == ["b1-n1"]
    r = await client.get("/v1/nodes", params={"block": "b1"}, headers=auth(ALPHA))
    assert {n["node_id"] for n in r.json()["nodes"]} == {"b1-n0", "b1-n1"}
    n = (await client.get("/v1/nodes/b0-n0", headers=auth(ALPHA))).json()
    assert n["gpus"] == 8 and len(n["gpu_slots"]) == 8
    assert [s["allocated"] for s in n["gpu_slots"]] == [True, True, False, False, True, True, False, False]
    assert n["gpu_slots"][0]["job_id"] == alpha_job and n["gpu_slots"][4]["job_id"] is None  # beta's: hidden
    own = [lease for lease in n["leases"] if lease["job_id"]]
    assert [lease["job_id"] for lease in own] == [alpha_job]
    assert sorted(lease["gpu_indices"] for lease in n["leases"]) == [[0, 1], [4, 5]]
    full = (await client.get("/v1/nodes/b0-n0", headers=auth(ADMIN))).json()
    assert all(lease["job_id"] for lease in full["leases"]) and full["task_queue"]
    r = await client.get("/v1/nodes/nope", headers=auth(ADMIN))
    assert r.status_code == 404 and r.json()["error"]["code"] == "node_not_found"


async def test_drain_sets_draining_with_reason_and_audit(client, pool):
    key = new_key()
    r = await client.post(
        "/v1/nodes/b1-n1:drain", json={"reason": "fan noise", "evict": True}, headers=auth(ADMIN, key)
    )
    assert r.status_code == 202, r.text
    assert r.json() == {
        "node_id": "b1-n1",
        "state": "draining",
        "previous_state": "ready",
        "reason": "fan noise",
        "evict": True,
    }
    row = await pool.fetchrow("SELECT state, reason, drain_evict FROM nodes WHERE node_id = 'b1-n1'")
    assert tuple(row) == ("draining", "fan noise", True)
    audit = await pool.fetchrow("SELECT actor, action, reason, detail FROM audit WHERE subject = 'b1-n1'")
    assert (audit["actor"], audit["action"], audit["reason"]) == ("root", "drain", "fan noise")
    assert audit["detail"] == {"from_state": "ready", "evict": True}
    again = await client.post(
        "/v1/nodes/b1-n1:drain", json={"reason": "fan noise", "evict": True}, headers=auth(ADMIN, key)
    )
    assert again.status_code == 202 and again.headers["idempotent-replayed"] == "true"
    r = await client.post("/v1/nodes/b1-n0:drain", json={"reason": "x"}, headers=auth(ALPHA, new_key()))
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
    await pool.execute("UPDATE nodes SET state = 'down' WHERE node_id = 'b1-n0'")
    r = await client.post("/v1/nodes/b1-n0:drain", json={"reason": "x"}, headers=auth(ADMIN, new_key()))
    assert r.status_code == 409 and r.json()["error"]["code"] == "node_not_drainable"
    r = await client.post("/v1/nodes/zzz:drain", json={"reason": "x"}, headers=auth(ADMIN, new_key()))
    assert r.status_code == 404
    r = await client.post("/v1/nodes/b0-n0:drain", json={"reason": ""}, headers=auth(ADMIN, new_key()))
    assert r.status_code == 422
    assert await pool.fetchval("SELECT count(*) FROM audit WHERE action = 'drain'") == 1


async def test_return_moves_a_drained_node_to_burn_in_with_audit(client, pool):
    await client.post("/v1/nodes/b1-n1:drain", json={"reason": "fan noise"}, headers=auth(ADMIN, new_key()))
    key = new_key()
    r = await client.post("/v1/nodes/b1-n1:return", json={"reason": "fan replaced"}, headers=auth(ADMIN, key))
    assert r.status_code == 202, r.text
    assert r.json() == {"node_id": "b1-n1", "state": "burn_in", "previous_state": "draining", "reason": "fan replaced"}
    row = await pool.fetchrow("SELECT state, reason, drain_evict FROM nodes WHERE node_id = 'b1-n1'")
    assert tuple(row) == ("burn_in", "fan replaced", False)
    audit = await pool.fetchrow(
        "SELECT actor, reason, detail FROM audit WHERE subject = 'b1-n1' AND action = 'node_return'"
    )
    assert (audit["actor"], audit["reason"]) == ("root", "fan replaced")
    assert audit["detail"] == {"from": "draining", "to": "burn_in"}
    again = await client.post("/v1/nodes/b1-n1:return", json={"reason": "fan replaced"}, headers=auth(ADMIN, key))
    assert again.status_code == 202 and again.headers["idempotent-replayed"] == "true"
    assert again.json() == r.json()
    # a cordoned node may be returned too
    await pool.execute("UPDATE nodes SET state = 'cordoned' WHERE node_id = 'b1-n0'")
    r = await client.post("/v1/nodes/b1-n0:return", json={"reason": "gpu swapped"}, headers=auth(ADMIN, new_key()))
    assert r.status_code == 202 and r.json()["previous_state"] == "cordoned"
    # not draining or cordoned: 409 with the state, nothing written
    for node, state in (("b0-n0", "ready"), ("b1-n1", "burn_in")):
        r = await client.post(f"/v1/nodes/{node}:return", json={"reason": "x"}, headers=auth(ADMIN, new_key()))
        assert r.status_code == 409 and r.json()["error"]["code"] == "node_not_returnable", r.text
        assert r.json()["error"]["details"] == {"state": state}
    r = await client.post("/v1/nodes/b1-n0:return", json={"reason": "x"}, headers=auth(ALPHA, new_key()))
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required"
    r = await client.post("/v1/nodes/zzz:return", json={"reason": "x"}, headers=auth(ADMIN, new_key()))
    assert r.status_code == 404 and r.json()["error"]["code"] == "node_not_found"
    r = await client.post("/v1/nodes/b1-n1:return", json={"reason": ""}, headers=auth(ADMIN, new_key()))
    assert r.status_code == 422
    r = await client.post("/v1/nodes/b1-n1:return", json={"reason": "x"}, headers=auth(ADMIN))
    assert r.status_code == 400 and r.json()["error"]["code"] == "idempotency_key_missing"
    assert await pool.fetchval("SELECT count(*) FROM audit WHERE action = 'node_return'") == 2


async def test_nodes_show_the_hot_spares_the_leader_published(client, pool):
    """The leader's published spares are read from Postgres (no control plane needed);
    another team's job id is hidden, as on leases."""
    alpha_job = (await submit(client, name="big")).json()["job_id"]
    beta_job = (await submit(client, token=BETA, team="beta", name="big")).json()["job_id"]
    await pool.executemany(
        "INSERT INTO hot_spares (node_id, job_id, epoch) VALUES ($1, $2, 1)",
        [("b1-n0", alpha_job), ("b1-n1", alpha_job), ("b0-n1", beta_job)],
    )
    page = (await client.get("/v1/nodes", headers=auth(ALPHA))).json()
    assert page["hot_spares"] == 3
    by_id = {n["node_id"]: n for n in page["nodes"]}
    assert {n: (v["hot_spare"], v["hot_spare_for"]) for n, v in by_id.items()} == {
        "b0-n0": (False, None),
        "b0-n1": (True, None),
        "b1-n0": (True, alpha_job),
        "b1-n1": (True, alpha_job),
    }
    assert by_id["b0-n0"]["state"] == "ready"  # the existing fields stay
    admin = (await client.get("/v1/nodes", params={"limit": 2}, headers=auth(ADMIN))).json()
    assert admin["hot_spares"] == 3 and admin["nodes"][1]["hot_spare_for"] == beta_job  # counted over all pages
    assert (await client.get("/v1/nodes", params={"block": "b1"}, headers=auth(ADMIN))).json()["hot_spares"] == 2
    one = (await client.get("/v1/nodes/b1-n0", headers=auth(BETA))).json()
    assert one["hot_spare"] is True and one["hot_spare_for"] is None
    one = (await client.get("/v1/nodes/b1-n0", headers=auth(ALPHA))).json()
    assert one["hot_spare_for"] == alpha_job
    await pool.execute("DELETE FROM hot_spares")
    page = (await client.get("/v1/nodes", headers=auth(ADMIN))).json()
    assert page["hot_spares"] == 0 and not any(n["hot_spare"] for n in page["nodes"])
