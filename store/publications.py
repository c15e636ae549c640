"""What each placement cycle publishes for the API to read (docs/design.md, Placement):
queue positions, pending reasons and expected starts of queued jobs, the reservations
and the hot spares. The leader writes only what changed, under its epoch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from store.leadership import check_epoch
from store.tx import Db, transaction


@dataclass(frozen=True)
class Publication:
    """What a cycle publishes for one queued job (docs/design.md: 'why pending')."""

    job_id: str
    queue_position: int | None
    pending_reason: str | None
    pending_detail: str | None
    expected_start: datetime | None


async def publish_positions(db: Db, *, scope: str, epoch: int, rows: Sequence[Publication]) -> int:
    """Write queue positions / pending reasons of QUEUED jobs (the caller sends changed rows
    only; the SQL skips rows that already hold these values). Returns rows written."""
    if not rows:
        return 0
    async with transaction(db) as conn:
        await check_epoch(conn, scope, epoch)
        status = await conn.execute(
            "UPDATE jobs j SET queue_position = u.pos, pending_reason = u.reason, pending_detail = u.detail,"
            "   expected_start = u.start"
            " FROM unnest($1::text[], $2::int[], $3::text[], $4::text[], $5::timestamptz[])"
            "   AS u(job_id, pos, reason, detail, start)"
            " WHERE j.job_id = u.job_id AND j.state = 'QUEUED'"
            "   AND (j.queue_position, j.pending_reason, j.pending_detail, j.expected_start)"
            "       IS DISTINCT FROM (u.pos, u.reason, u.detail, u.start)",
            [r.job_id for r in rows],
            [r.queue_position for r in rows],
            [r.pending_reason for r in rows],
            [r.pending_detail for r in rows],
            [r.expected_start for r in rows],
        )
        return int(status.split()[-1])


@dataclass(frozen=True)
class ReservationRow:
    job_id: str
    expected_start: datetime | None
    nodes: tuple[str, ...]
    blocks: tuple[str, ...]


async def publish_reservations(db: Db, *, scope: str, epoch: int, rows: Sequence[ReservationRow]) -> None:
    """Replace the published reservations with ``rows`` (the caller calls only on change)."""
    async with transaction(db) as conn:
        await check_epoch(conn, scope, epoch)
        keep = [r.job_id for r in rows]
        await conn.execute("DELETE FROM reservations WHERE NOT (job_id = ANY($1::text[]))", keep)
        if rows:
            await conn.executemany(
                "INSERT INTO reservations (job_id, epoch, expected_start, nodes, blocks) VALUES ($1, $2, $3, $4, $5)"
                " ON CONFLICT (job_id) DO UPDATE SET epoch = EXCLUDED.epoch, expected_start = EXCLUDED.expected_start,"
                " nodes = EXCLUDED.nodes, blocks = EXCLUDED.blocks, updated_at = now()",
                [(r.job_id, epoch, r.expected_start, list(r.nodes), list(r.blocks)) for r in rows],
            )


async def publish_hot_spares(db: Db, *, scope: str, epoch: int, spares: Mapping[str, str]) -> None:
    """Make the published hot spares ``spares`` (node_id -> job it is held for); rows not in it
    are deleted, rows whose job changed are rewritten (the caller calls only on change)."""
    async with transaction(db) as conn:
        await check_epoch(conn, scope, epoch)
        await conn.execute("DELETE FROM hot_spares WHERE NOT (node_id = ANY($1::text[]))", list(spares))
        if spares:
            await conn.executemany(
                "INSERT INTO hot_spares (node_id, job_id, epoch) VALUES ($1, $2, $3)"
                " ON CONFLICT (node_id) DO UPDATE SET job_id = EXCLUDED.job_id, epoch = EXCLUDED.epoch, updated_at = now()"
                " WHERE hot_spares.job_id IS DISTINCT FROM EXCLUDED.job_id",
                [(n, j, epoch) for n, j in sorted(spares.items())],
            )
