"""``gpufleet bench placement`` at a small size: it runs, reports every figure, and leaves
the cyclic GC on (it holds it off only within each cycle, as the leader does)."""

from __future__ import annotations

import gc

from bench.placement import run


def test_a_small_run_reports_cycle_and_collector_times() -> None:
    assert gc.isenabled()
    out = run(gpus=512, cycles=6, queue=300, baseline_cycles=2, seed=3)
    assert gc.isenabled()
    assert out["cycles"] == 6 and out["gpus"] == 512
    for key in ("cycle_ms_p50", "cycle_ms_p99", "plan_ms_p99", "apply_ms_p99", "gc_ms_per_cycle_mean"):
        assert out[key] >= 0.0, key
    assert out["gc_ms_per_cycle_max"] >= out["gc_ms_per_cycle_mean"]
    assert out["considered_per_cycle"] > 0
    assert 0 < out["decided_afresh_per_cycle"] <= out["considered_per_cycle"]
    assert out["baseline"]["cycles"] == 2
