"""Nodes the jobs' own record blames (docs/design.md, Health, "A node that fails jobs"): the
jobs of several teams had an attempt fail first on the node (``job_events.detail.failed_on``,
``store.job_states.requeue_job``), and each then ran elsewhere: it succeeded, or its attempt
now runs on other nodes and has run for a while. A fault no check sees (a GPU that fails
CUDA's init while NVML reads it healthy, a broken library) shows this way; a job that is
broken fails everywhere and is no evidence, and one team's jobs alone (a sweep of one
broken config) are not enough.

Only what happened since the node's current state began counts (its last ``node_state``
audit row): a node taken out and burnt in comes back with no evidence against it.
"""

from __future__ import annotations

import asyncpg

from store.errors import StoreError
from store.tx import Db

_QUERY = """
WITH failed AS (
    SELECT e.job_id, e.attempt, e.at, e.detail->>'failed_on' AS node_id
    FROM job_events e
    WHERE e.event = 'attempt_failed' AND e.at > now() - make_interval(secs => $1)
      AND e.detail ? 'failed_on'
), since AS (
    SELECT n.node_id,
           coalesce((SELECT max(a.at) FROM audit a WHERE a.subject = n.node_id AND a.action = 'node_state'),
                    '-infinity'::timestamptz) AS at
    FROM nodes n
    WHERE n.state IN ('ready', 'suspect') AND n.node_id IN (SELECT node_id FROM failed)
)
SELECT f.node_id, count(DISTINCT f.job_id) AS jobs, count(DISTINCT j.team) AS teams
FROM failed f
JOIN since s ON s.node_id = f.node_id
JOIN jobs j ON j.job_id = f.job_id
WHERE f.at > s.at
  AND j.attempt > f.attempt
  AND (j.state = 'SUCCEEDED' OR (j.state = 'RUNNING' AND j.started_at < now() - make_interval(secs => $2)))
  AND NOT EXISTS (
      SELECT 1 FROM leases l WHERE l.job_id = j.job_id AND l.attempt = j.attempt AND l.node_id = f.node_id
  )
GROUP BY f.node_id
HAVING count(DISTINCT f.job_id) >= $3 AND count(DISTINCT j.team) >= $4
ORDER BY f.node_id
"""


async def nodes_failing_jobs(db: Db, *, window_s: float, ran_s: float, min_jobs: int, min_teams: int) -> dict[str, str]:
    """Node -> why it is blamed, as a node fault's text (the node row's reason says it). A
    query Postgres refuses (a statement timeout on a large table) raises ``StoreError``."""
    try:
        rows = await db.fetch(_QUERY, float(window_s), float(ran_s), int(min_jobs), int(min_teams))
    except asyncpg.PostgresError as e:
        raise StoreError(f"cannot read the failed attempts: {e}") from e
    return {
        r["node_id"]: (
            f"jobs: the attempts of {r['jobs']} jobs of {r['teams']} teams failed here first and then ran elsewhere"
        )
        for r in rows
    }
