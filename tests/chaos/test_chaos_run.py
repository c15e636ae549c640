"""A short chaos run is part of the suite (issue 19, "Must show"): its own stack, the mixed
workload, every fault kind at least once, the independent checker, and nothing left behind.

2.5 minutes of workload with the faults 15 s apart (8 slots: one per kind), so the whole
run, start to teardown, stays near 3 minutes on a 2-core box. Four agents of two nodes each:
an agent fault silences two of the eight nodes, fewer than the mass-silence guard's three,
so they are marked down and their gangs restarted elsewhere (with two agents, half the fleet
went silent at once and the guard, rightly, marked none down: CI never took that path).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import psutil
import pytest

from chaos.run import ChaosOptions, run_chaos
from chaos.stack import Layout
from chaos.timeline import FAULT_KINDS

# what a failed run's assertion shows
SUMMARY = ("faults", "jobs", "invariants", "counterexamples", "durations_s", "state_dir", "unfinished_at_end")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SEED = 5


def _processes_under(root: Path) -> list[str]:
    """Processes that still name the run's dir (command line or working dir)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
        cmd = " ".join(p.info.get("cmdline") or ())
        if str(root) in cmd or (p.info.get("cwd") or "").startswith(str(root)):
            out.append(f"{p.info['pid']}: {cmd[:160]}")
    return out


async def test_a_chaos_run_injects_every_fault_and_every_invariant_holds() -> None:
    work = Path(tempfile.mkdtemp(prefix="gpufleet-chaos-test-"))
    lines: list[str] = []
    passed = False
    try:
        # the state dir is kept (its processes are gone) so a failure leaves its evidence
        rep = await run_chaos(
            ChaosOptions(
                minutes=2.5, seed=SEED, min_gap_s=15.0, settle_s=90.0, workdir=work, keep=True, layout=Layout(agents=4)
            ),
            log=lines.append,
        )
        summary = {k: rep[k] for k in SUMMARY}
        assert all(rep["invariants"].values()), json.dumps(summary, indent=1, default=str)
        assert rep["leftover_processes"] == [], (
            f"the teardown found processes still running: {rep['leftover_processes']}"
        )
        assert rep["ok"]
        missing = [k for k in FAULT_KINDS if rep["faults"].get(k, 0) < 1]
        assert not missing, f"fault kinds never injected: {missing}; {rep['fault_timeline']}"
        assert not rep["crashes"], f"children exited by themselves: {rep['crashes']}"
        assert sum(rep["jobs"].values()) >= 20 and rep["jobs"].get("SUCCEEDED", 0) >= 10, rep["jobs"]
        assert rep["submissions"]["sent_again_with_same_key"] >= 1
        assert rep["measurements"]["takeover_s"]["n"] >= 1, "a leader kill or stop was taken over"
        assert not _processes_under(work), "nothing of the run is left running"
        passed = True
    finally:
        if passed:
            shutil.rmtree(work, ignore_errors=True)
