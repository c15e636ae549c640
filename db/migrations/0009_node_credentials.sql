-- Per-node credentials issued (and revoked) by an admin, instead of being derived from a
-- shared secret: only a SHA-256 of each credential is stored; control checks an agent's stream
-- against it. One credential per node: issuing again rotates it.
CREATE TABLE node_credentials (
    node_id            text PRIMARY KEY REFERENCES nodes(node_id) ON DELETE CASCADE,
    credential_sha256  text NOT NULL,
    issued_at          timestamptz NOT NULL DEFAULT now(),
    issued_by          text NOT NULL,
    revoked_at         timestamptz,
    revoked_by         text
);
