"""The `gpufleet` command: platform processes, database, benchmarks, simulator and the user CLI.

Heavy subcommands import their implementation lazily so `gpufleet --help` stays fast.
Setup problems (bad settings, unreachable database, port in use, unwritable state
dir) end with a one-line `error: ...` and exit code 2, never a traceback.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
from typing import Any

import typer

from common.embedded import PlatformError

app = typer.Typer(
    help="gpufleet: scheduler and control plane for a shared GPU cluster",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="benchmarks that print JSON (medians and ratios against a same-run baseline)")
db_app = typer.Typer(help="database schema")
app.add_typer(bench_app, name="bench")
app.add_typer(db_app, name="db")

from cli.user_cmd import register as _register_user_commands  # noqa: E402  (the user CLI: submit, status, ...)

_register_user_commands(app)
app.command("top")(importlib.import_module("cli.top_cmd").top)  # the cluster map in the terminal

from cli.sim_cmd import sim as _sim  # noqa: E402  (imports sim/ lazily inside)

app.command("sim")(_sim)

from cli.chaos_cmd import chaos as _chaos  # noqa: E402  (imports chaos/ lazily inside)

app.command("chaos")(_chaos)


def _call(module: str, func: str, **kwargs: Any) -> Any:
    return getattr(importlib.import_module(module), func)(**kwargs)


def _run_command(module: str, func: str, args: list[str], prog: str) -> None:
    """Run a typer command function that lives in a lazily imported module."""
    sub = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    sub.command()(getattr(importlib.import_module(module), func))
    sub(args, prog_name=prog)


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def _flatten(obj: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, value) for every scalar in a benchmark's result; lists shown by length."""
    if isinstance(obj, dict):
        return [row for k, v in obj.items() for row in _flatten(v, f"{prefix}{k}.")]
    if isinstance(obj, list):
        return [(prefix[:-1], f"[{len(obj)} items]")]
    return [(prefix[:-1], str(obj))]


def _print_result(obj: Any, as_json: bool) -> None:
    """A benchmark's result: JSON (the default, what scripts and notes read) or a table."""
    if as_json:
        _print_json(obj)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("metric", "value")
    for key, value in _flatten(obj):
        table.add_row(key, value)
    Console().print(table)


def _settings():
    from pydantic import ValidationError

    from common.settings import Settings

    try:
        return Settings()
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        if not loc:  # a check across settings: its message names them
            raise PlatformError(f"invalid settings: {err['msg'].removeprefix('Value error, ')}") from e
        raise PlatformError(f"invalid setting GPUFLEET_{loc.upper()}: {err['msg']}") from e


@app.command()
def up(
    stop_jobs: bool = typer.Option(
        False, "--stop-jobs", help="on stop, also stop running jobs' ranks (by default they keep running)"
    ),
    grace: float = typer.Option(30.0, "--grace", help="with --stop-jobs: seconds from SIGTERM to SIGKILL"),
    ha: bool = typer.Option(
        False, "--ha", help="Postgres primary + synchronous standby with failover, two APIs on one port, two controls"
    ),
) -> None:
    """Bring the whole platform up on embedded defaults (Postgres, Temporal + UI, API, control, agents)."""
    from cli.up import run

    raise typer.Exit(run(_settings(), stop_jobs=stop_jobs, grace_s=grace, ha=ha))


