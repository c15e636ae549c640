"""The leader's placement policy comes from settings (every duration is a setting)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from common.settings import Settings
from control.leader.state import policy_from_settings


def test_policy_from_settings_carries_the_placement_durations() -> None:
    s = Settings(preemption_protect_s=60, claim_borrowed_reservations_after_s=5, reclaim_small_borrowed_after_s=7)
    p = policy_from_settings(s)
    assert p.preemption_protect_s == 60 and p.claim_borrowed_reservations_after_s == 5
    assert p.reclaim_small_borrowed_after_s == 7
    assert policy_from_settings(
        Settings(claim_borrowed_reservations_after_s="inf")
    ).claim_borrowed_reservations_after_s == float("inf")
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        Settings(claim_borrowed_reservations_after_s=-1)
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        Settings(reclaim_small_borrowed_after_s=-1)
    assert policy_from_settings(Settings()).spares_yield_after_s is None  # off, as measured (sim/README.md)
    assert policy_from_settings(Settings(spares_yield_after_s=3)).spares_yield_after_s == 3
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        Settings(spares_yield_after_s=-1)


def test_the_borrowed_gang_guard_is_a_setting_and_the_leader_keeps_the_demand_it_reads(pool) -> None:
    from control.leader.cycle import PlacementCycles
    from control.leader.signals import JobSignals
    from control.leader.state import LeaderState

    assert policy_from_settings(Settings()).borrowed_gang_guard == 0.5  # on, as measured (sim/README.md)
    assert policy_from_settings(Settings(borrowed_gang_guard=0.25)).borrowed_gang_guard == 0.25
    off = Settings(borrowed_gang_guard=None, borrowed_restart_backoff_s=None)
    assert policy_from_settings(off).borrowed_gang_guard is None
    # the restart backoff and the pooled forecast: on, as measured (sim/README.md), and settings
    on = policy_from_settings(Settings())
    assert (on.borrowed_restart_backoff_s, on.pooled_demand_forecast) == (1800.0, True)
    tuned = policy_from_settings(Settings(borrowed_restart_backoff_s=5, pooled_demand_forecast=False))
    assert (tuned.borrowed_restart_backoff_s, tuned.pooled_demand_forecast) == (5.0, False)
    assert policy_from_settings(off).borrowed_restart_backoff_s is None
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        Settings(borrowed_restart_backoff_s=-1)
    with pytest.raises(ValidationError, match="greater than or equal to 0"):
        Settings(borrowed_gang_guard=-0.1)

    def cycles(settings: Settings) -> PlacementCycles:
        signals = JobSignals(pool, None, settings)  # type: ignore[arg-type]
        return PlacementCycles(LeaderState(pool, settings, signals), signals, None)  # type: ignore[arg-type]

    # the guards read each team's recent demand: without the window they would see none expected back
    assert cycles(Settings()).demand is not None
    assert cycles(off).demand is None
