"""The health monitor's Prometheus metrics (names start with ``gpufleet_``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

FAILURE_TO_RESTART = Histogram(
    "gpufleet_failure_to_restart_seconds",
    "From a node failure (last heartbeat of a lost node, fault report, hang) to the job RUNNING again",
    ["cause"],
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600),
)
NODE_TRANSITIONS = Counter(
    "gpufleet_node_transitions_total", "Node state changes written", ["from_state", "to_state", "event"]
)
NODES = Gauge("gpufleet_nodes", "Nodes per health state (leader's view)", ["state"])
RECOVERIES = Counter("gpufleet_gang_recoveries_total", "Jobs ended by a node failure and re-queued", ["cause"])
RECONCILE = Counter("gpufleet_reconciliation_total", "Reconciliation actions", ["action"])
HOT_SPARES = Gauge("gpufleet_hot_spare_nodes", "Nodes held free as hot spares for restarts of large gangs")
HEALTH_GUARD = Gauge(
    "gpufleet_health_guard_engaged",
    "1 while the mass-silence guard holds (so many nodes are silent at once that none is marked down for it)",
)
SILENT_NODES = Gauge(
    "gpufleet_silent_nodes", "Nodes in service the leader has not heard for suspect_after_s (the guard's census)"
)
