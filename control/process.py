"""The control process (DESIGN.md, Processes and Leadership).

    await run_control(settings, holder="c1", stop_event=stop)     # until stop is set

or drive it yourself (tests)::

    proc = ControlProcess(settings, holder="c1")
    await proc.start(); ...; await proc.stop()

What it runs:

* a Temporal worker on ``settings.control_task_queue``: ``JobWorkflow`` and its
  local activities (and ``PlacementWorkflow`` runs left there by older versions), in
  ``control_job_workers`` child processes (``control/job_workers.py``) or, with 0, here;
* a Temporal worker on ``settings.placement_task_queue`` for ``PlacementWorkflow``
  alone, so placement's workflow tasks never queue behind a burst of job tasks;
* a Temporal worker on its own leader task queue (``<control queue>-leader-<holder>``)
  for ``placement_cycle``, which runs on this process's in-memory ``LeaderState``
  only while it holds the leader epoch;
* the leadership loop: take the Postgres leader row when it is free or expired
  (epoch + 1), rebuild the in-memory state on takeover, renew every
  ``leader_renew_s``; a refused renewal (or none for ``leader_ttl_s``) drops the
  state at once;
* the ``PlacementWorkflow`` singleton (started by every process, USE_EXISTING);
* the leader wakes the placement cycle when Postgres notifies ``gpufleet_wake``
  (new job, job ended, node or quota change), coalesced to one signal per
  ``placement_wake_min_s``;
* the agents' gRPC server (``control.heartbeat_server``): TaskStatus reports are
  forwarded to job workflows as signals batched per job; heartbeat acks confirm
  the leases live on the node; non-leaders redirect agents to the leader.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from typing import Any

import asyncpg
from temporalio.client import Client
from temporalio.common import WorkflowIDConflictPolicy

from activities import store
from activities.placement_activities import CycleActivity, ReadLeaderActivity
from activities.placement_cycle import LeaderState
from common.db import pool_from_settings
from common.settings import Settings
from common.temporal import connect, make_worker
from control.health import HealthMonitor
from control.job_workers import JobWorkerChildren, control_queue_worker
from control.status_forwarder import TaskStatusForwarder
from workflows import messages as m
from workflows.placement import PlacementWorkflow

log = logging.getLogger("gpufleet.control")

WAKE_CHANNEL = "gpufleet_wake"
ENSURE_PLACEMENT_EVERY_S = 30.0
RECONCILE_AFTER_S = 2.0


def default_holder() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class _Waker:
    """``wake`` signals to the PlacementWorkflow, only when they buy something: a change
    (Postgres NOTIFY) wakes a cycle unless a cycle that started after the change will
    see it anyway; at most one signal in flight and one per ``min_interval_s``."""

    def __init__(self, client: Client, min_interval_s: float, leader: LeaderState) -> None:
        self.client = client
        self.min_interval_s = min_interval_s
        self.leader = leader
        self._task: asyncio.Task | None = None
        self._last = 0.0
        self._poked_at = 0.0
        self.sent = 0
        self.skipped = 0

    def poke(self) -> None:
        if self.leader.wake():
            return  # a batch of cycles runs here: woken in-process, no signal needed
        self._poked_at = time.monotonic()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._send())

    async def _send(self) -> None:
        while True:
            poked = self._poked_at
            delay = self._last + self.min_interval_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if self.leader.cycle_running and self.leader.refresh_started_at < poked:
                await self.leader.cycle_done.wait()  # then a new cycle is needed for this change
            if self.leader.refresh_started_at >= poked:
                self.skipped += 1  # a cycle that started after the change sees it
            else:
                self._last = time.monotonic()
                try:
                    await self.client.get_workflow_handle(m.PLACEMENT_WORKFLOW_ID).signal(
                        m.SIGNAL_WAKE, m.WakeRequest("changes")
                    )
                    self.sent += 1
                except Exception as e:  # the periodic cycle covers a lost wake
                    log.debug("wake not delivered: %s", e)
            if self._poked_at == poked:
                return

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass


class ControlProcess:
    def __init__(
        self,
        settings: Settings,
        *,
        holder: str | None = None,
        pool: asyncpg.Pool | None = None,
        client: Client | None = None,
        grpc: bool = True,
        grpc_port: int | None = None,
    ) -> None:
        self.settings = settings
        self.holder = holder or default_holder()
        self.leader_queue = f"{settings.control_task_queue}-leader-{self.holder}"
        self._pool = pool
        self._own_pool = pool is None
        self._client = client
        self.grpc = grpc
        self.grpc_port = grpc_port
        self.grpc_addr = ""
        self.epoch: int | None = None
        self.takeover_at: float | None = None
        self.leader_grpc_addr = ""
        self.leader: LeaderState | None = None
        self.forwarder: TaskStatusForwarder | None = None
        self.heartbeats: Any = None
        self.health: HealthMonitor | None = None
        self._workers: list[Any] = []
        self.job_workers: JobWorkerChildren | None = None
        self._tasks: list[asyncio.Task] = []
        self._waker: _Waker | None = None
        self._listen_conn: asyncpg.Connection | None = None
        self._stopping = asyncio.Event()
        self._last_renew = 0.0
        self._next_ensure = 0.0
        # reconciliation: tasks agents run whose lease is not live (first seen missing, DB-verified dead)
        self._missing_since: dict[str, float] = {}
        self._dead_leases: set[str] = set()
        self._to_verify: set[str] = set()
        self._verifying: asyncio.Task | None = None

    # ------------------------------------------------------------------ properties

    @property
    def pool(self) -> asyncpg.Pool:
        assert self._pool is not None
        return self._pool

    @property
    def client(self) -> Client:
        assert self._client is not None
        return self._client

    @property
    def is_leader(self) -> bool:
        return self.epoch is not None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        s = self.settings
        if self._pool is None:
            self._pool = await pool_from_settings(s)
        if self._client is None:
            self._client = await connect(s)
        self.leader = LeaderState(self.pool, self.client, s, actor=f"placement:{self.holder}")
        self.forwarder = TaskStatusForwarder(self.client)
        await self.forwarder.start()
        self._waker = _Waker(self.client, s.placement_wake_min_s, self.leader)
        self.health = HealthMonitor(
            self.pool,
            self.client,
            s,
            leader=self.leader,
            table=lambda: self.heartbeats.table if self.heartbeats is not None else None,
            forward_status=self.forwarder.submit,
            actor=f"health:{self.holder}",
        )

        if self.grpc:
            from control.heartbeat_server import HeartbeatServer

            self.heartbeats = HeartbeatServer(
                s,
                port=self.grpc_port,
                confirmed_leases=self._confirmed_leases,
                leases_to_stop=self._leases_to_stop,
                on_task_status=self._on_task_status,
                on_heartbeat=self.health.on_heartbeat,
                leader_address=self._leader_address,
            )
            self.grpc_addr = await self.heartbeats.start()
        else:
            self.grpc_addr = f"{s.control_grpc_host}:{s.control_grpc_port}"

        workers = []
        if s.control_job_workers == 0:
            workers.append(control_queue_worker(self.client, self.pool, s))
        else:
            self.job_workers = JobWorkerChildren(s, s.control_job_workers)
            await self.job_workers.start()
        placement = make_worker(
            self.client,
            s.placement_task_queue,
            workflows=[PlacementWorkflow],
            activities=ReadLeaderActivity(self.pool, s).all(),
        )
        leader = make_worker(self.client, self.leader_queue, activities=CycleActivity(self.leader).all())
        self._workers = [*workers, placement, leader]
        for w in self._workers:
            self._tasks.append(asyncio.create_task(w.run(), name=f"worker-{w.task_queue}"))
        await self._ensure_placement_workflow()
        await self._listen()
        self._tasks.append(asyncio.create_task(self._leadership_loop(), name="leadership"))
        log.info("control %s up (leader queue %s, gRPC %s)", self.holder, self.leader_queue, self.grpc_addr or "-")

    async def stop(self, *, resign: bool = True) -> None:
        """Stop cleanly: resign leadership (a successor need not wait for expiry), stop
        serving agents and workers. Running ranks are untouched."""
        self._stopping.set()
        for t in self._tasks:
            if t.get_name() == "leadership":
                t.cancel()
        if resign and self.epoch is not None and self._pool is not None:
            try:
                await store.resign_leadership(self.pool, scope=self.settings.leader_scope, holder=self.holder, epoch=self.epoch)
            except Exception as e:
                log.warning("resign failed: %s", e)
        self._lose("stopping")
        if self.health is not None:
            await self.health.stop()
        if self._waker is not None:
            await self._waker.close()
        if self._listen_conn is not None:
            try:
                await self._listen_conn.remove_listener(WAKE_CHANNEL, self._on_notify)
            except Exception:
                pass
            await self.pool.release(self._listen_conn)
            self._listen_conn = None
        if self.heartbeats is not None:
            await self.heartbeats.stop()
        await asyncio.gather(*(w.shutdown() for w in self._workers), return_exceptions=True)
        if self.job_workers is not None:
            await self.job_workers.stop()
        if self.forwarder is not None:
            await self.forwarder.stop()
        for t in self._tasks:
            if not t.done():
                t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._own_pool and self._pool is not None:
            await self._pool.close()

    async def kill(self) -> None:
        """Die like a crashed process would (tests): no resignation, nothing flushed."""
        await self.stop(resign=False)

    # ------------------------------------------------------------------ leadership

    async def _leadership_loop(self) -> None:
        s = self.settings
        while not self._stopping.is_set():
            try:
                if self.epoch is None:
                    epoch = await store.acquire_leadership(
                        self.pool,
                        scope=s.leader_scope,
                        holder=self.holder,
                        task_queue=self.leader_queue,
                        grpc_addr=self.grpc_addr,
                        ttl_s=s.leader_ttl_s,
                    )
                    if epoch is not None:
                        await self._take_over(epoch)
                    else:
                        row = await self.pool.fetchrow("SELECT grpc_addr FROM leader WHERE scope = $1", s.leader_scope)
                        self.leader_grpc_addr = row["grpc_addr"] if row else ""
                else:
                    ok = await store.renew_leadership(
                        self.pool, scope=s.leader_scope, holder=self.holder, epoch=self.epoch, ttl_s=s.leader_ttl_s
                    )
                    if ok:
                        self._last_renew = time.monotonic()
                    else:
                        self._lose("renewal refused (expired or deposed)")
                    if self.epoch is not None and time.monotonic() >= self._next_ensure:
                        self._next_ensure = time.monotonic() + ENSURE_PLACEMENT_EVERY_S
                        await self._ensure_placement_workflow()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("leadership loop: %s", e)
                if self.epoch is not None and time.monotonic() - self._last_renew > s.leader_ttl_s:
                    self._lose(f"no renewal for {s.leader_ttl_s}s")
            interval = s.leader_renew_s if self.epoch is not None else min(s.leader_renew_s, s.leader_ttl_s / 3)
            try:
                await asyncio.wait_for(self._stopping.wait(), interval)
            except asyncio.TimeoutError:
                pass

    async def _take_over(self, epoch: int) -> None:
        assert self.leader is not None
        self._last_renew = time.monotonic()
        log.info("control %s takes leadership with epoch %d", self.holder, epoch)
        try:
            await self.leader.take_over(epoch)
        except Exception:
            self.leader.drop()
            await store.resign_leadership(self.pool, scope=self.settings.leader_scope, holder=self.holder, epoch=epoch)
            raise
        self.epoch = epoch
        self.takeover_at = time.time()
        if self.health is not None:  # its quiet period starts now (DESIGN.md, Leadership)
            await self.health.take_over(epoch)
        self._next_ensure = time.monotonic() + ENSURE_PLACEMENT_EVERY_S
        await self._ensure_placement_workflow()
        self._wake()

    def _lose(self, why: str) -> None:
        if self.epoch is not None:
            log.warning("control %s loses leadership (epoch %d): %s", self.holder, self.epoch, why)
        self.epoch = None
        if self.leader is not None:
            self.leader.drop()
        if self.health is not None:
            self.health.drop()

    async def _ensure_placement_workflow(self) -> None:
        try:
            await self.client.start_workflow(
                m.PLACEMENT_WORKFLOW,
                m.PlacementInput(task_queue=self.settings.placement_task_queue),
                id=m.PLACEMENT_WORKFLOW_ID,
                task_queue=self.settings.placement_task_queue,
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
            )
        except Exception as e:
            log.warning("cannot start the placement workflow: %s", e)

    # ------------------------------------------------------------------ wake-ups

    async def _listen(self) -> None:
        try:
            self._listen_conn = await self.pool.acquire()
            await self._listen_conn.add_listener(WAKE_CHANNEL, self._on_notify)
        except Exception as e:  # the 1 s cycle still runs
            log.warning("cannot LISTEN for wake-ups: %s", e)

    def _on_notify(self, *_: Any) -> None:
        self._wake()

    def _wake(self) -> None:
        if self.epoch is not None and self._waker is not None:
            self._waker.poke()

    # ------------------------------------------------------------------ agents

    def _confirmed_leases(self, node_id: str) -> list[str]:
        if self.epoch is None or self.leader is None:
            return []
        out = sorted(self.leader.node_leases.get(node_id, ()))
        if self.health is not None:
            out.extend(self.health.confirmed_extra(node_id))  # a burn-in rank
        return out

    def _leases_to_stop(self, entry: Any) -> list[tuple[str, int, str]]:
        """DESIGN.md, Health: a task with no live lease is killed. A running task whose lease
        the leader does not hold as live is stopped once Postgres confirms the lease is not
        live (released, or never committed) and it stayed missing ``RECONCILE_AFTER_S``."""
        if self.epoch is None or self.leader is None:
            return []
        live = self.leader.node_leases.get(entry.node_id, set())
        now = time.monotonic()
        out: list[tuple[str, int, str]] = []
        health = self.health
        for r in entry.message.running:
            if r.lease_id in live or (health is not None and health.is_burn_in(r.lease_id)
                                      and r.lease_id in health.confirmed_extra(entry.node_id)):
                self._missing_since.pop(r.lease_id, None)
                continue
            first = self._missing_since.setdefault(r.lease_id, now)
            if r.lease_id in self._dead_leases:
                out.append((r.lease_id, r.epoch, "reconciliation: no live lease"))
            elif now - first >= RECONCILE_AFTER_S:
                self._to_verify.add(r.lease_id)
        if self._to_verify and (self._verifying is None or self._verifying.done()):
            self._verifying = asyncio.create_task(self._verify_dead())
        if health is not None:
            out.extend(health.stops_for(entry))  # ranks on other GPUs than their lease's
        return out

    async def _verify_dead(self) -> None:
        ids, self._to_verify = sorted(self._to_verify), set()
        try:
            live = {
                r["lease_id"]
                for r in await self.pool.fetch(
                    "SELECT lease_id FROM leases WHERE lease_id = ANY($1::text[]) AND state = 'live'", ids
                )
            }
        except Exception as e:
            log.warning("lease reconciliation check failed: %s", e)
            return
        dead = set(ids) - live
        if dead:
            log.warning("agents run %d task(s) without a live lease; stopping them: %s", len(dead), sorted(dead)[:5])
        self._dead_leases |= dead
        for lid in live:
            self._missing_since.pop(lid, None)
        if len(self._dead_leases) > 100_000:
            self._dead_leases = set(list(self._dead_leases)[-50_000:])

    def _on_task_status(self, status: Any) -> None:
        assert self.forwarder is not None
        if self.health is not None and self.health.on_task_status(status):
            return  # a burn-in rank's report: the health monitor's, not a job's
        self.forwarder.submit(status)
        if status.checkpoint_uri and self.epoch is not None and self.leader is not None:
            self.leader.note_checkpoint(status.job_id, status.attempt)

    def _leader_address(self) -> str | None:
        return None if self.epoch is not None else self.leader_grpc_addr


async def run_control(
    settings: Settings,
    *,
    holder: str | None = None,
    stop_event: asyncio.Event | None = None,
    pool: asyncpg.Pool | None = None,
    client: Client | None = None,
    grpc: bool = True,
    ready: asyncio.Event | None = None,
) -> None:
    """Run a control process until ``stop_event`` is set (or the task is cancelled)."""
    proc = ControlProcess(settings, holder=holder, pool=pool, client=client, grpc=grpc)
    await proc.start()
    if ready is not None:
        ready.set()
    try:
        if stop_event is None:
            await asyncio.Event().wait()
        else:
            await stop_event.wait()
    finally:
        await proc.stop()
