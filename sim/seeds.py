"""Several seeds of one run: each seed's own report, and each policy's min/median/max per metric.

``gpufleet sim --seeds 1-5`` (or ``1,3,7``, or ``1-3,7``) builds the workload and the
fault schedule of each seed and runs every policy on it (with ``--fault-draws 0-2``, on each
of the seed's fault draws too, a run keyed ``"3/d1"``) (``sim.run.run_policies``), then
``across_seeds`` gathers, for each policy, every numeric figure of its per-seed reports
(flattened to a dotted path: ``allocation.healthy_gpu_pct``, ``wait_s.by_size.>=1024.mean``,
...) into ``{"min", "median", "max", "n"}``, and counts each check's verdicts over the seeds.
A figure that is ``null`` on some seeds (nothing to measure there) is summarized over the
seeds that have it (``n``). Wall-clock timings, the time series and lists are left out.

``paired`` sets each other policy beside the first one named, run by run: a candidate's
figures move with the seed and the fault draw about as far as most changes move them
(sim/README.md, "How much of a cell is the fault draw"), so a min/median/max per policy
cannot say whether it wins on the same runs. It gives the difference on each run, their
mean/min/max, and on how many runs the candidate is better, worse or tied by the
report's own margins (``sim.run.compare``).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping

from sim.run import MARGIN_PCT_POINTS, MARGIN_RELATIVE, compare

_SKIP = {"series", "timing"}  # the time series; wall-clock figures (not deterministic)


def parse_seeds(text: str) -> list[int]:
    """``"1-5"`` -> [1, 2, 3, 4, 5]; ``"1,3,7"``; ``"1-3,7"``. Order kept, duplicates dropped."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if dash else a
        except ValueError:
            raise ValueError(f"bad seed list {text!r}: use 1-5, 1,3,7 or 1-3,7") from None
        if b < a:
            raise ValueError(f"bad seed range {part!r}: the end is below the start")
        if b - a >= 1000:
            raise ValueError(f"seed range {part!r} is too long (at most 1,000 seeds)")
        for s in range(a, b + 1):
            if s not in out:
                out.append(s)
    if not out:
        raise ValueError(f"no seed in {text!r}")
    return out


def flatten(d: dict, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a policy's report by dotted path (booleans and lists left out; the
    lists of starved teams counted: ``starved_teams_count``,
    ``starved_teams_while_capacity_suffices_count``, ``starved_teams_while_nodes_suffice_count``,
    ``starved_teams_by_one_job_count``)."""
    out: dict[str, float] = {}
    for k, v in d.items():
        if not isinstance(k, str) or k.startswith("_") or k in _SKIP:
            continue
        path = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, path + "."))
        elif isinstance(v, bool):
            continue
        elif isinstance(v, int | float):
            out[path] = v
        elif v is None:
            out.setdefault(path, None)  # type: ignore[arg-type]
        elif k.startswith("starved_teams") and isinstance(v, list):
            out[f"{path}_count"] = len(v)
    return out


def _policy_names(reports: Mapping[int | str, dict]) -> list[str]:
    """Every policy named in the runs, in the order first seen."""
    names: list[str] = []
    for rep in reports.values():
        for n in rep["policies"]:
            if n not in names:
                names.append(n)
    return names


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {"min": None, "median": None, "max": None, "n": 0}
    return {"min": min(xs), "median": round(float(statistics.median(xs)), 4), "max": max(xs), "n": len(xs)}


def across_seeds(reports: Mapping[int | str, dict]) -> dict:
    """Per policy, per metric: min/median/max over the runs (seeds, or seeds and fault draws);
    per check: its verdicts' counts."""
    seeds = list(reports)
    names = _policy_names(reports)
    policies: dict[str, dict] = {}
    for name in names:
        flat = [flatten(reports[s]["policies"][name]) for s in seeds if name in reports[s]["policies"]]
        paths: list[str] = []
        for f in flat:
            for p in f:
                if p not in paths:
                    paths.append(p)
        policies[name] = {p: _stats([f[p] for f in flat if f.get(p) is not None]) for p in paths}
    balance: dict[str, Counter] = {name: Counter() for name in names}
    for s in seeds:
        for name, p in reports[s]["policies"].items():
            balance[name][_label(p["jobs"]["balance"]["holds"])] += 1
    checks: dict[str, dict] = {}
    for s in seeds:
        for key, v in _verdicts(reports[s].get("checks") or {}).items():
            checks.setdefault(key, Counter())[_label(v)] += 1
    return {
        "seeds": seeds,
        "policies": policies,
        # each other policy beside the first one named, run by run (``paired``)
        "paired": paired(reports),
        # seeds on which each policy's jobs balance (submitted = finished + running + queued + requeued)
        "jobs_balance_holds": {name: dict(sorted(c.items())) for name, c in balance.items()},
        # for each check of ours: on how many seeds it was true, false, tie or null
        "checks": {k: dict(sorted(c.items())) for k, c in checks.items()},
    }


