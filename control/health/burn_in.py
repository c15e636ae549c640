"""Burn-in: a node that was down, cordoned or drained runs the burn-in test before it
returns to service (docs/design.md, Health).

The leader starts ``BurnInWorkflow`` (workflow id = the burn-in lease id), which starts
``burn_in_check.py`` as a rank on every GPU of the node. The monitor watches the rank
through heartbeats (its GPUs must be busy) and its exit report, and judges it: passed
when it exits 0, every GPU was busy during it and no fatal fault showed. A burn-in rank
holds no lease in the store: heartbeat acks confirm it while it runs.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio.client import Client

from common.contracts import StartTaskResult, TaskState, TaskStatus
from common.settings import Settings
from control.health.node_states import Decision, Event, HealthParams, NodeObservation, transition
from workflows.burn_in import BurnInInput, BurnInWorkflow

log = logging.getLogger("gpufleet.control.health")

BURN_IN_PREFIX = "burnin-"
BURN_IN_SCRIPT = Path(__file__).with_name("burn_in_check.py")


def is_burn_in(lease_id: str) -> bool:
    return lease_id.startswith(BURN_IN_PREFIX)


@dataclass
class _BurnIn:
    lease_id: str
    started: float  # monotonic
    busy: set[int] = field(default_factory=set)  # GPUs seen busy during the test
    exit_code: int | None = None
    done: bool = False
    failed: str = ""


class BurnIns:
    """The burn-ins this leader runs, one per node at most."""

    def __init__(
        self,
        client: Client,
        settings: Settings,
        params: HealthParams,
        *,
        node_info: Callable[[str], Any],  # node id -> control.leader.state.KnownNode | None
        kick: Callable[[str], None],  # look at this node again soon
        spawn: Callable[[Any], None],
    ) -> None:
        self.client = client
        self.settings = settings
        self.params = params
        self.node_info = node_info
        self.kick = kick
        self.spawn = spawn
        self.running: dict[str, _BurnIn] = {}
        self.retry_at: dict[str, float] = {}
        self.seq = 0

    def drop(self) -> None:
        self.running.clear()
        self.retry_at.clear()

    def confirmed(self, node_id: str) -> list[str]:
        """The burn-in lease to confirm in the node's heartbeat ack (its rank is not fenced)."""
        b = self.running.get(node_id)
        return [b.lease_id] if b is not None and not b.done else []

    def on_task_status(self, status: TaskStatus) -> bool:
        """Take a burn-in rank's report (True: it is a burn-in's, not a job's)."""
        if not is_burn_in(status.lease_id):
            return False
        b = self.running.get(status.node_id)
        if b is not None and b.lease_id == status.lease_id and status.state != TaskState.STARTED:
            b.exit_code = status.exit_code if status.state == TaskState.EXITED else -1
            b.done = True
            self.kick(status.node_id)
        return True

    def node_left_burn_in(self, node_id: str, to: str) -> None:
        b = self.running.pop(node_id, None)
        if b is not None and not b.done:
            log.info("node %s: burn-in %s ends: abandoned, node %s", node_id, b.lease_id, to)

    def passed(self, node_id: str) -> None:
        self.retry_at.pop(node_id, None)

    def progress(
        self, epoch: int, node_id: str, obs: NodeObservation, d: Decision | None, now: float, report: Any
    ) -> Decision | None:
        """Start, watch and judge the node's burn-in; returns the decision to apply.
        ``report``: the node's latest heartbeat report heard by this leadership, or None."""
        if d is not None and d.event in (Event.LOST, Event.FATAL, Event.HANG, Event.UNFIT):
            return d  # the table fails the burn-in
        b = self.running.get(node_id)
        if b is None:
            fresh = obs.last_heartbeat_at is not None and now - obs.last_heartbeat_at < self.params.suspect_after_s
            if not fresh or obs.live_leases or obs.running or now < self.retry_at.get(node_id, 0.0):
                return None
            self.seq += 1
            b = _BurnIn(f"{BURN_IN_PREFIX}{node_id}-{epoch}-{self.seq}", now)
            self.running[node_id] = b
            log.info("node %s: burn-in %s starts", node_id, b.lease_id)
            self.spawn(self._start(epoch, node_id, b))
            return None
        if report is not None:
            mine = next((r for r in report.running if r.lease_id == b.lease_id), None)
            if mine is not None:
                util = {g.index: g.sm_util for g in report.gpus}
                b.busy |= {i for i in mine.gpu_indices if (util.get(i) or 0.0) > self.params.idle_util_pct}
        verdict: Event | None = None
        why = ""
        if b.failed:
            verdict, why = Event.BURN_IN_FAILED, b.failed
        elif b.done:
            gpus = self._node_gpus(node_id)
            if b.exit_code != 0:
                verdict, why = Event.BURN_IN_FAILED, f"burn-in exited with {b.exit_code}"
            elif len(b.busy) < gpus:
                verdict, why = (
                    Event.BURN_IN_FAILED,
                    f"GPUs never busy during burn-in: {sorted(set(range(gpus)) - b.busy)}",
                )
            else:
                verdict, why = Event.BURN_IN_PASSED, "burn-in passed on every GPU"
        elif now - b.started > self.settings.burn_in_timeout_s:
            verdict, why = Event.BURN_IN_FAILED, f"burn-in not done in {self.settings.burn_in_timeout_s:.0f}s"
        if verdict is None:
            return None
        if verdict == Event.BURN_IN_FAILED:
            self.retry_at[node_id] = now + self.settings.burn_in_retry_s
            if not b.done:
                # nothing to call: an unconfirmed burn-in rank is stopped by reconciliation
                # (no live lease) or fences itself
                log.info("node %s: burn-in %s ends: %s", node_id, b.lease_id, why)
        self.running.pop(node_id, None)
        return Decision(obs.state, verdict, transition(obs.state, verdict), why)

    def _node_gpus(self, node_id: str) -> int:
        n = self.node_info(node_id)
        return n.gpus if n is not None else self.settings.demo_gpus_per_node

    async def _start(self, epoch: int, node_id: str, b: _BurnIn) -> None:
        s = self.settings
        node = self.node_info(node_id)
        env = {"GPUFLEET_BURN_IN_MODE": "simulated"} if s.agent_nvml_backend == "simulated" else {}
        inp = BurnInInput(
            node_id=node_id,
            lease_id=b.lease_id,
            epoch=epoch,
            task_queue=s.node_task_queue(node_id, node.task_queue if node is not None else None),
            gpu_indices=list(range(self._node_gpus(node_id))),
            command=[sys.executable, str(BURN_IN_SCRIPT), "--seconds", str(s.burn_in_seconds)],
            start_timeout_s=s.start_task_timeout_s,
            env=env,
        )
        try:
            res: StartTaskResult = await self.client.execute_workflow(
                BurnInWorkflow.run, inp, id=b.lease_id, task_queue=s.control_task_queue
            )
            if not res.accepted:
                b.failed = f"burn-in refused by the agent: {res.reason}"
        except asyncio.CancelledError:
            raise
        except Exception as e:
            b.failed = f"burn-in could not start: {str(e)[:200]}"
        if b.failed:
            self.kick(node_id)


__all__ = ["BURN_IN_PREFIX", "BurnIns", "is_burn_in"]
