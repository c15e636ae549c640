"""Admission at submit: each rejection is a 4xx with a machine-readable code and a
human sentence, and nothing is written for it."""

from __future__ import annotations

import httpx
import pytest

from api.admission import check_capacity, parse_duration
from api.errors import ApiError
from api.main import create_app
from api.schemas import JobSubmit
from store.seed import seed_demo
from tests.api.conftest import ADMIN, ALPHA, BETA, auth, job_body, new_key, submit
from tests.foundation.builders import queued_job

# The seed's own example request (README / DESIGN: 128 x 8 GPUs, pack block, max_blocks 4)
SEED_EXAMPLE = {
    "team": "pretrain",
    "priority_class": "prod-batch",
    "image": "registry/llm:2024-06",
    "command": ["torchrun", "train.py"],
    "gpu_type": "h100",
    "replicas": 128,
    "gpus_per_replica": 8,
    "topology": {"pack": "block", "max_blocks": 4},
    "max_runtime": "72h",
    "checkpoint": {"preemptible": True, "grace_seconds": 120},
}


async def nothing_written(pool) -> None:
    for table in ("jobs", "job_events", "idempotency_keys"):
        assert await pool.fetchval(f"SELECT count(*) FROM {table}") == 0, table
    assert await pool.fetchval("SELECT count(*) FROM audit WHERE action = 'submit'") == 0


CASES = [
    # (token, overrides, status, code, words in the message)
    (ALPHA, {"replicas": 5, "gpus_per_replica": 8}, 422, "exceeds_cluster", ["40", "32"]),
    (BETA, {"team": "beta", "replicas": 3, "gpus_per_replica": 8}, 422, "exceeds_quota", ["24", "16"]),
    (
        ALPHA,
        {"image": "docker.io/evil:1"},
        422,
        "image_not_allowed",
        ["docker.io/evil:1", "allowed registry (registry)"],
    ),
    (ALPHA, {"image": "registry.evil/x:1"}, 422, "image_not_allowed", ["registry.evil"]),
    (ALPHA, {"max_runtime": None}, 422, "max_runtime_required", ["max_runtime"]),
    (ALPHA, {"max_runtime": "8d"}, 422, "max_runtime_too_long", ["8d", "research", "7d"]),
    (ALPHA, {"max_runtime": "forever"}, 422, "invalid_max_runtime", ["forever"]),
    (ADMIN, {"team": "ghosts"}, 422, "unknown_team", ["ghosts"]),
    (ALPHA, {"gpu_type": "tpu"}, 422, "unknown_gpu_type", ["tpu"]),
    (ALPHA, {"priority_class": "vip"}, 422, "unknown_priority_class", ["vip", "prod-serving"]),
    (ALPHA, {"team": "beta"}, 403, "forbidden_team", ["alpha"]),
    (
        ALPHA,
        {"replicas": 3, "gpus_per_replica": 8, "topology": {"pack": "block", "max_blocks": 1}},
        422,
        "exceeds_topology",
        ["1 block"],
    ),
    (
        ALPHA,
        {"replicas": 2, "gpus_per_replica": 8, "topology": {"pack": "node"}},
        422,
        "exceeds_topology",
        ["one node"],
    ),
]


@pytest.mark.parametrize("token,over,status,code,words", CASES, ids=[c[3] + "-" + str(i) for i, c in enumerate(CASES)])
async def test_each_admission_error(client, pool, token, over, status, code, words):
    r = await submit(client, token=token, **over)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code
    assert "\n" not in err["message"] and "Traceback" not in err["message"] and len(err["message"]) < 300
    for w in words:
        assert w in err["message"], (w, err["message"])
    await nothing_written(pool)


async def test_queue_full_is_429(settings, pool, cluster, temporal_env):
    app = create_app(
        settings.model_copy(update={"max_queued_per_team": 3}), pool=pool, temporal_client=temporal_env.client
    )
    async with pool.acquire() as conn:
        for i in range(3):
            await queued_job(conn, f"old{i}", "alpha")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await submit(c)
        assert r.status_code == 429 and r.json()["error"]["code"] == "team_queue_full"
        assert "3 queued jobs" in r.json()["error"]["message"]
        # another team is not affected
        assert (await submit(c, token=BETA, team="beta")).status_code == 202
    assert await pool.fetchval("SELECT count(*) FROM jobs WHERE team = 'alpha'") == 3


async def test_body_validation_is_422_with_the_error_shape(client, pool):
    for bad in (
        {"replicas": 0},
        {"gpus_per_replica": 9},
        {"command": []},
        {"env": {"1BAD": "x"}},
        {"unknown": 1},
        {"name": "nul\x00"},
    ):
        r = await submit(client, **bad)
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["error"]["code"] == "validation_error"
    await nothing_written(pool)


async def test_seed_example_is_rejected_on_the_demo_cluster(settings, pool, temporal_env):
    async with pool.acquire() as conn:
        await seed_demo(conn, gpu_type="h100", blocks=4, nodes_per_block=4, gpus_per_node=8, task_queue_prefix="n-")
    app = create_app(settings, pool=pool, temporal_client=temporal_env.client)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/jobs", json=SEED_EXAMPLE, headers=auth(ADMIN, new_key()))
    assert r.status_code == 422
    err = r.json()["error"]
    assert err["code"] == "exceeds_cluster"
    assert err["message"] == "the job asks for 1024 h100 GPUs (128 x 8); the cluster has 128"
    await nothing_written(pool)


async def test_seed_example_is_accepted_on_a_cluster_large_enough(settings, pool, temporal_env):
    async with pool.acquire() as conn:  # 4 blocks x 32 nodes x 8 GPUs = 1,024 GPUs
        await seed_demo(conn, gpu_type="h100", blocks=4, nodes_per_block=32, gpus_per_node=8, task_queue_prefix="n-")
    app = create_app(settings, pool=pool, temporal_client=temporal_env.client)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        r = await c.post("/v1/jobs", json=SEED_EXAMPLE, headers=auth(ADMIN, new_key()))
        assert r.status_code == 202, r.text
        # with max_blocks 3 the same request cannot fit
        three = SEED_EXAMPLE | {"topology": {"pack": "block", "max_blocks": 3}}
        r3 = await c.post("/v1/jobs", json=three, headers=auth(ADMIN, new_key()))
        assert r3.status_code == 422 and r3.json()["error"]["code"] == "exceeds_topology"
    assert await pool.fetchval("SELECT replicas * gpus_per_replica FROM jobs") == 1024


def test_durations():
    assert parse_duration("72h") == 72 * 3600
    assert parse_duration("1d12h") == 36 * 3600
    assert parse_duration("90m") == 5400 and parse_duration("45s") == 45 and parse_duration(3600) == 3600
    assert parse_duration("3600") == 3600
    for bad in ("", "h", "0h", "-1h", "1y", "1h x", True):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_capacity_is_counted_in_replica_slots():
    # 8-GPU replicas never fit on 4-GPU nodes, however many GPUs the cluster has
    job = JobSubmit.model_validate(job_body(replicas=1, gpus_per_replica=8))
    with pytest.raises(ApiError) as e:
        check_capacity(job, [("b0", 4)] * 10)
    assert e.value.code == "exceeds_cluster" and "one node" in e.value.message
    check_capacity(job, [("b0", 8)])
