"""Fixtures of the workflow tests: a control worker + a fake agent on unique task queues."""

from __future__ import annotations

import asyncio

import pytest

from activities.job_activities import JobActivities
from common.aio import cancel_and_wait
from common.temporal import ensure_search_attributes, make_worker
from control.report_delivery import ReportDelivery
from tests.workflows.fake_agent import FakeAgent
from tests.workflows.harness import Stand, scaled_settings, seed
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
        yield Stand(pool=pool, client=client, settings=settings, agent=agent, epoch=epoch, nodes=nodes)
        await agent.kill_all()
        await cancel_and_wait(delivery)
        await reports.close()
