-- Job runtime: extensions and the reservations placement publishes (DESIGN.md, Job lifecycle).

-- Seconds granted by extensions so far: the original max_runtime is max_runtime_s - extended_s
-- (each extension is capped at a fraction of the original).
ALTER TABLE jobs ADD COLUMN extended_s double precision NOT NULL DEFAULT 0 CHECK (extended_s >= 0);

-- Reservations of head-of-line gangs, published by each placement cycle (changed rows only),
-- so an extension that would delay one can be refused without asking the leader.
CREATE TABLE reservations (
    job_id          text PRIMARY KEY REFERENCES jobs(job_id),
    epoch           bigint NOT NULL,
    expected_start  timestamptz,
    nodes           text[] NOT NULL DEFAULT '{}',
    blocks          text[] NOT NULL DEFAULT '{}',
    updated_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX reservations_nodes ON reservations USING gin (nodes);
CREATE INDEX reservations_blocks ON reservations USING gin (blocks);

-- Live leases of a job are read by (job_id, attempt) and the STARTING/PREEMPTING jobs by state.
CREATE INDEX leases_live_job ON leases (job_id, attempt) WHERE state = 'live';
