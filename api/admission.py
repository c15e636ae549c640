"""Admission at submit: every rejection is a 4xx with a machine-readable code and a
human sentence, raised before anything is written (the caller's transaction then
rolls back, idempotency claim included).

The capacity checks are pure functions over the cluster's shape so they can be
tested without a database; ``admit`` fetches what they need.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

import asyncpg

from api.errors import ApiError
from api.schemas import PRIORITY_CLASSES, JobSubmit
from common.image_ref import parse_image_ref, parse_registry_rule
from common.settings import Principal, Settings
from store import jobs, nodes, teams

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)([smhdw]))+$")
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def parse_duration(value: str | int | float) -> float:
    """``"72h"``, ``"1d12h"``, ``"90m"``, ``"3600"`` or a number -> seconds (> 0)."""
    if isinstance(value, bool):
        raise ValueError("a duration is not a boolean")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = value.strip().lower().replace(" ", "")
        if re.fullmatch(r"\d+(?:\.\d+)?", text):
            seconds = float(text)
        elif _DURATION.fullmatch(text):
            seconds = sum(float(n) * _UNITS[u] for n, u in _PART.findall(text))
        else:
            raise ValueError(f"{value!r} is not a duration (try 72h, 90m, 1d12h or seconds)")
    if not seconds > 0 or seconds > 10 * 365 * 86400:
        raise ValueError(f"{value!r} is not a positive duration of at most 10 years")
    return seconds


def format_duration(seconds: float) -> str:
    s = int(seconds)
    if s % 86400 == 0:
        return f"{s // 86400}d"
    if s % 3600 == 0:
        return f"{s // 3600}h"
    if s % 60 == 0:
        return f"{s // 60}m"
    return f"{s}s"


def reject(code: str, message: str, status: int = 422, **details: object) -> ApiError:
    return ApiError(status, code, message, details or None)


def check_capacity(job: JobSubmit, nodes: Iterable[tuple[str, int]]) -> None:
    """Could this gang ever fit on the cluster, honouring its topology?

    ``nodes`` is (block_id, gpus) per node of the job's GPU type. One replica lives on
    one node, and jobs of >= 8 GPUs own whole nodes, so a node of g GPUs hosts
    floor(g / gpus_per_replica) replicas of this job.
    """
    nodes = list(nodes)
    gpr, replicas = job.gpus_per_replica, job.replicas
    total = gpr * replicas
    cluster_gpus = sum(g for _, g in nodes)
    if total > cluster_gpus:
        raise reject(
            "exceeds_cluster",
            f"the job asks for {total} {job.gpu_type} GPUs ({replicas} x {gpr}); the cluster has {cluster_gpus}",
            requested=total,
            available=cluster_gpus,
        )
    slots_per_block: dict[str, int] = defaultdict(int)
    for block, g in nodes:
        slots_per_block[block] += g // gpr
    slots = sum(slots_per_block.values())
    if slots < replicas:
        raise reject(
            "exceeds_cluster",
            f"{replicas} replicas of {gpr} GPUs do not fit on the cluster's {job.gpu_type} nodes"
            f" (room for {slots}: a replica must sit on one node)",
            requested=total,
            replica_slots=slots,
        )
    pack = job.topology.pack
    if pack == "node":
        largest = max((g for _, g in nodes), default=0)
        if total > largest:
            raise reject(
                "exceeds_topology",
                f"topology pack=node puts every replica on one node, but the job needs {total} GPUs and the"
                f" largest {job.gpu_type} node has {largest}; use pack block or any",
                requested=total,
                largest_node=largest,
            )
    elif pack == "block" and job.topology.max_blocks is not None:
        best = sorted(slots_per_block.values(), reverse=True)[: job.topology.max_blocks]
        if sum(best) < replicas:
            raise reject(
                "exceeds_topology",
                f"{replicas} replicas of {gpr} GPUs do not fit in {job.topology.max_blocks} block(s) of the"
                f" cluster (the largest {job.topology.max_blocks} hold {sum(best)} replicas)",
                requested=total,
                replica_slots=sum(best),
            )


async def admit(conn: asyncpg.Connection, settings: Settings, principal: Principal, job: JobSubmit) -> float:
    """Run every admission check; return max_runtime in seconds. Raises ApiError."""
    if not principal.admin and principal.team != job.team:
        raise reject(
            "forbidden_team", f"principal {principal.name} may submit for team {principal.team} only", status=403
        )
    rights = await teams.entitlement(conn, job.team)
    if rights is None:
        raise reject("unknown_team", f"there is no team {job.team!r}", team=job.team)
    if job.priority_class not in PRIORITY_CLASSES:
        raise reject(
            "unknown_priority_class",
            f"priority class {job.priority_class!r} does not exist (one of {', '.join(PRIORITY_CLASSES)})",
        )
    allowed = rights.priority_classes
    if allowed is not None and job.priority_class not in allowed:
        raise reject(
            "priority_class_not_allowed",
            f"team {job.team} may submit in {', '.join(allowed)} only, not {job.priority_class}"
            f" (an admin sets a team's classes: PUT /v1/teams/{job.team}/priority-classes)",
            status=403,
            priority_class=job.priority_class,
            allowed=list(allowed),
        )
    if not await nodes.gpu_type_exists(conn, job.gpu_type):
        raise reject("unknown_gpu_type", f"this cluster has no GPU type {job.gpu_type!r}", gpu_type=job.gpu_type)
    ref = parse_image_ref(job.image)  # the schema has checked the grammar already
    rules = [parse_registry_rule(r) for r in settings.allowed_registries]
    if not any(rule.allows(ref) for rule in rules):
        raise reject(
            "image_not_allowed",
            f"image: {job.image!r} is not from an allowed registry ({', '.join(map(str, rules))})",
            field="image",
        )
    if job.max_runtime is None:
        raise reject("max_runtime_required", 'every job needs a max_runtime (e.g. "72h")')
    try:
        max_runtime_s = parse_duration(job.max_runtime)
    except ValueError as e:
        raise reject("invalid_max_runtime", f"max_runtime: {e}") from e
    cap = settings.max_runtime_caps_s.get(job.priority_class)
    if cap is not None and max_runtime_s > cap:
        raise reject(
            "max_runtime_too_long",
            f"max_runtime {format_duration(max_runtime_s)} is longer than the {job.priority_class} cap of"
            f" {format_duration(cap)}",
            cap_seconds=cap,
        )
    check_capacity(job, await nodes.node_capacity(conn, job.gpu_type))
    total = job.replicas * job.gpus_per_replica
    quota = await teams.get_quota(conn, job.team, job.gpu_type)
    limit = 0 if quota is None else quota["guaranteed"] + quota["borrow_limit"]
    if total > limit:
        raise reject(
            "exceeds_quota",
            f"the job asks for {total} {job.gpu_type} GPUs; team {job.team} may hold at most {limit}"
            " (guarantee + borrow limit)",
            requested=total,
            limit=limit,
        )
    await jobs.lock_team_queue(conn, job.team)
    queued = await jobs.count_queued(conn, job.team)
    if queued >= settings.max_queued_per_team:
        raise reject(
            "team_queue_full",
            f"team {job.team} already has {queued} queued jobs (limit {settings.max_queued_per_team});"
            " wait for some to start or cancel some",
            status=429,
        )
    return max_runtime_s
