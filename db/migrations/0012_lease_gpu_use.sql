-- What a lease's GPUs are really doing (docs/design.md, Observability). Agents report each
-- running lease's mean SM use in heartbeats; the leader writes it here every gpu_use_flush_s,
-- and idle_since when the use stayed below idle_gpu_util_pct (NULL while the lease is in use).
-- Observations, not decisions: no allocation reads them, so they carry no epoch.
ALTER TABLE leases
    ADD COLUMN gpu_util real,
    ADD COLUMN gpu_util_at timestamptz,
    ADD COLUMN idle_since timestamptz;
