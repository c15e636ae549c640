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
