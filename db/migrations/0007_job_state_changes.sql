-- The job state table (placement/lifecycle.py, TRANSITIONS) mirrored in Postgres, the last
-- line of defence (DESIGN.md, Job lifecycle): a state change with no edge is refused.
-- tests/foundation/test_job_transitions.py keeps these rows equal to the table's (from, to) pairs.

CREATE TABLE job_state_changes (
    from_state text NOT NULL,
    to_state   text NOT NULL,
    PRIMARY KEY (from_state, to_state)
);

INSERT INTO job_state_changes (from_state, to_state) VALUES
    ('CANCELLING', 'CANCELLED'),
    ('CANCELLING', 'SUCCEEDED'),
    ('PREEMPTING', 'CANCELLED'),
    ('PREEMPTING', 'CANCELLING'),
    ('PREEMPTING', 'QUEUED'),
    ('PREEMPTING', 'SUCCEEDED'),
    ('PREEMPTING', 'TIMED_OUT'),
    ('QUEUED', 'CANCELLED'),
    ('QUEUED', 'FAILED'),
    ('QUEUED', 'STARTING'),
    ('RUNNING', 'CANCELLED'),
    ('RUNNING', 'CANCELLING'),
    ('RUNNING', 'FAILED'),
    ('RUNNING', 'PREEMPTING'),
    ('RUNNING', 'QUEUED'),
    ('RUNNING', 'SUCCEEDED'),
    ('RUNNING', 'TIMED_OUT'),
    ('STARTING', 'CANCELLED'),
    ('STARTING', 'CANCELLING'),
    ('STARTING', 'FAILED'),
    ('STARTING', 'PREEMPTING'),
    ('STARTING', 'QUEUED'),
    ('STARTING', 'RUNNING');

CREATE FUNCTION check_job_state_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- test fixtures that set up a state directly say so for their transaction
    IF current_setting('gpufleet.unchecked_state_changes', true) = 'on' THEN
        RETURN NEW;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM job_state_changes WHERE from_state = OLD.state AND to_state = NEW.state) THEN
        RAISE EXCEPTION 'job %: % -> % is not an edge of the job state table', OLD.job_id, OLD.state, NEW.state
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER jobs_state_change BEFORE UPDATE OF state ON jobs
    FOR EACH ROW WHEN (OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION check_job_state_change();
