"""Reports of a run: the side-by-side markdown table and the plots (matplotlib, Agg).

* ``markdown_table(report)``: one column per policy, one row per headline metric.
* ``seeds_table(across)``: several seeds (sim/seeds.py): min / median / max per policy of
  the headline metrics;
* ``write_plots(report, dir)``: ``allocation.png`` (allocated % of healthy GPUs over
  time, one line per policy, with demand in the background) and ``wait_cdf.png``
  (queue-wait CDFs, one panel per class, one line per policy). Returns the paths.
"""

from __future__ import annotations

from pathlib import Path

from sim.workload import CLASSES, SIZE_BUCKETS


def fmt_s(x: float | None) -> str:
    if x is None:
        return "–"
    if x < 60:
        return f"{x:.0f} s"
    if x < 3600:
        return f"{x / 60:.1f} min"
    return f"{x / 3600:.1f} h"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f}%"


def _num(x: float | None, nd: int = 0) -> str:
    if x is None:
        return "–"
    return f"{x:,.{nd}f}"


def rows(report: dict) -> list[tuple[str, list[str]]]:
    pols = list(report["policies"].values())
    out: list[tuple[str, list[str]]] = []

    def row(label: str, f) -> None:
        out.append((label, [f(p) for p in pols]))

    row("preset (placement.PRESETS)", lambda p: f"`{p['preset']}`")
    row("allocated % of healthy GPUs", lambda p: _pct(p["allocation"]["healthy_gpu_pct"]))
    row(
        "… while demand exceeds capacity",
        lambda p: (
            f"{_pct(p['allocation']['healthy_gpu_pct_while_demand_exceeds_capacity'])}"
            f" ({p['allocation']['hours_demand_exceeds_capacity']:.1f} h)"
        ),
    )
    row(
        "… net of work lost (preemption, failures, spread placement)",
        lambda p: _pct(p["allocation"]["healthy_gpu_pct_net_of_lost_work"]),
    )
    row(
        "idle GPU-hours (cost at $2)",
        lambda p: f"{_num(p['idle']['gpu_hours'])} (${_num(p['idle']['cost_usd'])})",
    )

    def breakdown(p: dict) -> str:
        b = p["idle"]["breakdown_pct_of_healthy"].get("while_demand_exceeds_capacity")
        if not b:
            return "–"
        return f"{b['hot_spares']:.1f} / {b['reserved_for_large_gangs']:.1f} / {b['other_free']:.1f}"

    row("idle while over capacity: spares / reserved / other (%)", breakdown)

    def queued_beside(p: dict) -> str:
        q = p["idle"].get("queued_while_demand_exceeds_capacity")
        if not q or not q["by_kind_gpus_mean"]:
            return "–"
        kind, gpus = next(iter(q["by_kind_gpus_mean"].items()))
        return f"{kind} ({_num(gpus, 1)} of {_num(q['queued_gpus_mean'], 1)} GPUs queued)"

    row("… the most work queued beside them (kind: mean GPUs)", queued_beside)
    for c in CLASSES:
        row(
            f"wait ≤8 GPUs, {c}: p50 / p95 / p99",
            lambda p, c=c: " / ".join(
                fmt_s(p["wait_s"]["by_class_and_size"][c]["<=8"][k]) for k in ("p50", "p95", "p99")
            ),
        )
    for b in SIZE_BUCKETS:
        row(
            f"wait {b} GPUs: p50 / p95 / p99",
            lambda p, b=b: " / ".join(fmt_s(p["wait_s"]["by_size"][b][k]) for k in ("p50", "p95", "p99")),
        )
    row(
        "large gangs (≥1,024): wait p50 / mean / max (never started)",
        lambda p: (
            " / ".join(fmt_s(p["wait_s"]["large_gangs"][k]) for k in ("p50", "mean", "max"))
            + f" ({p['wait_s']['large_gangs']['censored']})"
        ),
    )
    row(
        "jobs queued at the window's end / never started (drain after the window)",
        lambda p: (
            f"{p['jobs']['still_queued_at_window_end']} / {p['jobs']['never_started']}"
            f" ({_num(p['jobs']['drain_h'], 1)} h)"
        ),
    )

    def balance(p: dict) -> str:
        b = p["jobs"]["balance"]
        eq = "=" if b["holds"] else "≠"
        return f"{b['submitted']} {eq} {b['finished']} + {b['running']} + {b['queued']} + {b['requeued']}"

    row("jobs at the window's end: submitted = finished + running + queued + requeued", balance)
    row(
        "large-gang placements: min blocks / ≤ max_blocks / all",
        lambda p: (
            f"{p['large_gangs']['in_min_blocks']} / {p['large_gangs']['in_min_blocks_or_within_max_blocks']}"
            f" / {p['large_gangs']['placements']}"
        ),
    )
    row(
        "blocks per large gang: mean vs minimum",
        lambda p: f"{_num(p['large_gangs']['mean_blocks'], 2)} vs {_num(p['large_gangs']['mean_min_blocks'], 2)}",
    )
    row(
        "head-of-line reservations: made / owner started / dropped while owner waits",
        lambda p: (
            f"{p['head_of_line_reservations']['made']} / {p['head_of_line_reservations']['owner_started']}"
            f" / {p['head_of_line_reservations']['dropped_while_owner_waits']}"
        ),
    )
    row(
        "teams starved (max wait of any team)",
        lambda p: f"{len(p['starved_teams'])} ({fmt_s(max((t['max_wait_s'] or 0) for t in p['teams'].values()))})",
    )
    row(
        "… of them while free + reclaimable GPUs could hold the job",
        lambda p: str(len(p["starved_teams_while_capacity_suffices"])),
    )
    row(
        "… of them while nodes free or holding reclaimable work could hold it",
        lambda p: str(len(p["starved_teams_while_nodes_suffice"])),
    )
    row(
        "… of them with one job waiting past the line",
        lambda p: str(len(p["starved_teams_by_one_job"])),
    )
    row(
        "GPU-hours lost: preemption / failures / spread placement",
        lambda p: (
            f"{_num(p['lost_gpu_hours']['preemption'])} / {_num(p['lost_gpu_hours']['failures'])}"
            f" / {_num(p['lost_gpu_hours']['spread_placement'])}"
        ),
    )
    row(
        "… preemption by the victim's age at SIGTERM: <30 min / 30 min-2 h / ≥2 h",
        lambda p: " / ".join(_num(v) for v in p["lost_gpu_hours"]["preemption_by"]["victim_age_at_sigterm"].values()),
    )
    row(
        "… the same, SIGTERM cost model (preemption: saved on SIGTERM + not saved)",
        lambda p: (
            f"{_num(p['lost_gpu_hours_sigterm_model']['preemption'])}"
            f" ({_num(p['lost_gpu_hours_sigterm_model']['preemption_saved_on_sigterm'])}"
            f" + {_num(p['lost_gpu_hours_sigterm_model']['preemption_not_saved'])})"
            f" / {_num(p['lost_gpu_hours_sigterm_model']['failures'])}"
            f" / {_num(p['lost_gpu_hours_sigterm_model']['spread_placement'])}"
        ),
    )
    row(
        "net of lost work, SIGTERM cost model",
        lambda p: _pct(p["allocation"]["healthy_gpu_pct_net_of_lost_work_sigterm_model"]),
    )
    row(
        "borrowed-GPU reclaim: p50 / p99 (n, over grace+2 cycles)",
        lambda p: (
            f"{fmt_s(p['reclaim']['p50_s'])} / {fmt_s(p['reclaim']['p99_s'])}"
            f" ({p['reclaim']['count']}, {p['reclaim']['over_grace_plus_2_cycles']})"
        ),
    )
    row(
        "preemptions: total / per job mean / max",
        lambda p: (
            f"{p['preemptions']['total']} / {_num(p['preemptions']['per_job_mean'], 3)}"
            f" / {p['preemptions']['per_job_max'] if p['preemptions']['per_job_max'] is not None else '–'}"
        ),
    )
    row("cycles", lambda p: _num(p["cycles"]))
    row(
        "cycle time p50 / p99 (wall clock)",
        lambda p: f"{p['timing']['cycle_ms']['p50']} / {p['timing']['cycle_ms']['p99']} ms" if p.get("timing") else "–",
    )
    row("run time (wall clock)", lambda p: f"{p['timing']['wall_s']:.0f} s" if p.get("timing") else "–")
    return out


