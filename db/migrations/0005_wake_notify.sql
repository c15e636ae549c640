-- Wake the placement cycle when something it cares about happens (DESIGN.md, Placement:
-- "a cycle runs every second and when woken: new job, job ended, node change").
-- The leader LISTENs on gpufleet_wake and signals the PlacementWorkflow (coalesced).
-- Notifications with equal payloads in one transaction are delivered once.

CREATE FUNCTION notify_wake() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_TABLE_NAME = 'jobs' THEN
        IF TG_OP = 'INSERT'
           OR (NEW.state IS DISTINCT FROM OLD.state
               AND NEW.state IN ('QUEUED', 'SUCCEEDED', 'FAILED', 'CANCELLED', 'TIMED_OUT'))
           OR NEW.max_runtime_s IS DISTINCT FROM OLD.max_runtime_s THEN
            PERFORM pg_notify('gpufleet_wake', 'job');
        END IF;
    ELSE
        PERFORM pg_notify('gpufleet_wake', TG_TABLE_NAME);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER jobs_wake AFTER INSERT OR UPDATE ON jobs
    FOR EACH ROW EXECUTE FUNCTION notify_wake();
CREATE TRIGGER nodes_wake AFTER INSERT OR UPDATE ON nodes
    FOR EACH STATEMENT EXECUTE FUNCTION notify_wake();
CREATE TRIGGER quotas_wake AFTER INSERT OR UPDATE ON quotas
    FOR EACH STATEMENT EXECUTE FUNCTION notify_wake();