@app.command("stop-ranks")
def stop_ranks_cmd(
    state_dir: str = typer.Option(None, "--state-dir", help="the agents' state dir (default: GPUFLEET_STATE_DIR)"),
    grace: float = typer.Option(30.0, "--grace", help="seconds from SIGTERM to SIGKILL"),
    dry_run: bool = typer.Option(False, "--dry-run", help="only say what runs"),
) -> None:
    """Stop the ranks this machine's agents started (they outlive `gpufleet up` and the agents):
    SIGTERM through their supervisors, SIGKILL after the grace. On each node with no rank
    left, the jobs' /dev/shm dirs and IPC namespaces go too, as the next agent's start would
    let them go; with none left anywhere, so do the ranks' firewall rules of the state dir."""
    from pathlib import Path

    from cli.up import describe_ranks, release_after_ranks, stop_ranks
    from worker_agent.live_ranks import live_ranks

    settings = _settings()
    where = Path(state_dir).expanduser() if state_dir else settings.state_dir
    if dry_run:
        ranks = live_ranks(where)
        print(f"{describe_ranks(ranks)} running under {where}")
        for r in ranks:
            print(f"  {r.node_id:<10} {r.lease_id}")
        return
    found, killed = stop_ranks(where, grace)
    release_after_ranks(where, settings.agent_rank_firewall_table)
    if not found:
        print(f"no rank runs under {where}")
        return
    how = f"{len(killed)} killed after {grace:g}s" if killed else "all exited"
    print(f"stopped {describe_ranks(found)} ({how})")


@db_app.command("migrate")
def db_migrate() -> None:
    """Apply pending migrations to GPUFLEET_DATABASE_URL (safe to re-run)."""
    import asyncpg

    from cli.up import redact
    from common.db import migrate

    settings = _settings()
    if not settings.database_url:
        raise PlatformError("GPUFLEET_DATABASE_URL is not set (`gpufleet up` migrates its embedded database itself)")

    async def go() -> list[str]:
        try:
            conn = await asyncpg.connect(settings.database_url, timeout=10)
        except (TimeoutError, OSError, asyncpg.PostgresError) as e:
            raise PlatformError(f"cannot reach the database at {redact(settings.database_url)}: {e}") from e
        try:
            return await migrate(conn)
        finally:
            await conn.close()

    applied = asyncio.run(go())
    print(f"applied {len(applied)} migration(s)" + (": " + ", ".join(applied) if applied else ""))


_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@app.command(context_settings=_PASSTHROUGH)
def api(ctx: typer.Context) -> None:
    """Run the REST API server (uvicorn)."""
    _run_command("cli.api_cmd", "serve", ctx.args, "gpufleet api")


@app.command(context_settings=_PASSTHROUGH)
def control(ctx: typer.Context) -> None:
    """Run a control process (Temporal worker, leadership, placement, heartbeat gRPC)."""
    _run_command("cli.control_cmd", "serve", ctx.args, "gpufleet control")


@app.command(context_settings=_PASSTHROUGH)
def agent(ctx: typer.Context) -> None:
    """Node agent: `agent run`, `agent inject-fault` (see `gpufleet agent --help`)."""
    from cli.agent_cmd import agent_app

    agent_app(ctx.args, prog_name="gpufleet agent")


@app.command("settings")
def settings_cmd(
    markdown: bool = typer.Option(False, "--markdown", help="the design doc's settings table (defaults)"),
    as_json: bool = typer.Option(False, "--json", help="the values in effect as JSON"),
    changed: bool = typer.Option(False, "--changed", help="only the settings not at their default"),
) -> None:
    """Show every setting in effect here: its value, where it came from (default, env, a
    secret's file) and its meaning. Secrets are redacted."""
    from cli.design_doc import settings_table

    if markdown:
        print(settings_table())
        return
    rows = settings_in_effect()
    if changed:
        rows = [r for r in rows if r["source"] != "default"]
    if as_json:
        _print_json(rows)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("variable", "value", "from", "meaning")
    table.columns[0].no_wrap = True
    for r in rows:
        value = r["value"] if isinstance(r["value"], str) else json.dumps(r["value"])
        where = r["source"] if r["detail"] in ("", r["variable"]) else f"{r['source']} {r['detail']}"
        table.add_row(r["variable"], value, where, r["meaning"], style=None if r["source"] == "default" else "bold")
    Console().print(table)


