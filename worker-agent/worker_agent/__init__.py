"""The gpufleet node agent (docs/design.md, Processes and Health).

Kept import-light on purpose: each rank's supervisor (``python -m
worker_agent.supervisor``) and training scripts (``worker_agent.jobhelper``)
import from this package, so nothing heavy (temporalio, grpc) loads here.

Modules:
  statefiles  the node's state dir: file layout, atomic JSON, boot id, pid identity
  supervisor  the per-rank supervisor process (exit codes, stop, 15-min self-fence)
  runtime     process and container runtimes: argv and the rank's environment
  nvml        GPU health backends: real (nvidia-ml-py) and simulated with fault injection
  node        NodeAgent: one node's StartTask/StopTask activities, epochs, re-adoption
  link        the agent side of the gRPC stream to the control leader
  log_http    rank logs over HTTP, the contract the API proxies
  agent       run_agent(): Temporal workers + links + log server for one or many nodes
  jobhelper   for training scripts: checkpoint on SIGTERM, async checkpoints, steps, resume
"""