def markdown_table(report: dict) -> str:
    names = list(report["policies"])
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for label, cells in rows(report):
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# (label, dotted path in a policy's report, format) of the rows of ``seeds_table``
SEED_ROWS: tuple[tuple[str, str, str], ...] = (
    ("allocated % of healthy GPUs", "allocation.healthy_gpu_pct", "pct"),
    ("… while demand exceeds capacity", "allocation.healthy_gpu_pct_while_demand_exceeds_capacity", "pct"),
    ("… net of lost work", "allocation.healthy_gpu_pct_net_of_lost_work", "pct"),
    ("… net of lost work, SIGTERM cost model", "allocation.healthy_gpu_pct_net_of_lost_work_sigterm_model", "pct"),
    ("allocated GPU-hours", "allocation.allocated_gpu_hours", "num"),
    ("teams starved", "starved_teams_count", "num"),
    ("… while free + reclaimable GPUs could hold the job", "starved_teams_while_capacity_suffices_count", "num"),
    ("… while nodes free or holding reclaimable work could hold it", "starved_teams_while_nodes_suffice_count", "num"),
    ("… with one job waiting past the line", "starved_teams_by_one_job_count", "num"),
    ("GPU-hours lost to preemption", "lost_gpu_hours.preemption", "num"),
    ("… SIGTERM cost model", "lost_gpu_hours_sigterm_model.preemption", "num"),
    ("GPU-hours lost to failures", "lost_gpu_hours.failures", "num"),
    ("preemptions", "preemptions.total", "num"),
    ("wait ≤8 GPUs, prod-serving p95", "wait_s.by_class_and_size.prod-serving.<=8.p95", "s"),
    ("wait ≤8 GPUs, prod-batch p95", "wait_s.by_class_and_size.prod-batch.<=8.p95", "s"),
    ("wait 9-1023 GPUs, mean", "wait_s.by_size.9-1023.mean", "s"),
    ("large gangs (≥1,024): wait mean", "wait_s.large_gangs.mean", "s"),
    ("large gangs never started", "wait_s.large_gangs.censored", "num"),
)