def _redacted(value: Any, secret: bool) -> Any:
    """A secret's value as shown: ``<redacted>`` when set (with its number of entries for a map)."""
    if not secret or value in (None, "", {}, []):
        return value
    if isinstance(value, dict):
        return f"<redacted: {len(value)} {'entry' if len(value) == 1 else 'entries'}>"
    return "<redacted>"


def settings_in_effect() -> list[dict[str, Any]]:
    """Every setting as this process reads it: variable, value (JSON; a secret redacted),
    source (``default``, ``env``, ``file``: a secret's ``GPUFLEET_X_FILE``) with its detail
    (the variable or the file), default and meaning."""
    from common.settings import SECRET_FIELDS, Settings, setting_origins

    values = _settings().model_dump(mode="json")
    defaults = Settings.model_construct().model_dump(mode="json")
    origins = setting_origins()
    rows = []
    for name, f in Settings.model_fields.items():
        secret = name in SECRET_FIELDS
        source, detail = origins[name]
        rows.append(
            {
                "name": name,
                "variable": f"GPUFLEET_{name.upper()}",
                "value": _redacted(values[name], secret),
                "source": source,
                "detail": detail,
                "default": _redacted(defaults[name], secret),
                "secret": secret,
                "meaning": f.description or "",
            }
        )
    return rows


@app.command("docs")
def docs_cmd(check: bool = typer.Option(False, "--check", help="exit 1 when a generated table is stale")) -> None:
    """Regenerate docs/design.md's tables from the code (settings, job and node states, migrations)."""
    from cli.design_doc import DESIGN, render, stale

    text = DESIGN.read_text()
    if check:
        names = stale(text)
        if names:
            print(f"docs/design.md is stale: {', '.join(names)} (run `gpufleet docs`)", file=sys.stderr)
            raise typer.Exit(1)
        print("docs/design.md is current")
        return
    DESIGN.write_text(render(text))
    print(f"rewrote the generated tables of {DESIGN}")


# options several bench commands share (one definition each, so their help stays alike)
_AS_JSON = typer.Option(True, "--json/--no-json", help="one JSON object (default), or a table of every figure")
# the simulated fleet of the takeover, node-loss and outage benches
_FLEET_BLOCKS = typer.Option(94, min=1, help="blocks of simulated nodes")
_FLEET_NODES_PER_BLOCK = typer.Option(32, min=1, help="simulated nodes (8 GPUs each) per block")
_FLEET_JOBS = typer.Option(300, min=0, help="running jobs besides the gang (1 GPU, 1 node, 2-node gangs)")
_FLEET_GANG_GPUS = typer.Option(1024, min=0, help="GPUs of the one large gang (0: none)")
_SETTING = typer.Option([], "--setting", help="KEY=VALUE (JSON or text) for a setting of the stack; repeatable")
_KEEP = typer.Option(False, help="keep the state dir and logs (their path is in the result)")


@bench_app.command("placement")
def bench_placement(
    gpus: int = typer.Option(24_000, help="cluster size in GPUs (8 per node, 32 nodes per block)"),
    cycles: int = typer.Option(1000, help="placement cycles to run with churn"),
    queue: int = typer.Option(50_000, help="queued jobs at the start"),
    baseline_cycles: int = typer.Option(50, help="cycles of the naive full-rescan baseline"),
    seed: int = typer.Option(1),
    as_json: bool = _AS_JSON,
) -> None:
    """Placement cycle time at cluster scale, against a naive full-rescan baseline."""
    result = _call(
        "bench.placement", "run", gpus=gpus, cycles=cycles, queue=queue, baseline_cycles=baseline_cycles, seed=seed
    )
    _print_result(result, as_json)


@bench_app.command("heartbeat")
def bench_heartbeat(
    nodes: int = typer.Option(3000, help="simulated nodes, each one authenticated gRPC stream"),
    seconds: float = typer.Option(10.0, help="measurement time per offered rate"),
    rates: str = typer.Option("", help="comma-separated heartbeats/s to offer (default: 600 then faster)"),
    as_json: bool = _AS_JSON,
) -> None:
    """Heartbeat ingestion by the control side: sustained rate, p99 handling time, CPU."""
    parsed = [int(r) for r in rates.split(",") if r.strip()] or None
    _print_result(_call("bench.heartbeat", "run", nodes=nodes, seconds=seconds, rates=parsed), as_json)


