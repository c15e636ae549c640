-- The health monitor reads the recent failed attempts each minute to find nodes that fail
-- the jobs of several teams, jobs that then run elsewhere (store/node_blame.py); job_events
-- is indexed by job only. Partial: only attempt_failed rows, a small share of the table.
CREATE INDEX job_events_attempt_failed_at ON job_events (at) WHERE event = 'attempt_failed';
