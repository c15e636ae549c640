"""`gpufleet top`: the cluster map of `/ui` in the terminal (rich Live), from `GET /v1/cluster`.

Each block is a line of nodes, each node its GPUs as coloured glyphs (the legend names them),
then the idle GPUs and their cost, each team's quota and use, and the queue by priority class.
`--once` prints one frame and exits (scripts, tests); otherwise it redraws every `--interval`
seconds until Ctrl-C. Like the other user commands it reaches the API only, with a token.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from cli.user_cmd import CliError, Token, Url, _client, _err, _fmt, _out

# state -> (glyph, style): distinct glyphs, so the map reads without colour too
GLYPHS: dict[str, tuple[str, str]] = {
    "free": ("·", "grey62"),
    "guaranteed": ("█", "blue"),
    "borrowed": ("▓", "magenta"),
    "reserved": ("░", "yellow"),
    "hot_spare": ("▒", "dark_orange"),
    "cordoned": ("#", "grey50"),
    "down": ("x", "bold red"),
    "burn_in": ("~", "cyan"),
}
LABELS = {"hot_spare": "hot spare", "burn_in": "burn-in"}


def _legend(states: list[str]) -> Text:
    t = Text("legend: ")
    for s in states:
        glyph, style = GLYPHS.get(s, ("?", ""))
        t.append(glyph, style=style)
        t.append(f" {LABELS.get(s, s)}  ")
    return t


def _map(c: dict[str, Any]) -> Table:
    t = Table("block", "nodes (one glyph per GPU)", box=None, show_header=True, title="map", title_justify="left")
    for b in c["blocks"]:
        line = Text()
        for i, n in enumerate(b["nodes"]):
            if i:
                line.append(" ")
            for g in n["gpus"]:
                glyph, style = GLYPHS.get(g["state"], ("?", ""))
                line.append(glyph, style=style)
        t.add_row(b["block_id"], line)
    return t


def _summary(c: dict[str, Any]) -> Table:
    tot = c["totals"]
    t = Table(show_header=False, box=None, title="cluster", title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    for gpu_type, counts in tot["gpus"].items():
        shown = ", ".join(f"{LABELS.get(s, s)} {n}" for s, n in counts.items() if n)
        t.add_row(f"{gpu_type} GPUs", f"{sum(counts.values())}: {shown or 'none'}")
    t.add_row("idle GPUs", f"{tot['idle_gpu_total']} (${tot['idle_cost_usd_per_hour']:.2f}/h)")
    busy_idle = tot["allocated_idle_gpus"]
    t.add_row(
        "allocated but idle",
        f"{sum(busy_idle.values())} (${tot['allocated_idle_cost_usd_per_hour']:.2f}/h)"
        + (": " + ", ".join(f"{k} {v}" for k, v in sorted(busy_idle.items())) if busy_idle else ""),
    )
    return t


def _teams(c: dict[str, Any]) -> Table:
    t = Table(
        "team", "type", "guaranteed", "borrow limit", "in use", "borrowed", "idle", title="teams", title_justify="left"
    )
    for u in c["teams"]:
        t.add_row(
            u["team"],
            u["gpu_type"],
            str(u["guaranteed"]),
            str(u["borrow_limit"]),
            str(u["in_use"]),
            str(u["borrowed"]),
            str(u["allocated_idle"]),
        )
    return t


def _queue(c: dict[str, Any], rows: int) -> Table:
    t = Table("class", "#", "job", "team", "gpus", "reason", "expected start", title="queue", title_justify="left")
    for q in c["queue"]:
        t.add_row(
            f"[bold]{q['priority_class']}[/]", "", f"{q['jobs_queued']} queued", "", str(q["gpus_queued"]), "", ""
        )
        for j in q["jobs"][:rows]:
            t.add_row(
                "",
                _fmt(j.get("queue_position")),
                j.get("job_id") or "(another team)",
                j["team"],
                f"{j['gpus']} {j['gpu_type']}",
                _fmt(j.get("pending_reason")),
                _fmt(j.get("expected_start")),
            )
    return t


def frame(c: dict[str, Any], *, rows: int = 5, note: str = "") -> RenderableType:
    """One screen of `top` from a /v1/cluster body."""
    parts: list[RenderableType] = [_summary(c), _teams(c), _queue(c, rows), _legend(c["gpu_states"]), _map(c)]
    if note:
        parts.insert(0, Text(note, style="dim"))
    return Group(*parts)


def top(
    once: Annotated[bool, typer.Option("--once", help="print one frame and exit")] = False,
    interval: Annotated[float, typer.Option(help="seconds between redraws", min=0.5)] = 2.0,
    rows: Annotated[int, typer.Option(help="queued jobs shown per priority class", min=0)] = 5,
    url: Url = None,
    token: Token = None,
) -> None:
    """The whole cluster, live: the map of blocks and GPUs, idle GPUs and cost, teams, the queue."""
    api = _client(url, token)

    def fetch() -> dict[str, Any]:
        return api.request("GET", "/v1/cluster", params={"jobs": max(rows, 1)})

    try:
        first = fetch()
    except CliError as e:
        _err(f"error: {e.message}")
        raise typer.Exit(e.exit_code) from None
    if once:
        _out().print(frame(first, rows=rows))
        return
    console = Console()
    with Live(frame(first, rows=rows), console=console, auto_refresh=False, screen=False) as live:
        try:
            while True:
                time.sleep(interval)
                try:
                    c = fetch()
                except CliError as e:
                    if e.code in ("unauthenticated", "forbidden"):
                        raise
                    live.update(Text(f"cannot refresh: {e.message} (retrying)", style="red"), refresh=True)
                    continue
                live.update(frame(c, rows=rows, note=f"updated {time.strftime('%H:%M:%S')}"), refresh=True)
        except CliError as e:
            _err(f"error: {e.message}")
            raise typer.Exit(e.exit_code) from None
        except KeyboardInterrupt:
            return
