"""`gpufleet top --once` against the API served by a real uvicorn over the seeded cluster
(tests/api/cluster_seed.py): one frame, the map's glyphs per GPU state, teams, queue, idle cost."""

from __future__ import annotations

import asyncio

import pytest
from typer.testing import CliRunner

from api.main import create_app
from cli.main import app as gpufleet
from cli.top_cmd import GLYPHS
from tests.api.cluster_seed import seed_cluster_states
from tests.api.conftest import ALPHA, BETA
from tests.api.test_cli import UvicornThread


@pytest.fixture
async def server(settings, pool, cluster):
    await seed_cluster_states(pool)
    with UvicornThread(create_app(settings)) as s:
        yield s


def top_once(url: str, token: str):
    return CliRunner().invoke(gpufleet, ["top", "--once", "--url", url, "--token", token], catch_exceptions=False)


async def test_top_once_prints_one_frame(server):
    r = await asyncio.to_thread(top_once, server.url, ALPHA)
    assert r.exit_code == 0, r.output
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip()}
    g = {s: glyph for s, (glyph, _) in GLYPHS.items()}
    assert lines["b0"].split()[1:] == [
        g["guaranteed"] * 4 + g["borrowed"] * 2 + g["free"] * 2,
        g["guaranteed"] * 8,
        g["down"] * 8,
    ]
    assert lines["b1"].split()[1:] == [g["hot_spare"] * 8, g["cordoned"] * 8, g["guaranteed"] * 2 + g["down"] * 6]
    assert lines["b2"].split()[1:] == [g["burn_in"] * 8, g["reserved"] * 8, g["reserved"] * 8]
    assert "idle GPUs" in r.stdout and "26 ($" in r.stdout
    assert "a-big" in r.stdout and "b-wait" not in r.stdout  # another team's job id stays hidden
    assert "(another team)" in r.stdout


async def test_top_with_a_bad_token_fails_with_the_api_error(server):
    r = await asyncio.to_thread(top_once, server.url, "not-a-token")
    assert r.exit_code == 1
    assert "unauthenticated" in r.stderr
    r = await asyncio.to_thread(top_once, server.url, BETA)
    assert r.exit_code == 0 and "b-wait" in r.stdout and "a-big" not in r.stdout
