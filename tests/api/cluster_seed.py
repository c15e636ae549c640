"""A cluster in every GPU state, for the operators' views (/v1/cluster, /metrics, /ui, top).

On the API tests' cluster (blocks b0, b1 x nodes n0, n1; teams alpha and beta) it adds nodes
b0-n2, b1-n2, b2-n0..n2 (9 nodes x 8 h100 = 72 GPUs) and writes, the way the leader would:

    b0-n0  ready     a-run (alpha) GPUs 0-3 guaranteed, a-borrow (alpha) 4-5 borrowed, 6-7 free
    b0-n1  ready     b-run (beta) all 8, guaranteed; its lease idle (idle_since set)
    b0-n2  down      8 down
    b1-n0  ready     hot spare for b-run: 8 hot_spare
    b1-n1  cordoned  8 cordoned
    b1-n2  suspect   a-idle (alpha) GPUs 0-1 guaranteed, lease idle; 2-7 down
    b2-n0  burn_in   8 burn_in (block b2 is reserved, but the node's state comes first)
    b2-n1, b2-n2     ready, block b2 reserved for a-big (alpha, prod-batch): 16 reserved

Queued: a-big (alpha, prod-batch, 16 GPUs, position 1, reserved), b-wait (beta, research, 4
GPUs, position 2, capacity), a-wait (alpha, research, 1 GPU, unpublished).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg

from store import allocations, leadership, publications
from store.seed import ensure_cluster
from tests.foundation.builders import gang, queued_job

EXPECTED_GPUS = {
    "free": 2,
    "guaranteed": 14,
    "borrowed": 2,
    "reserved": 16,
    "hot_spare": 8,
    "cordoned": 8,
    "down": 14,
    "burn_in": 8,
}
EXPECTED_START = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)


async def seed_cluster_states(pool: asyncpg.Pool) -> int:
    """Write the states above; return the leader epoch used."""
    async with pool.acquire() as conn:
        await ensure_cluster(conn, gpu_type="h100", blocks=3, nodes_per_block=3)
        for job_id, team, replicas, gpus, cls in (
            ("a-run", "alpha", 1, 4, "research"),
            ("a-borrow", "alpha", 1, 2, "research"),
            ("b-run", "beta", 1, 8, "prod-batch"),
            ("a-idle", "alpha", 1, 2, "research"),
            ("a-big", "alpha", 2, 8, "prod-batch"),
            ("b-wait", "beta", 1, 4, "research"),
            ("a-wait", "alpha", 1, 1, "research"),
        ):
            await queued_job(conn, job_id, team, replicas=replicas, gpus_per_replica=gpus, priority_class=cls)
    epoch = await leadership.acquire_leadership(pool, scope="placement", holder="seed", grpc_addr="x", ttl_s=600)
    assert epoch is not None

    async def commit(job_id: str, node: str, gpus: tuple[int, ...], borrowed: bool = False) -> None:
        await allocations.commit_gang(
            pool,
            scope="placement",
            epoch=epoch,
            job_id=job_id,
            attempt=1,
            placements=gang((node, gpus), borrowed=borrowed),
        )

    await commit("a-run", "b0-n0", (0, 1, 2, 3))
    await commit("a-borrow", "b0-n0", (4, 5), borrowed=True)
    await commit("b-run", "b0-n1", tuple(range(8)))
    await commit("a-idle", "b1-n2", (0, 1))
    await pool.execute(
        "UPDATE leases SET gpu_util = 0.5, gpu_util_at = now(), idle_since = now() - interval '20 minutes'"
        " WHERE job_id = ANY($1::text[])",
        ["b-run", "a-idle"],
    )
    await publications.publish_hot_spares(pool, scope="placement", epoch=epoch, spares={"b1-n0": "b-run"})
    await publications.publish_reservations(
        pool,
        scope="placement",
        epoch=epoch,
        rows=[publications.ReservationRow("a-big", EXPECTED_START, nodes=(), blocks=("b2",))],
    )
    await publications.publish_positions(
        pool,
        scope="placement",
        epoch=epoch,
        rows=[
            publications.Publication("a-big", 1, "reserved", "holds block b2", EXPECTED_START),
            publications.Publication("b-wait", 2, "capacity", "4 GPUs, 2 free", EXPECTED_START + timedelta(hours=1)),
        ],
    )
    for node, state in (("b0-n2", "down"), ("b1-n1", "cordoned"), ("b1-n2", "suspect"), ("b2-n0", "burn_in")):
        await pool.execute("UPDATE nodes SET state = $2, reason = 'seeded' WHERE node_id = $1", node, state)
    return epoch
