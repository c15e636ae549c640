-- Agents' reports about ranks (exits, checkpoints): stored before the agent is acknowledged,
-- then delivered to the job's workflow at least once (docs/design.md, Reports). A report sent
-- again (the agent retried, or re-reported after a restart) is the same row.
CREATE TABLE task_reports (
    id              bigserial PRIMARY KEY,
    lease_id        text NOT NULL,
    job_id          text NOT NULL,
    attempt         integer NOT NULL,
    epoch           bigint NOT NULL,
    rank            integer NOT NULL,
    node_id         text NOT NULL,
    state           text NOT NULL,
    exit_code       integer,
    checkpoint_uri  text,
    report          jsonb NOT NULL,                  -- the TaskStatus as received
    received_at     timestamptz NOT NULL DEFAULT now(),
    delivered_at    timestamptz,                     -- in the job workflow's history, or dropped
    outcome         text CHECK (outcome IN ('delivered', 'job_finished'))
);
CREATE UNIQUE INDEX task_reports_once ON task_reports (lease_id, epoch, state, coalesce(checkpoint_uri, ''));
CREATE INDEX task_reports_undelivered ON task_reports (id) WHERE delivered_at IS NULL;
CREATE INDEX task_reports_job ON task_reports (job_id, attempt);