@bench_app.command("e2e")
def bench_e2e(
    jobs: int = typer.Option(1000, help="one-GPU jobs submitted through the API"),
    rate: float = typer.Option(50.0, help="submissions per second"),
    job_seconds: float = typer.Option(300.0, help="how long each job runs"),
    settle_s: float = typer.Option(120.0, help="wait this long at most for the last job to run"),
    baseline: bool = typer.Option(
        True, "--baseline/--no-baseline", help="also run the lean job workflow (a same-run baseline)"
    ),
    repeat: int = typer.Option(1, min=1, max=20, help="runs on fresh stacks; the run with the median p95 is reported"),
    as_json: bool = _AS_JSON,
) -> None:
    """Submit -> RUNNING latency on the embedded stack with a simulated fleet that has room."""
    from common.temporal import hard_exit

    result = _call(
        "bench.e2e", "run", jobs=jobs, rate=rate, job_seconds=job_seconds, settle_s=settle_s, baseline=baseline,
        repeat=repeat,
    )  # fmt: skip
    _print_result(result, as_json)
    hard_exit(0)


@bench_app.command("takeover")
def bench_takeover(
    blocks: int = _FLEET_BLOCKS,
    nodes_per_block: int = _FLEET_NODES_PER_BLOCK,
    jobs: int = _FLEET_JOBS,
    gang_gpus: int = _FLEET_GANG_GPUS,
    freeze_s: float = typer.Option(30.0, min=0, help="how long the leader is frozen (SIGSTOP) before it is killed"),
    observe_s: float = typer.Option(60.0, min=0, help="look on this long after the takeover"),
    agent_procs: int = typer.Option(4, min=1, help="agent processes the nodes are spread over"),
    setting: list[str] = _SETTING,
    keep: bool = _KEEP,
    shared_connections: bool = typer.Option(
        False, help="the simulated nodes of one agent process share a connection to each control (not one each)"
    ),
    as_json: bool = _AS_JSON,
) -> None:
    """A leader frozen then killed under a loaded cluster: takeover, re-linking, and nothing restarted."""
    from common.temporal import hard_exit

    overrides = _setting_overrides(setting)
    result = _call(
        "bench.takeover", "run", blocks=blocks, nodes_per_block=nodes_per_block, jobs=jobs, gang_gpus=gang_gpus,
        freeze_s=freeze_s, observe_s=observe_s, agent_procs=agent_procs, overrides=overrides, keep=keep,
        shared_connections=shared_connections,
    )  # fmt: skip
    _print_result(result, as_json)
    hard_exit(0 if result["jobs_restarted"] == 0 and result["nodes_marked_down"] == 0 else 1)


