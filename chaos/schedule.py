"""The fault schedule of a chaos run: a pure function of the seed and the run's length.

``plan(seed, seconds)`` spreads the faults over the run in equal slots (no fault in the
first ``warmup_s``, while the workload ramps up, or the last ``tail_s``), each at a random
point of the first third of its slot. A run of ``COVERAGE_S`` or more injects every kind
at least once (a shuffled round of all kinds first, then random kinds); a shorter run
injects as many different kinds as it has slots. How long each fault lasts, how hard it
hits and which target it picks are drawn here too, so one seed is one schedule; the
target itself is chosen at run time among what is running then (``pick``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from chaos.timeline import FAULT_KINDS

COVERAGE_S = 180.0


@dataclass(frozen=True)
class PlannedFault:
    at_s: float  # seconds after the fault phase began
    kind: str
    down_s: float  # how long it lasts: the agent or leader down, the server down, the GPU faulty
    hard: bool  # SIGKILL rather than SIGTERM (Temporal), immediate rather than fast (Postgres)
    pick: int  # chooses the target among the candidates at run time


@dataclass(frozen=True)
class Timings:
    """The stack durations the faults are sized against (chaos-scaled settings)."""

    leader_ttl_s: float = 4.0
    hang_after_s: float = 3.0
    down_after_s: float = 8.0


def _down_s(rng: random.Random, kind: str, t: Timings) -> float:
    if kind == "agent_kill":
        return rng.uniform(2.0, t.down_after_s + 2.0)  # sometimes long enough for the node to go down
    if kind == "agent_stop":
        return rng.uniform(2.0, t.down_after_s + 4.0)  # often past the node's down timeout
    if kind == "leader_stop":
        return t.leader_ttl_s + rng.uniform(1.5, 4.0)  # past the lease: the other control takes over
    if kind == "leader_kill":
        return rng.uniform(1.0, 4.0)
    if kind == "temporal_restart":
        return rng.uniform(1.0, 4.0)
    if kind == "postgres_restart":
        return rng.uniform(1.0, 3.0)
    if kind == "postgres_failover":
        return 0.0  # the primary does not come back: the supervisor seeds a new standby
    if kind == "xid":
        return rng.uniform(6.0, 12.0)
    if kind == "rank_hang":
        return t.hang_after_s + rng.uniform(3.0, 6.0)
    raise ValueError(f"unknown fault kind {kind!r}")


def plan(
    seed: int,
    seconds: float,
    *,
    kinds: tuple[str, ...] = FAULT_KINDS,
    warmup_s: float = 20.0,
    tail_s: float = 10.0,
    min_gap_s: float = 20.0,
    max_faults: int = 40,
    timings: Timings | None = None,
) -> list[PlannedFault]:
    """The faults of a run of ``seconds`` for ``seed`` (at most ``max_faults``)."""
    t = timings or Timings()
    rng = random.Random(seed)
    warmup = min(warmup_s, seconds * 0.15)
    usable = max(0.0, seconds - warmup - tail_s)
    if not kinds or usable <= 0:
        return []
    n = min(max_faults, int(usable // min_gap_s))
    if seconds >= COVERAGE_S:
        n = max(n, len(kinds))
    n = max(1, n)
    order = list(kinds)
    rng.shuffle(order)
    chosen = order[:n] + [rng.choice(kinds) for _ in range(n - len(order))]
    slot = usable / n
    out = []
    for i, kind in enumerate(chosen):
        at = warmup + i * slot + rng.uniform(0.0, slot / 3)
        out.append(
            PlannedFault(
                round(at, 2), kind, round(_down_s(rng, kind, t), 2), rng.random() < 0.5, rng.randrange(1 << 30)
            )
        )
    return out
