-- Each job's number for the user its ranks run as (docs/security.md, "Ranks on one node").
-- A node agent runs a job's ranks as uid agent_rank_id_base + jobs.rank_id and gid
-- agent_rank_id_base + teams.rank_id, so two jobs on one node, of one team or of two,
-- cannot read each other's work dirs, checkpoints or /proc/<pid>/environ, nor signal each
-- other; a team's jobs still share a group. The number is the job's for its life (every
-- attempt, on every node, owns its checkpoints) and is never reused.
--
-- Jobs are numbered from 1,000,000 and teams below it, so a job's uid is never a number a
-- team's user had before this migration (ranks ran as agent_rank_id_base + teams.rank_id):
-- no job can own another team's older files. Existing jobs are numbered in the order
-- Postgres reads them.
ALTER TABLE teams ALTER COLUMN rank_id SET MAXVALUE 999999;
ALTER TABLE jobs ADD COLUMN rank_id bigint GENERATED ALWAYS AS IDENTITY (START WITH 1000000 MINVALUE 1000000);
ALTER TABLE jobs ADD CONSTRAINT jobs_rank_id_key UNIQUE (rank_id);
