"""The control process (docs/design.md, Processes and Leadership).

    await run_control(settings, holder="c1", stop_event=stop)     # until stop is set

or drive it yourself (tests)::

    proc = ControlProcess(settings, holder="c1")
    await proc.start(); ...; await proc.stop()

It assembles, and owns nothing else:

* a Temporal worker on ``settings.control_task_queue`` for ``JobWorkflow``,
  ``BurnInWorkflow`` and their local activities, in ``control_job_workers`` child
  processes (``control/job_workers.py``) or, with 0, here;
* leadership (``control.leader.leadership``): the Postgres leader row; on takeover the
  in-memory state is rebuilt (``control.leader.state``), the placement cycles run here
  (``control.leader.cycle``) and the health monitor starts (``control.health``); on loss
  all of it is dropped;
* wake-ups: Postgres notifies ``gpufleet_wake`` (new job, job ended, node or quota
  change) and the leader runs a cycle at once;
* the agents' gRPC server (``control.heartbeat_server``): a TaskStatus report is stored in
  Postgres before the agent is acknowledged and the leader delivers it to the job's
  workflow (``control.report_delivery``); heartbeat acks confirm the leases live on the
  node; tasks without a live lease are stopped; non-leaders redirect agents to the leader;
* the leader keeps a running workflow for every active job (``control.leader.workflows``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from typing import Any

from temporalio.client import Client
from temporalio.service import RPCError

from common.aio import Stopped, unless_stopped
from common.db import pool_when_reachable
from common.settings import Settings
from common.temporal import connect_when_reachable, ensure_search_attributes
from control.agent_link import AuthFailure, ReportRefused
from control.health.monitor import HealthMonitor
from control.job_workers import JobWorkerChildren, control_queue_worker
from control.leader.cycle import PlacementCycles
from control.leader.leadership import Leadership
from control.leader.metrics import ControlMetrics
from control.leader.signals import JobSignals
from control.leader.state import LeaderState
from control.leader.workflows import WorkflowOwnership
from control.metrics_http import MetricsServer
from control.node_auth import NodeAuth
from control.report_delivery import ReportDelivery
from store import leadership as leadership_rows
from store import node_credentials
from store.tx import Pool
from store.wake import WakeListener
from workflows import search_attributes

log = logging.getLogger("gpufleet.control")

# The singleton workflow that scheduled placement cycles before the leader ran them itself:
# a run left by an older version is terminated once by a new leader (nothing polls its queues).
RETIRED_PLACEMENT_WORKFLOW_ID = "gpufleet-placement"


def default_holder() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class ControlProcess:
    def __init__(
        self,
        settings: Settings,
        *,
        holder: str | None = None,
        pool: Pool | None = None,
        client: Client | None = None,
        grpc: bool = True,
        grpc_port: int | None = None,
    ) -> None:
        self.settings = settings
        self.holder = holder or default_holder()
        self._pool = pool
        self._own_pool = pool is None
        self._client = client
        self.grpc = grpc
        self.grpc_port = grpc_port
        self.grpc_addr = ""
        self.leader: LeaderState | None = None
        self.signals: JobSignals | None = None
        self.cycles: PlacementCycles | None = None
        self.leadership: Leadership | None = None
        self.reports: ReportDelivery | None = None
        self.ownership: WorkflowOwnership | None = None
        self.heartbeats: Any = None
        self.node_auth: NodeAuth | None = None
        self.health: HealthMonitor | None = None
        self.job_workers: JobWorkerChildren | None = None
        self.metrics: ControlMetrics | None = None
        self.metrics_server: MetricsServer | None = None
        self.metrics_url = ""
        self._workers: list[Any] = []
        self._tasks: list[asyncio.Task] = []
        self._cycle_task: asyncio.Task | None = None
        self._wake: WakeListener | None = None
        self._stopping = asyncio.Event()

    # ------------------------------------------------------------------ properties

    @property
    def pool(self) -> Pool:
        assert self._pool is not None
        return self._pool

    @property
    def client(self) -> Client:
        assert self._client is not None
        return self._client

    @property
    def epoch(self) -> int | None:
        return self.leadership.epoch if self.leadership is not None else None

    @property
    def is_leader(self) -> bool:
        return self.epoch is not None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        s = self.settings
        if "skip_epoch_check" in s.test_faults:  # a deliberately broken build (chaos checker tests)
            leadership_rows.SKIP_EPOCH_CHECK = True
            log.error("test_faults: skip_epoch_check: allocation writes ignore the leader epoch")
        # started during an outage (a host reboot where Postgres or Temporal comes up later):
        # wait for it instead of exiting, which under `gpufleet up` would stop the platform
        if self._pool is None:
            self._pool = await pool_when_reachable(s, log)
        if self._client is None:
            self._client = await connect_when_reachable(s, log)
        self.signals = JobSignals(self.pool, self.client, s)
        self.leader = LeaderState(self.pool, s, self.signals)
        if not s.job_search_attributes:
            pass
        elif await ensure_search_attributes(self.client, s.temporal_namespace, search_attributes.KEYS):
            self.signals.labels = self.leader.labels_of  # job histories carry team, class, size, state
        else:
            log.warning("Temporal refused gpufleet's search attributes: job workflows start without them")
        self.metrics = ControlMetrics(self.holder, s.gpu_hour_usd)
        self.cycles = PlacementCycles(
            self.leader, self.signals, self.client, actor=f"placement:{self.holder}", metrics=self.metrics
        )
        self.reports = ReportDelivery(self.pool, self.client, s)
        self.ownership = WorkflowOwnership(self.pool, self.client, s, actor=f"control:{self.holder}")
        self.node_auth = NodeAuth(self.pool, s)
        self.health = HealthMonitor(
            self.pool,
            self.client,
            s,
            state=self.leader,
            table=lambda: self.heartbeats.table if self.heartbeats is not None else None,
            forward_status=self.reports.submit,
            actor=f"health:{self.holder}",
            metrics=self.metrics,
            idle_victims_first=self.cycles.policy.idle_victims_first,
        )
        if self.grpc:
            from control.heartbeat_server import HeartbeatServer

            self.heartbeats = HeartbeatServer(
                s,
                port=self.grpc_port,
                confirmed_leases=self.health.confirmed_leases,
                leases_to_stop=self.health.reconciler.stops_for,
                on_task_status=self._on_task_status,
                on_heartbeat=self.health.on_heartbeat,
                leader_address=self._leader_address,
                authenticate=self.node_auth.verify,
                on_auth_failure=self._on_auth_failure,
            )
            self.grpc_addr = await self.heartbeats.start()
        else:
            self.grpc_addr = f"{s.control_grpc_host}:{s.control_grpc_port}"

        if s.control_job_workers == 0:
            self._workers.append(control_queue_worker(self.client, self.pool, s))
        else:
            self.job_workers = JobWorkerChildren(s, s.control_job_workers)
            await self.job_workers.start()
        for w in self._workers:
            self._tasks.append(asyncio.create_task(w.run(), name=f"worker-{w.task_queue}"))
        # the leader's: deliver stored reports, and keep every active job's workflow running
        leading = lambda: self.is_leader  # noqa: E731
        self._tasks.append(asyncio.create_task(self.reports.run(leading), name="report-delivery"))
        self._tasks.append(asyncio.create_task(self.ownership.run(leading), name="workflow-ownership"))
        if s.control_metrics_listen:
            self.metrics_server = MetricsServer(self.metrics.registry, s.control_metrics_listen)
            self.metrics_url = self.metrics_server.start()
        await self._listen()
        self._tasks.append(asyncio.create_task(self._wake_kept(), name="wake-listener"))
        self.leadership = Leadership(
            self.pool, s, holder=self.holder, grpc_addr=self.grpc_addr, on_acquire=self._take_over, on_lose=self._lose
        )
        self._tasks.append(asyncio.create_task(self.leadership.run(), name="leadership"))
        log.info("control %s up (gRPC %s, metrics %s)", self.holder, self.grpc_addr or "-", self.metrics_url or "-")

    async def stop(self, *, resign: bool = True) -> None:
        """Stop cleanly: resign leadership (a successor need not wait for expiry), stop
        serving agents and workers. Running ranks are untouched."""
        self._stopping.set()
        if self.leadership is not None:
            await self.leadership.stop(resign=resign and self._pool is not None)
        self._lose("stopping")
        if self.health is not None:
            await self.health.stop()
        if self._wake is not None:
            await self._wake.close()
            self._wake = None
        if self.heartbeats is not None:
            await self.heartbeats.stop()
        await asyncio.gather(*(w.shutdown() for w in self._workers), return_exceptions=True)
        if self.job_workers is not None:
            await self.job_workers.stop()
        if self.reports is not None:
            await self.reports.close()
        if self.signals is not None:
            await self.signals.close()
        for t in self._tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.metrics_server is not None:
            self.metrics_server.stop()
            self.metrics_server = None
        if self._own_pool and self._pool is not None:
            await self._pool.close()

    async def kill(self) -> None:
        """Die like a crashed process would (tests): no resignation, nothing flushed."""
        await self.stop(resign=False)

    # ------------------------------------------------------------------ leadership

    async def _take_over(self, epoch: int) -> None:
        """Runs before the epoch is claimed; an exception resigns it (Leadership)."""
        assert self.leader is not None and self.cycles is not None and self.health is not None
        assert self.metrics is not None
        try:
            await self.leader.take_over(epoch)
        except Exception:
            self.leader.drop()
            raise
        self.cycles.forget_publications()
        self.metrics.took_over(epoch)
        await self.health.take_over(epoch)  # its quiet period starts now
        self._cycle_task = asyncio.create_task(self.cycles.run(epoch), name="placement-cycles")
        # among the tasks a stop cancels and awaits: no cycle may outlive the pool it writes through
        self._tasks = [t for t in self._tasks if not t.done()]
        self._tasks.append(self._cycle_task)
        self._tasks.append(asyncio.create_task(self._retire_placement_workflow(), name="retire-placement-workflow"))

    def _lose(self, why: str) -> None:
        if self.metrics is not None:
            self.metrics.lost()
        if self._cycle_task is not None:
            self._cycle_task.cancel()
            self._cycle_task = None
        if self.leader is not None:
            self.leader.drop()
        if self.health is not None:
            self.health.drop()

    async def _retire_placement_workflow(self) -> None:
        try:
            await asyncio.wait_for(
                self.client.get_workflow_handle(RETIRED_PLACEMENT_WORKFLOW_ID).terminate(
                    reason="retired: the leader runs placement cycles itself"
                ),
                self.settings.api_temporal_timeout_s,
            )
            log.info("terminated the retired placement workflow left by an older version")
        except RPCError:
            pass  # none runs (the usual case)
        except Exception as e:
            log.debug("retired placement workflow not terminated: %s", e)

    # ------------------------------------------------------------------ wake-ups

    async def _listen(self) -> None:
        self._wake = WakeListener(self.pool, self._on_wake)
        try:
            await self._wake.start()
        except Exception as e:  # the periodic cycle still runs, and the keeper tries again
            log.warning("cannot LISTEN for wake-ups: %s", e)

    async def _wake_kept(self) -> None:
        assert self._wake is not None
        await self._wake.keep(self.settings.wake_check_s)

    def _on_wake(self) -> None:
        if self.is_leader and self.cycles is not None:
            self.cycles.wake()

    # ------------------------------------------------------------------ agents

    async def _on_task_status(self, status: Any) -> None:
        """A node's report about one of its ranks: forwarded to the rank's job. A report about a
        lease the store assigns to another node (or to no node) is refused and audited."""
        assert self.reports is not None and self.node_auth is not None
        if self.health is not None and self.health.on_task_status(status):
            return  # a burn-in rank's report: the health monitor's, not a job's
        owner = await self.node_auth.owner_of(status.lease_id)
        if owner != status.node_id:
            what = f"a report about lease {status.lease_id}, which " + (
                f"runs on node {owner}" if owner else "is no lease of the store"
            )
            await self._security_event(status.node_id, what, {"lease_id": status.lease_id, "owner": owner,
                                                              "state": str(status.state), "job_id": status.job_id})  # fmt: skip
            raise ReportRefused(f"node {status.node_id} sent {what}")
        if "ack_before_durable" in self.settings.test_faults:
            # a deliberately broken build (tests of the chaos checker): acknowledged, then stored
            # in the background, so a crash or a database outage loses it
            self.reports.submit_once(status)
        else:
            await self.reports.store(status)  # durable before the agent is acknowledged
        if status.checkpoint_uri and self.is_leader and self.leader is not None:
            self.leader.note_checkpoint(status.job_id, status.attempt)

    async def _on_auth_failure(self, failure: AuthFailure) -> None:
        detail = {"peer": failure.peer, "claimed_node": failure.node_id, "message_node": failure.message_node_id}
        await self._security_event(failure.node_id or "unknown", failure.reason, detail)

    async def _security_event(self, node_id: str, what: str, detail: dict[str, Any]) -> None:
        log.warning("security: node %s: %s", node_id, what)
        try:
            await node_credentials.audit_security_event(
                self.pool, actor=f"control:{self.holder}", node_id=node_id, what=what[:500], detail=detail
            )
        except Exception as e:  # the refusal stands even when it cannot be audited now
            log.warning("security event not audited: %s", e)

    def _leader_address(self) -> str | None:
        if self.is_leader:
            return None
        return self.leadership.leader_grpc_addr if self.leadership is not None else ""


async def run_control(
    settings: Settings,
    *,
    holder: str | None = None,
    stop_event: asyncio.Event | None = None,
    pool: Pool | None = None,
    client: Client | None = None,
    grpc: bool = True,
    ready: asyncio.Event | None = None,
) -> None:
    """Run a control process until ``stop_event`` is set (or the task is cancelled)."""
    proc = ControlProcess(settings, holder=holder, pool=pool, client=client, grpc=grpc)
    try:
        # a stop while start waits for Postgres or Temporal ends the wait
        await unless_stopped(proc.start(), stop_event)
    except Stopped:
        await proc.stop()
        return
    except BaseException:
        await proc.stop()
        raise
    if ready is not None:
        ready.set()
    try:
        if stop_event is None:
            await asyncio.Event().wait()
        else:
            await stop_event.wait()
    finally:
        await proc.stop()
