"""Node states say what they wait for (issue 23: a drained node showed `burn_in` for 13
minutes with 8/8 GPUs allocated and no hint that burn-in waits for its ranks to exit): in
`GET /v1/nodes`, `GET /v1/nodes/{id}` and `gpufleet nodes`."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import UTC, datetime, timedelta

import typer
from typer.testing import CliRunner

from api.main import create_app
from cli.user_cmd import register
from store.nodes import node_waits_for
from tests.api.conftest import ADMIN, ALPHA, auth, new_key
from tests.api.test_cli import UvicornThread
from tests.api.test_teams_nodes import running

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def waits(state: str, ranks: int = 0, jobs: int = 0, evict: bool = False, ago_s: float = 0.0) -> str | None:
    return node_waits_for(
        state, live_ranks=ranks, live_jobs=jobs, drain_evict=evict, since=NOW - timedelta(seconds=ago_s), now=NOW,
        suspect_after_s=30.0, down_after_s=90.0,
    )  # fmt: skip


def test_every_state_but_ready_says_what_it_waits_for():
    assert waits("ready", 2, 1) is None
    assert waits("burn_in", 1, 1) == "waiting for 1 rank to exit"
    assert waits("burn_in", 3, 2) == "waiting for 3 ranks to exit"
    assert "burn-in test runs" in waits("burn_in")
    assert waits("draining", 4, 2) == "2 jobs to finish or be evicted"
    assert waits("draining", 1, 1, evict=True) == "1 job being evicted"
    assert waits("draining") == "drained: waiting for an admin return"
    assert waits("suspect", ago_s=12).startswith("no heartbeat for 42 s")  # 30 s to go suspect, 12 s since
    assert (
        waits("down", ago_s=60)
        == "since 2026-12-01 11:59:00 UTC: burn-in once its agent reports again with no rank left"
    )
    assert "2 ranks of 1 job being recovered" in waits("down", 2, 1)
    assert "waiting for 1 rank of 1 job to stop" in waits("cordoned", 1, 1)
    assert "once the fault clears" in waits("cordoned")


async def node(client, node_id: str, token: str = ADMIN) -> dict:
    r = await client.get(f"/v1/nodes/{node_id}", headers=auth(token))
    assert r.status_code == 200, r.text
    listed = await client.get("/v1/nodes", headers=auth(token))
    [same] = [n for n in listed.json()["nodes"] if n["node_id"] == node_id]
    assert (same["status"], same["waiting_for"]) == (r.json()["status"], r.json()["waiting_for"])
    return r.json()


async def test_a_drained_then_returned_node_says_it_waits_for_its_rank(client, pool):
    assert (await node(client, "b0-n0"))["status"] == "ready"
    assert (await node(client, "b0-n0"))["waiting_for"] is None
    await running(client, pool, "b0-n0", tuple(range(8)))
    r = await client.post("/v1/nodes/b0-n0:drain", json={"reason": "fan noise"}, headers=auth(ADMIN, new_key()))
    assert r.status_code == 202
    n = await node(client, "b0-n0", ALPHA)
    assert n["status"] == "draining (1 job to finish or be evicted)" and n["reason"] == "fan noise"
    r = await client.post("/v1/nodes/b0-n0:return", json={"reason": "fixed"}, headers=auth(ADMIN, new_key()))
    assert r.status_code == 202
    n = await node(client, "b0-n0")
    assert n["status"] == "burn_in (waiting for 1 rank to exit)"
    assert (n["gpus_allocated"], n["live_ranks"]) == (8, 1)
    # the rank's lease released: burn-in itself is what it waits for
    await pool.execute("UPDATE leases SET state = 'released', released_at = now() WHERE node_id = 'b0-n0'")
    await pool.execute("DELETE FROM allocations WHERE node_id = 'b0-n0'")
    assert (await node(client, "b0-n0"))["waiting_for"].startswith("the burn-in test runs")


async def test_a_suspect_node_says_how_long_it_has_been_silent(client, pool):
    await pool.execute(
        "UPDATE nodes SET state = 'suspect', reason = 'silent', updated_at = now() - interval '12 seconds'"
        " WHERE node_id = 'b1-n0'"
    )
    n = await node(client, "b1-n0")
    # the API's settings: suspect after 30 s (the default), suspect for 12 s since (plus the
    # seconds the request itself took on a busy machine)
    silent = re.match(r"suspect \(no heartbeat for (\d+) s: ", n["status"])
    assert silent and 42 <= int(silent.group(1)) <= 45, n["status"]


async def test_gpufleet_nodes_shows_what_a_state_waits_for(client, settings, pool):
    await running(client, pool, "b0-n1", (0, 1))
    await pool.execute("UPDATE nodes SET state = 'burn_in', reason = 'returned' WHERE node_id = 'b0-n1'")
    with UvicornThread(create_app(settings)) as server:
        cli = typer.Typer()
        register(cli)

        def invoke(*args: str):
            return CliRunner().invoke(cli, [*args, "--url", server.url, "--token", ADMIN], env={"COLUMNS": "200"})

        r = await asyncio.to_thread(invoke, "nodes")
        assert r.exit_code == 0, r.output
        assert "burn_in (waiting for 1 rank to exit)" in r.stdout
        r = await asyncio.to_thread(invoke, "nodes", "b0-n1")
        assert r.exit_code == 0 and "burn_in (waiting for 1 rank to exit)" in r.stdout
        r = await asyncio.to_thread(invoke, "nodes", "--json")
        [n] = [n for n in json.loads(r.stdout)["nodes"] if n["node_id"] == "b0-n1"]
        assert n["waiting_for"] == "waiting for 1 rank to exit"


def test_every_pending_reason_the_engine_gives_has_a_sentence_in_explain() -> None:
    # a reason the engine learns (hot_spare, issue 22) must not reach users as "pending: <code>"
    from api.routes.jobs import _PENDING_TEXT
    from placement.model import PendingReason

    assert {r.value for r in PendingReason} <= set(_PENDING_TEXT)
