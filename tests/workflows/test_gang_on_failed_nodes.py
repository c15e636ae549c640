"""A gang whose nodes fail one after another restarts without waiting on the dead ones.

A block failure silences a gang's nodes together, but the health monitor judges them one by
one: the workflow hears ``node_failed`` for the first node, fails the attempt and stops every
other rank. A rank on a node whose failure it hears of next had its stop scheduled on a queue
no agent polls any more; before ``stop-skips-lost-ranks`` the workflow waited out the stop's
pickup timeout (``start_task_timeout_s``, 60 s by default) before it re-queued the gang.
Found by ``gpufleet bench node-loss`` (docs/design.md, Health)."""

from __future__ import annotations

import time

import pytest

from tests.support import eventually
from tests.workflows.harness import PY
from workflows import messages as m

PICKUP_S = 30.0  # the stop's pickup timeout: the re-queue must come long before it


@pytest.fixture
def settings_overrides() -> dict:
    return {"start_task_timeout_s": PICKUP_S}


async def test_a_gang_told_of_its_second_failed_node_requeues_without_waiting_for_its_stop(stand):
    job = await stand.submit(
        "j-two-dead-nodes", command=[PY, "-c", "import time; time.sleep(120)"], replicas=2, gpus_per_replica=8,
        grace_s=1.0, start=False,
    )  # fmt: skip
    await stand.allocate(job, (stand.nodes[0], tuple(range(8))), (stand.nodes[1], tuple(range(8))))
    await stand.wait_state(job, "RUNNING")
    await stand.node_worker.shutdown()  # both nodes go dark: no agent takes a task any more
    handle = stand.client.get_workflow_handle(job)
    await handle.signal(m.SIGNAL_NODE_FAILED, m.NodeFailed(job, 1, stand.nodes[0], "node b0-n0: node_down"))

    # the workflow is stopping rank 1 on the other node
    await eventually(lambda: stand.scheduled(job, "stop_task"), timeout=10, what="the stop of rank 1 scheduled")
    told = time.monotonic()
    await handle.signal(m.SIGNAL_NODE_FAILED, m.NodeFailed(job, 1, stand.nodes[1], "node b0-n1: node_down"))
    await stand.wait_state(job, "QUEUED", attempt=2, timeout=2 * PICKUP_S)
    waited = time.monotonic() - told
    assert waited < PICKUP_S / 3, f"re-queued {waited:.1f}s after its second node's failure"
    assert await stand.live_gpus(job) == 0


async def test_one_signal_naming_both_nodes_requeues_the_gang_without_stopping_either(stand):
    # the monitor names every failed node of a gang found in one pass in one signal
    job = await stand.submit(
        "j-two-dead-nodes-at-once", command=[PY, "-c", "import time; time.sleep(120)"], replicas=2,
        gpus_per_replica=8, grace_s=1.0, start=False,
    )  # fmt: skip
    await stand.allocate(job, (stand.nodes[0], tuple(range(8))), (stand.nodes[1], tuple(range(8))))
    await stand.wait_state(job, "RUNNING")
    await stand.node_worker.shutdown()
    handle = stand.client.get_workflow_handle(job)
    run_id = (await handle.describe()).run_id  # the failed attempt's run
    told = time.monotonic()
    req = m.NodeFailed(job, 1, stand.nodes[0], "node b0-n0: node_down", more_nodes=(stand.nodes[1],))
    await handle.signal(m.SIGNAL_NODE_FAILED, req)
    await stand.wait_state(job, "QUEUED", attempt=2, timeout=2 * PICKUP_S)
    waited = time.monotonic() - told
    assert waited < PICKUP_S / 3, f"re-queued {waited:.1f}s after its nodes' failure"
    assert not await stand.scheduled(job, "stop_task", run_id=run_id)  # nothing left alive to stop
    assert await stand.live_gpus(job) == 0
