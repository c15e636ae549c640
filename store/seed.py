"""Cluster inventory writes: GPU types, blocks, nodes, and the demo teams' quotas and classes.

Used by `make up` to seed the demo cluster and by tests and benchmarks to build
fixtures. Every write is idempotent (ON CONFLICT) so re-seeding a running platform is
safe; quota and class changes go through ``store.teams`` (audited).
"""

from __future__ import annotations

from collections.abc import Mapping

import asyncpg

from store.teams import TeamQuota, set_priority_classes, set_quota, team_exists


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


DEMO_TEAMS: Mapping[str, tuple[float, float]] = {
    # team: (share of the cluster guaranteed, share it may borrow)
    "pretrain": (0.5, 1.0),
    "infer": (0.25, 0.5),
    "research": (0.25, 1.0),
}

# the classes each demo team may submit in (docs/security.md): each has what its examples use
DEMO_CLASSES: Mapping[str, tuple[str, ...]] = {
    "pretrain": ("prod-batch", "research", "preemptible"),
    "infer": ("prod-serving", "prod-batch"),
    "research": ("research", "preemptible"),
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
        new_team = not await team_exists(conn, team)
        exists = await conn.fetchval("SELECT 1 FROM quotas WHERE team = $1 AND gpu_type = $2", team, gpu_type)
        if not exists:  # never overwrite a quota an admin changed
            await set_quota(
                conn,
                TeamQuota(team, gpu_type, int(total * g), int(total * b)),
                actor="system:seed",
                reason="demo cluster seed",
            )
        if new_team:  # its classes likewise: only a team this seed created gets them
            await set_priority_classes(conn, team, DEMO_CLASSES[team], actor="system:seed", reason="demo cluster seed")
    return nodes
