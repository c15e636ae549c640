"""Issue 19, defect 5 at a scale this machine runs in a test: a leader frozen (SIGSTOP) past its
lease, then killed, under running jobs, restarts nothing.

``bench.takeover`` at 2 blocks x 8 nodes (16 nodes, 13 running jobs among them a 4-node gang),
timings scaled down (heartbeat 0.5 s, lease 4 s, suspect after 6 s, down after 10 s; the
leader is frozen for 16 s, then killed). Before the
fix the agents kept writing into the frozen leader's connection (one HTTP/2 connection shared by
every node of the process, its flow-control window soon full, the write waiting without a
deadline), so they reached the new leader only when the old one died: by then the new leader
had judged them silent, marked them suspect and down, and restarted their jobs. Now they leave
the frozen leader within the ack deadline, try every control address, wait at the standby until
it takes over, and the new leader counts silence from its own takeover."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCALED = {
    "heartbeat_interval_s": 0.5,
    "agent_ack_timeout_s": 1.5,
    "agent_connect_timeout_s": 1.5,
    "leader_renew_s": 1.0,
    "leader_ttl_s": 4.0,
    "takeover_quiet_s": 2.0,
    "suspect_after_s": 6.0,
    "down_after_s": 10.0,
}


def test_a_frozen_then_killed_leader_restarts_no_job_and_marks_no_node_down():
    from bench.takeover import run

    r = run(
        blocks=2,
        nodes_per_block=8,
        jobs=12,
        gang_gpus=32,
        freeze_s=16.0,
        observe_s=10.0,
        agent_procs=2,
        overrides=SCALED,
    )
    summary = {k: r[k] for k in ("takeover_s", "takeover_to_all_relinked_s", "takeover_to_first_placement_s",
                                 "jobs_restarted", "nodes_marked_down", "nodes_marked_suspect",
                                 "nodes_not_relinked", "health_guard_changes")}  # fmt: skip
    assert r["running_jobs_before"] == 13, summary
    # the standby took the lease while the leader was still frozen
    assert 0 < r["takeover_s"] < SCALED["leader_ttl_s"] + 2 * SCALED["leader_renew_s"], summary
    # every node is streaming to the new leader within seconds of the takeover, long before
    # the frozen one is killed (16 s after the freeze) and before any could be judged silent
    assert r["nodes_not_relinked"] == 0, summary
    assert r["takeover_to_all_relinked_s"] < SCALED["suspect_after_s"] - 1.0, summary
    assert (r["jobs_restarted"], r["nodes_marked_down"], r["nodes_marked_suspect"]) == (0, 0, 0), summary
    assert not r["gang_restarted"]
    # the new leader places again: the jobs submitted during the freeze
    assert r["takeover_to_first_placement_s"] is not None, summary


def test_the_bench_takeover_command_is_registered():
    from cli.main import app

    out = CliRunner().invoke(app, ["bench", "takeover", "--help"])
    assert out.exit_code == 0, out.output
    for option in ("--blocks", "--nodes-per-block", "--freeze-s", "--gang-gpus", "--setting", "--json"):
        assert option in out.output
