"""GET /v1/cluster and its read model (store.cluster_view) on a cluster in every GPU state
(tests/api/cluster_seed.py): each GPU's state and owner, the queue, quotas, idle GPUs and
cost, and what a team token may see of other teams' jobs."""

from __future__ import annotations

from collections import Counter

import pytest

from store import nodes
from store.cluster_view import GPU_STATES, read_cluster
from tests.api.cluster_seed import EXPECTED_GPUS, seed_cluster_states
from tests.api.conftest import ADMIN, ALPHA, BETA, auth


@pytest.fixture
async def seeded(pool, cluster) -> None:
    await seed_cluster_states(pool)


def _cells(body: dict) -> dict[tuple[str, int], dict]:
    return {(n["node_id"], g["index"]): g for b in body["blocks"] for n in b["nodes"] for g in n["gpus"]}


async def test_every_gpu_has_the_state_its_node_and_rows_give_it(client, seeded):
    r = await client.get("/v1/cluster", headers=auth(ADMIN))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["gpu_states"] == list(GPU_STATES)
    cells = _cells(body)
    assert len(cells) == 72
    assert Counter(g["state"] for g in cells.values()) == EXPECTED_GPUS
    assert body["totals"]["gpus"] == {"h100": EXPECTED_GPUS}

    def states(node: str) -> list[str]:
        return [cells[(node, i)]["state"] for i in range(8)]

    assert states("b0-n0") == ["guaranteed"] * 4 + ["borrowed"] * 2 + ["free"] * 2
    assert states("b0-n1") == ["guaranteed"] * 8
    assert states("b0-n2") == ["down"] * 8
    assert states("b1-n0") == ["hot_spare"] * 8
    assert states("b1-n1") == ["cordoned"] * 8
    assert states("b1-n2") == ["guaranteed"] * 2 + ["down"] * 6  # suspect: running work untouched
    assert states("b2-n0") == ["burn_in"] * 8  # in the reserved block, but burning in
    assert states("b2-n1") == states("b2-n2") == ["reserved"] * 8
    assert cells[("b0-n0", 4)] == {"index": 4, "state": "borrowed", "team": "alpha", "job_id": "a-borrow"}
    assert cells[("b1-n0", 0)]["team"] == "beta" and cells[("b1-n0", 0)]["job_id"] == "b-run"
    assert cells[("b2-n1", 0)]["team"] == "alpha" and cells[("b2-n1", 0)]["job_id"] == "a-big"
    assert cells[("b0-n0", 7)] == {"index": 7, "state": "free", "team": None, "job_id": None}

    by_id = {n["node_id"]: n for b in body["blocks"] for n in b["nodes"]}
    assert [b["block_id"] for b in body["blocks"]] == ["b0", "b1", "b2"]
    assert by_id["b1-n1"]["cordoned"] and not by_id["b1-n1"]["drained"]
    assert by_id["b2-n0"]["burn_in"] and by_id["b2-n0"]["state"] == "burn_in"
    assert by_id["b0-n2"]["reason"] == "seeded"


