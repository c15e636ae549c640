"""The control activities JobWorkflow calls, as typed interfaces.

Each is a signature and a name; ``activities.job_activities.JobActivities`` registers the
implementations under the same names (a test checks that every interface has one with
the same parameter and return types). The workflow calls these functions, so a wrong
payload type is a type error, not a failure at run time. The node's activities
(``start_task``, ``stop_task``) are in ``common.contracts``: the agent implements them.
"""

from __future__ import annotations

from temporalio import activity

from workflows import messages as m


def _interface() -> NotImplementedError:
    return NotImplementedError("an interface: activities.job_activities implements it")


@activity.defn(name=m.ACT_LOAD_JOB)
async def load_job(req: m.LoadJob) -> m.JobSnapshot:
    """The job row, its live gang and the settings the run goes by."""
    raise _interface()


@activity.defn(name=m.ACT_MARK_RUNNING)
async def mark_running(t: m.JobTransition) -> m.TransitionResult:
    """STARTING -> RUNNING once every rank has started."""
    raise _interface()


@activity.defn(name=m.ACT_MARK_CANCELLING)
async def mark_cancelling(t: m.JobTransition) -> m.TransitionResult:
    """STARTING / RUNNING / PREEMPTING -> CANCELLING, audited as a cancel."""
    raise _interface()


@activity.defn(name=m.ACT_FINISH_JOB)
async def finish_job(t: m.JobTransition) -> m.TransitionResult:
    """Any live state of this attempt -> a terminal state, its gang released."""
    raise _interface()


@activity.defn(name=m.ACT_REQUEUE_JOB)
async def requeue_job(r: m.RequeueJob) -> m.RequeueResult:
    """End an attempt without finishing the job: release its gang, queue attempt + 1."""
    raise _interface()


@activity.defn(name=m.ACT_EXTEND_JOB)
async def extend_job(e: m.ExtendJob) -> m.ExtendResult:
    """Grant or refuse a runtime extension (audited either way)."""
    raise _interface()


@activity.defn(name=m.ACT_RESTART_REPLICA)
async def restart_replica(r: m.RestartReplica) -> m.RestartedReplica:
    """prod-serving: hand a failed replica's GPUs to a fresh lease of the same rank."""
    raise _interface()


INTERFACES = (load_job, mark_running, mark_cancelling, finish_job, requeue_job, extend_job, restart_replica)
