"""Abuse limits at the edge: an address that floods bad tokens is backed off with 429 and
Retry-After (and so is its next good token, for a while), a principal beyond its request
rate is refused without slowing anyone else, and the defaults leave room for the
requirements' sweep bursts."""

from __future__ import annotations

import httpx
import pytest

from api.main import create_app
from common.settings import Settings
from tests.api.conftest import ALPHA, BETA, auth


def _client(app, address: str) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(address, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://api.test")


@pytest.fixture
def limited_app(settings, pool, temporal_env, cluster):
    tight = settings.model_copy(
        update={
            "api_auth_failures_per_minute": 30,
            "api_requests_per_s_per_principal": 20,
            "api_requests_per_s_per_address": 10_000,
        }
    )
    return create_app(tight, pool=pool, temporal_client=temporal_env.client)


async def test_a_thousand_bad_tokens_are_backed_off_with_retry_after(limited_app):
    statuses: list[int] = []
    async with _client(limited_app, "203.0.113.7") as attacker:
        for i in range(1000):
            r = await attacker.get("/v1/jobs", headers=auth(f"forged-{i}"))
            statuses.append(r.status_code)
            if r.status_code == 429:
                assert r.json()["error"]["code"] == "too_many_auth_failures"
                assert int(r.headers["Retry-After"]) >= 1
        assert statuses[:30] == [401] * 30
        assert statuses[30:] == [429] * 970
        # the backed-off address is refused even with a good token until the window passes
        r = await attacker.get("/v1/jobs", headers=auth(ALPHA))
        assert r.status_code == 429
    # another address with a good token is untouched
    async with _client(limited_app, "198.51.100.2") as other:
        r = await other.get("/v1/jobs", headers=auth(ALPHA))
        assert r.status_code == 200, r.text


async def test_a_principal_beyond_its_rate_is_refused_alone(limited_app):
    async with _client(limited_app, "198.51.100.3") as c:
        # 20/s averaged over 10 s: a burst of 200 passes, the next requests do not
        codes = [(await c.get("/v1/jobs", headers=auth(ALPHA))).status_code for _ in range(210)]
        assert codes[:200] == [200] * 200 and codes[200:] == [429] * 10
        r = await c.get("/v1/jobs", headers=auth(ALPHA))
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limited"
        assert int(r.headers["Retry-After"]) >= 1
        # a different principal from the same address still gets through
        r = await c.get("/v1/jobs", headers=auth(BETA))
        assert r.status_code == 200, r.text


def test_default_limits_leave_room_for_sweep_bursts():
    # the requirements' sweep: 50 submissions per second from one team, each also polled
    defaults = Settings()
    assert defaults.api_requests_per_s_per_principal >= 2 * 50
    assert defaults.api_requests_per_s_per_address >= defaults.api_requests_per_s_per_principal
