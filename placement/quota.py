"""Quotas: guaranteed and borrowed capacity per (team, GPU type).

* A placement is *guaranteed* if the team's guaranteed usage plus the job's charge
  stays within its guarantee; otherwise it is *borrowed* if borrowing is on and the
  team's borrowed usage plus the charge stays within its borrow limit; otherwise the
  job waits (``quota``). Flags are per job (every allocation row of a gang carries
  the same flag), so guaranteed usage can never exceed the guarantee.
* Borrowed placements take only idle capacity (they never cause preemption), except
  prod-serving, which beyond its guarantee takes capacity only by reclaiming
  borrowed allocations (``Policy.serving_borrows_idle`` False, the default).
* Re-check (``relabel``), for the pairs whose usage or quota changed: if guaranteed
  usage is above the guarantee (it was lowered), the newest guaranteed jobs become
  borrowed; then borrowed jobs, oldest first, become guaranteed while they fit.
"""

from __future__ import annotations

from placement.model import JobSpec, Policy, Relabel
from placement.ordering import JobQueue
from placement.state import ClusterState
from placement.topology import job_shape

_INF = float("inf")


def beyond_guarantee(state: ClusterState, team: str, gpu_type: str, charge: int) -> bool:
    """Would ``charge`` more GPUs take the team's guaranteed usage past its guarantee?"""
    return state.guaranteed_used(team, gpu_type) + charge > state.quota(team, gpu_type).guaranteed


def within_guarantee_since(state: ClusterState, queue: JobQueue) -> dict[tuple[str, str], float]:
    """Per (team, type): the submit time of the oldest queued job that fits what is left of
    its team's guarantee, judged by the team's whole use (borrowed jobs too), as the
    starvation yardstick judges it (``Policy.reclaim_wait_per_team``). A team whose queue
    holds only work that would run borrowed has no entry.

    Lanes are sorted by submit and hold jobs of at least their size floor: a lane whose
    floor passes what is left is skipped whole, and a walk stops at its first job that fits
    (a full scan of 50,000 queued jobs took 23 ms a cycle)."""
    out: dict[tuple[str, str], float] = {}
    left: dict[tuple[str, str], int] = {}

    def room(key: tuple[str, str]) -> int:
        got = left.get(key)
        if got is None:
            got = left[key] = state.quota(*key).guaranteed - state.used(*key)
        return got

    def fits(job: JobSpec, rest: int) -> bool:
        ti = state._types.get(job.gpu_type)
        if ti is None:
            return False
        shape = job_shape(job, ti.node_gpus)
        return not isinstance(shape, str) and shape.charge <= rest

    jobs = queue._jobs
    for (_rank, team, gpu_type, floor), lane in queue.lanes().items():
        key = (team, gpu_type)
        rest = room(key)
        if floor > rest:
            continue  # a job's charge is at least its lane's floor
        oldest = out.get(key, _INF)
        for submit, jid in lane:
            if submit >= oldest:
                break
            if fits(jobs[jid], rest):
                out[key] = submit
                break
    for lane in queue.front().values():
        for submit, jid in lane:
            job = jobs[jid]
            key = (job.team, job.gpu_type)
            if submit < out.get(key, _INF) and fits(job, room(key)):
                out[key] = submit
    return out


def classify(state: ClusterState, job: JobSpec, charge: int, policy: Policy) -> bool | None:
    """False: guaranteed, True: borrowed, None: over quota."""
    if not beyond_guarantee(state, job.team, job.gpu_type, charge):
        return False
    q = state.quota(job.team, job.gpu_type)
    if policy.borrowing and state.borrowed_used(job.team, job.gpu_type) + charge <= q.borrow_limit:
        return True
    return None


def over_share(state: ClusterState, team: str, gpu_type: str) -> float:
    """How far a team is over its share of a type right now: used / guarantee."""
    g = state.quota(team, gpu_type).guaranteed
    u = state.used(team, gpu_type)
    if g > 0:
        return u / g
    return _INF if u > 0 else 0.0


def relabel(state: ClusterState, team: str, gpu_type: str) -> list[Relabel]:
    """Re-check the borrowed flags of one (team, type); applies them to ``state`` and returns the changes."""
    a = state._acct.get((team, gpu_type))
    if a is None or not a.jobs:
        return []
    guarantee = state.quota(team, gpu_type).guaranteed
    if a.gused <= guarantee and (a.borrowed_n == 0 or a.gused >= guarantee):
        return []  # nothing over the guarantee, and no room to promote anyone
    out: list[Relabel] = []

    def by_start(rjs):
        return sorted(rjs, key=lambda rj: (rj.started_at, rj.job_id))

    if a.gused > guarantee:
        for rj in reversed(by_start(state._running[j] for j in a.jobs)):
            if a.gused <= guarantee:
                break
            if not rj.borrowed:
                state.set_borrowed(rj.job_id, True)
                out.append(Relabel(rj.job_id, True))
    if a.borrowed_n and a.gused < guarantee:
        borrowed = [rj for rj in (state._running[j] for j in a.jobs) if rj.borrowed and rj.preempting_for is None]
        for rj in by_start(borrowed):
            if a.gused + rj.charge <= guarantee:
                state.set_borrowed(rj.job_id, False)
                out.append(Relabel(rj.job_id, False))
    return out
