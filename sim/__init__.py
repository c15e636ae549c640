"""gpufleet's cluster simulator: the ``placement`` engine the live leader runs, driven by a
discrete-event loop over a generated or replayed workload (docs/design.md, Placement: "the same
engine drives the simulator, so the policy measured offline is the policy that runs").

Modules:

* ``sim.workload``: the values a run consumes (``ClusterSpec``, ``TeamSpec``, ``SimJob``,
  ``Workload``);
* ``sim.seed``: the seed workload (24,000 GPUs, ~40,000 submissions/day), deterministic
  from a seed;
* ``sim.traces``: trace replay (generic CSV, Philly-style, Alibaba GPU 2023 pods) and a
  cluster from a host-to-switch topology CSV;
* ``sim.failures``: GPU/node fault schedule (per GPU-hour rate, repair, burn-in);
* ``sim.core``: the event loop (``Simulation``), one policy at a time;
* ``sim.metrics``: what a run measures; ``sim.costs``: the SIGTERM preemption cost model
  reported beside today's accounting; ``sim.run``: several policies on the same workload
  and faults, the JSON and the acceptance checks (with their margins); ``sim.seeds``:
  several seeds, min/median/max per metric; ``sim.report``: markdown tables, plots.

Use::

    from sim.seed import SeedConfig, seed_workload
    from sim.run import run_policies, to_json
    report = run_policies(seed_workload(SeedConfig(days=1, seed=1)))   # ours, fifo, kueue-like, slurm-like
    print(to_json(report))

or ``gpufleet sim --workload seed --days 1 --json out.json --plots out/`` (cli/sim_cmd.py).
``sim`` imports ``placement`` and the standard library only (matplotlib for plots).
"""
