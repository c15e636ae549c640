"""The PlacementWorkflow's activities.

* ``read_leader`` (a local activity of the workflow, on any control worker): the
  leader row, plus the cycle's timing settings (recorded in history).
* ``placement_cycle`` (on the leader's own task queue): cycles of the leader's
  in-memory ``LeaderState`` under the given epoch, one, or (``run_for_s`` > 0) as many
  as fall due in that time, heartbeating; a process that does not hold that epoch
  refuses (non-retryable), so a deposed leader never runs a cycle.
"""

from __future__ import annotations

from typing import Any

import asyncpg
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.placement_cycle import LeaderState, NotLeader
from activities.store import StaleEpoch
from common.settings import Settings
from workflows import messages as m

MAX_CYCLES_PER_RUN = 250  # the PlacementWorkflow continues as new after this many cycles (~3,000 events)


class ReadLeaderActivity:
    def __init__(self, pool: asyncpg.Pool, settings: Settings) -> None:
        self.pool = pool
        self.settings = settings

    def all(self) -> list[Any]:
        return [self.read_leader]

    @activity.defn(name=m.ACT_READ_LEADER)
    async def read_leader(self, req: m.ReadLeader) -> m.LeaderInfo:
        s = self.settings
        row = await self.pool.fetchrow(
            "SELECT epoch, holder, task_queue, expires_at > now() AS live FROM leader WHERE scope = $1",
            req.scope or s.leader_scope,
        )
        # a leader that misses two renewals is presumed gone: its cycle activity is not
        # picked up (schedule-to-start) or stops heartbeating within this
        leader_gone_s = max(2.0, 2 * s.leader_renew_s)
        timing = dict(
            cycle_s=s.placement_cycle_s,
            cycle_timeout_s=s.leader_cycle_timeout_s,
            start_timeout_s=leader_gone_s,
            max_cycles_per_run=MAX_CYCLES_PER_RUN,
            placement_task_queue=s.placement_task_queue,
            cycles_per_activity_s=s.placement_cycles_per_activity_s,
            heartbeat_timeout_s=leader_gone_s,
        )
        if row is None:
            return m.LeaderInfo(live=False, **timing)
        return m.LeaderInfo(
            live=bool(row["live"]), epoch=row["epoch"], holder=row["holder"], task_queue=row["task_queue"], **timing
        )


class CycleActivity:
    def __init__(self, leader: LeaderState) -> None:
        self.leader = leader

    def all(self) -> list[Any]:
        return [self.placement_cycle]

    @activity.defn(name=m.ACT_PLACEMENT_CYCLE)
    async def placement_cycle(self, req: m.CycleInput) -> m.CycleResult:
        try:
            if req.run_for_s > 0:
                return await self.leader.run_cycles(req.epoch, req.run_for_s, req.cycle_s, heartbeat=activity.heartbeat)
            return await self.leader.run_cycle(req.epoch)
        except NotLeader as e:
            raise ApplicationError(str(e), type="NotLeader", non_retryable=True) from e
        except StaleEpoch as e:
            raise ApplicationError(str(e), type="StaleEpoch", non_retryable=True) from e
