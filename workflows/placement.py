"""PlacementWorkflow: the singleton that gives placement its durable clock (DESIGN.md, Leadership).

Started by every control process with a fixed id (``PLACEMENT_WORKFLOW_ID``) and
conflict policy USE_EXISTING, so exactly one runs. Each cycle it reads the leader
row (a local activity) and runs the cycle activity on the leader's own task queue
with the leader's epoch; the leader refuses a cycle under any other epoch, and every
write of the cycle checks the epoch in its transaction. A cycle runs every
``cycle_s``, at once when woken (``wake`` signal) or when the last cycle left
placeable work. Continue-as-new every ``max_cycles_per_run`` cycles.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

from workflows import messages as m

HISTORY_LIMIT = 3000


@workflow.defn(name=m.PLACEMENT_WORKFLOW)
class PlacementWorkflow:
    def __init__(self) -> None:
        self._woken = False
        self._cycles = 0
        self._last: m.CycleResult | None = None
        self._leader: m.LeaderInfo | None = None
        self._failures = 0

    @workflow.signal(name=m.SIGNAL_WAKE)
    def wake(self, req: m.WakeRequest) -> None:
        self._woken = True

    @workflow.query(name=m.QUERY_STATUS)
    def status(self) -> dict:
        return {
            "cycles": self._cycles,
            "epoch": self._leader.epoch if self._leader else None,
            "holder": self._leader.holder if self._leader else None,
            "last": self._last,
            "failures": self._failures,
        }

    @workflow.run
    async def run(self, inp: m.PlacementInput) -> None:
        self._cycles = inp.cycles
        this_run = 0
        while True:
            self._woken = False
            leader: m.LeaderInfo = await workflow.execute_local_activity(
                m.ACT_READ_LEADER,
                m.ReadLeader(),
                result_type=m.LeaderInfo,
                start_to_close_timeout=timedelta(seconds=10),
                retry_policy=RetryPolicy(maximum_interval=timedelta(seconds=2)),
            )
            self._leader = leader
            more = False
            ran = 1
            if leader.live:
                # Batched (cycles_per_activity_s > 0): the leader cycles inside one activity,
                # woken in-process, so a cycle costs no Temporal round trip; a dead leader is
                # noticed by the heartbeat timeout. Histories from before have 0 here.
                batch = leader.cycles_per_activity_s
                try:
                    self._last = await workflow.execute_activity(
                        m.ACT_PLACEMENT_CYCLE,
                        m.CycleInput(epoch=leader.epoch, cycle=self._cycles, run_for_s=batch, cycle_s=leader.cycle_s),
                        result_type=m.CycleResult,
                        task_queue=leader.task_queue,
                        schedule_to_start_timeout=timedelta(seconds=leader.start_timeout_s),
                        start_to_close_timeout=timedelta(seconds=leader.cycle_timeout_s + batch),
                        heartbeat_timeout=timedelta(seconds=leader.heartbeat_timeout_s) if batch else None,
                        retry_policy=RetryPolicy(maximum_attempts=1),
                    )
                    more = self._last.more or batch > 0
                    ran = self._last.cycles if batch else 1
                except ActivityError as e:
                    # the leader died, was deposed, or the cycle failed: the next cycle re-reads the row
                    self._failures += 1
                    workflow.logger.warning("placement cycle under epoch %s failed: %s", leader.epoch, e.cause or e)
            self._cycles += ran
            this_run += 1
            info = workflow.info()
            # A run on another queue (the control queue, before the placement workflow had
            # its own) moves over at once. No patch needed: histories from before carry no
            # placement_task_queue in read_leader's result, so they take the old path. (The
            # queue comes from the input, not workflow.info(): a replayer reports its own.)
            moving = bool(leader.placement_task_queue) and inp.task_queue != leader.placement_task_queue
            if (
                moving
                or this_run >= leader.max_cycles_per_run
                or info.is_continue_as_new_suggested()
                or info.get_current_history_length() > HISTORY_LIMIT
            ):
                await workflow.wait_condition(workflow.all_handlers_finished)
                workflow.continue_as_new(
                    m.PlacementInput(cycles=self._cycles, task_queue=leader.placement_task_queue),
                    task_queue=leader.placement_task_queue or None,
                )
            if more or self._woken:
                continue
            try:
                await workflow.wait_condition(lambda: self._woken, timeout=timedelta(seconds=leader.cycle_s))
            except asyncio.TimeoutError:
                pass
