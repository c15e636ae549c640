"""Fixtures for the browser tests: the API on a real uvicorn over a fresh migrated database
with the cluster of tests/api/cluster_seed.py (every GPU state); no Temporal, no leader (the
page reads only what the store holds)."""

from __future__ import annotations

import pytest

from api.main import create_app
from common.settings import Settings
from tests.api.cluster_seed import seed_cluster_states
from tests.api.conftest import TOKENS
from tests.api.test_cli import UvicornThread
from tests.foundation.builders import small_cluster, team


@pytest.fixture
def settings(db_dsn) -> Settings:
    return Settings(database_url=db_dsn, api_tokens=TOKENS, api_auth_failures_per_minute=1_000_000)


@pytest.fixture
async def seeded(pool) -> None:
    async with pool.acquire() as conn:
        await small_cluster(conn, blocks=2, nodes_per_block=2)
        await team(conn, "alpha", guaranteed=16, borrow_limit=16)
        await team(conn, "beta", guaranteed=16, borrow_limit=0)
    await seed_cluster_states(pool)


@pytest.fixture
def server(settings, seeded):
    with UvicornThread(create_app(settings)) as s:  # the app opens its own pool in uvicorn's loop
        yield s
