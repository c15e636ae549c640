-- gpufleet schema, version 2: what the public API needs.

-- POST /v1/nodes/{id}:drain {"evict": true}: the health monitor also stops the
-- node's running jobs when it acts on the drain.
ALTER TABLE nodes ADD COLUMN drain_evict boolean NOT NULL DEFAULT false;

-- GET /v1/jobs pages newest first with (submitted_at, job_id) cursors.
CREATE INDEX jobs_team_submitted ON jobs (team, submitted_at DESC, job_id DESC);
CREATE INDEX jobs_submitted ON jobs (submitted_at DESC, job_id DESC);
