"""The `gpufleet sim` command end to end, and the engine's invariant checkers across a small
seed run of every policy."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from cli.sim_cmd import sim
from sim.core import SimOptions
from sim.failures import FailureModel
from sim.report import markdown_table
from sim.run import run_policies
from sim.seed import SeedConfig, seed_workload

FIX = Path(__file__).parent / "fixtures"


def _app() -> typer.Typer:
    app = typer.Typer(add_completion=False)
    app.command()(sim)
    return app


def test_cli_seed_writes_json_plots_and_table(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    r = CliRunner().invoke(
        _app(),
        [
            "--workload", "seed", "--days", "0.02", "--nodes", "64", "--warmup-h", "0.2", "--seed", "2", "--one-block-wait", "120",
            "--spread-slowdown", "0.2", "--drain-h", "6", "--json", str(out), "--plots", str(tmp_path / "plots"), "--table", str(tmp_path / "t.md"), "--quiet",
        ],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    rep = json.loads(out.read_text())
    assert list(rep["policies"]) == ["ours", "fifo", "kueue-like", "slurm-like"]
    assert rep["options"]["spread_slowdown"] == 0.2
    assert rep["options"]["drain_s"] == 6 * 3600
    ours = rep["policies"]["ours"]
    assert ours["preset"] == "gpufleet"
    for key in ("allocation", "idle", "wait_s", "teams", "lost_gpu_hours", "reclaim", "large_gangs", "preemptions"):
        assert key in ours
    assert set(ours["wait_s"]["by_class"]) == {"prod-serving", "prod-batch", "research", "preemptible"}
    assert set(ours["wait_s"]["by_size"]) == {"<=8", "9-1023", ">=1024"}
    assert ours["lost_gpu_hours"]["spread_placement"] >= 0
    assert ours["timing"]["cycle_ms"]["p50"] is not None
    assert (tmp_path / "plots" / "allocation.png").stat().st_size > 10_000
    assert (tmp_path / "plots" / "wait_cdf.png").stat().st_size > 10_000
    table = (tmp_path / "t.md").read_text()
    assert table.startswith("| metric | ours | fifo | kueue-like | slurm-like |")
    assert "never started (drain after the window)" in table


def test_cli_trace_one_policy_to_stdout() -> None:
    r = CliRunner().invoke(
        _app(),
        ["--workload", str(FIX / "philly.csv"), "--format", "philly", "--policies", "ours", "--nodes", "16",
         "--quiet"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert list(rep["policies"]) == ["ours"]
    assert rep["workload"]["trace"]["jobs"] == 25


def test_cli_rejects_unknown_policy_and_bad_trace(tmp_path: Path) -> None:
    r = CliRunner().invoke(_app(), ["--policies", "ours,magic", "--quiet"])
    assert r.exit_code != 0 and "magic" in r.output
    r = CliRunner().invoke(_app(), ["--spread-slowdown", "-0.1", "--quiet"])
    assert r.exit_code == 2 and "spread-slowdown" in r.output
    r = CliRunner().invoke(_app(), ["--drain-h", "-1", "--quiet"])
    assert r.exit_code == 2 and "drain-h" in r.output
    bad = tmp_path / "bad.csv"
    bad.write_text("foo,bar\n1,2\n")
    r = CliRunner().invoke(_app(), ["--workload", str(bad), "--quiet"])
    assert r.exit_code == 2 and "missing column" in r.output


@pytest.mark.parametrize("policy", ["ours", "fifo", "kueue-like", "slurm-like"])
def test_invariants_hold_every_cycle_of_a_small_seed_run(policy: str) -> None:
    wl = seed_workload(SeedConfig(days=0.03, nodes=64, warmup_h=0.5, seed=11))
    rep = run_policies(
        wl, [policy], failures=FailureModel(rate_per_gpu_hour=2e-3), options=SimOptions(check_every=1)
    )  # raises InvariantViolation on the first broken plan or state
    p = rep["policies"][policy]
    assert p["jobs"]["started"] > 0
    assert "| metric |" in markdown_table(rep)


def test_the_invariant_check_catches_a_repeated_decision_that_differs_from_a_fresh_one(monkeypatch) -> None:
    """With checks on, every cycle's plan is compared with the plan that decides every job
    afresh (``plan(dedupe=False)``). A fault that changes only the repeated decisions (here,
    the first pending job's reason) stops the run, naming the job; without it the same busy
    run (4x the run times: jobs wait, reserve and preempt) passes every cycle."""
    import sim.core as core
    from placement import PendingReason

    real = core.plan
    forged = []

    def faulty(state, queue, policy, now, *, dedupe=True):
        p = real(state, queue, policy, now, dedupe=dedupe)
        if dedupe and p.pending:
            forged.append(p.pending[0].job_id)
            first = p.pending[0]._replace(reason=PendingReason.LOOKAHEAD, detail="forged")
            p = replace(p, pending=(first, *p.pending[1:]))
        return p

    wl = seed_workload(SeedConfig(days=0.1, nodes=64, warmup_h=1.0, seed=11, load_scale=4.0))
    monkeypatch.setattr(core, "plan", faulty)
    with pytest.raises(core.InvariantViolation, match=r"differs from deciding every job afresh.*forged"):
        run_policies(wl, ["ours"], options=SimOptions(check_every=1))
    assert len(forged) == 1
    monkeypatch.setattr(core, "plan", real)
    rep = run_policies(wl, ["ours"], options=SimOptions(check_every=1))
    assert rep["policies"]["ours"]["preemptions"]["total"] > 0


def test_policy_overrides_try_a_change_side_by_side() -> None:
    from sim.run import resolve_policy

    preset, pol = resolve_policy("ours:preemption_protect_s=600:backfill=false:ordering=class_fifo")
    assert preset == "gpufleet"
    assert (pol.preemption_protect_s, pol.backfill, pol.ordering.value) == (600.0, False, "class_fifo")
    # optional knobs: turned off with none, and turned on (a number) where a preset has them off
    assert resolve_policy("ours:reclaim_small_borrowed_after_s=none")[1].reclaim_small_borrowed_after_s is None
    assert resolve_policy("fifo:reclaim_small_borrowed_after_s=30")[1].reclaim_small_borrowed_after_s == 30.0
    for bad in (
        "ours:nonsense=1",
        "ours:backfill",
        "ours:backfill=maybe",
        "magic",
        "fifo:reclaim_small_borrowed_after_s=x",
    ):
        with pytest.raises(ValueError):
            resolve_policy(bad)


def _policy_report(alloc: float, net: float, large_mean: float | None, large_n: int, censored: int) -> dict:
    wait = {"n": 1, "p95": 30.0}
    return {
        "allocation": {
            "healthy_gpu_pct": alloc,
            "healthy_gpu_pct_while_demand_exceeds_capacity": 93.0,
            "healthy_gpu_pct_net_of_lost_work": net,
        },
        "wait_s": {
            "by_class_and_size": {c: {"<=8": wait} for c in ("prod-serving", "prod-batch", "research", "preemptible")},
            "large_gangs": {"n": large_n, "mean": large_mean, "censored": censored},
        },
        "large_gangs": {"placements": 3, "in_min_blocks_or_within_max_blocks": 3},
        "reclaim": {"count": 2, "over_grace_plus_2_cycles": 0},
        "teams": {"t": {"guaranteed": {"h100": 8}}},
        "starved_teams": [],
        "starved_teams_while_capacity_suffices": [],
        "starved_teams_while_nodes_suffice": [],
        "starved_teams_by_one_job": [],
    }


def test_checks_compare_ours_with_every_baseline_in_the_same_report() -> None:
    from sim.run import checks

    rep = {
        "policies": {
            "ours": _policy_report(86.0, 83.0, 3600.0, 10, 1),
            "wasteful": _policy_report(88.0, 78.0, 3000.0, 10, 1),  # more held, less kept, shorter wait
            "starver": _policy_report(80.0, 80.0, 4000.0, 10, 4),
            "finisher": _policy_report(80.0, 80.0, 5000.0, 10, 0),  # longer mean, but leaves none waiting
            "idle": _policy_report(60.0, 60.0, None, 0, 0),  # no large gang at all
            "close": _policy_report(85.6, 83.4, 3500.0, 10, 1),  # within every margin
        }
    }
    c = checks(rep)
    assert (c["alloc_floor_90"], c["alloc_target_95"]) == (True, False)
    assert c["prod_p95_wait_le8_target_120s"] and c["no_team_starved"]
    # better or worse by 0.5 points at least, else a tie
    assert c["better_allocation_than"] == {
        "wasteful": False,
        "starver": True,
        "finisher": True,
        "idle": True,
        "close": "tie",
    }
    assert c["better_allocation_net_of_lost_work_than"] == {
        "wasteful": True,
        "starver": True,
        "finisher": True,
        "idle": True,
        "close": "tie",
    }
    # mean wait (5%) and gangs left waiting together: a longer mean with fewer gangs left is a
    # tie; no large gang at all leaves nothing to compare
    assert c["better_large_gang_wait_than"] == {
        "wasteful": False,
        "starver": True,
        "finisher": "tie",
        "idle": None,
        "close": "tie",
    }
    assert c["why_null"] == {"better_large_gang_wait_than.idle": "no gang of >= 1,024 GPUs submitted in the window"}
    assert checks({"policies": {"fifo": _policy_report(1, 1, None, 0, 0)}}) == {}
