"""/v1/nodes: list, one node (state, GPUs, leases), drain and return (admin)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

import asyncpg
from fastapi import APIRouter, Depends, Header, Query, Request
from pydantic import AfterValidator

from api import idempotency
from api.auth import current_principal, require_admin
from api.deps import NodeId, decode_cursor, encode_cursor, page_size, pool_of, settings_of
from api.errors import ERROR_RESPONSES, ApiError
from api.schemas import (
    CredentialBody,
    CredentialIssued,
    CredentialRevoked,
    DrainAccepted,
    DrainBody,
    NodeList,
    NodeState,
    NodeView,
    ReturnAccepted,
    ReturnBody,
    storable,
)
from common.settings import Principal, Settings
from proto.auth import node_log_key
from store import node_credentials, nodes

router = APIRouter(prefix="/v1", tags=["nodes"], dependencies=[Depends(current_principal)], responses=ERROR_RESPONSES)

IdempotencyKey = Annotated[str, Header(alias="Idempotency-Key", description="required on every write")]
Filter = Annotated[str | None, Query(max_length=200), AfterValidator(lambda v: v if v is None else storable(v))]
NOT_DRAINABLE = ("down", "cordoned")


def node_summary(r: asyncpg.Record, principal: Principal, settings: Settings, now: datetime) -> dict[str, Any]:
    spare_for = r["hot_spare_for"]
    if spare_for is not None and not (principal.admin or principal.team == r["hot_spare_team"]):
        spare_for = None  # another team's job id: hidden, as on the node's leases
    waits = nodes.node_waits_for(
        r["state"],
        live_ranks=r["live_ranks"],
        live_jobs=r["live_jobs"],
        drain_evict=r["drain_evict"],
        since=r["updated_at"],
        now=now,
        suspect_after_s=settings.suspect_after_s,
        down_after_s=settings.down_after_s,
    )
    return {
        "status": f"{r['state']} ({waits})" if waits else r["state"],
        "waiting_for": waits,
        "live_ranks": r["live_ranks"],
        "node_id": r["node_id"],
        "block_id": r["block_id"],
        "gpu_type": r["gpu_type"],
        "gpus": r["gpus"],
        "gpus_allocated": r["gpus_allocated"],
        "state": r["state"],
        "reason": r["reason"],
        "drain_evict": r["drain_evict"],
        "updated_at": r["updated_at"],
        "hot_spare": r["hot_spare_for"] is not None,
        "hot_spare_for": spare_for,
    }


@router.get("/nodes", response_model=NodeList, summary="Nodes, by id")
async def list_nodes(
    request: Request,
    state: NodeState | None = None,
    block: Filter = None,
    gpu_type: Filter = None,
    cursor: Annotated[str | None, Query(max_length=2000)] = None,
    limit: Annotated[int | None, Query(ge=1, le=1_000_000)] = None,
    principal: Principal = Depends(current_principal),
) -> Any:
    n = page_size(request, limit)
    raw = decode_cursor("nodes", cursor)
    after = str(raw[0]) if raw else None
    if raw and not isinstance(raw[0], str):
        raise ApiError(400, "invalid_cursor", "the cursor is not one this list returned")
    pool = pool_of(request)
    rows = await nodes.list_nodes(pool, state=state, block=block, gpu_type=gpu_type, after=after, limit=n + 1)
    next_cursor = None
    if len(rows) > n:
        rows = rows[:n]
        next_cursor = encode_cursor("nodes", [rows[-1]["node_id"]])
    spares = await nodes.count_hot_spares(pool, state=state, block=block, gpu_type=gpu_type)
    settings, now = settings_of(request), datetime.now(UTC)
    return {
        "nodes": [node_summary(r, principal, settings, now) for r in rows],
        "next_cursor": next_cursor,
        "hot_spares": spares,
    }


@router.get("/nodes/{node_id}", response_model=NodeView, summary="One node: state, GPUs and live leases")
async def get_node(request: Request, node_id: NodeId, principal: Principal = Depends(current_principal)) -> Any:
    """Other teams' leases show only their GPUs (no job ids) unless the caller is an admin."""
    pool = pool_of(request)
    node = await nodes.get_node(pool, node_id)
    if node is None:
        raise ApiError(404, "node_not_found", f"no node {node_id}")
    leases = await nodes.node_leases(pool, node_id)
    allocs = {a["gpu_index"]: a for a in await nodes.node_allocations(pool, node_id)}

    def visible(team: str) -> bool:
        return principal.admin or principal.team == team

    out = node_summary(node, principal, settings_of(request), datetime.now(UTC))
    out["task_queue"] = node["task_queue"] if principal.admin else None
    out["agent_addr"] = node["agent_addr"] if principal.admin else None
    out["gpu_slots"] = [
        {
            "index": i,
            "allocated": i in allocs,
            "borrowed": allocs[i]["borrowed"] if i in allocs else None,
            "job_id": allocs[i]["job_id"] if i in allocs and visible(allocs[i]["team"]) else None,
        }
        for i in range(node["gpus"])
    ]
    out["leases"] = [
        {
            "lease_id": lease["lease_id"],
            "job_id": lease["job_id"],
            "team": lease["team"],
            "attempt": lease["attempt"],
            "rank": lease["rank"],
            "gpu_indices": list(lease["gpu_indices"]),
            "epoch": lease["epoch"],
        }
        if visible(lease["team"])
        else {"gpu_indices": list(lease["gpu_indices"])}
        for lease in leases
    ]
    return out


