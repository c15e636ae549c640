"""A plan does not depend on the interpreter's string hash seed.

Sets of job ids iterate in an order that follows ``PYTHONHASHSEED``; a float summed over
such a set in that order can differ in its last bit (-0.1 - 0.2 - 0.3 is -0.6 or
-0.6000000000000001 by order), and two victim sets whose costs tie exactly would then be
chosen by hash seed: the simulator's heavy days came out different per process. Here two
nodes offer victim sets that tie in every rule (three jobs each, the same lost work, teams
0.1, 0.2 and 0.3 over their share), so the tie-break alone decides, under every hash seed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from placement import ClusterState, Policy, plan

from .helpers import HOUR, occupy, queue_of, spec

ROOT = Path(__file__).resolve().parents[2]
NOW = 20 * HOUR


def tied_victims() -> tuple[str, ...]:
    """The victims planned for a whole-node job when n0's and n1's occupants tie exactly."""
    st = ClusterState()
    for n in ("n0", "n1"):
        st.add_node(n, "b0", "h100", 8)
    # each node: one job of each team, 1 + 2 + 3 GPUs; the teams' over-shares 2/20, 4/20, 6/20
    for team, first, gpus in (("a", 2, 1), ("b", 3, 2), ("c", 5, 3)):
        st.set_quota(team, "h100", 20, 100)
        for n in ("n0", "n1"):
            j = spec(f"{team}-{n}", team=team, cls="preemptible", gpr=gpus)
            occupy(st, j, {n: tuple(range(first, first + gpus))}, started_at=NOW - HOUR, now=NOW)
    st.set_quota("me", "h100", 1000, 0)
    job = spec("x", team="me", cls="prod-batch", gpr=8, submit=NOW)
    p = plan(st, queue_of(job), Policy(reservations=False), NOW)
    return tuple(sorted(pr.victim for pr in p.preemptions))


SCRIPT = "from tests.placement.test_hash_seed_independence import tied_victims; print(','.join(tied_victims()))"


def test_tied_victim_sets_are_chosen_the_same_under_every_hash_seed() -> None:
    got = set()
    for hs in ("0", "1", "2", "3", "4", "5", "6", "7"):
        env = {**os.environ, "PYTHONHASHSEED": hs, "PYTHONPATH": str(ROOT)}
        r = subprocess.run(
            [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )
        assert r.returncode == 0, r.stderr[-2000:]
        got.add(r.stdout.strip())
    assert len(got) == 1, got
    # the tie goes to the first node in id order
    assert got == {"a-n0,b-n0,c-n0"}
    assert ",".join(tied_victims()) == "a-n0,b-n0,c-n0"
