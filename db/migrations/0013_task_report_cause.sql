-- Why a rank ended, for the user (docs/design.md, Reports): an agent's terminal report carries
-- the signal that killed the rank and the last lines of its stderr (at most 20 lines / 4 KiB),
-- so `status`, `explain` and GET /v1/jobs/{id} say why a job failed after its node is gone.
-- Pruning keeps the terminal reports of each job's newest attempt that did not end with 0.
ALTER TABLE task_reports
    ADD COLUMN signal integer,
    ADD COLUMN stderr_tail text;
