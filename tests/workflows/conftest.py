"""Fixtures of the workflow tests: a control worker + a fake agent on unique task queues."""

from __future__ import annotations

import asyncio

import pytest

from activities.job_activities import JobActivities
from common.aio import cancel_and_wait
from common.temporal import ensure_search_attributes, make_worker
from control.leader.state import policy_from_settings
from control.report_delivery import ReportDelivery
from store import leadership
from tests.foundation.builders import small_cluster, team
from tests.workflows.fake_agent import FakeAgent
from tests.workflows.harness import Stand, leader_cycles, scaled_settings, seed
from workflows import search_attributes
from workflows.job import JobWorkflow


@pytest.fixture
def settings_overrides() -> dict:
    return {}


@pytest.fixture
async def stand(pool, temporal_env, tmp_path, settings_overrides):
    settings = scaled_settings(tmp_path, **settings_overrides)
    client = temporal_env.client
    nodes, epoch = await seed(pool, settings)
    assert await ensure_search_attributes(client, settings.temporal_namespace, search_attributes.KEYS)
    # the agent's reports take the durable path: stored, then delivered (here, by the stand)
    reports = ReportDelivery(pool, client, settings)
    delivery = asyncio.create_task(reports.run(lambda: True))
    agent = FakeAgent(reports, tmp_path / "agent")
    control = make_worker(
        client, settings.control_task_queue, workflows=[JobWorkflow], activities=JobActivities(pool, settings).all()
    )
    node = make_worker(client, settings.agent_shared_task_queue, activities=agent.activities())
    async with control, node:
        yield Stand(
            pool=pool, client=client, settings=settings, agent=agent, epoch=epoch, nodes=nodes, node_worker=node
        )
        await agent.kill_all()
        await cancel_and_wait(delivery)
        await reports.close()


@pytest.fixture
async def leader(pool, tmp_path):
    """A leader's state and cycles without Temporal over one block of 4 nodes, team "alpha"
    guaranteed 8 GPUs; (cycles, epoch). tests/workflows/test_hot_spares.py has its own."""
    settings = scaled_settings(tmp_path)
    async with pool.acquire() as conn:
        await small_cluster(conn, blocks=1, nodes_per_block=4)
        await team(conn, "alpha", guaranteed=8, borrow_limit=0)
    epoch = await leadership.acquire_leadership(
        pool, scope=settings.leader_scope, holder="test", grpc_addr="-", ttl_s=3600
    )
    return await leader_cycles(pool, settings, epoch, policy_from_settings(settings)), epoch