@router.post("/nodes/{node_id}:drain", status_code=202, response_model=DrainAccepted, summary="Drain a node (admin)")
async def drain_node(
    request: Request,
    node_id: NodeId,
    body: DrainBody,
    idempotency_key: IdempotencyKey,
    principal: Principal = Depends(require_admin),
) -> Any:
    """Sets the node `draining` (no new placements) with the reason, audited in the same
    transaction; with `evict` the health monitor also stops its running jobs."""

    async def work(conn: asyncpg.Connection) -> idempotency.Outcome:
        node = await nodes.get_node(conn, node_id, for_update=True)
        if node is None:
            raise ApiError(404, "node_not_found", f"no node {node_id}")
        if node["state"] in NOT_DRAINABLE:
            raise ApiError(
                409,
                "node_not_drainable",
                f"node {node_id} is {node['state']}; it takes no placements already",
                {"state": node["state"]},
            )
        await nodes.drain_node(
            conn, node_id, from_state=node["state"], reason=body.reason, evict=body.evict, actor=principal.name
        )
        out = {
            "node_id": node_id,
            "state": "draining",
            "previous_state": node["state"],
            "reason": body.reason,
            "evict": body.evict,
        }
        return idempotency.Outcome(202, out)

    return await idempotency.run(request, principal, idempotency_key, work)


@router.post(
    "/nodes/{node_id}:return",
    status_code=202,
    response_model=ReturnAccepted,
    summary="Return a node to service (admin)",
)
async def return_node(
    request: Request,
    node_id: NodeId,
    body: ReturnBody,
    idempotency_key: IdempotencyKey,
    principal: Principal = Depends(require_admin),
) -> Any:
    """Moves a draining or cordoned node to `burn_in` with the reason, audited in the same
    transaction; the leader runs the burn-in and marks it ready when it passes."""

    async def work(conn: asyncpg.Connection) -> idempotency.Outcome:
        node = await nodes.get_node(conn, node_id, for_update=True)
        if node is None:
            raise ApiError(404, "node_not_found", f"no node {node_id}")
        previous = await nodes.return_node(conn, node_id, actor=principal.name, reason=body.reason)
        if previous is None:
            raise ApiError(
                409,
                "node_not_returnable",
                f"node {node_id} is {node['state']}; only a draining or cordoned node can be returned",
                {"state": node["state"]},
            )
        out = {"node_id": node_id, "state": "burn_in", "previous_state": previous, "reason": body.reason}
        return idempotency.Outcome(202, out)

    return await idempotency.run(request, principal, idempotency_key, work)


@router.post(
    "/nodes/{node_id}:issue-credential",
    status_code=201,
    response_model=CredentialIssued,
    summary="Issue (or rotate) a node's credential (admin)",
)
async def issue_node_credential(
    request: Request,
    node_id: NodeId,
    body: CredentialBody,
    idempotency_key: IdempotencyKey,
    principal: Principal = Depends(require_admin),
) -> Any:
    """A new credential for the node's agent (`GPUFLEET_AGENT_CREDENTIALS`), shown once; the
    node's previous credential stops working. Only a SHA-256 of it is stored, audited. With it,
    the node's log key (`GPUFLEET_AGENT_LOG_KEYS`), derived from the API's signing key."""

    async def work(conn: asyncpg.Connection) -> idempotency.Outcome:
        if await nodes.get_node(conn, node_id, for_update=True) is None:
            raise ApiError(404, "node_not_found", f"no node {node_id}")
        issued = await node_credentials.issue(conn, node_id, actor=principal.name, reason=body.reason)
        out = {
            "node_id": node_id,
            "credential": issued.credential,
            "log_key": node_log_key(settings_of(request).log_signing_key, node_id),
            "issued_at": issued.issued_at,
        }
        return idempotency.Outcome(201, out, stored_body={**out, "credential": None, "log_key": None})

    return await idempotency.run(request, principal, idempotency_key, work)


@router.post(
    "/nodes/{node_id}:revoke-credential",
    status_code=200,
    response_model=CredentialRevoked,
    summary="Revoke a node's credential (admin)",
)
async def revoke_node_credential(
    request: Request,
    node_id: NodeId,
    body: CredentialBody,
    idempotency_key: IdempotencyKey,
    principal: Principal = Depends(require_admin),
) -> Any:
    """The node's agent is refused from now on (control re-reads credentials every
    `GPUFLEET_NODE_CREDENTIALS_REFRESH_S`) until a new credential is issued; audited."""

    async def work(conn: asyncpg.Connection) -> idempotency.Outcome:
        if await nodes.get_node(conn, node_id, for_update=True) is None:
            raise ApiError(404, "node_not_found", f"no node {node_id}")
        revoked = await node_credentials.revoke(conn, node_id, actor=principal.name, reason=body.reason)
        return idempotency.Outcome(200, {"node_id": node_id, "revoked": revoked})

    return await idempotency.run(request, principal, idempotency_key, work)
