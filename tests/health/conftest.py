"""The embedded stack of tests/e2e with health durations scaled to seconds (docs/design.md, Health)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import stack  # noqa: F401  (the e2e stack fixture, reused)

HEALTH = dict(
    suspect_after_s=1.5,
    down_after_s=3.0,
    takeover_quiet_s=1.0,
    unconfirmed_kill_s=4.0,
    fence_margin=1.5,
    hang_after_s=2.0,
    missing_task_release_s=2.0,
    health_sweep_s=0.2,
    recovery_resignal_s=1.0,
    burn_in_seconds=1.0,
    burn_in_retry_s=1.0,
    burn_in_timeout_s=20.0,
)


@pytest.fixture
def stack_overrides() -> dict:
    return {**HEALTH, "_nodes": 6}