def _verdicts(chk: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in chk.items():
        if k in ("why_null", "margins", "p95_wait_le8_by_class_s", "alloc_while_demand_exceeds_capacity_pct"):
            continue
        if isinstance(v, dict):
            out.update(_verdicts(v, f"{prefix}{k}."))
        elif isinstance(v, bool) or v is None or v == "tie":
            out[f"{prefix}{k}"] = v
    return out


def _label(v: object) -> str:
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    return str(v)


# (dotted path, higher is better, margin) of the figures ``paired`` compares (the issue's
# musts): "points" MARGIN_PCT_POINTS, "relative" MARGIN_RELATIVE of the larger value,
# "exact" none (one starved team is one too many)
PAIRED_FIGURES: tuple[tuple[str, bool, str], ...] = (
    ("allocation.healthy_gpu_pct_net_of_lost_work", True, "points"),
    ("allocation.healthy_gpu_pct_while_demand_exceeds_capacity", True, "points"),
    ("allocation.allocated_gpu_hours", True, "relative"),
    ("starved_teams_count", False, "exact"),
    ("lost_gpu_hours.preemption", False, "relative"),
    ("lost_gpu_hours.preemption_pct_of_allocated", False, "relative"),
    ("wait_s.by_class_and_size.prod-serving.<=8.p95", False, "relative"),
    ("wait_s.by_class_and_size.prod-batch.<=8.p95", False, "relative"),
    ("wait_s.by_size.9-1023.mean", False, "relative"),
    ("wait_s.large_gangs.mean", False, "relative"),
)
_MARGINS = {"points": (MARGIN_PCT_POINTS, False), "relative": (MARGIN_RELATIVE, True), "exact": (0.0, False)}


def paired(reports: Mapping[int | str, dict]) -> dict:
    """Each policy against the first one named (the reference), on the runs both have: per
    figure of ``PAIRED_FIGURES``, the differences (policy - reference) as
    ``{"min", "mean", "max", "n"}`` and the runs on which the policy is ``better``, ``worse``
    or ``tie`` by the report's margins (0.5 points for percentages of GPUs, 5% of the larger
    value otherwise; a count of starved teams by any team). A run where either value
    is ``null`` (nothing to measure) is left out of that figure (``n``)."""
    names = _policy_names(reports)
    if not names:
        return {"reference": None, "policies": {}}
    ref = names[0]
    # each run's policies flattened once, for the runs that have the reference
    flat = [{n: flatten(p) for n, p in rep["policies"].items()} for rep in reports.values() if ref in rep["policies"]]
    out: dict[str, dict] = {}
    for name in names[1:]:
        runs = [(f[ref], f[name]) for f in flat if name in f]
        figures: dict[str, dict] = {}
        for path, higher, kind in PAIRED_FIGURES:
            margin, relative = _MARGINS[kind]
            diffs: list[float] = []
            verdicts: Counter = Counter()
            for r, c in runs:
                a, b = r.get(path), c.get(path)
                if a is None or b is None:
                    continue
                diffs.append(b - a)
                v = compare(b, a, margin=margin, relative=relative, higher_is_better=higher)
                verdicts["tie" if v == "tie" else "better" if v is True else "worse"] += 1
            figures[path] = {
                "difference": {
                    "min": round(min(diffs), 4) if diffs else None,
                    "mean": round(statistics.fmean(diffs), 4) if diffs else None,
                    "max": round(max(diffs), 4) if diffs else None,
                    "n": len(diffs),
                },
                "better": verdicts["better"],
                "worse": verdicts["worse"],
                "tie": verdicts["tie"],
            }
        out[name] = figures
    return {"reference": ref, "policies": out}
