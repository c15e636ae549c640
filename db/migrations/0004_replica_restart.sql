-- prod-serving replicas restart alone (DESIGN.md, Jobs): a restarted replica gets a new
-- lease on the same GPUs (the agent never restarts a finished lease), so one rank of one
-- attempt may have several leases over time, but at most one live.
ALTER TABLE leases DROP CONSTRAINT leases_job_id_attempt_rank_key;
CREATE UNIQUE INDEX leases_live_rank ON leases (job_id, attempt, rank) WHERE state = 'live';
