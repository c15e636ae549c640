"""Run several policies over the same workload and fault schedule; build the JSON.

Policy names on the command line map to ``placement.PRESETS``:

=============  ==============================  ===========================================
name           preset                          what it is
=============  ==============================  ===========================================
ours           ``gpufleet``                    the policy docs/design.md describes
fifo           ``fifo_first_fit``              FIFO over all classes + first fit
kueue-like     ``no_topology_no_reservation``  no topology, no reservation, no backfill
                                               (a Kubernetes queue in best-effort FIFO)
slurm-like     ``easy_backfill``               EASY backfill, no borrowing, no preemption
=============  ==============================  ===========================================
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, fields, replace
from typing import Any

from placement import PRESETS, Policy
from sim import costs
from sim.core import SimOptions, Simulation
from sim.failures import FailureModel, fault_schedule
from sim.workload import CLASSES, Workload

POLICIES: dict[str, tuple[str, str]] = {
    "ours": ("gpufleet", "gpufleet: fair-share order, topology, reservations + backfill, borrowing, preemption"),
    "fifo": ("fifo_first_fit", "FIFO over all classes + first fit; no reservation/backfill/preemption"),
    "kueue-like": (
        "no_topology_no_reservation",
        "no topology, no reservation, no backfill (like a Kubernetes queue in best-effort FIFO mode)",
    ),
    "slurm-like": ("easy_backfill", "EASY backfill, class FIFO, no borrowing, no preemption (like Slurm)"),
}
DEFAULT_POLICIES = ("ours", "fifo", "kueue-like", "slurm-like")
BASELINES = ("fifo", "kueue-like", "slurm-like")


def resolve_policy(spec: str) -> tuple[str, Policy]:
    """A command-line policy -> (preset name, Policy).

    ``spec`` is a name above or a preset name, optionally followed by ``:field=value``
    overrides of ``placement.Policy`` fields, to try a policy change side by side:
    ``ours:preemption_protect_s=600:max_reservations_per_type=2``.
    """
    name, *overrides = spec.split(":")
    if name in POLICIES:
        preset = POLICIES[name][0]
    elif name in PRESETS:
        preset = name
    else:
        raise ValueError(f"unknown policy {name!r}: one of {', '.join(list(POLICIES) + list(PRESETS))}")
    policy = PRESETS[preset]
    changes: dict[str, Any] = {}  # field name -> value of that field's type (checked by replace)
    known = {f.name: f for f in fields(Policy)}
    for ov in overrides:
        key, sep, value = ov.partition("=")
        key = key.strip()
        if not sep or key not in known:
            raise ValueError(
                f"bad policy override {ov!r}: field=value with a field of placement.Policy ({', '.join(known)})"
            )
        cur = getattr(policy, key)
        v = value.strip()
        if "None" in str(known[key].type) and v.lower() == "none":
            changes[key] = None  # an optional knob turned off
        elif cur is None:  # an optional knob, off in this preset: its annotation says the type
            changes[key] = float(v) if "float" in str(known[key].type) else int(v)
        elif isinstance(cur, bool):
            if v.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(f"{key} takes true or false, not {v!r}")
            changes[key] = v.lower() in ("true", "1", "yes")
        elif isinstance(cur, int) and not isinstance(cur, bool):
            changes[key] = int(v)
        elif isinstance(cur, float):
            changes[key] = float(v)
        else:
            changes[key] = v  # enums (ordering) convert in Policy.__post_init__
    if changes:
        policy = replace(policy, **changes)
    return preset, policy


def faults_for(workload: Workload, model: FailureModel | None, seed: int, draw: int = 0):
    """The run's fault schedule. ``draw`` > 0 draws another schedule from the same model on
    the same workload: a change that should not matter, to see how much of a figure is the
    luck of which jobs the faults hit (0: the seed's own schedule)."""
    if model is None:
        return ()
    rng = random.Random(f"gpufleet-faults:{seed}" if draw == 0 else f"gpufleet-faults:{seed}:draw{draw}")
    return fault_schedule(workload.cluster, model, -workload.warmup, workload.end, rng)


def run_policies(
    workload: Workload,
    policies: tuple[str, ...] | list[str] = DEFAULT_POLICIES,
    *,
    seed: int = 1,
    failures: FailureModel | None = FailureModel(),
    fault_draw: int = 0,
    options: SimOptions | None = None,
    on_start: Callable[[str], None] | None = None,
    on_progress: Callable[[str, float], None] | None = None,
    on_done: Callable[[str, dict], None] | None = None,
    keep_sims: bool = False,
) -> dict:
    """Simulate each policy on the same workload and faults; returns the report dict."""
    options = options or SimOptions()
    faults = faults_for(workload, failures, seed, fault_draw)
    out: dict = {
        "workload": workload.summary(),
        "seed": seed,
        "fault_draw": fault_draw,
        "failure_model": asdict(failures) if failures else None,
        "faults_scheduled": len(faults),
        "options": asdict(options),
        "cost_models": costs.describe(),
        "policies": {},
    }
    sims = {}
    for name in policies:
        preset, policy = resolve_policy(name)
        if on_start:
            on_start(name)
        sim = Simulation(workload, policy, name, faults, options, seed=seed)
        cb = (lambda f, n=name: on_progress(n, f)) if on_progress else None
        res = sim.run(cb)
        base = name.split(":")[0]
        desc = POLICIES.get(base, (preset, preset))[1]
        if ":" in name:
            desc += " with " + ", ".join(name.split(":")[1:])
        res = {"name": name, "preset": preset, "description": desc, **res}
        out["policies"][name] = res
        res["_wait_samples"] = sim.metrics.wait_samples
        if keep_sims:
            sims[name] = sim
        if on_done:
            on_done(name, res)
    out["checks"] = checks(out)
    if keep_sims:
        out["_sims"] = sims
    return out


# comparisons: ours counts as better or worse than a baseline only past these margins
MARGIN_PCT_POINTS = 0.5  # percentages (allocation): points
MARGIN_RELATIVE = 0.05  # counts, hours, waits: share of the larger of the two values


def checks(report: dict) -> dict:
    """The issue's acceptance criteria, evaluated on the report (for ``ours`` when present).

    A check is ``true`` or ``false``, or ``null`` when there is nothing to judge (no prod
    job of <= 8 GPUs, no reclaim, no large gang, demand never above capacity); ``why_null``
    says why. A comparison with a baseline (``better_*_than``) is ``true`` (better by at
    least the margin), ``false`` (worse by at least the margin), ``"tie"`` (within it) or
    ``null`` (nothing to compare); margins: ``MARGIN_PCT_POINTS`` for percentages,
    ``MARGIN_RELATIVE`` for counts, hours and waits. ``"tie"`` is a truthy string: read
    these with ``is True``.
    """
    pol = report["policies"]
    if "ours" not in pol:
        return {}
    o = pol["ours"]
    why: dict[str, str] = {}

    def judged(key: str, value: bool | None, reason: str) -> bool | None:
        if value is None:
            why[key] = reason
        return value

    a = o["allocation"]["healthy_gpu_pct_while_demand_exceeds_capacity"]
    small = {c: o["wait_s"]["by_class_and_size"][c]["<=8"]["p95"] for c in CLASSES}
    prod_small = [small[c] for c in ("prod-serving", "prod-batch") if small[c] is not None]
    lg = o["large_gangs"]
    rc = o["reclaim"]
    no_over = "demand never exceeded capacity in the window"
    no_prod = "no prod-serving or prod-batch job of <= 8 GPUs in the window"
    guaranteed = any(any(g > 0 for g in t.get("guaranteed", {}).values()) for t in o.get("teams", {}).values())
    res: dict = {
        "alloc_while_demand_exceeds_capacity_pct": a,
        "alloc_floor_90": judged("alloc_floor_90", None if a is None else a >= 90.0, no_over),
        "alloc_target_95": judged("alloc_target_95", None if a is None else a >= 95.0, no_over),
        "p95_wait_le8_by_class_s": small,
        "prod_p95_wait_le8_floor_600s": judged(
            "prod_p95_wait_le8_floor_600s", all(x <= 600 for x in prod_small) if prod_small else None, no_prod
        ),
        "prod_p95_wait_le8_target_120s": judged(
            "prod_p95_wait_le8_target_120s", all(x <= 120 for x in prod_small) if prod_small else None, no_prod
        ),
        "reclaim_within_grace_plus_2_cycles": judged(
            "reclaim_within_grace_plus_2_cycles",
            rc["over_grace_plus_2_cycles"] == 0 if rc.get("count", 1) else None,
            "no borrowed capacity was reclaimed in the window",
        ),
        "no_team_starved": judged(
            "no_team_starved",
            not o["starved_teams"] if guaranteed else None,
            "no team has a guarantee: starvation is defined against one",
        ),
        # beside the check above, not instead: starvation only while free + reclaimable GPUs
        # could hold the job by count (sim.metrics), the part a placement choice could end
        "no_team_starved_while_capacity_suffices": judged(
            "no_team_starved_while_capacity_suffices",
            not o["starved_teams_while_capacity_suffices"] if guaranteed else None,
            "no team has a guarantee: starvation is defined against one",
        ),
        # narrower still: only while the job's shape fits nodes free or holding work it may take
        # back (sim.placeable); the rest of the starving waited on topology or the victim rules
        "no_team_starved_while_nodes_suffice": judged(
            "no_team_starved_while_nodes_suffice",
            not o["starved_teams_while_nodes_suffice"] if guaranteed else None,
            "no team has a guarantee: starvation is defined against one",
        ),
        "large_gangs_in_min_blocks_or_max_blocks": judged(
            "large_gangs_in_min_blocks_or_max_blocks",
            lg["in_min_blocks_or_within_max_blocks"] == lg["placements"] if lg["placements"] else None,
            "no gang of >= 1,024 GPUs was placed in the window",
        ),
    }
    better_alloc: dict[str, bool | str | None] = {}
    better_net: dict[str, bool | str | None] = {}
    better_large: dict[str, bool | str | None] = {}
    better_mid: dict[str, bool | str | None] = {}
    ours_large = o["wait_s"]["large_gangs"]
    ours_mid = o["wait_s"]["by_size"]["9-1023"] if "by_size" in o["wait_s"] else None
    for name, p in pol.items():
        if name == "ours":
            continue
        better_alloc[name] = _higher(o, p, "healthy_gpu_pct")
        better_net[name] = _higher(o, p, "healthy_gpu_pct_net_of_lost_work")
        better_large[name] = _better_wait(ours_large, p["wait_s"]["large_gangs"])
        if better_large[name] is None:
            why[f"better_large_gang_wait_than.{name}"] = "no gang of >= 1,024 GPUs submitted in the window"
        if ours_mid is not None:
            better_mid[name] = _better_wait(ours_mid, p["wait_s"]["by_size"]["9-1023"])
            if better_mid[name] is None:
                why[f"better_9_1023_gpu_wait_than.{name}"] = "no job of 9-1,023 GPUs submitted in the window"
    res["better_allocation_than"] = better_alloc
    # held GPUs count as allocated even when their work is thrown away or (with
    # --spread-slowdown) runs slow: this compares what is left of them
    res["better_allocation_net_of_lost_work_than"] = better_net
    res["better_large_gang_wait_than"] = better_large
    # the same rule for jobs of 9-1,023 GPUs (mean wait and jobs left waiting)
    res["better_9_1023_gpu_wait_than"] = better_mid
    res["margins"] = {"pct_points": MARGIN_PCT_POINTS, "relative": MARGIN_RELATIVE}
    res["why_null"] = why
    return res


def compare(ours: float | None, theirs: float | None, *, margin: float, relative: bool, higher_is_better: bool):
    """``True`` (ours better by at least the margin), ``False`` (worse by at least it), ``"tie"``,
    or ``None`` when either value is missing. ``relative``: the margin is a share of the larger
    absolute value (a count, hours, a wait); else it is in the values' unit (percentage points)."""
    if ours is None or theirs is None:
        return None
    m = margin * max(abs(ours), abs(theirs)) if relative else margin
    d = ours - theirs if higher_is_better else theirs - ours
    if abs(d) < m - 1e-12 or d == 0:
        return "tie"
    return d > 0


def _higher(ours: dict, theirs: dict, key: str) -> bool | str | None:
    return compare(
        ours["allocation"][key],
        theirs["allocation"][key],
        margin=MARGIN_PCT_POINTS,
        relative=False,
        higher_is_better=True,
    )


def _better_wait(ours: dict, theirs: dict) -> bool | str | None:
    """Mean wait (5%) and jobs left waiting when the run stopped (5% of the count), together:
    better or worse on one and tied on the other decides; better on one and worse on the
    other is a tie. Waits are followed into the drain; one still queued when the run stops
    counts as waited so far. ``None`` when there is no such job."""
    if not ours["n"] or not theirs["n"]:
        return None
    mean = compare(ours["mean"], theirs["mean"], margin=MARGIN_RELATIVE, relative=True, higher_is_better=False)
    left = compare(
        float(ours["censored"]),
        float(theirs["censored"]),
        margin=MARGIN_RELATIVE,
        relative=True,
        higher_is_better=False,
    )
    votes = {v for v in (mean, left) if v is not None and v != "tie"}
    return votes.pop() if len(votes) == 1 else "tie"


def to_json(report: dict, *, timings: bool = True) -> str:
    """The report as JSON text (keys starting with ``_`` dropped; ``timings`` False drops
    wall-clock figures, for determinism comparisons)."""
    return json.dumps(_clean(report, timings), indent=2, sort_keys=False) + "\n"


def _clean(x, timings: bool):
    if isinstance(x, dict):
        return {
            k: _clean(v, timings)
            for k, v in x.items()
            if not (isinstance(k, str) and k.startswith("_")) and (timings or k != "timing")
        }
    if isinstance(x, list | tuple):
        return [_clean(v, timings) for v in x]
    return x
