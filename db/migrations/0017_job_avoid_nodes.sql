-- The nodes a job's failed attempts failed on first (docs/design.md, Placement, "A failed
-- attempt's node"): the failing rank's node, as its agent's report names it (the first to
-- exit non-zero by itself, else the first lost, fenced or refused). The job's next attempts
-- are placed elsewhere when free capacity allows: a node whose fault no health check sees
-- (a GPU that fails CUDA's init, a broken library, a missing mount) otherwise takes every
-- attempt, as its GPUs are free again the moment the attempt ends, and the job is failed as
-- "caused by the job". The newest 8 are kept. Adding a column with a constant default
-- rewrites no row.
ALTER TABLE jobs ADD COLUMN avoid_nodes text[] NOT NULL DEFAULT '{}';
