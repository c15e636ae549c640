"""The `gpufleet` command: platform processes, database, benchmarks, simulator and the user CLI.

Each subcommand imports its implementation lazily so `gpufleet --help` stays fast
and a missing optional piece never breaks the others.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

import typer

app = typer.Typer(help="gpufleet: scheduler and control plane for a shared GPU cluster", no_args_is_help=True)
bench_app = typer.Typer(help="benchmarks that print JSON (medians and ratios against a same-run baseline)")
app.add_typer(bench_app, name="bench")


def _call(module: str, func: str, **kwargs: Any) -> Any:
    return getattr(importlib.import_module(module), func)(**kwargs)


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")


@bench_app.command("placement")
def bench_placement(
    gpus: int = typer.Option(24_000, help="cluster size in GPUs (8 per node, 32 nodes per block)"),
    cycles: int = typer.Option(1000, help="placement cycles to run with churn"),
    queue: int = typer.Option(50_000, help="queued jobs at the start"),
    baseline_cycles: int = typer.Option(50, help="cycles of the naive full-rescan baseline"),
    seed: int = typer.Option(1),
    as_json: bool = typer.Option(True, "--json/--no-json", help="print one JSON object"),
) -> None:
    """Placement cycle time at cluster scale, against a naive full-rescan baseline."""
    result = _call(
        "cli.bench_placement", "run", gpus=gpus, cycles=cycles, queue=queue, baseline_cycles=baseline_cycles, seed=seed
    )
    _print_json(result)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
