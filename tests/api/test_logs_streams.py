"""GET /v1/jobs/{id}/logs: both streams by time, all ranks merged, tail, NDJSON, follow,
and the errors for parameters that make no sense."""

from __future__ import annotations

import json

import pytest

from tests.api.agent_server import AgentLogServer
from tests.api.conftest import ALPHA, BETA, auth, submit
from tests.api.test_logs import LOG_KEY, place

T = 1_800_000_000.0


@pytest.fixture
def agent():
    with AgentLogServer(key=LOG_KEY) as server:
        yield server


async def two_ranks(client, pool, agent) -> str:
    job_id = (await submit(client, replicas=2)).json()["job_id"]
    r0, r1 = await place(pool, job_id, ["b0-n0", "b0-n1"], agent.addr)
    agent.records[r0] = [(T + 1, "stdout", "r0 out"), (T + 3, "stderr", "r0 boom")]
    agent.records[r1] = [(T + 2, "stderr", "r1 warn"), (T + 4, "stdout", "r1 out")]
    return job_id


async def get(client, job_id: str, **params):
    return await client.get(f"/v1/jobs/{job_id}/logs", params=params, headers=auth(ALPHA))


async def test_streams_of_one_rank(client, pool, agent):
    job_id = await two_ranks(client, pool, agent)
    assert (await get(client, job_id)).text == "[stdout] r0 out\n[stderr] r0 boom\n"
    assert (await get(client, job_id, stream="stderr")).text == "r0 boom\n"
    assert (await get(client, job_id, stream="stdout", rank=1)).text == "r1 out\n"
    assert (await get(client, job_id, tail=1)).text == "[stderr] r0 boom\n"
    assert agent.requests[-1]["stream"] == "all" and agent.requests[-1]["tail"] == 1


async def test_all_ranks_merged_by_time(client, pool, agent):
    job_id = await two_ranks(client, pool, agent)
    r = await get(client, job_id, all_ranks="true")
    assert r.text.splitlines() == [
        "[rank 0] [stdout] r0 out",
        "[rank 1] [stderr] r1 warn",
        "[rank 0] [stderr] r0 boom",
        "[rank 1] [stdout] r1 out",
    ]
    r = await get(client, job_id, all_ranks="true", stream="stderr")
    assert r.text == "[rank 1] r1 warn\n[rank 0] r0 boom\n"
    r = await get(client, job_id, all_ranks="true", tail=2)  # the last 2 of the merge
    assert r.text.splitlines() == ["[rank 0] [stderr] r0 boom", "[rank 1] [stdout] r1 out"]


async def test_ndjson(client, pool, agent):
    job_id = await two_ranks(client, pool, agent)
    r = await get(client, job_id, all_ranks="true", format="ndjson")
    assert r.headers["content-type"].startswith("application/x-ndjson")
    recs = [json.loads(x) for x in r.text.splitlines()]
    assert [(x["rank"], x["stream"], x["line"]) for x in recs] == [
        (0, "stdout", "r0 out"),
        (1, "stderr", "r1 warn"),
        (0, "stderr", "r0 boom"),
        (1, "stdout", "r1 out"),
    ]
    assert recs[0]["time"].startswith("2027-01-15T") and recs[0]["partial"] is False


async def test_follow_all_ranks_ends_when_every_rank_ends(client, pool, agent):
    job_id = await two_ranks(client, pool, agent)
    leases = [q for q in agent.records]
    agent.follow_lines[leases[1]] = [b"r1 later\n"]
    params = {"all_ranks": "true", "follow": "true", "stream": "stdout"}
    async with client.stream("GET", f"/v1/jobs/{job_id}/logs", params=params, headers=auth(ALPHA)) as r:
        text = "".join([c async for c in r.aiter_text()])
    assert text == "[rank 0] r0 out\n[rank 1] r1 out\n[rank 1] r1 later\n"
    follows = [q for q in agent.requests if q["follow"]]
    assert {q["lease_id"] for q in follows} == set(leases)
    assert all(q["offset"] == 2 for q in follows)  # from where the first read ended


@pytest.mark.parametrize(
    ("params", "status"),
    [
        ({"stream": "both"}, 422),
        ({"format": "xml"}, 422),
        ({"tail": -1}, 422),
        ({"tail": "many"}, 422),
        ({"rank": -1}, 422),
        ({"rank": 1, "all_ranks": "true"}, 400),
    ],
)
async def test_bad_parameters(client, pool, agent, params, status):
    job_id = await two_ranks(client, pool, agent)
    r = await get(client, job_id, **params)
    assert r.status_code == status and "error" in r.json(), r.text
    assert r.json()["error"]["message"]


async def test_another_team_sees_no_logs(client, pool, agent):
    job_id = await two_ranks(client, pool, agent)
    r = await client.get(f"/v1/jobs/{job_id}/logs", params={"all_ranks": "true"}, headers=auth(BETA))
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"
