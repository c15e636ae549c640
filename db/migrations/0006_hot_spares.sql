-- Hot spares the leader holds for large gangs (DESIGN.md, Placement: "a hot-spare pool is kept
-- free for restarts of large gangs"). The pool lives in the leader's memory; each placement cycle
-- publishes it here when it changes (epoch-checked), so the API can show which nodes are held,
-- and for which job, while the control plane is down. A table of its own, not a column of
-- nodes: writes here must not feed the change sequence or wake the cycle.
CREATE TABLE hot_spares (
    node_id     text PRIMARY KEY REFERENCES nodes(node_id) ON DELETE CASCADE,
    job_id      text NOT NULL,
    epoch       bigint NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX hot_spares_job ON hot_spares (job_id);
