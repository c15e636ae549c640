"""The Temporal activities of the control plane (the node agent's are in worker_agent)."""