def seeds_table(across: dict) -> str:
    """min / median / max over the seeds of each headline metric, one column per policy."""
    pols = across["policies"]
    names = list(pols)
    seeds = ", ".join(str(s) for s in across["seeds"])
    fmt = {"pct": _pct, "num": lambda x: _num(x, 1 if x is not None and x != int(x) else 0), "s": fmt_s}
    lines = [
        f"| metric (min / median / max over seeds {seeds}) | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for label, path, kind in SEED_ROWS:
        f = fmt[kind]
        cells = []
        for n in names:
            st = pols[n].get(path)
            cells.append("–" if not st or not st["n"] else " / ".join(f(st[k]) for k in ("min", "median", "max")))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    bal = across.get("jobs_balance_holds", {})
    lines.append(
        "| jobs balance holds (seeds) | "
        + " | ".join(f"{bal.get(n, {}).get('true', 0)} of {len(across['seeds'])}" for n in names)
        + " |"
    )
    out = "\n".join(lines) + "\n"
    pairs = (across.get("paired") or {}).get("policies") or {}
    return out + "\n" + paired_table(across) if pairs else out


# labels of ``sim.seeds.PAIRED_FIGURES`` in ``paired_table`` and the format of a difference
PAIRED_LABELS: dict[str, tuple[str, str]] = {
    "allocation.healthy_gpu_pct_net_of_lost_work": ("net of lost work, points", "pct"),
    "allocation.healthy_gpu_pct_while_demand_exceeds_capacity": ("while demand exceeds capacity, points", "pct"),
    "allocation.allocated_gpu_hours": ("allocated GPU-hours", "num"),
    "starved_teams_count": ("teams starved", "num"),
    "lost_gpu_hours.preemption": ("GPU-hours lost to preemption", "num"),
    "lost_gpu_hours.preemption_pct_of_allocated": ("… % of allocated, points", "pct"),
    "wait_s.by_class_and_size.prod-serving.<=8.p95": ("wait ≤8 GPUs, prod-serving p95", "s"),
    "wait_s.by_class_and_size.prod-batch.<=8.p95": ("wait ≤8 GPUs, prod-batch p95", "s"),
    "wait_s.by_size.9-1023.mean": ("wait 9-1023 GPUs, mean", "s"),
    "wait_s.large_gangs.mean": ("large gangs (≥1,024): wait mean", "s"),
}


def paired_table(across: dict) -> str:
    """Each policy minus the first one named, run by run (``across["paired"]``): the mean
    difference (min / max) and the runs on which it is better / worse / tied by the margins."""
    pr = across["paired"]
    names = list(pr["policies"])

    def signed(x: float | None, kind: str) -> str:
        if x is None:
            return "–"
        if kind == "s":
            return ("-" if x < 0 else "+") + fmt_s(abs(x))
        if kind == "pct" or (abs(x) < 100 and x != int(x)):
            return f"{x:+,.2f}"
        return f"{x:+,.0f}"

    lines = [
        f"| column − {pr['reference']}, run by run: mean (min / max); runs better / worse / tie | "
        + " | ".join(names)
        + " |",
        "|---|" + "---|" * len(names),
    ]
    for path, (label, kind) in PAIRED_LABELS.items():
        cells = []
        for n in names:
            f = pr["policies"][n].get(path)
            if not f or not f["difference"]["n"]:
                cells.append("–")
                continue
            d = f["difference"]
            cells.append(
                f"{signed(d['mean'], kind)} ({signed(d['min'], kind)} / {signed(d['max'], kind)});"
                f" {f['better']} / {f['worse']} / {f['tie']}"
            )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_plots(report: dict, out_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pols = report["policies"]
    paths = []
    w = report.get("workload", {})
    title = f"{w.get('name', 'workload')}: {w.get('gpus', '?'):,} GPUs, {w.get('days', '?')} day(s), seed {report.get('seed')}"

    fig, ax = plt.subplots(figsize=(11, 5))
    for name, p in pols.items():
        s = p["series"]
        ax.plot(s["t_h"], [x if x is not None else float("nan") for x in s["alloc_pct"]], label=name, lw=1.4)
    first = next(iter(pols.values()), None)
    if first is not None:
        s = first["series"]
        ax.plot(
            s["t_h"],
            [min(x, 200.0) if x is not None else float("nan") for x in s["demand_pct"]],
            color="0.6",
            ls="--",
            lw=1,
            label=f"demand ({first['name']}), % of healthy",
        )
    ax.axhline(100, color="0.8", lw=0.8)
    ax.set_xlabel("hours")
    ax.set_ylabel("% of healthy GPUs allocated")
    ax.set_ylim(0, 160)
    ax.set_title(f"Allocation over time — {title}")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p1 = out / "allocation.png"
    fig.savefig(p1, dpi=110)
    plt.close(fig)
    paths.append(p1)

    fig, axes = plt.subplots(1, len(CLASSES), figsize=(16, 4.2), sharey=True)
    for ax, c in zip(axes, CLASSES, strict=True):
        for name, p in pols.items():
            xs = sorted(p.get("_wait_samples", {}).get(c, []))
            if not xs:
                continue
            n = len(xs)
            ys = [(i + 1) / n for i in range(n)]
            ax.step([max(x, 0.1) for x in xs], ys, where="post", label=name, lw=1.3)
        ax.set_xscale("log")
        ax.set_title(c)
        ax.set_xlabel("queue wait (s, log)")
        ax.grid(alpha=0.3)
        for x, lab in ((60, "1m"), (600, "10m"), (3600, "1h")):
            ax.axvline(x, color="0.85", lw=0.8)
            ax.text(x, 0.02, lab, fontsize=7, color="0.5")
    axes[0].set_ylabel("fraction of jobs")
    axes[-1].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"Queue wait CDF by class — {title}")
    fig.tight_layout()
    p2 = out / "wait_cdf.png"
    fig.savefig(p2, dpi=110)
    plt.close(fig)
    paths.append(p2)
    return paths
