"""Postgres or Temporal goes away under running jobs (``bench.outage`` at a scale this machine
runs in a test): no running job restarts, no lease ends, no node is judged suspect or down,
and jobs submitted around the outage run once it is back, with no GPU held twice.

16 nodes in 4 blocks over 4 agent processes, two control processes, timings scaled down
(heartbeat 0.5 s, leader lease 3 s, takeover quiet 2 s, suspect after 3 s, down after 6 s), the
service away for 10 s: over three leader lease lifetimes and past down_after_s."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SCALED = {
    "heartbeat_interval_s": 0.5,
    "agent_ack_timeout_s": 1.5,
    "agent_connect_timeout_s": 1.5,
    "leader_ttl_s": 3.0,
    "leader_renew_s": 0.5,
    "takeover_quiet_s": 2.0,
    "suspect_after_s": 3.0,
    "down_after_s": 6.0,
    "allocation_resignal_s": 1.0,
    "workflow_reconcile_s": 2.0,
}
DOWN_S = 10.0


@pytest.mark.parametrize("service", ["postgres", "temporal"])
def test_an_outage_restarts_nothing_and_the_work_around_it_runs(service):
    from bench.outage import run

    r = run(
        service=service, down_s=DOWN_S, hard=True, blocks=4, nodes_per_block=4, jobs=12, gang_gpus=16, burst=6,
        agent_procs=4, observe_s=10.0, settle_s=90.0, overrides=SCALED,
    )  # fmt: skip
    summary = {k: v for k, v in r.items() if k not in ("settings", "stack", "measured")}
    assert r["running_jobs_before"] == 13 and r["outage_s"] >= DOWN_S, summary
    assert r["ok"], summary
    assert r["jobs_restarted"] == [] and r["leases_ended"] == 0, summary
    assert r["nodes_marked_suspect"] == [] and r["nodes_marked_down"] == [], summary
    assert r["burst_not_running"] == 0 and r["most_gpus_with_two_live_leases"] == 0, summary
    if service == "postgres":
        # no one could renew the lease: a leader takes a new epoch once Postgres is back, and
        # judges silence only after its quiet period, by when the nodes have relinked to it
        assert r["leader_epochs_since"] and r["back_to_leader_s"] < 10.0, summary
    else:
        assert r["leader_epochs_since"] == [], summary  # leadership lives in Postgres only
    # placement resumes within a few resignal periods of the service's return
    assert r["back_to_burst_running_s"]["max"] < 30.0, summary


def test_the_bench_outage_command_is_registered():
    from cli.main import app

    out = CliRunner().invoke(app, ["bench", "outage", "--help"])
    assert out.exit_code == 0, out.output
    for option in ("--service", "--down-s", "--hard", "--burst", "--setting", "--json"):
        assert option in out.output
    bad = CliRunner().invoke(app, ["bench", "outage", "--service", "redis"])
    assert bad.exit_code != 0 and "one of postgres, temporal" in bad.output
