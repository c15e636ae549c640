"""A gang on several failed nodes is told of each one (control/health/recovery.py).

The monitor judges a block's silent nodes one by one and calls ``Recoveries.recover`` per node.
The recovery of a job's attempt was kept once, with the first node only: a later node of the
same gang was never named to its workflow (nor in the re-sends), which then stopped that rank
as if alive and waited out the stop's pickup timeout. Now the nodes a pass finds are named in
one signal per job (``flush``), and each is re-sent while its lease is live. Here against the real Temporal dev server,
each job's workflow started by the signal itself (signal-with-start) on a task queue no worker
polls, so its history holds exactly what the monitor sent."""

from __future__ import annotations

import uuid

from temporalio.api.enums.v1 import EventType

from common.settings import Settings
from common.temporal import DATA_CONVERTER
from control.health.node_states import Decision, Event, NodeState, transition
from control.health.recovery import Recoveries
from store.allocations import LeaseRow
from workflows import messages as m


def _lease(job: str, rank: int, node: str) -> LeaseRow:
    return LeaseRow(f"{job}.a1.r{rank}", job, 1, rank, node, tuple(range(8)), 1, True)


async def _told(client, job: str) -> list[tuple[str, ...]]:
    """The nodes named by each ``node_failed`` signal in the job's history, in order."""
    out = []
    async for e in client.get_workflow_handle(job).fetch_history_events():
        if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            attrs = e.workflow_execution_signaled_event_attributes
            if attrs.signal_name == m.SIGNAL_NODE_FAILED:
                (req,) = await DATA_CONVERTER.decode(attrs.input.payloads, [m.NodeFailed])
                out.append((req.node_id, *req.more_nodes))
    return out


async def test_each_failed_node_of_a_gang_is_named_to_its_workflow_and_in_the_resends(temporal_env):
    uid = uuid.uuid4().hex[:8]
    settings = Settings(control_task_queue=f"nobody-{uid}", recovery_resignal_s=0.0)
    failures: list[tuple[str, str]] = []
    rec = Recoveries(None, temporal_env.client, settings, actor="test",  # type: ignore[arg-type]
                     on_failure=lambda cause, job, _at: failures.append((cause, job)))  # fmt: skip
    gang, single = f"j-gang-{uid}", f"j-one-{uid}"
    lost = Decision(NodeState.READY, Event.LOST, transition(NodeState.READY, Event.LOST), "no heartbeat for 91s")
    # the gang has ranks 0 and 1 on n0, rank 2 on n1; another job is alone on n1
    rec.recover("n0", lost, [_lease(gang, 0, "n0"), _lease(gang, 1, "n0")], failed_at=100.0)
    rec.recover("n1", lost, [_lease(gang, 2, "n1"), _lease(single, 0, "n1")], failed_at=101.0)

    rec.flush()  # the monitor's pass ends: one signal per job for the nodes it found
    await rec.sent()  # the sends run beside the monitor's pass, a few at a time
    assert await _told(temporal_env.client, gang) == [("n0", "n1")]
    assert await _told(temporal_env.client, single) == [("n1",)]
    # the work lost is counted once per job's attempt, the restart measured from the first node
    assert failures == [("node_down", gang), ("node_down", single)]
    assert rec.nodes_recovering() == {"n0", "n1"} and rec.pending() == 2
    # re-sent while a lease on the node is live: only n1's is (n0's ranks were released)
    rec.resignal([_lease(gang, 2, "n1")])
    await rec.sent()
    assert await _told(temporal_env.client, gang) == [("n0", "n1"), ("n1",)]
    # a flush with nothing due sends nothing
    rec.flush()
    await rec.sent()
    assert len(await _told(temporal_env.client, single)) == 1