@bench_app.command("node-loss")
def bench_node_loss(
    blocks: int = _FLEET_BLOCKS,
    nodes_per_block: int = _FLEET_NODES_PER_BLOCK,
    jobs: int = _FLEET_JOBS,
    gang_gpus: int = _FLEET_GANG_GPUS,
    agent_procs: int = typer.Option(
        8, min=2, help="agent processes, each hosting a run of consecutive nodes, block after block"
    ),
    fail_procs: int = typer.Option(1, min=1, help="agent processes killed: those hosting the most running GPUs"),
    settle_s: float = typer.Option(600.0, min=1, help="wait at most this long (past down_after_s) for the restarts"),
    setting: list[str] = _SETTING,
    keep: bool = _KEEP,
    shared_connections: bool = typer.Option(
        False, help="the simulated nodes of one agent process share a connection to the control (not one each)"
    ),
    fault: str = typer.Option(
        "kill", help="kill: SIGKILL the processes (power lost); freeze: SIGSTOP them (cut off, ranks kept in memory)"
    ),
    back: str = typer.Option(
        "never",
        help="bring the processes back (thawed, or started again): never; down (once their nodes are marked"
        " down, while their jobs restart); restarted (once every hit job runs again)",
    ),
    as_json: bool = _AS_JSON,
) -> None:
    """Whole blocks of nodes die under a loaded cluster: their jobs, and only theirs, restart elsewhere."""
    from bench.node_loss import BACK, FAULTS
    from common.temporal import hard_exit

    if fault not in FAULTS:
        raise typer.BadParameter(f"{fault!r}: one of {', '.join(FAULTS)}", param_hint="--fault")
    if back not in BACK:
        raise typer.BadParameter(f"{back!r}: one of {', '.join(BACK)}", param_hint="--back")
    result = _call(
        "bench.node_loss", "run", blocks=blocks, nodes_per_block=nodes_per_block, jobs=jobs, gang_gpus=gang_gpus,
        agent_procs=agent_procs, fail_procs=fail_procs, settle_s=settle_s, overrides=_setting_overrides(setting),
        keep=keep, shared_connections=shared_connections, fault=fault, back=back,
    )  # fmt: skip
    _print_result(result, as_json)
    hard_exit(0 if result["ok"] else 1)


@bench_app.command("outage")
def bench_outage(
    service: str = typer.Option("postgres", help="what goes away: postgres or temporal"),
    down_s: float = typer.Option(30.0, min=0, help="how long it stays away"),
    hard: bool = typer.Option(
        True, "--hard/--clean", help="stopped as a crash (SIGKILL, pg_ctl -m immediate), or cleanly"
    ),
    blocks: int = _FLEET_BLOCKS,
    nodes_per_block: int = _FLEET_NODES_PER_BLOCK,
    jobs: int = _FLEET_JOBS,
    gang_gpus: int = _FLEET_GANG_GPUS,
    burst: int = typer.Option(50, min=0, help="1-GPU jobs submitted during the outage (or once Postgres is back)"),
    agent_procs: int = typer.Option(4, min=1, help="agent processes the nodes are spread over"),
    observe_s: float = typer.Option(60.0, min=0, help="look on at least this long after the service is back"),
    setting: list[str] = _SETTING,
    keep: bool = _KEEP,
    shared_connections: bool = typer.Option(
        False, help="the simulated nodes of one agent process share a connection to each control (not one each)"
    ),
    as_json: bool = _AS_JSON,
) -> None:
    """Postgres or Temporal goes away under a loaded cluster: nothing restarts, no node is judged, new work runs."""
    from bench.outage import SERVICES
    from common.temporal import hard_exit

    if service not in SERVICES:
        raise typer.BadParameter(f"{service!r}: one of {', '.join(SERVICES)}", param_hint="--service")
    result = _call(
        "bench.outage", "run", service=service, down_s=down_s, hard=hard, blocks=blocks,
        nodes_per_block=nodes_per_block, jobs=jobs, gang_gpus=gang_gpus, burst=burst, agent_procs=agent_procs,
        observe_s=observe_s, overrides=_setting_overrides(setting), keep=keep, shared_connections=shared_connections,
    )  # fmt: skip
    _print_result(result, as_json)
    hard_exit(0 if result["ok"] else 1)


def _setting_overrides(setting: list[str]) -> dict[str, Any]:
    """``--setting KEY=VALUE`` pairs: a value that parses as JSON is that, else the text."""
    overrides: dict[str, Any] = {}
    for kv in setting:
        key, sep, value = kv.partition("=")
        if not sep:
            raise typer.BadParameter(f"{kv!r}: expected KEY=VALUE", param_hint="--setting")
        try:
            overrides[key.strip()] = json.loads(value)
        except ValueError:
            overrides[key.strip()] = value
    return overrides


def main() -> None:
    try:
        app()
    except PlatformError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
