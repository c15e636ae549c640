"""`gpufleet sim`: the cluster simulator (sim/) over the seed workload or a trace.

Mounted by cli/main.py as ``app.command("sim")(sim)``; also ``python -m cli.sim_cmd``.

    gpufleet sim --workload seed --days 1 --seed 1 --json out.json --plots out/
    gpufleet sim --workload seed --days 1 --policies ours
    gpufleet sim --workload seed --days 1 --seeds 1-5 --json seeds.json --table seeds.md
    gpufleet sim --workload trace.csv --format generic --days 2
    gpufleet sim --workload openb_pod_list_default.csv --format alibaba \\
        --trace-start 10000000 --arrival-scale 20 --size-scale 8 --teams 8 --days 1

All four policies by default (ours, fifo, kueue-like, slurm-like: presets of
placement.PRESETS), on the same workload and the same fault schedule. The JSON holds one
object per policy (wall-clock figures under each policy's ``timing``); ``--plots`` writes
allocation.png and wait_cdf.png; ``--table`` writes the side-by-side markdown table.
With ``--seeds`` the JSON holds ``runs`` (each seed's report, as above), ``across_seeds``
(each policy's min/median/max per metric, sim/seeds.py; ``paired``: each policy minus the
first one named, run by run) and the table shows min / median / max of the headline
metrics, then the paired differences; plots go to ``<plots>/seed-N/``.
This module parses arguments, shows progress and prints; the simulation is in sim/.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer


def sim(
    workload: str = typer.Option("seed", "--workload", help="'seed' or a trace CSV file"),
    fmt: str = typer.Option("generic", "--format", help="trace format: generic | philly | alibaba"),
    days: float | None = typer.Option(
        None, "--days", help="simulated days measured (seed: default 1; trace: default the whole trace)"
    ),
    seed: int = typer.Option(1, "--seed", help="seed for the workload, faults and trace draws"),
    seeds: str | None = typer.Option(
        None,
        "--seeds",
        help="run several seeds (1-5, 1,3,7 or 1-3,7; replaces --seed): each seed's report, each"
        " policy's min/median/max per metric, and each policy minus the first one named, run by run",
    ),
    policies: str = typer.Option(
        "ours,fifo,kueue-like,slurm-like",
        "--policies",
        help="comma-separated: ours, fifo, kueue-like, slurm-like; try a change with name:field=value"
        " (fields of placement.Policy), e.g. ours:preemption_protect_s=600",
    ),
    json_out: Path | None = typer.Option(None, "--json", help="write the report JSON here"),
    plots: Path | None = typer.Option(None, "--plots", help="write allocation.png and wait_cdf.png here"),
    table: Path | None = typer.Option(None, "--table", help="write the side-by-side markdown table here"),
    warmup_h: float | None = typer.Option(
        None, "--warmup-h", help="simulated hours before the measured window (seed default 6, trace 0)"
    ),
    failure_rate: float = typer.Option(2e-5, "--failure-rate", help="GPU/node faults per GPU-hour (0: none)"),
    fault_draws: str = typer.Option(
        "0",
        "--fault-draws",
        help="fault schedules from the same model on the same workload (0: the seed's own; 1-2 or"
        " 0-2: others, each run like another seed): how much of a figure is which jobs the faults"
        " happen to hit",
    ),
    load_scale: float = typer.Option(1.0, "--load-scale", help="seed: multiply every job's run time"),
    one_block_wait: float = typer.Option(
        300.0,
        "--one-block-wait",
        help="seed: seconds a medium job asking for one block waits for it before it takes the fewest"
        " blocks it can (Slurm's max_switch_wait); -1: one block is a hard limit",
    ),
    nodes: int | None = typer.Option(None, "--nodes", help="cluster nodes (default 3,000)"),
    block_nodes: int = typer.Option(32, "--block-nodes", help="nodes per network block"),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node"),
    topology: Path | None = typer.Option(
        None, "--topology", help="cluster from a host-to-switch CSV (ip, DSW, PSW, ASW): one block per ToR"
    ),
    arrival_scale: float = typer.Option(1.0, "--arrival-scale", help="trace: x submissions per hour"),
    size_scale: float = typer.Option(1.0, "--size-scale", help="trace: x GPUs per job"),
    duration_scale: float = typer.Option(1.0, "--duration-scale", help="trace: x run time per job"),
    trace_start: float | None = typer.Option(
        None, "--trace-start", help="trace: window start in trace seconds (default: first submission)"
    ),
    teams: int = typer.Option(8, "--teams", help="trace: number of teams (equal guarantees summing to the cluster)"),
    team_assign: str = typer.Option(
        "column", "--team-assign", help="trace: column (the trace's team/vc column, else hash) | hash | round-robin"
    ),
    default_class: str = typer.Option("research", "--default-class", help="trace: class of jobs without one"),
    times_from: Path | None = typer.Option(
        None,
        "--times-from",
        help="alibaba trace without times (openb_pod_list_multigpu50.csv): take each pod's times from its"
        " namesake in this pod list, or from a GPU pod of it drawn by the seed",
    ),
    check_invariants: int = typer.Option(
        0,
        "--check-invariants",
        help="check plan and state invariants every N cycles, and that the plan equals deciding"
        " every job afresh (0: off; slow)",
    ),
    cycle_interval: float = typer.Option(1.0, "--cycle-interval", help="at most one cycle per this many simulated s"),
    start_latency: float = typer.Option(
        0.0,
        "--start-latency",
        min=0.0,
        help="simulated s from placement to running ranks (image pull, checkpoint load): GPUs held, no work;"
        " every restart pays it again",
    ),
    spread_slowdown: float = typer.Option(
        0.0,
        "--spread-slowdown",
        min=0.0,
        help="a gang placed in more blocks than its max_blocks runs this much slower (0.1: 10% more time);"
        " the extra GPU time counts as lost",
    ),
    drain_h: float = typer.Option(
        48.0,
        "--drain-h",
        min=0.0,
        help="after the window, run on without arrivals up to this many simulated hours until every job"
        " submitted in it has started, so its wait is measured, not cut off at the window's end (0: off)",
    ),
    quiet: bool = typer.Option(False, "--quiet", help="no progress bar or table"),
) -> None:
    """Simulate policies side by side on the seed workload or a trace (same workload, same faults)."""
    from rich.console import Console

    from sim.core import SimOptions
    from sim.failures import FailureModel
    from sim.report import markdown_table, seeds_table, write_plots
    from sim.run import DEFAULT_POLICIES, resolve_policy, to_json
    from sim.seed import SeedConfig, seed_workload
    from sim.seeds import across_seeds, parse_seeds
    from sim.traces import TraceError, TraceOptions, load_topology_csv, load_trace
    from sim.workload import ClusterSpec

    console = Console(stderr=True)
    try:
        seed_list = parse_seeds(seeds) if seeds is not None else [seed]
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--seeds") from None
    try:
        draw_list = parse_seeds(fault_draws)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--fault-draws") from None
    names = [p.strip() for p in policies.split(",") if p.strip()] or list(DEFAULT_POLICIES)
    for n in names:
        try:
            resolve_policy(n)
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--policies") from None
    if topology is not None:
        cluster = load_topology_csv(topology, gpus_per_node)
    else:
        cluster = ClusterSpec.uniform(nodes or 3000, block_nodes, gpus_per_node)
    if workload == "seed" and topology is not None:
        raise typer.BadParameter("the seed workload builds its own uniform cluster", param_hint="--topology")

    def build(run_seed: int):
        try:
            if workload == "seed":
                wl = seed_workload(
                    SeedConfig(
                        days=days if days is not None else 1.0,
                        seed=run_seed,
                        warmup_h=warmup_h if warmup_h is not None else 6.0,
                        nodes=nodes or 3000,
                        block_nodes=block_nodes,
                        gpus_per_node=gpus_per_node,
                        load_scale=load_scale,
                        one_block_wait_s=one_block_wait if one_block_wait >= 0 else None,
                    )
                )
            else:
                path = Path(workload)
                if not path.is_file():
                    raise typer.BadParameter(f"no such file: {workload} (or use 'seed')", param_hint="--workload")
                wl = load_trace(
                    path,
                    cluster,
                    TraceOptions(
                        format=fmt,
                        arrival_scale=arrival_scale,
                        size_scale=size_scale,
                        duration_scale=duration_scale,
                        start=trace_start,
                        days=days,
                        warmup_h=warmup_h or 0.0,
                        teams=teams,
                        team_assign=team_assign,
                        default_class=default_class,
                        seed=run_seed,
                        times_from=str(times_from) if times_from is not None else None,
                        gpu_type=cluster.gpu_types()[0],
                    ),
                )
        except TraceError as e:
            console.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from None

        summary = wl.summary()
        if not quiet:
            console.print(
                f"[bold]{summary['name']}[/bold]: {summary['jobs_measured']:,} jobs in {summary['days']} day(s)"
                f" (+{summary['warmup_h']} h warm-up), {summary['gpus']:,} GPUs in {summary['blocks']} blocks,"
                f" offered load {summary['offered_load']}"
            )
        return wl

    failures = FailureModel(rate_per_gpu_hour=failure_rate) if failure_rate > 0 else None
    options = SimOptions(
        cycle_interval_s=cycle_interval,
        check_every=check_invariants,
        start_latency_s=start_latency,
        spread_slowdown=spread_slowdown,
        drain_s=drain_h * 3600.0,
    )

    # a run per seed and fault draw, keyed by the seed alone while every draw is the seed's own
    reports: dict[int | str, dict] = {}
    for run_seed in seed_list:
        wl = build(run_seed)
        for draw in draw_list:
            key: int | str = run_seed if draw_list == [0] else f"{run_seed}/d{draw}"
            label = f"seed {key} " if len(seed_list) * len(draw_list) > 1 else ""
            reports[key] = _run_one(wl, names, run_seed, failures, draw, options, console, quiet, label)

    if len(reports) == 1:
        report = next(iter(reports.values()))
        text = to_json(report)
        md = markdown_table(report)
    else:
        # each run's own report, and each policy's min/median/max per metric over them
        report = {
            "seeds": seed_list,
            "fault_draws": draw_list,
            "across_seeds": across_seeds(reports),
            "runs": {str(k): v for k, v in reports.items()},
        }
        text = to_json(report)
        md = seeds_table(report["across_seeds"])
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text)
    if table is not None:
        table.parent.mkdir(parents=True, exist_ok=True)
        table.write_text(md)
    if plots is not None:
        for run_key, rep in reports.items():
            where = plots if len(reports) == 1 else plots / f"seed-{str(run_key).replace('/', '-')}"
            for p in write_plots(rep, where):
                if not quiet:
                    console.print(f"plot: {p}")
    if not quiet:
        console.print(md, markup=False, highlight=False, soft_wrap=True)
        if len(reports) == 1:
            chk = report.get("checks") or {}
            if chk:
                console.print({k: v for k, v in chk.items() if not isinstance(v, dict)})
        else:
            console.print(report["across_seeds"]["checks"])
    if json_out is None:
        sys.stdout.write(text)
    sys.stdout.flush()


def _run_one(
    wl, names: list[str], seed: int, failures, fault_draw: int, options, console, quiet: bool, label: str
) -> dict:
    """Every policy over one seed's workload and faults, with a progress bar per policy."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from sim.run import run_policies

    progress = Progress(
        TextColumn("{task.description:<12}"),
        BarColumn(),
        TextColumn("{task.percentage:>5.1f}%"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=quiet,
    )
    tasks = {n: progress.add_task(label + n, total=1.0, start=False) for n in names}

    def on_start(name: str) -> None:
        progress.start_task(tasks[name])

    def on_progress(name: str, frac: float) -> None:
        progress.update(tasks[name], completed=frac)

    def on_done(name: str, res: dict) -> None:
        progress.update(tasks[name], completed=1.0)
        progress.stop_task(tasks[name])

    with progress:
        return run_policies(
            wl,
            names,
            seed=seed,
            failures=failures,
            fault_draw=fault_draw,
            options=options,
            on_start=on_start,
            on_progress=on_progress,
            on_done=on_done,
        )


def main() -> None:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(sim)
    app(prog_name="gpufleet sim")


if __name__ == "__main__":
    main()
