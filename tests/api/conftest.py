"""Fixtures for the API tests: the app over a fresh migrated database and the real
Temporal dev server, bearer tokens for two teams and an admin, a small cluster,
and a stand-in job workflow worker on a per-test task queue."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from api.main import create_app
from common.settings import Principal, Settings
from common.temporal import make_worker
from tests.api.fake_workflow import FakeJobWorkflow
from tests.foundation.builders import small_cluster, team

ADMIN = "tok-admin"
ALPHA = "tok-alpha"  # member of team alpha
BETA = "tok-beta"  # member of team beta
TOKENS = {
    ADMIN: Principal(name="root", admin=True),
    ALPHA: Principal(name="alice", team="alpha"),
    BETA: Principal(name="bob", team="beta"),
    "tok-nobody": Principal(name="nobody"),
}


def auth(token: str | None, key: str | None = None) -> dict[str, str]:
    h: dict[str, str] = {}
    if token:
        h["Authorization"] = f"Bearer {token}"
    if key:
        h["Idempotency-Key"] = key
    return h


def new_key() -> str:
    return uuid.uuid4().hex


def job_body(**over) -> dict:
    body = {
        "team": "alpha",
        "priority_class": "research",
        "image": "registry/llm:1",
        "command": ["python", "train.py"],
        "gpu_type": "h100",
        "replicas": 1,
        "gpus_per_replica": 4,
        "topology": {"pack": "any"},
        "max_runtime": "2h",
        "checkpoint": {"preemptible": True, "grace_seconds": 30},
    }
    body.update(over)
    return body


def temporal_target(temporal_env) -> str:
    return temporal_env.client.service_client.config.target_host


@pytest.fixture
def task_queue() -> str:
    return f"api-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def settings(db_dsn, temporal_env, task_queue) -> Settings:
    return Settings(
        database_url=db_dsn,
        temporal_address=temporal_target(temporal_env),
        control_task_queue=task_queue,
        api_tokens=TOKENS,
        idempotency_wait_s=0.3,
        api_temporal_timeout_s=3.0,
        max_queued_per_team=5000,
        log_signing_key="test-log-signing-key",
        # the authorization matrix and the fuzzer send hundreds of bad tokens from one
        # address; the back-off has its own tests (test_edge_limits)
        api_auth_failures_per_minute=1_000_000,
    )


@pytest.fixture
async def cluster(pool) -> list[str]:
    """2 blocks x 2 nodes x 8 h100 GPUs (32 GPUs); alpha: 16 + borrow 16; beta: 16."""
    async with pool.acquire() as conn:
        nodes = await small_cluster(conn, blocks=2, nodes_per_block=2)
        await team(conn, "alpha", guaranteed=16, borrow_limit=16)
        await team(conn, "beta", guaranteed=16, borrow_limit=0)
    return nodes


@pytest.fixture
def app(settings, pool, temporal_env, cluster):
    return create_app(settings, pool=pool, temporal_client=temporal_env.client)


@pytest.fixture
async def client(app) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api.test") as c:
        yield c


@pytest.fixture
async def worker(temporal_env, task_queue):
    """The stand-in JobWorkflow, polling this test's control task queue."""
    w = make_worker(temporal_env.client, task_queue, workflows=[FakeJobWorkflow])
    async with w:
        yield w


async def submit(client: httpx.AsyncClient, token: str = ALPHA, key: str | None = None, **over) -> httpx.Response:
    return await client.post("/v1/jobs", json=job_body(**over), headers=auth(token, key or new_key()))


async def start_as_placed(temporal_env, task_queue: str, job_id: str) -> None:
    """What the leader's allocation does for a job (a submit starts no workflow): its
    workflow starts, here the stand-in."""
    from workflows.messages import JOB_WORKFLOW, JobInput

    await temporal_env.client.start_workflow(JOB_WORKFLOW, JobInput(job_id=job_id), id=job_id, task_queue=task_queue)
