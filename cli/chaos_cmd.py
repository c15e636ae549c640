"""`gpufleet chaos`: a fault-injection run on its own embedded stack, judged by an independent checker.

Mounted by cli/main.py as ``app.command("chaos")(chaos)``.

    gpufleet chaos --minutes 3 --seed 7 --json chaos.json     # report to a file, summary printed
    gpufleet chaos --minutes 1 --seed 7 --json -              # report on stdout, no summary
    gpufleet chaos --faults leader_kill,postgres_restart      # only these kinds
    gpufleet chaos --ha --minutes 10                          # Postgres standby; adds postgres_failover

Exit status 0 when every invariant holds and nothing was left running, 1 otherwise, 2 on a
setup problem. Progress goes to stderr. The run is in chaos/ (chaos/run.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer


def chaos(
    minutes: float = typer.Option(3.0, "--minutes", min=0.1, max=120, help="workload and faults for this long"),
    seed: int = typer.Option(1, "--seed", help="seeds the fault schedule and the workload"),
    json_out: str | None = typer.Option(None, "--json", help="write the report JSON here ('-': stdout, no summary)"),
    settle_s: float = typer.Option(90.0, "--settle", help="after the faults, wait at most this long for jobs to end"),
    faults: str = typer.Option("", "--faults", help="comma-separated fault kinds to inject (default: all)"),
    agents: int = typer.Option(2, "--agents", min=1, help="agent processes sharing the simulated fleet"),
    blocks: int = typer.Option(2, "--blocks", min=1),
    nodes_per_block: int = typer.Option(4, "--nodes-per-block", min=1),
    job_workers: int = typer.Option(0, "--job-workers", min=0, help="control_job_workers of each control process"),
    test_faults: str = typer.Option(
        "", "--test-faults", help="a deliberately broken build: ack_before_durable, skip_epoch_check"
    ),
    keep: bool = typer.Option(False, "--keep", help="keep the run's state dir and logs"),
    ha: bool = typer.Option(
        False, "--ha", help="Postgres as a primary and a synchronous standby; adds the postgres_failover fault"
    ),
) -> None:
    """Fault injection on its own stack (two controls, agents, the API), then an independent check."""
    import asyncio

    from chaos.run import ChaosOptions, run_chaos, summary
    from chaos.stack import Layout
    from common.temporal import hard_exit

    kinds = tuple(k.strip() for k in faults.split(",") if k.strip()) or None
    layout = Layout(
        blocks=blocks,
        nodes_per_block=nodes_per_block,
        agents=agents,
        job_workers=job_workers,
        test_faults=tuple(t.strip() for t in test_faults.split(",") if t.strip()),
        ha=ha,
    )
    opts = ChaosOptions(minutes=minutes, seed=seed, settle_s=settle_s, layout=layout, kinds=kinds, keep=keep)
    rep = asyncio.run(run_chaos(opts))
    text = json.dumps(rep, indent=2, default=str)
    if json_out == "-":
        sys.stdout.write(text + "\n")
    else:
        if json_out:
            Path(json_out).write_text(text + "\n")
        summary(rep)
    hard_exit(0 if rep["ok"] else 1)  # docs/design.md, Known pitfalls: temporalio at interpreter exit
