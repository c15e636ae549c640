"""/v1/cluster: the operators' picture of the whole cluster (the map, the queue per class, each
team's quota and use, idle GPUs and their cost), read from ``store.cluster_view``.

Any member sees the whole map, every count and which team holds each GPU; job ids, job names
and pending reasons are shown only for the caller's own team's jobs (admins see all).
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, Field

from api.auth import can_see_team, current_principal
from api.deps import pool_of, settings_of
from api.errors import ERROR_RESPONSES
from common.settings import Principal
from store.cluster_view import GPU_STATES, ClusterView, read_cluster

router = APIRouter(prefix="/v1", tags=["cluster"], dependencies=[Depends(current_principal)], responses=ERROR_RESPONSES)

GPU_STATE_DOC = (
    "free; guaranteed / borrowed (allocated within / beyond its team's guarantee); reserved (held for a"
    " waiting gang); hot_spare (held by the leader for a large gang's restarts); cordoned (cordoned or"
    " draining); down (down or suspect); burn_in"
)


class ClusterGpu(BaseModel):
    index: int = Field(description="the GPU's index on its node")
    state: str = Field(description=f"one of {', '.join(GPU_STATES)}: {GPU_STATE_DOC}")
    team: str | None = Field(None, description="the team it is allocated to, or held for (reserved, hot spare)")
    job_id: str | None = Field(None, description="the job holding it; shown only for the caller's own team (or admin)")


class ClusterNode(BaseModel):
    node_id: str
    block_id: str = Field(description="the network block (leaf switch) it sits under")
    gpu_type: str
    state: str = Field(description="the node's health state: ready, suspect, down, cordoned, draining, burn_in")
    reason: str | None = Field(None, description="why it is in that state (set with the state)")
    cordoned: bool = Field(description="cordoned: out of service until it passes burn-in")
    drained: bool = Field(description="draining: an admin took it out of placement")
    burn_in: bool = Field(description="running the burn-in test")
    gpus: list[ClusterGpu] = Field(description="every GPU of the node, by index")


class ClusterBlock(BaseModel):
    block_id: str
    nodes: list[ClusterNode]


class ClusterQueuedJob(BaseModel):
    job_id: str | None = Field(None, description="shown only for the caller's own team (or admin)")
    name: str | None = Field(None, description="shown only for the caller's own team (or admin)")
    team: str
    gpu_type: str
    gpus: int = Field(description="replicas x GPUs per replica")
    queue_position: int | None = Field(
        None, description="its place in the whole queue, as the leader last published it"
    )
    pending_reason: str | None = Field(
        None,
        description="why it waits (quota, capacity, topology, ...); shown only for the caller's own team (or admin)",
    )
    expected_start: datetime | None = Field(None, description="when the leader expects it to start, if it can tell")
    submitted_at: datetime


class ClusterQueueClass(BaseModel):
    priority_class: str
    jobs_queued: int = Field(description="queued jobs of this class (all of them)")
    gpus_queued: int = Field(description="GPUs those jobs ask for")
    jobs: list[ClusterQueuedJob] = Field(
        description="the first jobs of the class in queue order (up to `jobs` per class)"
    )


class ClusterTeamUse(BaseModel):
    team: str
    gpu_type: str
    guaranteed: int = Field(description="the quota's guaranteed GPUs")
    borrow_limit: int = Field(description="GPUs it may borrow beyond the guarantee")
    in_use: int = Field(description="GPUs allocated to it now")
    guaranteed_in_use: int = Field(description="of in_use, within the guarantee")
    borrowed: int = Field(description="of in_use, beyond the guarantee (may be reclaimed)")
    allocated_idle: int = Field(0, description="GPUs of its live leases whose use the leader marked idle (all types)")


class ClusterTotals(BaseModel):
    gpus: dict[str, dict[str, int]] = Field(description=f"GPU type -> GPU state ({', '.join(GPU_STATES)}) -> GPUs")
    idle_gpus: dict[str, int] = Field(
        description="GPU type -> healthy, schedulable, unallocated GPUs (free, reserved, hot spare)"
    )
    idle_gpu_total: int
    idle_cost_usd_per_hour: float = Field(description="idle GPUs x gpu_hour_usd")
    allocated_idle_gpus: dict[str, int] = Field(
        description="team -> GPUs of live leases whose use the leader marked idle (idle_since set)"
    )
    allocated_idle_cost_usd_per_hour: float = Field(description="allocated-but-idle GPUs x gpu_hour_usd")
    gpu_hour_usd: float = Field(description="the price of one GPU-hour the costs use (setting gpu_hour_usd)")


class ClusterMap(BaseModel):
    gpu_states: list[str] = Field(description="every GPU state, in the order a legend shows them")
    blocks: list[ClusterBlock] = Field(description="every block, by id, with its nodes")
    queue: list[ClusterQueueClass] = Field(description="every priority class, highest first")
    teams: list[ClusterTeamUse] = Field(description="each team's quota and use, per GPU type")
    totals: ClusterTotals


def cluster_body(view: ClusterView, principal: Principal) -> dict[str, Any]:
    """The view as the principal may see it: other teams' job ids, names and reasons removed."""

    def own(team: str | None) -> bool:
        return team is not None and can_see_team(principal, team)

    blocks: dict[str, list[dict[str, Any]]] = {}
    for n in view.nodes:
        blocks.setdefault(n.block_id, []).append(
            {
                "node_id": n.node_id,
                "block_id": n.block_id,
                "gpu_type": n.gpu_type,
                "state": n.health,
                "reason": n.reason,
                "cordoned": n.cordoned,
                "drained": n.drained,
                "burn_in": n.burn_in,
                "gpus": [
                    {
                        "index": g.index,
                        "state": g.state.value,
                        "team": g.team,
                        "job_id": g.job_id if own(g.team) else None,
                    }
                    for g in n.gpus
                ],
            }
        )
    counts = view.gpu_counts()
    return {
        "gpu_states": list(GPU_STATES),
        "blocks": [{"block_id": b, "nodes": nodes} for b, nodes in sorted(blocks.items())],
        "queue": [
            {
                "priority_class": q.priority_class,
                "jobs_queued": q.jobs_queued,
                "gpus_queued": q.gpus_queued,
                "jobs": [
                    {
                        "job_id": j.job_id if own(j.team) else None,
                        "name": j.name if own(j.team) else None,
                        "team": j.team,
                        "gpu_type": j.gpu_type,
                        "gpus": j.gpus,
                        "queue_position": j.queue_position,
                        "pending_reason": j.pending_reason if own(j.team) else None,
                        "expected_start": j.expected_start,
                        "submitted_at": j.submitted_at,
                    }
                    for j in q.jobs
                ],
            }
            for q in view.queue
        ],
        "teams": [
            {
                "team": u.team,
                "gpu_type": u.gpu_type,
                "guaranteed": u.guaranteed,
                "borrow_limit": u.borrow_limit,
                "in_use": u.in_use,
                "guaranteed_in_use": u.guaranteed_in_use,
                "borrowed": u.borrowed,
                "allocated_idle": view.allocated_idle.get(u.team, 0),
            }
            for u in view.teams
        ],
        "totals": {
            "gpus": {t: {s: counts[(t, s)] for s in GPU_STATES} for t in view.gpu_types},
            "idle_gpus": view.idle_gpus(),
            "idle_gpu_total": view.idle_gpu_total,
            "idle_cost_usd_per_hour": view.idle_cost_usd_per_hour,
            "allocated_idle_gpus": dict(view.allocated_idle),
            "allocated_idle_cost_usd_per_hour": view.allocated_idle_cost_usd_per_hour,
            "gpu_hour_usd": view.gpu_hour_usd,
        },
    }


@router.get("/cluster", response_model=ClusterMap, summary="The whole cluster: map, queue, quotas, idle GPUs")
async def get_cluster(
    request: Request,
    jobs: Annotated[int, Query(ge=0, le=500, description="queued jobs listed per priority class")] = 50,
    principal: Principal = Depends(current_principal),
) -> Any:
    """Every node of every block with each GPU's state and owning team; the queue per priority
    class (counts, and the first jobs with their published position, reason and expected start);
    each team's quota and use; idle GPUs, their cost per hour, and allocated-but-idle GPUs per
    team. Job ids, names and reasons of other teams' jobs are shown to admins only."""
    view = await read_cluster(pool_of(request), gpu_hour_usd=settings_of(request).gpu_hour_usd, jobs_per_class=jobs)
    return cluster_body(view, principal)
