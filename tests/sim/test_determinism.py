"""Same seed -> byte-identical JSON (wall-clock timings excluded), in-process and across
interpreters with different hash seeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sim.failures import FailureModel
from sim.run import faults_for, run_policies, to_json
from sim.seed import SeedConfig, seed_workload

ROOT = Path(__file__).resolve().parents[2]
CFG = dict(days=0.04, nodes=96, warmup_h=0.5)
FAILURES = FailureModel(rate_per_gpu_hour=1e-2)  # busy enough to see faults in a tiny run

SCRIPT = """
import sys
from sim.failures import FailureModel
from sim.run import run_policies, to_json
from sim.seed import SeedConfig, seed_workload
wl = seed_workload(SeedConfig(seed=int(sys.argv[1]), days=0.04, nodes=96, warmup_h=0.5))
rep = run_policies(wl, seed=int(sys.argv[1]), failures=FailureModel(rate_per_gpu_hour=1e-2))
sys.stdout.write(to_json(rep, timings=False))
"""


def _run(seed: int) -> str:
    wl = seed_workload(SeedConfig(seed=seed, **CFG))
    return to_json(run_policies(wl, seed=seed, failures=FAILURES), timings=False)


def test_same_seed_same_json_and_other_seed_differs() -> None:
    a = _run(3)
    b = _run(3)
    assert a == b
    rep = json.loads(a)
    assert set(rep["policies"]) == {"ours", "fifo", "kueue-like", "slurm-like"}
    assert "timing" not in rep["policies"]["ours"]
    assert rep["faults_scheduled"] > 0
    assert sum(p["failures"]["faults"] for p in rep["policies"].values()) > 0
    assert _run(4) != a


def test_same_json_across_interpreters_with_different_hash_seeds() -> None:
    outs = []
    for hs in ("1", "987"):
        env = {**os.environ, "PYTHONHASHSEED": hs, "PYTHONPATH": str(ROOT)}
        r = subprocess.run(
            [sys.executable, "-c", SCRIPT, "5"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(r.stdout)
    assert outs[0] == outs[1]
    assert outs[0] == _run(5)


def test_a_fault_draw_is_another_schedule_on_the_same_workload() -> None:
    """``fault_draw`` 0 is the seed's own schedule; another draw moves the faults (same
    model, same workload, same jobs) and is itself reproducible."""
    wl = seed_workload(SeedConfig(seed=3, **CFG))
    own = faults_for(wl, FAILURES, 3)
    assert faults_for(wl, FAILURES, 3, 0) == own
    other = faults_for(wl, FAILURES, 3, 1)
    assert other and other != own
    assert faults_for(wl, FAILURES, 3, 1) == other
    rep = run_policies(wl, ("ours",), seed=3, failures=FAILURES, fault_draw=1)
    assert rep["fault_draw"] == 1
    assert rep["workload"] == run_policies(wl, ("ours",), seed=3, failures=FAILURES)["workload"]
