"""What the leader publishes for jobs it does not place: a team out of quota room reads
`quota` (whether the engine evaluated the job or skipped its whole lane), never a blank
or `lookahead`, so `GET /v1/jobs/{id}/explain` tells the user the real reason."""

from __future__ import annotations

from tests.foundation.builders import queued_job


async def test_jobs_without_quota_room_are_published_as_quota(pool, leader):
    cycles, epoch = leader
    async with pool.acquire() as conn:
        await queued_job(conn, "fits", "alpha", gpus_per_replica=8)
        for i in range(3):
            await queued_job(conn, f"over{i}", "alpha", gpus_per_replica=8)
    await cycles.run_cycle(epoch)
    rows = {r["job_id"]: r for r in await pool.fetch("SELECT job_id, state, pending_reason FROM jobs")}
    assert rows["fits"]["state"] == "STARTING"
    for i in range(3):
        assert rows[f"over{i}"]["state"] == "QUEUED"
        assert rows[f"over{i}"]["pending_reason"] == "quota", dict(rows[f"over{i}"])
