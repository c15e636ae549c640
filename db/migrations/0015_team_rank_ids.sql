-- Each team's number for the user its ranks run as (docs/security.md, "Ranks on one node").
-- A node agent runs a team's ranks as uid and gid agent_team_uid_base + rank_id, so two
-- teams' ranks on one node cannot read each other's work dirs, checkpoints or
-- /proc/<pid>/environ, nor signal each other. The store assigns the number once, for the
-- team's life: every node must agree on it (a checkpoint on shared storage written by one
-- attempt is read by the next, on other nodes), and a number is never reused for another
-- team. Existing teams are numbered in the order Postgres reads them.
ALTER TABLE teams ADD COLUMN rank_id integer GENERATED ALWAYS AS IDENTITY;
ALTER TABLE teams ADD CONSTRAINT teams_rank_id_key UNIQUE (rank_id);
