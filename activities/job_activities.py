"""The JobWorkflow's control activities (run as local activities: short Postgres writes).

``JobActivities(pool, settings).all()`` lists them for a control worker. Each takes
one frozen dataclass from ``workflows.messages`` and returns one; the SQL is the
store's (``store.jobs``, ``store.job_states``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from temporalio import activity

from common.settings import Settings
from placement.lifecycle import ACTIVE
from store import job_spec, job_states, jobs
from store.tx import Pool
from workflows import messages as m


class JobActivities:
    def __init__(self, pool: Pool, settings: Settings) -> None:
        self.pool = pool
        self.settings = settings

    def all(self) -> list[Any]:
        return [
            self.load_job,
            self.mark_running,
            self.mark_cancelling,
            self.finish_job,
            self.requeue_job,
            self.extend_job,
            self.restart_replica,
        ]

    @activity.defn(name=m.ACT_LOAD_JOB)
    async def load_job(self, req: m.LoadJob) -> m.JobSnapshot:
        s = self.settings
        job, leases = await jobs.load_job(self.pool, req.job_id)
        if job is None:
            return m.JobSnapshot(job_id=req.job_id, exists=False)
        spec = job_spec.parse_spec(job["spec"])
        ck = job_spec.spec_checkpoint(spec)
        job_dir = ck.get("dir") or ck.get("path") or str(Path(s.state_dir).resolve() / "checkpoints" / req.job_id)
        # each attempt writes its own dir: ranks of an attempt that has not been fenced yet
        # (a lost node's) cannot overwrite what the next attempt writes or resumes from
        ck_dir = Path(job_dir) / f"attempt-{job['attempt']}"
        alloc = None
        if job["state"] in ACTIVE:
            alloc = m.allocation_from_leases(req.job_id, job["attempt"], leases, s.node_task_queue)
        return m.JobSnapshot(
            job_id=req.job_id,
            exists=True,
            state=job["state"],
            attempt=job["attempt"],
            team=job["team"],
            team_rank_id=job["team_rank_id"],
            job_rank_id=job["job_rank_id"],
            priority_class=job["priority_class"],
            replicas=job["replicas"],
            gpus_per_replica=job["gpus_per_replica"],
            image=str(spec.get("image", "")),
            command=job_spec.spec_command(spec),
            env=job_spec.spec_env(spec),
            max_runtime_s=float(job["max_runtime_s"]),
            original_max_runtime_s=float(job["max_runtime_s"] - job["extended_s"]),
            extensions=job["extensions"],
            last_checkpoint=job["last_checkpoint"],
            checkpoint_dir=str(ck_dir),
            preemptible=bool(ck.get("preemptible", False)),
            grace_s=job_spec.spec_grace_s(spec, s.default_grace_s),
            gang_start_timeout_s=s.gang_start_timeout_s,
            gang_timeout_in_start=True,
            start_task_timeout_s=s.start_task_timeout_s,
            stop_margin_s=s.stop_margin_s,
            max_extensions=s.max_extensions,
            max_extension_fraction=s.max_extension_fraction,
            allocation=alloc,
            started_at=job["started_at"],
        )

    @activity.defn(name=m.ACT_MARK_RUNNING)
    async def mark_running(self, t: m.JobTransition) -> m.TransitionResult:
        o = await job_states.mark_running(self.pool, t.job_id, t.attempt, actor=t.actor, epoch=t.epoch)
        return m.TransitionResult(o.applied, o.state, o.attempt)

    @activity.defn(name=m.ACT_MARK_CANCELLING)
    async def mark_cancelling(self, t: m.JobTransition) -> m.TransitionResult:
        o = await job_states.mark_cancelling(self.pool, t.job_id, t.attempt, actor=t.actor, reason=t.reason)
        return m.TransitionResult(o.applied, o.state, o.attempt)

    @activity.defn(name=m.ACT_FINISH_JOB)
    async def finish_job(self, t: m.JobTransition) -> m.TransitionResult:
        o = await job_states.finish_job(
            self.pool,
            t.job_id,
            t.attempt,
            t.to_state,
            actor=t.actor,
            reason=t.reason,
            exit_code=t.exit_code,
            checkpoint_uri=t.checkpoint_uri,
        )
        return m.TransitionResult(o.applied, o.state, o.attempt, o.released)

    @activity.defn(name=m.ACT_REQUEUE_JOB)
    async def requeue_job(self, r: m.RequeueJob) -> m.RequeueResult:
        o = await job_states.requeue_job(
            self.pool,
            r.job_id,
            r.attempt,
            cause=r.cause,
            reason=r.reason,
            actor=r.actor,
            job_fault=r.job_fault,
            checkpoint_uri=r.checkpoint_uri,
            max_failed_attempts=self.settings.max_failed_attempts,
            failure_window_s=self.settings.failure_window_s,
        )
        return m.RequeueResult(
            state=o.state, attempt=o.attempt, resume_from=(o.extra or {}).get("resume_from"), applied=o.applied
        )

    @activity.defn(name=m.ACT_EXTEND_JOB)
    async def extend_job(self, e: m.ExtendJob) -> m.ExtendResult:
        r = await job_states.extend_job(
            self.pool,
            e.job_id,
            e.attempt,
            e.seconds,
            actor=e.actor,
            reason=e.reason,
            running_since=e.running_since,
            max_extensions=self.settings.max_extensions,
            max_fraction=self.settings.max_extension_fraction,
            request_id=e.request_id,
        )
        return m.ExtendResult(**r)

    @activity.defn(name=m.ACT_RESTART_REPLICA)
    async def restart_replica(self, r: m.RestartReplica) -> m.RestartedReplica:
        row = await job_states.restart_replica(
            self.pool, r.job_id, r.attempt, r.rank, r.failed_lease_id, actor="workflow", reason=r.reason
        )
        if row is None:
            return m.RestartedReplica(ok=False)
        return m.RestartedReplica(
            ok=True,
            placement=m.RankPlacement(
                rank=row["rank"],
                node_id=row["node_id"],
                gpu_indices=list(row["gpu_indices"]),
                lease_id=row["lease_id"],
                task_queue=self.settings.node_task_queue(row["node_id"], row["task_queue"]),
            ),
        )
