"""The same-run baseline of ``gpufleet bench e2e``: a "lean job workflow"
(3 local activities, 1 signal, 1 node activity) on the same Temporal server, so the
benchmark can say how much of its latency is the platform's and how much the box's."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

LEAN_WORKFLOW = "LeanJobWorkflow"
ACT_LEAN_WRITE = "lean_write"  # a short Postgres write (local activity)
ACT_LEAN_NODE = "lean_node"  # the node activity


@workflow.defn(name=LEAN_WORKFLOW)
class LeanJobWorkflow:
    def __init__(self) -> None:
        self._go = False

    @workflow.signal(name="go")
    def go(self, _: str) -> None:
        self._go = True

    @workflow.run
    async def run(self, job_id: str) -> str:
        opts = dict(start_to_close_timeout=timedelta(seconds=10))
        await workflow.execute_local_activity(ACT_LEAN_WRITE, job_id, result_type=str, **opts)
        await workflow.wait_condition(lambda: self._go)
        await workflow.execute_activity(
            ACT_LEAN_NODE, job_id, result_type=str, task_queue=workflow.info().task_queue + "-node", **opts
        )
        await workflow.execute_local_activity(ACT_LEAN_WRITE, job_id, result_type=str, **opts)
        await workflow.execute_local_activity(ACT_LEAN_WRITE, job_id, result_type=str, **opts)
        return job_id
