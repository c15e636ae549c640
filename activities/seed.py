"""Cluster inventory writes: GPU types, blocks, nodes, teams and quotas.

Used by `make up` to seed the demo cluster and by tests to build fixtures.
Every write is idempotent (ON CONFLICT) so re-seeding a running platform is safe,
and quota changes are audited in the same transaction (invariant 7).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import asyncpg

from activities.store import write_audit


@dataclass(frozen=True)
class TeamQuota:
    team: str
    gpu_type: str
    guaranteed: int
    borrow_limit: int


async def ensure_cluster(
    conn: asyncpg.Connection,
    *,
    gpu_type: str,
    blocks: int,
    nodes_per_block: int,
    gpus_per_node: int = 8,
    prefix: str = "",
    task_queue_prefix: str = "gpufleet-node-",
) -> list[str]:
    """Create blocks ``{prefix}b{i}`` with nodes ``{prefix}b{i}-n{j}``; return node ids."""
    node_ids: list[str] = []
    async with conn.transaction():
        await conn.execute("INSERT INTO gpu_types (name) VALUES ($1) ON CONFLICT DO NOTHING", gpu_type)
        for b in range(blocks):
            block_id = f"{prefix}b{b}"
            await conn.execute(
                "INSERT INTO blocks (block_id, gpu_type) VALUES ($1, $2) ON CONFLICT DO NOTHING", block_id, gpu_type
            )
            rows = []
            for n in range(nodes_per_block):
                node_id = f"{block_id}-n{n}"
                node_ids.append(node_id)
                rows.append((node_id, block_id, gpu_type, gpus_per_node, task_queue_prefix + node_id))
            await conn.executemany(
                "INSERT INTO nodes (node_id, block_id, gpu_type, gpus, task_queue) VALUES ($1, $2, $3, $4, $5)"
                " ON CONFLICT (node_id) DO NOTHING",
                rows,
            )
    return node_ids


async def set_quota(
    conn: asyncpg.Connection, quota: TeamQuota, *, actor: str, reason: str
) -> None:
    """Create the team if needed and set its quota for one GPU type, audited."""
    async with conn.transaction():
        await conn.execute("INSERT INTO teams (name) VALUES ($1) ON CONFLICT DO NOTHING", quota.team)
        await conn.execute("INSERT INTO gpu_types (name) VALUES ($1) ON CONFLICT DO NOTHING", quota.gpu_type)
        old = await conn.fetchrow(
            "SELECT guaranteed, borrow_limit FROM quotas WHERE team = $1 AND gpu_type = $2 FOR UPDATE",
            quota.team,
            quota.gpu_type,
        )
        await conn.execute(
            "INSERT INTO quotas (team, gpu_type, guaranteed, borrow_limit) VALUES ($1, $2, $3, $4)"
            " ON CONFLICT (team, gpu_type) DO UPDATE SET guaranteed = EXCLUDED.guaranteed,"
            " borrow_limit = EXCLUDED.borrow_limit, updated_at = now()",
            quota.team,
            quota.gpu_type,
            quota.guaranteed,
            quota.borrow_limit,
        )
        # Invariant 4: lowering a guarantee re-marks the team's newest allocations as borrowed.
        await conn.execute(
            "WITH ranked AS ("
            "  SELECT node_id, gpu_index, row_number() OVER (ORDER BY allocated_at, node_id, gpu_index) AS n"
            "  FROM allocations WHERE team = $1 AND gpu_type = $2)"
            " UPDATE allocations a SET borrowed = (r.n > $3) FROM ranked r"
            " WHERE a.node_id = r.node_id AND a.gpu_index = r.gpu_index AND a.borrowed <> (r.n > $3)",
            quota.team,
            quota.gpu_type,
            quota.guaranteed,
        )
        await write_audit(
            conn,
            actor,
            "quota_change",
            f"{quota.team}/{quota.gpu_type}",
            reason,
            {
                "old": dict(old) if old else None,
                "new": {"guaranteed": quota.guaranteed, "borrow_limit": quota.borrow_limit},
            },
        )


DEMO_TEAMS: Mapping[str, tuple[float, float]] = {
    # team: (share of the cluster guaranteed, share it may borrow)
    "pretrain": (0.5, 1.0),
    "infer": (0.25, 0.5),
    "research": (0.25, 1.0),
}


async def seed_demo(
    conn: asyncpg.Connection,
    *,
    gpu_type: str,
    blocks: int,
    nodes_per_block: int,
    gpus_per_node: int,
    task_queue_prefix: str,
) -> list[str]:
    nodes = await ensure_cluster(
        conn,
        gpu_type=gpu_type,
        blocks=blocks,
        nodes_per_block=nodes_per_block,
        gpus_per_node=gpus_per_node,
        task_queue_prefix=task_queue_prefix,
    )
    total = blocks * nodes_per_block * gpus_per_node
    for team, (g, b) in DEMO_TEAMS.items():
        exists = await conn.fetchval("SELECT 1 FROM quotas WHERE team = $1 AND gpu_type = $2", team, gpu_type)
        if not exists:  # never overwrite a quota an admin changed
            await set_quota(
                conn,
                TeamQuota(team, gpu_type, int(total * g), int(total * b)),
                actor="system:seed",
                reason="demo cluster seed",
            )
    return nodes
