"""The leader's change feed on real Postgres: a change whose transaction commits after a
later one is still read; a rolled-back change stops being waited for."""

from __future__ import annotations

from store.change_feed import ChangeFeed


async def _change(conn, subject: str) -> int:
    return await conn.fetchval(
        "INSERT INTO changes (kind, subject, op) VALUES ('job', $1, 'INSERT') RETURNING seq", subject
    )


async def test_a_change_committed_late_is_read_and_a_rolled_back_one_is_dropped(pool):
    async with pool.acquire() as conn:
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            feed = await ChangeFeed.start(conn)
    base = feed.cursor
    slow = await pool.acquire()
    aborted = await pool.acquire()
    try:
        tx_slow = slow.transaction()
        await tx_slow.start()
        late_seq = await _change(slow, "late-job")  # takes its seq first, commits last
        tx_abort = aborted.transaction()
        await tx_abort.start()
        lost_seq = await _change(aborted, "rolled-back-job")
        async with pool.acquire() as conn:
            quick_seq = await _change(conn, "quick-job")
        assert base < late_seq < lost_seq < quick_seq

        first = await feed.read(pool)
        assert [r["subject"] for r in first if r["seq"] > base] == ["quick-job"]
        assert {late_seq, lost_seq} <= set(feed.gaps)

        await tx_slow.commit()
        await tx_abort.rollback()
        second = await feed.read(pool)
        assert [r["subject"] for r in second] == ["late-job"]
        assert feed.late == 1
        # every transaction running when they went missing has ended: no gap is left
        await feed.read(pool)
        assert not {late_seq, lost_seq} & set(feed.gaps)
    finally:
        await pool.release(slow)
        await pool.release(aborted)


async def test_a_feed_started_from_a_snapshot_keeps_the_seqs_missing_at_the_top(pool):
    slow = await pool.acquire()
    try:
        tx = slow.transaction()
        await tx.start()
        hidden = await _change(slow, "in-flight-at-takeover")
        async with pool.acquire() as conn:
            await _change(conn, "visible-at-takeover")
        async with pool.acquire() as conn:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                feed = await ChangeFeed.start(conn)
        assert hidden in feed.gaps and feed.cursor > hidden
        await tx.commit()
        assert [r["subject"] for r in await feed.read(pool)] == ["in-flight-at-takeover"]
    finally:
        await pool.release(slow)
