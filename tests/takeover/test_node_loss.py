"""Nodes die at once under running jobs (``bench.node_loss`` at a scale this machine runs in a
test): the leader marks exactly them down and restarts exactly their jobs, a gang whole, on
other nodes, with no GPU held twice.

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


def test_the_bench_node_loss_command_is_registered():
    from cli.main import app

    out = CliRunner().invoke(app, ["bench", "node-loss", "--help"])
    assert out.exit_code == 0, out.output
    for option in ("--blocks", "--agent-procs", "--fail-procs", "--gang-gpus", "--setting", "--json"):
        assert option in out.output
