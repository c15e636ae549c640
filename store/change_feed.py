"""The leader's reader of the ``changes`` sequence, without losing late commits.

``changes.seq`` is taken when a row is inserted, not when its transaction commits: a
transaction holding seq 51 may commit after one holding seq 52. A reader that only
asks for ``seq > cursor`` would skip 51 for good (seen: a job that stayed QUEUED with
no reason until the next leader). So every seq missing below the cursor is kept as a
gap and asked for again until it appears, or until every transaction that was running
when it went missing has ended (``pg_snapshot_xmin`` has passed the ``xmax`` noted
then): by then a missing seq belongs to a rolled-back transaction and never will.
"""

from __future__ import annotations

from typing import Any

import asyncpg

READ_LIMIT = 20000
MAX_GAPS = 100_000  # a runaway gap set (e.g. a huge rollback) is dropped beyond this


class ChangeFeed:
    def __init__(self, cursor: int = 0, gaps: dict[int, int] | None = None) -> None:
        self.cursor = cursor
        # missing seq -> xmax of a snapshot taken after it went missing
        self.gaps: dict[int, int] = dict(gaps or {})
        self.late = 0  # gaps that did appear (diagnostics)

    @staticmethod
    async def start(conn: asyncpg.Connection, window: int = 1000) -> ChangeFeed:
        """A feed positioned at the newest change visible to ``conn``'s transaction (the
        rebuild's snapshot), with the seqs missing near the top kept as gaps."""
        top = await conn.fetchval("SELECT coalesce(max(seq), 0) FROM changes")
        seen = {r["seq"] for r in await conn.fetch("SELECT seq FROM changes WHERE seq > $1", max(0, top - window))}
        xmax = int(await conn.fetchval("SELECT pg_snapshot_xmax(pg_current_snapshot())::text"))
        gaps = {s: xmax for s in range(max(1, top - window + 1), top) if s not in seen}
        return ChangeFeed(top, gaps)

    async def read(self, db: Any) -> list[asyncpg.Record]:
        """Changes not read before, in seq order: new ones and gaps that have appeared."""
        xmin = None
        if self.gaps:
            xmin = int(await db.fetchval("SELECT pg_snapshot_xmin(pg_current_snapshot())::text"))
        rows = await db.fetch(
            "SELECT seq, kind, subject FROM changes WHERE seq > $1 OR seq = ANY($2::bigint[]) ORDER BY seq LIMIT $3",
            self.cursor,
            list(self.gaps),
            READ_LIMIT,
        )
        for r in rows:
            if self.gaps.pop(r["seq"], None) is not None:
                self.late += 1
        if xmin is not None:
            # every transaction that could still have written these has ended
            for seq in [s for s, x in self.gaps.items() if x <= xmin]:
                del self.gaps[seq]
        new_gaps: list[int] = []
        expected = self.cursor + 1
        for r in rows:
            seq = r["seq"]
            if seq < expected:
                continue
            new_gaps.extend(range(expected, seq))
            expected = seq + 1
        if rows:
            self.cursor = max(self.cursor, rows[-1]["seq"])
        if new_gaps:
            xmax = int(await db.fetchval("SELECT pg_snapshot_xmax(pg_current_snapshot())::text"))
            for seq in new_gaps:
                self.gaps[seq] = xmax
            if len(self.gaps) > MAX_GAPS:
                for seq in sorted(self.gaps)[: len(self.gaps) - MAX_GAPS]:
                    del self.gaps[seq]
        return rows

    async def prune(self, db: Any, *, kept_s: float) -> None:
        """Delete changes this feed has read that are older than ``kept_s``. The sequence is
        read only forward (a new leader starts from its max), so only a margin for slow
        readers is kept; a gap's row, committed late, is still to be read and stays."""
        await db.execute(
            "DELETE FROM changes WHERE seq <= $1 AND at < now() - make_interval(secs => $2)"
            " AND seq <> ALL($3::bigint[])",
            self.cursor,
            kept_s,
            list(self.gaps),
        )
