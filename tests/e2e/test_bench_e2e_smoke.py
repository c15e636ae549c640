"""`gpufleet bench e2e` on a small load: its own embedded stack, a control process with a
job-worker child, the API and a simulated fleet; every job reaches RUNNING and the JSON has
the promised keys."""

from __future__ import annotations

from bench.e2e import run


def test_bench_e2e_small_load_runs_every_job():
    result = run(jobs=20, rate=10.0, job_seconds=60.0, settle_s=60.0, baseline=False, repeat=2)
    for key in ("submitted", "errors", "p50_ms", "p95_ms", "p99_ms"):
        assert key in result
    assert result["errors"] == 0, result.get("error_samples")
    assert result["submitted"] == 20 and result["running"] == 20
    assert result["repeat"] == 2 and len(result["runs"]) == 2
    assert result["p95_ms"] is not None and result["p95_ms"] > 0
    assert result["job_events"].get("running") == 20
    # what each job cost the server, from its own /metrics: every job was created in its store
    cost = result["temporal_persistence_per_job"]
    assert cost["by_operation"].get("CreateWorkflowExecution", 0) >= 1.0
    assert cost["total"] > cost["by_operation"]["CreateWorkflowExecution"]
    assert result["temporal_cpu_ms_per_job"] > 0
