"""Builders for store-level tests: a small cluster, teams and queued jobs."""

from __future__ import annotations

import json

import asyncpg

from store import leadership
from store.allocations import GangPlacement
from store.seed import ensure_cluster
from store.teams import TeamQuota, set_quota


async def leader(pool: asyncpg.Pool, holder: str = "c1", scope: str = "placement") -> int:
    """Take the leader row for ``holder`` (free or expired); its epoch."""
    epoch = await leadership.acquire_leadership(pool, scope=scope, holder=holder, grpc_addr="127.0.0.1:1", ttl_s=30)
    assert epoch is not None
    return epoch


async def small_cluster(
    conn: asyncpg.Connection, *, blocks: int = 1, nodes_per_block: int = 2, gpu_type: str = "h100"
) -> list[str]:
    return await ensure_cluster(conn, gpu_type=gpu_type, blocks=blocks, nodes_per_block=nodes_per_block)


async def team(conn: asyncpg.Connection, name: str, guaranteed: int, borrow_limit: int = 0, gpu_type: str = "h100"):
    await set_quota(conn, TeamQuota(name, gpu_type, guaranteed, borrow_limit), actor="test", reason="fixture")


async def queued_job(
    conn: asyncpg.Connection,
    job_id: str,
    team: str,
    *,
    replicas: int = 1,
    gpus_per_replica: int = 1,
    priority_class: str = "research",
    gpu_type: str = "h100",
) -> str:
    await conn.execute(
        "INSERT INTO jobs (job_id, team, priority_class, gpu_type, replicas, gpus_per_replica, spec,"
        " max_runtime_s, submitted_by) VALUES ($1, $2, $3, $4, $5, $6, $7, 3600, 'test')",
        job_id,
        team,
        priority_class,
        gpu_type,
        replicas,
        gpus_per_replica,
        json.loads('{"image": "registry/x:1", "command": ["true"]}'),
    )
    return job_id


def gang(*specs: tuple[str, tuple[int, ...]], borrowed: bool = False) -> list[GangPlacement]:
    return [GangPlacement(rank=i, node_id=n, gpu_indices=g, borrowed=borrowed) for i, (n, g) in enumerate(specs)]
