"""A chaos run on the HA stack (issue 24, "Must show"): Postgres as a primary and a
synchronous standby under the failover supervisor, two control processes, the workload
submitting throughout. The primary is SIGKILLed while a burst is submitted, the standby is
lost once, the leader is killed once; every invariant holds (no acknowledged job lost, no
GPU double-allocated, no running rank touched by a control-plane fault) and submissions
are accepted again well within 30 s of the primary's death.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from chaos import schedule
from chaos.run import ChaosOptions, run_chaos
from chaos.stack import Layout
from chaos.timeline import ALL_FAULT_KINDS, FAULT_KINDS

# what a failed run's assertion shows
SUMMARY = (
    "faults",
    "jobs",
    "invariants",
    "counterexamples",
    "fault_timeline",
    "leftover_processes",
    "unfinished_at_end",
)

SEED = 3
KINDS = ("postgres_failover", "postgres_restart", "leader_kill")


@pytest.mark.parametrize("seed", [1, 2, 3, 17])
def test_a_ha_run_of_three_minutes_plans_a_postgres_failover(seed: int) -> None:
    plan = schedule.plan(seed, 180.0, kinds=ALL_FAULT_KINDS)
    assert {p.kind for p in plan} == set(ALL_FAULT_KINDS)
    # a run without --ha plans what it always did: the HA kinds are extra
    assert schedule.plan(seed, 180.0) == schedule.plan(seed, 180.0, kinds=FAULT_KINDS)


async def test_ha_kinds_need_the_ha_stack() -> None:
    from common.embedded import PlatformError

    with pytest.raises(PlatformError, match="need --ha"):
        await run_chaos(ChaosOptions(minutes=1, kinds=("postgres_failover",)))


@pytest.mark.e2e
@pytest.mark.slow
async def test_the_primary_postgres_sigkilled_under_submissions_loses_nothing() -> None:
    work = Path(tempfile.mkdtemp(prefix="gpufleet-chaos-ha-"))
    lines: list[str] = []
    passed = False
    try:
        rep = await run_chaos(
            ChaosOptions(
                minutes=1.5, seed=SEED, min_gap_s=15.0, settle_s=90.0, workdir=work, keep=True,
                layout=Layout(ha=True), kinds=KINDS,
            ),
            log=lines.append,
        )  # fmt: skip
        summary = {k: rep[k] for k in SUMMARY}
        assert rep["ok"] and all(rep["invariants"].values()), json.dumps(summary, indent=1, default=str)
        assert rep["faults"]["postgres_failover"] >= 1, summary
        assert not rep["crashes"], rep["crashes"]
        for f in rep["measurements"]["postgres_failovers"]:
            assert f["new_primary"] != f["old_primary"], f
            assert f["promoted_after_s"] is not None and f["promoted_after_s"] < 10, f
            assert f["writes_after_s"] is not None and f["writes_after_s"] < 30, f
            # every submission of the burst sent as the primary died was accepted within 30 s
            assert f["burst_accepted_after_s"] is not None and f["burst_accepted_after_s"] < 30, f
            assert f["synchronous_again_after_s"] is not None, f"no new standby: {f}"
        standby = [f for f in rep["fault_timeline"] if f["kind"] == "postgres_restart"]
        assert all(f["synchronous_again_after_s"] is not None for f in standby), standby
        assert rep["submissions"]["accepted"] == rep["submissions"]["logical"], rep["submissions"]
        passed = True
    finally:
        if passed:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print("\n".join(lines[-60:]))
