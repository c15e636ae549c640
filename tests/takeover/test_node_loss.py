"""Nodes die at once under running jobs (``bench.node_loss`` at a scale this machine runs in a
test): the leader marks exactly them down and restarts exactly their jobs, a gang whole, on
other nodes, with no GPU held twice; when the block comes back (thawed with its old ranks, or
started again empty), its nodes are cleared and nothing else moves.

6 blocks x 4 nodes, one agent process per block; the process hosting the 2-node gang is killed:
4 of 24 nodes (17%) fall silent, below the mass-silence guard's share (0.2), so they are judged
one by one, and the gang's workflow hears of each of its two nodes in turn. Timings scaled down (heartbeat 0.5 s, suspect after
3 s, down after 6 s)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCALED = {
    "heartbeat_interval_s": 0.5,
    "agent_ack_timeout_s": 1.5,
    "agent_connect_timeout_s": 1.5,
    "takeover_quiet_s": 1.0,
    "suspect_after_s": 3.0,
    "down_after_s": 6.0,
    "recovery_resignal_s": 1.0,
}


def test_a_lost_block_restarts_its_jobs_and_no_other():
    from bench.node_loss import run

    r = run(
        blocks=6, nodes_per_block=4, jobs=12, gang_gpus=16, agent_procs=6, fail_procs=1, settle_s=90.0,
        overrides=SCALED,
    )  # fmt: skip
    summary = {k: v for k, v in r.items() if k not in ("settings", "stack", "measured")}
    assert r["running_jobs_before"] == 13, summary
    assert r["nodes_failed"] == 4 and r["gang_hit"], summary
    assert r["ok"], summary
    assert r["nodes_marked_down"] == 4 and r["other_nodes_marked_down"] == [], summary
    assert r["jobs_restarted"] == r["jobs_hit"] and r["jobs_restarted_not_hit"] == [], summary
    assert r["live_leases_on_failed_nodes"] == 0 and r["gpus_with_two_live_leases"] == 0, summary
    assert r["health_guard_changes"] == [], summary  # below the guard's share: it never engaged
    # a node is down no sooner than down_after_s after its last heartbeat
    assert r["kill_to_down_s"]["median"] >= SCALED["down_after_s"] - SCALED["heartbeat_interval_s"], summary
    # ... and its jobs restart only then (the gang whole, on other nodes), and soon: not after
    # a stop's pickup timeout (start_task_timeout_s, 60 s) on a node that will never answer
    floor = SCALED["down_after_s"] - SCALED["heartbeat_interval_s"]
    assert r["gang_kill_to_restart_s"] is not None and r["gang_kill_to_restart_s"] >= floor, summary
    assert r["kill_to_restart_s"]["max"] < SCALED["down_after_s"] + 20.0, summary


@pytest.mark.parametrize(("fault", "back"), [("freeze", "restarted"), ("freeze", "down"), ("kill", "restarted")])
def test_a_lost_block_that_comes_back_is_cleared_and_changes_no_job(fault, back):
    """The block's process comes back, once its jobs run elsewhere or as soon as its nodes are
    down (while its jobs restart): thawed, with its ranks of the replaced attempts still in
    memory (the leader has them stopped), or started again, empty. Its nodes are cleared for
    burn-in; every hit job runs in its next attempt and no other moved; the late reports
    change nothing."""
    from bench.node_loss import run

    r = run(
        blocks=6, nodes_per_block=4, jobs=12, gang_gpus=16, agent_procs=6, fail_procs=1, settle_s=90.0,
        overrides=SCALED, fault=fault, back=back,
    )  # fmt: skip
    summary = {k: v for k, v in r.items() if k not in ("settings", "stack", "measured")}
    returned = r["returned"]
    assert r["ok"] and r["jobs_restarted"] == r["jobs_hit"] > 0, summary
    assert r["jobs_restarted_more_than_once"] == [] and r["most_gpus_with_two_live_leases"] == 0, summary
    assert returned["nodes_not_cleared"] == [] and returned["jobs_changed"] == [], summary
    assert returned["late_reports_undelivered"] == 0, summary
    if fault == "freeze":
        # a report per rank the nodes held, each STOPPED by the leader: none fenced itself
        # (unconfirmed_kill_s is 900 s), none exited as if its work were done
        assert set(returned["late_reports"]) == {"STOPPED"}, summary
        assert returned["late_reports"]["STOPPED"] >= r["jobs_hit"], summary
    else:
        assert returned["late_reports"] == {}, summary  # a restarted agent's simulated ranks are gone
    assert returned["back_to_clear_s"]["max"] < 20.0, summary


def test_the_bench_node_loss_command_is_registered():
    from cli.main import app

    out = CliRunner().invoke(app, ["bench", "node-loss", "--help"])
    assert out.exit_code == 0, out.output
    for option in (
        "--blocks",
        "--agent-procs",
        "--fail-procs",
        "--gang-gpus",
        "--setting",
        "--json",
        "--fault",
        "--back",
    ):
        assert option in out.output
