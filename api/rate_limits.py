"""Abuse limits at the edge (docs/design.md, Security): per-address and per-principal request
rates, and a back-off for an address that keeps failing authentication.

Moving windows of ten seconds (requests) and one minute (authentication failures), kept in
this API process's memory by the ``limits`` library: several API processes each enforce
their own share. A refused request gets 429 with ``Retry-After``. The defaults sit well
above the requirements' sweep bursts (50 submissions/s from one team).
"""

from __future__ import annotations

import math
import time

from limits import RateLimitItem, RateLimitItemPerMinute, RateLimitItemPerSecond
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter

from api.errors import ApiError
from common.settings import Settings

RATE_WINDOW_S = 10


class EdgeLimits:
    def __init__(self, settings: Settings) -> None:
        self._limiter = MovingWindowRateLimiter(MemoryStorage())
        # rates are averaged over RATE_WINDOW_S, so a client's burst (a sweep fired at once, its
        # retries of 409 in flight) passes while a sustained flood does not
        window = RATE_WINDOW_S
        self._per_address = RateLimitItemPerSecond(settings.api_requests_per_s_per_address * window, window)
        self._per_principal = RateLimitItemPerSecond(settings.api_requests_per_s_per_principal * window, window)
        self._auth_failures = RateLimitItemPerMinute(settings.api_auth_failures_per_minute)

    def _hit(self, item: RateLimitItem, code: str, message: str, *key: str) -> None:
        """Count one request against ``item`` for ``key``; beyond it, 429 with Retry-After."""
        if not self._limiter.hit(item, *key):
            raise self._refusal(item, code, message, *key)

    def _refusal(self, item: RateLimitItem, code: str, message: str, *key: str) -> ApiError:
        reset = self._limiter.get_window_stats(item, *key).reset_time
        retry_after = str(max(1, math.ceil(reset - time.time())))
        return ApiError(429, code, message, headers={"Retry-After": retry_after})

    def before_auth(self, address: str) -> None:
        """A request from ``address``: refused while it is backing off after too many failed
        authentications, or beyond its request rate."""
        if not self._limiter.test(self._auth_failures, "auth", address):
            raise self._refusal(
                self._auth_failures,
                "too_many_auth_failures",
                "too many requests with a bad token from this address; wait before trying again",
                "auth",
                address,
            )
        self._hit(self._per_address, "rate_limited", "too many requests from this address", "addr", address)

    def auth_failed(self, address: str) -> None:
        self._limiter.hit(self._auth_failures, "auth", address)

    def after_auth(self, principal: str) -> None:
        self._hit(self._per_principal, "rate_limited", f"too many requests from {principal}", "principal", principal)