async def test_queue_teams_and_idle_totals(client, pool, seeded):
    body = (await client.get("/v1/cluster", headers=auth(ADMIN))).json()
    queue = {q["priority_class"]: q for q in body["queue"]}
    assert list(queue) == ["prod-serving", "prod-batch", "research", "preemptible"]
    assert (queue["prod-batch"]["jobs_queued"], queue["prod-batch"]["gpus_queued"]) == (1, 16)
    assert (queue["research"]["jobs_queued"], queue["research"]["gpus_queued"]) == (2, 5)
    [big] = queue["prod-batch"]["jobs"]
    assert big["job_id"] == "a-big" and big["pending_reason"] == "reserved" and big["queue_position"] == 1
    assert big["expected_start"].startswith("2030-01-02T03:04:05")
    # published position first, unpublished last
    assert [j["job_id"] for j in queue["research"]["jobs"]] == ["b-wait", "a-wait"]

    teams = {(u["team"], u["gpu_type"]): u for u in body["teams"]}
    assert teams[("alpha", "h100")] == {
        "team": "alpha",
        "gpu_type": "h100",
        "guaranteed": 16,
        "borrow_limit": 16,
        "in_use": 8,
        "guaranteed_in_use": 6,
        "borrowed": 2,
        "allocated_idle": 2,
    }
    assert teams[("beta", "h100")]["in_use"] == 8 and teams[("beta", "h100")]["borrowed"] == 0

    t = body["totals"]
    assert t["idle_gpus"] == {"h100": await nodes.free_gpus(pool, "h100")} == {"h100": 26}
    assert t["idle_gpu_total"] == 26
    assert t["gpu_hour_usd"] > 0
    assert t["idle_cost_usd_per_hour"] == pytest.approx(26 * t["gpu_hour_usd"])
    assert t["allocated_idle_gpus"] == {"alpha": 2, "beta": 8}
    assert t["allocated_idle_cost_usd_per_hour"] == pytest.approx(10 * t["gpu_hour_usd"])

    r = await client.get("/v1/cluster?jobs=0", headers=auth(ADMIN))
    assert all(q["jobs"] == [] for q in r.json()["queue"])
    assert r.json()["queue"][1]["jobs_queued"] == 1


async def test_a_team_sees_the_whole_map_but_only_its_own_job_ids_and_reasons(client, seeded):
    admin = (await client.get("/v1/cluster", headers=auth(ADMIN))).json()
    beta = (await client.get("/v1/cluster", headers=auth(BETA))).json()
    alpha = (await client.get("/v1/cluster", headers=auth(ALPHA))).json()
    # the same map, the same counts
    for body in (alpha, beta):
        assert {k: v["state"] for k, v in _cells(body).items()} == {k: v["state"] for k, v in _cells(admin).items()}
        assert {k: v["team"] for k, v in _cells(body).items()} == {k: v["team"] for k, v in _cells(admin).items()}
        assert body["totals"] == admin["totals"] and body["teams"] == admin["teams"]
        assert [q["jobs_queued"] for q in body["queue"]] == [q["jobs_queued"] for q in admin["queue"]]

    def job_ids(body: dict) -> set[str]:
        ids = {g["job_id"] for g in _cells(body).values()}
        ids |= {j["job_id"] for q in body["queue"] for j in q["jobs"]}
        return ids - {None}

    assert job_ids(admin) == {"a-run", "a-borrow", "b-run", "a-idle", "a-big", "b-wait", "a-wait"}
    assert job_ids(beta) == {"b-run", "b-wait"}
    assert job_ids(alpha) == {"a-run", "a-borrow", "a-idle", "a-big", "a-wait"}
    reasons = {j["team"]: j["pending_reason"] for q in beta["queue"] for j in q["jobs"] if j["pending_reason"]}
    assert reasons == {"beta": "capacity"}  # alpha's "reserved" is not beta's to read
    big = next(j for q in beta["queue"] for j in q["jobs"] if j["team"] == "alpha" and j["gpus"] == 16)
    assert big["job_id"] is None and big["name"] is None and big["queue_position"] == 1


async def test_unauthenticated_and_teamless_are_refused(client, cluster):
    assert (await client.get("/v1/cluster")).status_code == 401
    assert (await client.get("/v1/cluster", headers=auth("tok-nobody"))).status_code == 403


async def test_read_model_counts_only(pool, cluster):
    """An empty cluster: every type x state present (zeros), every class, nothing idle-but-allocated."""
    view = await read_cluster(pool, gpu_hour_usd=2.5, jobs_per_class=0)
    counts = view.gpu_counts()
    assert counts[("h100", "free")] == 32 and sum(counts.values()) == 32
    assert set(counts) == {("h100", s) for s in GPU_STATES}
    assert view.idle_cost_usd_per_hour == 32 * 2.5
    assert [q.priority_class for q in view.queue] == ["prod-serving", "prod-batch", "research", "preemptible"]
    assert dict(view.allocated_idle) == {} and view.allocated() == {}
