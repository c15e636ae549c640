-- An attempt recovered from a silent node may in fact have finished: when every rank's exit 0
-- arrives late, the job succeeds from the state its next attempt is in (placement/lifecycle.py,
-- EARLIER_SUCCESS). RUNNING and PREEMPTING -> SUCCEEDED are edges already.
INSERT INTO job_state_changes (from_state, to_state) VALUES
    ('QUEUED', 'SUCCEEDED'),
    ('STARTING', 'SUCCEEDED');
