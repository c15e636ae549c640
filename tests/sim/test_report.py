"""The honest report (issue 22): jobs balance, checks with nothing to judge, comparison
margins, several seeds, and the SIGTERM preemption cost model beside today's."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cli.sim_cmd import sim
from sim.core import SimOptions
from sim.costs import SIGTERM_SAVE_SHARE, restart_s, saves_on_sigterm
from sim.failures import FailureModel
from sim.report import PAIRED_LABELS, markdown_table, paired_table, seeds_table
from sim.run import checks, compare, run_policies, to_json
from sim.seed import SeedConfig, seed_workload
from sim.seeds import PAIRED_FIGURES, across_seeds, flatten, paired, parse_seeds
from sim.traces import TraceOptions, load_trace
from sim.workload import ClusterSpec

from .helpers import HOUR, job, preemptions, simulate, workload

FIX = Path(__file__).parent / "fixtures"

# ---------------------------------------------------------------------- jobs balance


def _balanced(p: dict) -> None:
    b = p["jobs"]["balance"]
    assert b["holds"], b
    assert b["submitted"] == b["finished"] + b["running"] + b["queued"] + b["requeued"]
    assert b["submitted"] == p["jobs"]["submitted"]
    assert b["finished"] == sum(p["jobs"]["outcomes"].values())
    assert b["queued"] == p["jobs"]["still_queued_at_window_end"]


@pytest.mark.parametrize(
    "seed, cfg",
    [
        (1, dict(days=0.04, nodes=64, warmup_h=0.5, load_scale=3.0, submissions_per_day=120_000)),
        (2, dict(days=0.04, nodes=64, warmup_h=0.5, load_scale=3.0, submissions_per_day=120_000)),
        (3, dict(days=0.03, nodes=64, warmup_h=0.5)),
        (7, dict(days=0.05, nodes=96, warmup_h=0.3, load_scale=2.0, submissions_per_day=80_000)),
    ],
)
def test_jobs_balance_on_seed_workloads_for_every_policy(seed: int, cfg: dict) -> None:
    wl = seed_workload(SeedConfig(seed=seed, **cfg))
    rep = run_policies(wl, seed=seed, failures=FailureModel(rate_per_gpu_hour=1e-2), options=SimOptions(drain_s=HOUR))
    for p in rep["policies"].values():
        _balanced(p)
    assert "submitted = finished + running + queued + requeued" in markdown_table(rep)


@pytest.mark.parametrize("fmt", ["generic", "philly", "alibaba"])
def test_jobs_balance_on_trace_replays(fmt: str) -> None:
    cluster = ClusterSpec.uniform(16, 8)
    wl = load_trace(FIX / f"{fmt if fmt != 'alibaba' else 'alibaba_pods'}.csv", cluster, TraceOptions(format=fmt))
    wl = replace(wl, end=wl.end / 2)  # cut the window: jobs are still running and queued at its end
    rep = run_policies(wl, failures=FailureModel(rate_per_gpu_hour=1e-2))
    for p in rep["policies"].values():
        _balanced(p)


def test_a_job_requeued_before_the_windows_end_is_counted_and_warmup_jobs_are_not() -> None:
    # the reclaim scenario (tests/sim/test_scenarios.py) cut at 1.5 h: a2 and a3 are
    # preempted at 1 h and wait, queued again, until b0/b1 end at 2 h. Two warm-up jobs:
    # w0 ends before the window, w1 in it (an outcome of a warm-up job, outside the balance)
    a_jobs = [job(f"a{i}", "A", float(i), 10 * HOUR, checkpoint_s=600.0) for i in range(4)]
    b_jobs = [job(f"b{i}", "B", HOUR + i, 1 * HOUR) for i in range(2)]
    warm = [job("w0", "B", -2 * HOUR, 0.5 * HOUR), job("w1", "B", -1 * HOUR, 1.25 * HOUR)]
    wl = workload(a_jobs + b_jobs + warm, {"A": (16, 32), "B": (16, 32)}, blocks=1, end=1.5 * HOUR)
    wl = replace(wl, warmup=2 * HOUR)
    sim, res = simulate(wl, drain_s=0.0)
    assert {pr.victim for _, pr in preemptions(sim)} == {"a2", "a3"}
    assert sim.recs["a2"].phase == "queued" and sim.recs["a2"].first_start is not None
    b = res["jobs"]["balance"]
    assert (b["submitted"], b["finished"], b["running"], b["queued"], b["requeued"]) == (6, 0, 4, 0, 2)
    assert b["holds"]
    assert res["jobs"]["outcomes"] == {}
    assert res["jobs"]["outcomes_of_warmup_jobs"] == {"succeeded": 1}


# ---------------------------------------------------------------------- checks and margins


@pytest.mark.parametrize(
    "ours, theirs, margin, relative, higher, expected",
    [
        (86.0, 85.5, 0.5, False, True, True),  # exactly the margin: better
        (86.0, 85.51, 0.5, False, True, "tie"),
        (86.0, 86.49, 0.5, False, True, "tie"),
        (86.0, 86.5, 0.5, False, True, False),
        (83.52, 85.9, 0.5, False, True, False),
        (100.0, 95.0, 0.05, True, False, False),  # a count: 5% of the larger
        (100.0, 95.1, 0.05, True, False, "tie"),
        (95.0, 100.0, 0.05, True, False, True),
        (0.0, 0.0, 0.05, True, False, "tie"),
        (0.0, 1.0, 0.05, True, False, True),
        (None, 1.0, 0.5, False, True, None),
        (1.0, None, 0.5, False, True, None),
    ],
)
def test_compare_needs_the_margin_to_call_better_or_worse(ours, theirs, margin, relative, higher, expected) -> None:
    assert compare(ours, theirs, margin=margin, relative=relative, higher_is_better=higher) == expected


def _quiet_policy(alloc_over: float | None = None, *, prod: bool = False, large: int = 0) -> dict:
    empty = {"n": 0, "p95": None, "mean": None, "censored": 0}
    wait = {"n": 3, "p95": 30.0} if prod else empty
    return {
        "allocation": {
            "healthy_gpu_pct": 40.0,
            "healthy_gpu_pct_while_demand_exceeds_capacity": alloc_over,
            "healthy_gpu_pct_net_of_lost_work": 40.0,
        },
        "wait_s": {
            "by_class_and_size": {
                c: {"<=8": wait if c.startswith("prod") else empty}
                for c in ("prod-serving", "prod-batch", "research", "preemptible")
            },
            "large_gangs": {"n": large, "mean": 60.0 if large else None, "censored": 0},
        },
        "large_gangs": {"placements": large, "in_min_blocks_or_within_max_blocks": large},
        "reclaim": {"count": 0, "over_grace_plus_2_cycles": 0},
        "teams": {"t": {"guaranteed": {"h100": 0}}},
        "starved_teams": [],
        "starved_teams_while_capacity_suffices": [],
        "starved_teams_while_nodes_suffice": [],
        "starved_teams_by_one_job": [],
    }


@pytest.mark.parametrize(
    "key, reason",
    [
        ("alloc_floor_90", "demand never exceeded capacity in the window"),
        ("alloc_target_95", "demand never exceeded capacity in the window"),
        ("prod_p95_wait_le8_floor_600s", "no prod-serving or prod-batch job of <= 8 GPUs in the window"),
        ("prod_p95_wait_le8_target_120s", "no prod-serving or prod-batch job of <= 8 GPUs in the window"),
        ("reclaim_within_grace_plus_2_cycles", "no borrowed capacity was reclaimed in the window"),
        ("no_team_starved", "no team has a guarantee: starvation is defined against one"),
        ("no_team_starved_while_capacity_suffices", "no team has a guarantee: starvation is defined against one"),
        ("no_team_starved_while_nodes_suffice", "no team has a guarantee: starvation is defined against one"),
        ("large_gangs_in_min_blocks_or_max_blocks", "no gang of >= 1,024 GPUs was placed in the window"),
    ],
)
def test_a_check_with_nothing_to_judge_is_null_with_its_reason(key: str, reason: str) -> None:
    c = checks({"policies": {"ours": _quiet_policy(), "fifo": _quiet_policy()}})
    assert c[key] is None
    assert c["why_null"][key] == reason
    assert c["better_large_gang_wait_than"] == {"fifo": None}
    assert c["better_allocation_than"] == {"fifo": "tie"}


def test_mid_size_waits_are_compared_like_large_gangs() -> None:
    def pol(mean: float, censored: int) -> dict:
        p = _quiet_policy()
        p["wait_s"]["by_size"] = {"9-1023": {"n": 40, "mean": mean, "censored": censored}}
        return p

    rep = {
        "policies": {
            "ours": pol(600.0, 0),
            "a": pol(620.0, 0),
            "b": pol(900.0, 0),
            "c": pol(400.0, 0),
            "d": pol(610.0, 3),
            "e": pol(400.0, 2),
        }
    }
    assert checks(rep)["better_9_1023_gpu_wait_than"] == {"a": "tie", "b": True, "c": False, "d": True, "e": "tie"}


def test_checks_with_something_to_judge_are_true_or_false() -> None:
    ours = _quiet_policy(91.0, prod=True, large=2)
    ours["teams"]["t"]["guaranteed"]["h100"] = 8
    c = checks({"policies": {"ours": ours}})
    assert (c["alloc_floor_90"], c["alloc_target_95"]) == (True, False)
    assert c["prod_p95_wait_le8_target_120s"] is True and c["no_team_starved"] is True
    assert c["no_team_starved_while_capacity_suffices"] is True
    assert c["no_team_starved_while_nodes_suffice"] is True
    assert c["large_gangs_in_min_blocks_or_max_blocks"] is True
    assert c["reclaim_within_grace_plus_2_cycles"] is None  # still nothing reclaimed
    assert set(c["why_null"]) == {"reclaim_within_grace_plus_2_cycles"}
    assert c["margins"] == {"pct_points": 0.5, "relative": 0.05}


# ---------------------------------------------------------------------- several seeds


@pytest.mark.parametrize(
    "text, seeds",
    [("1-5", [1, 2, 3, 4, 5]), ("1,3,7", [1, 3, 7]), ("1-3,7", [1, 2, 3, 7]), (" 4 ", [4]), ("2,2,1-2", [2, 1])],
)
def test_parse_seeds(text: str, seeds: list[int]) -> None:
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize("bad", ["", "a", "5-1", "1-", "1-2000"])
def test_parse_seeds_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_seeds(bad)


def _fake_report(alloc: float, starved: list[str], over: float | None, balance: bool = True) -> dict:
    return {
        "policies": {
            "ours": {
                "allocation": {"healthy_gpu_pct": alloc, "healthy_gpu_pct_while_demand_exceeds_capacity": over},
                "starved_teams": starved,
                "jobs": {"balance": {"submitted": 3, "holds": balance}},
                "series": {"t_h": [0.0, 1.0]},
                "timing": {"wall_s": 12.0},
            }
        },
        "checks": {
            "alloc_while_demand_exceeds_capacity_pct": over,  # a figure, not a verdict
            "alloc_floor_90": None if over is None else over >= 90,
            "better_allocation_than": {"fifo": "tie"},
        },
    }


def test_across_seeds_min_median_max_per_metric_and_check_counts() -> None:
    reps = {
        1: _fake_report(80.0, [], 92.0),
        2: _fake_report(90.0, ["a", "b"], None),
        3: _fake_report(70.0, ["a"], 85.0, balance=False),
    }
    a = across_seeds(reps)
    assert a["seeds"] == [1, 2, 3]
    ours = a["policies"]["ours"]
    assert ours["allocation.healthy_gpu_pct"] == {"min": 70.0, "median": 80.0, "max": 90.0, "n": 3}
    # null on seed 2: summarized over the seeds that have it
    assert ours["allocation.healthy_gpu_pct_while_demand_exceeds_capacity"] == {
        "min": 85.0,
        "median": 88.5,
        "max": 92.0,
        "n": 2,
    }
    assert ours["starved_teams_count"] == {"min": 0, "median": 1.0, "max": 2, "n": 3}
    assert not any(k.startswith(("series", "timing")) for k in ours)
    assert a["jobs_balance_holds"] == {"ours": {"false": 1, "true": 2}}
    assert a["checks"]["alloc_floor_90"] == {"false": 1, "null": 1, "true": 1}
    assert a["checks"]["better_allocation_than.fifo"] == {"tie": 3}
    assert set(a["checks"]) == {"alloc_floor_90", "better_allocation_than.fifo"}
    assert "| allocated % of healthy GPUs | 70.0% / 80.0% / 90.0% |" in seeds_table(a)


def _pair_run(ref: dict, cand: dict) -> dict:
    def pol(net: float, over: float | None, starved: int, lost: float, mid: float | None) -> dict:
        return {
            "allocation": {
                "healthy_gpu_pct_net_of_lost_work": net,
                "healthy_gpu_pct_while_demand_exceeds_capacity": over,
            },
            "starved_teams": [f"t{i}" for i in range(starved)],
            "lost_gpu_hours": {"preemption": lost},
            "wait_s": {"by_size": {"9-1023": {"mean": mid}}},
            "jobs": {"balance": {"holds": True}},
        }

    return {"policies": {"ours": pol(**ref), "ours:x=1": pol(**cand)}}


def test_paired_compares_each_policy_with_the_first_run_by_run_past_the_margins() -> None:
    base = {"net": 80.0, "over": 90.0, "starved": 0, "lost": 1000.0, "mid": 100.0}
    reps = {
        # better net past 0.5 points, within it while over capacity, one team more starved,
        # 4% more lost (within 5%), a wait that is null for the candidate
        1: _pair_run(base, {"net": 80.6, "over": 90.4, "starved": 1, "lost": 1040.0, "mid": None}),
        # worse net past the margin, better over capacity, 10% less lost, a shorter wait
        2: _pair_run(base, {"net": 79.0, "over": 91.0, "starved": 0, "lost": 900.0, "mid": 50.0}),
        # the same everywhere
        3: _pair_run(base, base),
    }
    p = paired(reps)
    assert p["reference"] == "ours" and list(p["policies"]) == ["ours:x=1"]
    f = p["policies"]["ours:x=1"]
    net = f["allocation.healthy_gpu_pct_net_of_lost_work"]
    assert (net["better"], net["worse"], net["tie"]) == (1, 1, 1)
    assert net["difference"] == {"min": -1.0, "mean": round((0.6 - 1.0) / 3, 4), "max": 0.6, "n": 3}
    over = f["allocation.healthy_gpu_pct_while_demand_exceeds_capacity"]
    assert (over["better"], over["worse"], over["tie"]) == (1, 0, 2)
    starved = f["starved_teams_count"]  # any team counts: no margin
    assert (starved["better"], starved["worse"], starved["tie"]) == (0, 1, 2)
    lost = f["lost_gpu_hours.preemption"]  # lower is better, 5% of the larger value
    assert (lost["better"], lost["worse"], lost["tie"]) == (1, 0, 2)
    mid = f["wait_s.by_size.9-1023.mean"]  # null on run 1: left out
    assert mid["difference"]["n"] == 2 and (mid["better"], mid["worse"], mid["tie"]) == (1, 0, 1)
    absent = f["wait_s.large_gangs.mean"]
    assert absent["difference"] == {"min": None, "mean": None, "max": None, "n": 0}
    a = across_seeds(reps)
    assert a["paired"] == p
    table = paired_table(a)
    assert table.startswith("| column − ours, run by run: mean (min / max); runs better / worse / tie | ours:x=1 |")
    assert "| net of lost work, points | -0.13 (-1.00 / +0.60); 1 / 1 / 1 |" in table
    assert "| teams starved | +0.33 (+0 / +1); 0 / 1 / 2 |" in table
    assert "| large gangs (≥1,024): wait mean | – |" in table
    assert table in seeds_table(a)
    # every paired figure has its row, in the same order
    assert list(PAIRED_LABELS) == [path for path, _, _ in PAIRED_FIGURES]
    # one policy: nothing to pair, and the seeds table carries no second table
    one = {k: {"policies": {"ours": r["policies"]["ours"]}} for k, r in reps.items()}
    assert paired(one) == {"reference": "ours", "policies": {}}


def test_flatten_keeps_numbers_by_path() -> None:
    assert flatten({"a": {"b": 1, "c": [1, 2], "d": True, "e": None}, "starved_teams": ["x"], "_s": 3}) == {
        "a.b": 1,
        "a.e": None,
        "starved_teams_count": 1,
    }


def _app() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.command()(sim)
    return app


def test_cli_seeds_reports_each_seed_and_min_median_max(tmp_path: Path) -> None:
    out = tmp_path / "seeds.json"
    args = ["--workload", "seed", "--days", "0.02", "--nodes", "64", "--warmup-h", "0.2", "--drain-h", "1",
            "--policies", "ours,fifo", "--quiet"]  # fmt: skip
    r = CliRunner().invoke(_app(), [*args, "--seeds", "1,3", "--json", str(out), "--table", str(tmp_path / "t.md")])
    assert r.exit_code == 0, r.output
    rep = json.loads(out.read_text())
    assert rep["seeds"] == [1, 3] and list(rep["runs"]) == ["1", "3"]
    assert rep["runs"]["3"]["seed"] == 3 and list(rep["runs"]["3"]["policies"]) == ["ours", "fifo"]
    st = rep["across_seeds"]["policies"]["ours"]["allocation.healthy_gpu_pct"]
    per_seed = sorted(rep["runs"][s]["policies"]["ours"]["allocation"]["healthy_gpu_pct"] for s in ("1", "3"))
    assert (st["min"], st["max"], st["n"]) == (per_seed[0], per_seed[1], 2)
    assert (tmp_path / "t.md").read_text().startswith("| metric (min / median / max over seeds 1, 3) | ours | fifo |")
    # fifo beside ours on the same runs
    assert rep["across_seeds"]["paired"]["reference"] == "ours"
    pair = rep["across_seeds"]["paired"]["policies"]["fifo"]["allocation.healthy_gpu_pct_net_of_lost_work"]
    assert pair["difference"]["n"] == 2 and pair["better"] + pair["worse"] + pair["tie"] == 2
    assert "| column − ours, run by run" in (tmp_path / "t.md").read_text()
    # each seed's report is the one a single-seed run gives (timings aside)
    one = tmp_path / "one.json"
    r = CliRunner().invoke(_app(), [*args, "--json", str(one), "--seed", "3"])
    assert r.exit_code == 0, r.output
    single = json.loads(one.read_text())
    for p in (single, rep["runs"]["3"]):
        for pol in p["policies"].values():
            pol.pop("timing")
    assert single == rep["runs"]["3"]
    r = CliRunner().invoke(_app(), ["--seeds", "5-1", "--quiet"])
    assert r.exit_code == 2 and "seeds" in r.output


def test_cli_fault_draws_run_each_seed_on_each_draw(tmp_path: Path) -> None:
    """``--fault-draws 0-1``: a run per seed and draw, keyed "seed/dN"; draw 0 is the seed's
    own run, and another draw keeps the workload but not the faults."""
    args = ["--workload", "seed", "--days", "0.02", "--nodes", "64", "--warmup-h", "0.2", "--drain-h", "1",
            "--failure-rate", "0.01", "--policies", "ours", "--quiet"]  # fmt: skip
    out = tmp_path / "draws.json"
    r = CliRunner().invoke(_app(), [*args, "--seed", "3", "--fault-draws", "0-1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    rep = json.loads(out.read_text())
    assert rep["seeds"] == [3] and rep["fault_draws"] == [0, 1] and list(rep["runs"]) == ["3/d0", "3/d1"]
    d0, d1 = rep["runs"]["3/d0"], rep["runs"]["3/d1"]
    assert (d0["fault_draw"], d1["fault_draw"]) == (0, 1)
    assert d0["workload"] == d1["workload"]
    assert d0["policies"]["ours"]["failures"] != d1["policies"]["ours"]["failures"]
    assert rep["across_seeds"]["policies"]["ours"]["allocation.healthy_gpu_pct"]["n"] == 2
    one = tmp_path / "one.json"
    r = CliRunner().invoke(_app(), [*args, "--seed", "3", "--json", str(one)])
    assert r.exit_code == 0, r.output
    single = json.loads(one.read_text())
    for p in (single, d0):
        for pol in p["policies"].values():
            pol.pop("timing")
    assert single == d0
    r = CliRunner().invoke(_app(), ["--fault-draws", "-1", "--quiet"])
    assert r.exit_code == 2 and "fault-draws" in r.output


# ---------------------------------------------------------------------- the SIGTERM cost model


@pytest.mark.parametrize("gpus, seconds", [(1, 120.0), (8, 120.0), (9, 300.0), (1023, 300.0), (1024, 600.0)])
def test_restart_time_by_size(gpus: int, seconds: float) -> None:
    assert restart_s(gpus) == seconds


def test_seventy_percent_of_checkpointing_jobs_save_deterministically_per_job_and_seed() -> None:
    ids = [f"job-{i}" for i in range(20_000)]
    share = sum(saves_on_sigterm(j, 1, True) for j in ids) / len(ids)
    assert abs(share - SIGTERM_SAVE_SHARE) < 0.015
    assert [saves_on_sigterm(j, 1, True) for j in ids[:200]] == [saves_on_sigterm(j, 1, True) for j in ids[:200]]
    assert [saves_on_sigterm(j, 1, True) for j in ids[:200]] != [saves_on_sigterm(j, 2, True) for j in ids[:200]]
    assert not any(saves_on_sigterm(j, 1, False) for j in ids[:200])  # cannot checkpoint: cannot save


def _reclaim_run(seed: int):
    # team A runs 4 x 8 GPUs (2 borrowed, checkpoints every 10 min) from ~0; at 1 h team B
    # reclaims 16 GPUs: a2 and a3 get SIGTERM with a 30 s grace, 10 min after a checkpoint
    a_jobs = [job(f"a{i}", "A", float(i), 10 * HOUR, checkpoint_s=600.0, grace_s=30.0) for i in range(4)]
    b_jobs = [job(f"b{i}", "B", HOUR + i, 1 * HOUR, grace_s=30.0) for i in range(2)]
    wl = workload(a_jobs + b_jobs, {"A": (16, 32), "B": (16, 32)}, blocks=1, end=3 * HOUR)
    from placement import PRESETS
    from sim.core import Simulation

    sim = Simulation(wl, PRESETS["gpufleet"], "t", (), SimOptions(keep_log=True), seed=seed)
    return sim, sim.run()


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_sigterm_model_prices_each_preemption_beside_todays(seed: int) -> None:
    sim, res = _reclaim_run(seed)
    victims = {pr.victim: (now, pr) for now, pr in preemptions(sim)}
    assert set(victims) == {"a2", "a3"}
    today = sig = saved_h = 0.0
    n_saved = 0
    for v, (now, pr) in victims.items():
        # today: the work since the last 10-min checkpoint, up to the end of the grace
        lost = 8 * ((now + pr.grace_s) - (v == "a2") * 2.0 - (v == "a3") * 3.0 - 3000.0) / 3600.0
        today += lost
        if saves_on_sigterm(v, seed, True):
            n_saved += 1
            h = 8 * (pr.grace_s + 120.0) / 3600.0  # grace + restart of a <= 8-GPU job
            sig += h
            saved_h += h
        else:
            sig += lost
    assert res["lost_gpu_hours"]["preemption"] == pytest.approx(today, abs=2e-3)
    m = res["lost_gpu_hours_sigterm_model"]
    assert m["preemption"] == pytest.approx(sig, abs=2e-3)
    assert m["preemption_saved_on_sigterm"] == pytest.approx(saved_h, abs=2e-3)
    assert m["of_which_restart"] == pytest.approx(n_saved * 8 * 120.0 / 3600.0, abs=2e-3)
    assert (m["preemptions_saved_on_sigterm"], m["preemptions_not_saved"]) == (n_saved, 2 - n_saved)
    assert m["failures"] == res["lost_gpu_hours"]["failures"]
    a = res["allocation"]
    assert a["healthy_gpu_pct_net_of_lost_work_sigterm_model"] == pytest.approx(
        100 * (a["allocated_gpu_hours"] - m["preemption"]) / a["healthy_gpu_hours"], abs=0.06
    )  # allocated_gpu_hours is rounded to 0.1 of 96 healthy GPU-hours


def test_the_sigterm_model_changes_no_other_figure() -> None:
    # the seed only picks who saves on SIGTERM: the schedule and today's figures are the same
    _, r1 = _reclaim_run(1)
    _, r2 = _reclaim_run(2)
    for res in (r1, r2):
        res.pop("timing")
        res.pop("lost_gpu_hours_sigterm_model")
        res["allocation"].pop("healthy_gpu_pct_net_of_lost_work_sigterm_model")
    assert r1 == r2


def test_sigterm_model_on_a_seed_run_is_deterministic_and_reported() -> None:
    wl = seed_workload(
        SeedConfig(days=0.04, nodes=64, warmup_h=0.5, seed=1, load_scale=3.0, submissions_per_day=120_000)
    )
    opts = SimOptions(drain_s=HOUR)
    rep = run_policies(wl, ["ours", "kueue-like"], seed=1, failures=None, options=opts)
    assert to_json(rep, timings=False) == to_json(
        run_policies(wl, ["ours", "kueue-like"], seed=1, failures=None, options=opts), timings=False
    )
    assert rep["cost_models"]["sigterm_model"]["save_on_sigterm_share_of_checkpointing_jobs"] == 0.7
    for p in rep["policies"].values():
        m = p["lost_gpu_hours_sigterm_model"]
        assert m["preemptions_saved_on_sigterm"] + m["preemptions_not_saved"] == p["preemptions"]["total"]
        assert m["preemption"] == pytest.approx(m["preemption_saved_on_sigterm"] + m["preemption_not_saved"], abs=1e-2)
    assert rep["policies"]["ours"]["preemptions"]["total"] > 0
    assert "SIGTERM cost model" in markdown_table(rep)
