"""Reconciliation of what agents run against the store's leases (docs/design.md, Health).

Per heartbeat, while this process leads:

* a task with no live lease is stopped: once it stayed unknown to the leader's view for
  ``RECONCILE_AFTER_S`` and Postgres confirms the lease is not live (released, or never
  committed) - ``stops_for``; a node that reports a lease live on another node is not
  believed (a node speaks only for itself) and the report is audited as a security event;
* a rank on other GPUs than its live lease holds is stopped, and audited once -
  ``stops_for``;
* a live lease of a RUNNING job whose rank the agent no longer reports is released after
  ``missing_task_release_s`` (epoch-checked), and its job is told the rank was LOST -
  ``release_missing`` - unless the rank's end is on record (a stored report the job's
  workflow has or will get: a late report never turns a finished rank into a lost one).

Burn-in ranks hold no lease in the store; they are the burn-in's to judge, never stopped here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from common.contracts import TaskState, TaskStatus
from common.settings import Settings
from control.health.burn_in import BurnIns, is_burn_in
from control.health.metrics import RECONCILE
from control.health.node_states import LeaseView, NodeObservation, RankView, reconcile
from control.leader.state import LeaderState
from placement.lifecycle import JobState
from store import allocations, node_credentials, nodes, task_reports
from store.tx import Pool

log = logging.getLogger("gpufleet.control.health")

RECONCILE_AFTER_S = 2.0


def rank_views(report: Any) -> tuple[RankView, ...]:
    return tuple(
        RankView(r.lease_id, r.job_id, r.epoch, r.attempt, r.step, r.step_age_s, tuple(r.gpu_indices))
        for r in report.running
    )


class Reconciler:
    def __init__(
        self,
        pool: Pool,
        settings: Settings,
        state: LeaderState,
        burn_ins: BurnIns,
        *,
        actor: str,
        forward_status: Callable[[TaskStatus], None] | None,
        spawn: Callable[[Any], None],
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.state = state
        self.burn_ins = burn_ins
        self.actor = actor
        self.forward_status = forward_status
        self.spawn = spawn
        # tasks agents run whose lease the leader does not hold as live: first seen, confirmed dead
        self._unknown_since: dict[tuple[str, str], float] = {}  # (node, lease) first seen unknown
        self._dead: set[str] = set()
        self._to_verify: dict[str, str] = {}  # lease -> the node that reported it
        self._verifying: asyncio.Task | None = None
        self._foreign: set[tuple[str, str]] = set()  # (node, lease) audited once
        self._wrong_gpus: set[str] = set()  # leases whose rank ran on the wrong GPUs (audited once)
        self._missing_since: dict[str, float] = {}  # live leases the agent does not report

    def drop(self) -> None:
        self._unknown_since.clear()
        self._dead.clear()
        self._to_verify.clear()
        self._wrong_gpus.clear()
        self._missing_since.clear()

    def live_leases(self, node_id: str) -> set[str]:
        """The node's live job leases as the leader knows them."""
        return set(self.state.node_leases.get(node_id, ()))

    def live_views(self, node_id: str) -> dict[str, LeaseView]:
        out = {}
        for lid in self.live_leases(node_id):
            lz = self.state.lease_cache.get(lid)
            if lz is not None:
                out[lid] = LeaseView(lid, lz.job_id, lz.attempt, lz.epoch, lz.gpu_indices, 0.0)
        return out

    # ------------------------------------------------------------------ tasks to stop

    def stops_for(self, entry: Any) -> list[tuple[str, int, str]]:
        """(lease_id, epoch, reason) of the tasks the node's agent must stop."""
        if self.state.epoch is None:
            return []
        live = self.live_leases(entry.node_id)
        confirmed_burn_in = set(self.burn_ins.confirmed(entry.node_id))
        now = time.monotonic()
        out: list[tuple[str, int, str]] = []
        for r in entry.message.running:
            key = (entry.node_id, r.lease_id)
            if r.lease_id in live or (is_burn_in(r.lease_id) and r.lease_id in confirmed_burn_in):
                self._unknown_since.pop(key, None)
                continue
            first = self._unknown_since.setdefault(key, now)
            if r.lease_id in self._dead:
                out.append((r.lease_id, r.epoch, "reconciliation: no live lease"))
            elif now - first >= RECONCILE_AFTER_S:
                self._to_verify[r.lease_id] = entry.node_id
        if self._to_verify and (self._verifying is None or self._verifying.done()):
            self._verifying = asyncio.create_task(self._verify_dead())
        out.extend(self._wrong_gpu_stops(entry))
        return out

    async def _verify_dead(self) -> None:
        reporters, self._to_verify = self._to_verify, {}
        ids = sorted(reporters)
        try:
            owners = await allocations.live_lease_nodes(self.pool, ids)
        except Exception as e:
            log.warning("lease reconciliation check failed: %s", e)
            return
        live = set(owners)
        for lid, owner in owners.items():
            node = reporters[lid]
            if owner != node and (node, lid) not in self._foreign:
                self._foreign.add((node, lid))
                log.warning("security: node %s reports lease %s, which runs on node %s", node, lid, owner)
                await node_credentials.audit_security_event(
                    self.pool,
                    actor=self.actor,
                    node_id=node,
                    what=f"a heartbeat reports lease {lid}, which runs on node {owner}",
                    detail={"lease_id": lid, "owner": owner},
                )
        dead = set(ids) - live
        if dead:
            log.warning("agents run %d task(s) without a live lease; stopping them: %s", len(dead), sorted(dead)[:5])
        self._dead |= dead
        for lid in live:
            self._unknown_since.pop((reporters[lid], lid), None)
        if len(self._dead) > 100_000:
            self._dead = set(list(self._dead)[-50_000:])

    def _wrong_gpu_stops(self, entry: Any) -> list[tuple[str, int, str]]:
        """Ranks on other GPUs than their live lease holds: stop them (audited once)."""
        live = self.live_views(entry.node_id)
        if not live:
            return []
        report = entry.report()
        rec = reconcile(rank_views(report), live)
        for lease_id, _, _ in rec.kill_wrong_gpus:
            if lease_id in self._wrong_gpus:
                continue
            self._wrong_gpus.add(lease_id)
            RECONCILE.labels("kill_wrong_gpus").inc()
            rank = next(r for r in report.running if r.lease_id == lease_id)
            lz = self.state.lease_cache[lease_id]
            log.warning("%s: rank of %s runs on GPUs %s, its lease holds %s: stopping it",
                        entry.node_id, lease_id, list(rank.gpu_indices), list(lz.gpu_indices))  # fmt: skip
            self.spawn(nodes.audit_wrong_gpus(
                self.pool, node_id=entry.node_id, lease_id=lease_id, job_id=lz.job_id,
                reported=rank.gpu_indices, held=lz.gpu_indices, actor=self.actor,
            ))  # fmt: skip
        return list(rec.kill_wrong_gpus)

    # ------------------------------------------------------------------ leases to release

    async def release_missing(self, node_id: str, obs: NodeObservation, now: float) -> None:
        """A live lease of a RUNNING job whose rank the agent does not report: released after
        ``missing_task_release_s`` (epoch-checked), and its job told the rank is LOST."""
        reported = {r.lease_id for r in obs.running}
        for lid in reported:
            self._missing_since.pop(lid, None)
        candidates = set(obs.live_leases) - reported
        if not candidates:
            return
        rows = await self.state.lease_rows(candidates)
        due = []
        for lid, lz in rows.items():
            job = self.state.jobs.get(lz.job_id)
            if job is None or job.state != JobState.RUNNING or job.attempt != lz.attempt:
                self._missing_since.pop(lid, None)  # not started yet, or being stopped: not missing
                continue
            since = self._missing_since.setdefault(lid, now)
            if now - since >= self.settings.missing_task_release_s:
                due.append((lid, lz, since))
        ended = await task_reports.exits_for(self.pool, [lid for lid, _, _ in due]) if due else set()
        for lid, lz, since in due:
            if lid in ended:
                continue  # its exit is on record: the job's workflow ends the attempt itself
            self._missing_since.pop(lid, None)
            released = await allocations.release_lease(
                self.pool, lid, reason=f"reconciliation: task missing for {now - since:.0f}s",
                actor=self.actor, epoch=lz.epoch,
            )  # fmt: skip
            if released:
                RECONCILE.labels("release_missing").inc()
                log.warning("%s: lease %s released: its task is missing for %.0fs", node_id, lid, now - since)
                if self.forward_status is not None:
                    self.forward_status(TaskStatus(
                        node_id=node_id, lease_id=lid, job_id=lz.job_id, attempt=lz.attempt, epoch=lz.epoch,
                        rank=lz.rank, state=TaskState.LOST, at=datetime.now(UTC),
                    ))  # fmt: skip
