-- gpufleet schema, version 1. Postgres is the source of truth and the last line
-- of defence (DESIGN.md, Invariants): the constraints below make a double
-- allocation impossible whatever the code above them does.

CREATE TABLE teams (
    name        text PRIMARY KEY CHECK (name ~ '^[a-z][a-z0-9-]{0,62}$'),
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE gpu_types (
    name text PRIMARY KEY
);

-- Per team and GPU type: a guaranteed share plus idle capacity it may borrow.
CREATE TABLE quotas (
    team          text NOT NULL REFERENCES teams(name),
    gpu_type      text NOT NULL REFERENCES gpu_types(name),
    guaranteed    integer NOT NULL CHECK (guaranteed >= 0),
    borrow_limit  integer NOT NULL DEFAULT 0 CHECK (borrow_limit >= 0),
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (team, gpu_type)
);

-- A network block: nodes under one leaf switch.
CREATE TABLE blocks (
    block_id  text PRIMARY KEY,
    gpu_type  text NOT NULL REFERENCES gpu_types(name),
    spine     text
);

CREATE TABLE nodes (
    node_id     text PRIMARY KEY,
    block_id    text NOT NULL REFERENCES blocks(block_id),
    gpu_type    text NOT NULL REFERENCES gpu_types(name),
    gpus        integer NOT NULL CHECK (gpus BETWEEN 1 AND 16),
    state       text NOT NULL DEFAULT 'ready'
                CHECK (state IN ('ready', 'suspect', 'down', 'cordoned', 'draining', 'burn_in')),
    reason      text,
    task_queue  text,
    agent_addr  text,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX nodes_block ON nodes (block_id);

CREATE TABLE jobs (
    job_id            text PRIMARY KEY,
    team              text NOT NULL REFERENCES teams(name),
    name              text,
    priority_class    text NOT NULL
                      CHECK (priority_class IN ('prod-serving', 'prod-batch', 'research', 'preemptible')),
    gpu_type          text NOT NULL REFERENCES gpu_types(name),
    replicas          integer NOT NULL CHECK (replicas >= 1),
    gpus_per_replica  integer NOT NULL CHECK (gpus_per_replica BETWEEN 1 AND 8),
    spec              jsonb NOT NULL,
    state             text NOT NULL DEFAULT 'QUEUED'
                      CHECK (state IN ('QUEUED', 'STARTING', 'RUNNING', 'PREEMPTING', 'CANCELLING',
                                       'SUCCEEDED', 'FAILED', 'CANCELLED', 'TIMED_OUT')),
    attempt           integer NOT NULL DEFAULT 1 CHECK (attempt >= 1),
    submitted_at      timestamptz NOT NULL DEFAULT now(),   -- original submit time, kept across attempts
    queued_at         timestamptz NOT NULL DEFAULT now(),   -- this attempt's enqueue time
    front_of_class    boolean NOT NULL DEFAULT false,       -- re-queued after a failure not its own
    started_at        timestamptz,
    finished_at       timestamptz,
    max_runtime_s     double precision NOT NULL CHECK (max_runtime_s > 0),
    extensions        integer NOT NULL DEFAULT 0,
    last_checkpoint   text,
    last_checkpoint_at timestamptz,
    preemptions       integer NOT NULL DEFAULT 0,
    preempted_at      timestamptz[] NOT NULL DEFAULT '{}',
    failed_attempts   integer NOT NULL DEFAULT 0,
    exit_code         integer,
    submitted_by      text NOT NULL,
    workflow_started  boolean NOT NULL DEFAULT false,
    -- published by each placement cycle (changed rows only), read by the API
    queue_position    integer,
    pending_reason    text,
    pending_detail    text,
    expected_start    timestamptz,
    updated_at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX jobs_team_state ON jobs (team, state);
CREATE INDEX jobs_state ON jobs (state) WHERE state NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'TIMED_OUT');

-- Every job state change writes one row here in the same transaction (invariant 7).
CREATE TABLE job_events (
    id          bigserial PRIMARY KEY,
    job_id      text NOT NULL REFERENCES jobs(job_id),
    attempt     integer NOT NULL,
    event       text NOT NULL,
    from_state  text,
    to_state    text,
    reason      text,
    detail      jsonb NOT NULL DEFAULT '{}',
    actor       text NOT NULL,
    at          timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX job_events_job ON job_events (job_id, id);

-- The fencing row (DESIGN.md, Leadership).
CREATE TABLE leader (
    scope       text PRIMARY KEY,
    epoch       bigint NOT NULL CHECK (epoch >= 1),
    holder      text NOT NULL,
    expires_at  timestamptz NOT NULL,
    task_queue  text NOT NULL,
    grpc_addr   text NOT NULL,
    acquired_at timestamptz NOT NULL DEFAULT now()
);

-- One lease per replica (rank) on one node; a live lease owns its GPUs' allocation rows.
CREATE TABLE leases (
    lease_id       text PRIMARY KEY,
    job_id         text NOT NULL REFERENCES jobs(job_id),
    attempt        integer NOT NULL,
    rank           integer NOT NULL,
    node_id        text NOT NULL REFERENCES nodes(node_id),
    gpu_indices    integer[] NOT NULL,
    epoch          bigint NOT NULL,
    state          text NOT NULL DEFAULT 'live' CHECK (state IN ('live', 'released')),
    created_at     timestamptz NOT NULL DEFAULT now(),
    released_at    timestamptz,
    release_reason text,
    UNIQUE (job_id, attempt, rank)
);
CREATE INDEX leases_live_node ON leases (node_id) WHERE state = 'live';
CREATE INDEX leases_job ON leases (job_id, attempt);

-- Invariant 1: a GPU belongs to at most one live lease. Rows exist only while
-- the lease is live; each carries its own borrowed flag.
CREATE TABLE allocations (
    node_id      text NOT NULL REFERENCES nodes(node_id),
    gpu_index    integer NOT NULL CHECK (gpu_index >= 0),
    lease_id     text NOT NULL REFERENCES leases(lease_id),
    job_id       text NOT NULL REFERENCES jobs(job_id),
    team         text NOT NULL REFERENCES teams(name),
    gpu_type     text NOT NULL REFERENCES gpu_types(name),
    borrowed     boolean NOT NULL,
    allocated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (node_id, gpu_index)
);
CREATE INDEX allocations_team ON allocations (team, gpu_type, borrowed);
CREATE INDEX allocations_lease ON allocations (lease_id);

-- Invariant 7: who did what and why, written in the same transaction as the change.
CREATE TABLE audit (
    id       bigserial PRIMARY KEY,
    at       timestamptz NOT NULL DEFAULT now(),
    actor    text NOT NULL,
    action   text NOT NULL,
    subject  text NOT NULL,
    reason   text,
    detail   jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX audit_subject ON audit (subject, id);

-- IETF Idempotency-Key draft: the first response is stored and replayed.
CREATE TABLE idempotency_keys (
    principal      text NOT NULL,
    key            text NOT NULL,
    method         text NOT NULL,
    path           text NOT NULL,
    request_hash   text NOT NULL,
    status         text NOT NULL CHECK (status IN ('in_flight', 'done')),
    response_code  integer,
    response_body  jsonb,
    created_at     timestamptz NOT NULL DEFAULT now(),
    expires_at     timestamptz NOT NULL,
    PRIMARY KEY (principal, key)
);
CREATE INDEX idempotency_expiry ON idempotency_keys (expires_at);

-- The change sequence the leader reads incrementally (DESIGN.md, Placement):
-- triggers append one row per change to the tables placement cares about.
CREATE TABLE changes (
    seq      bigserial PRIMARY KEY,
    kind     text NOT NULL,     -- 'job', 'node', 'allocation', 'quota'
    subject  text NOT NULL,     -- job_id, node_id, 'node_id/gpu', 'team/gpu_type'
    op       text NOT NULL,     -- INSERT, UPDATE, DELETE
    at       timestamptz NOT NULL DEFAULT now()
);

CREATE FUNCTION record_change() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    subj text;
    r record;
BEGIN
    IF TG_OP = 'DELETE' THEN r := OLD; ELSE r := NEW; END IF;
    IF TG_TABLE_NAME = 'jobs' THEN
        -- placement cares about state, shape and checkpoint changes, not published positions
        IF TG_OP = 'UPDATE' AND NEW.state IS NOT DISTINCT FROM OLD.state
           AND NEW.attempt = OLD.attempt AND NEW.max_runtime_s = OLD.max_runtime_s
           AND NEW.last_checkpoint_at IS NOT DISTINCT FROM OLD.last_checkpoint_at THEN
            RETURN NULL;
        END IF;
        subj := r.job_id;
    ELSIF TG_TABLE_NAME = 'nodes' THEN
        subj := r.node_id;
    ELSIF TG_TABLE_NAME = 'allocations' THEN
        subj := r.node_id || '/' || r.gpu_index;
    ELSIF TG_TABLE_NAME = 'quotas' THEN
        subj := r.team || '/' || r.gpu_type;
    END IF;
    INSERT INTO changes (kind, subject, op) VALUES (rtrim(TG_TABLE_NAME, 's'), subj, TG_OP);
    RETURN NULL;
END $$;

CREATE TRIGGER jobs_changes AFTER INSERT OR UPDATE OR DELETE ON jobs
    FOR EACH ROW EXECUTE FUNCTION record_change();
CREATE TRIGGER nodes_changes AFTER INSERT OR UPDATE OR DELETE ON nodes
    FOR EACH ROW EXECUTE FUNCTION record_change();
CREATE TRIGGER allocations_changes AFTER INSERT OR UPDATE OR DELETE ON allocations
    FOR EACH ROW EXECUTE FUNCTION record_change();
CREATE TRIGGER quotas_changes AFTER INSERT OR UPDATE OR DELETE ON quotas
    FOR EACH ROW EXECUTE FUNCTION record_change();
