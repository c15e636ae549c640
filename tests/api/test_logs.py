"""GET /v1/jobs/{id}/logs: real rank output, proxied from the agent on the node that
holds the rank (a real HTTP server here, speaking the agent's log contract)."""

from __future__ import annotations

import time

import pytest

from proto.auth import check_lease_log_token, lease_log_token, node_log_key
from store import allocations, leadership
from tests.api.agent_server import AgentLogServer
from tests.api.conftest import ALPHA, BETA, auth, submit
from tests.foundation.builders import gang
from tests.support import force_job_state

LOG_KEY = "test-log-signing-key"  # tests/api/conftest.py's settings


def token(lease_id: str, node: str = "b0-n0") -> str:
    return lease_log_token(node_log_key(LOG_KEY, node), lease_id, now=time.time(), ttl_s=60)


@pytest.fixture
def agent():
    with AgentLogServer(key=LOG_KEY) as server:
        yield server


async def place(pool, job_id: str, nodes: list[str], agent_addr: str | None, attempt: int = 1) -> list[str]:
    epoch = await leadership.acquire_leadership(pool, scope="placement", holder="t", grpc_addr="x", ttl_s=60)
    if epoch is None:
        epoch = await pool.fetchval("SELECT epoch FROM leader")
    await pool.execute("UPDATE nodes SET agent_addr = $1", agent_addr)
    return await allocations.commit_gang(
        pool,
        scope="placement",
        epoch=epoch,
        job_id=job_id,
        attempt=attempt,
        placements=gang(*[(n, (0, 1, 2, 3)) for n in nodes]),
    )


async def test_logs_of_a_rank_are_proxied_from_its_agent(client, pool, agent):
    job_id = (await submit(client, replicas=2)).json()["job_id"]
    leases = await place(pool, job_id, ["b0-n0", "b0-n1"], agent.addr)
    agent.logs[leases[0]] = b"rank0 step 1\nrank0 step 2\n"
    agent.logs[leases[1]] = b"rank1 step 1\n"
    r = await client.get(f"/v1/jobs/{job_id}/logs", params={"stream": "stdout"}, headers=auth(ALPHA))
    assert r.status_code == 200 and r.text == "rank0 step 1\nrank0 step 2\n"
    assert r.headers["content-type"].startswith("text/plain") and r.headers["x-lease-id"] == leases[0]
    r = await client.get(f"/v1/jobs/{job_id}/logs", params={"rank": 1, "attempt": 1}, headers=auth(ALPHA))
    assert r.text == "[stdout] rank1 step 1\n"
    # offset: leave out what a client already has (the CLI resumes a dropped stream with it)
    r = await client.get(f"/v1/jobs/{job_id}/logs", params={"offset": 13, "stream": "stdout"}, headers=auth(ALPHA))
    assert r.text == "rank0 step 2\n"
    # the API presents a token for that lease alone, signed with its node's key, never the
    # caller's, never a static one
    assert all(q["auth"] != auth(ALPHA)["Authorization"] for q in agent.requests)
    tokens = {q["lease_id"]: q["auth"][len("Bearer ") :] for q in agent.requests}
    b0n1 = node_log_key(LOG_KEY, "b0-n1")
    assert check_lease_log_token(b0n1, tokens[leases[1]], leases[1], now=time.time())
    assert not check_lease_log_token(node_log_key(LOG_KEY, "b0-n0"), tokens[leases[1]], leases[1], now=time.time())
    assert not check_lease_log_token(LOG_KEY, tokens[leases[1]], leases[1], now=time.time())
    assert not check_lease_log_token(b0n1, tokens[leases[1]], leases[0], now=time.time())
    assert not check_lease_log_token(b0n1, tokens[leases[1]], leases[1], now=time.time() + 3600)
    assert agent.requests[-1]["format"] == "ndjson" and agent.requests[-1]["follow"] is False


async def test_follow_streams_until_the_agent_ends(client, pool, agent):
    job_id = (await submit(client)).json()["job_id"]
    [lease] = await place(pool, job_id, ["b1-n0"], agent.addr)
    agent.logs[lease] = b"start\n"
    agent.follow_lines[lease] = [b"step 1\n", b"step 2\n", b"done\n"]
    async with client.stream("GET", f"/v1/jobs/{job_id}/logs", params={"follow": "true"}, headers=auth(ALPHA)) as r:
        assert r.status_code == 200
        text = "".join([chunk async for chunk in r.aiter_text()])
    assert text == "[stdout] start\n[stdout] step 1\n[stdout] step 2\n[stdout] done\n"
    assert agent.requests[-1]["follow"] is True


async def test_log_errors_use_the_error_shape(client, pool, agent):
    job_id = (await submit(client, replicas=2)).json()["job_id"]
    # not scheduled yet
    r = await client.get(f"/v1/jobs/{job_id}/logs", headers=auth(ALPHA))
    assert r.status_code == 404 and r.json()["error"]["code"] == "logs_not_found"
    leases = await place(pool, job_id, ["b0-n0", "b0-n1"], agent.addr)
    # the agent has no file for it
    r = await client.get(f"/v1/jobs/{job_id}/logs", headers=auth(ALPHA))
    assert r.status_code == 404 and r.json()["error"]["code"] == "logs_not_found"
    # another team cannot read them
    agent.logs[leases[0]] = b"secret\n"
    r = await client.get(f"/v1/jobs/{job_id}/logs", headers=auth(BETA))
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"
    # the agent refuses the API's token (the agent's key was rotated)
    agent.key = "rotated-key-rotated-key"
    r = await client.get(f"/v1/jobs/{job_id}/logs", headers=auth(ALPHA))
    assert r.status_code == 502 and r.json()["error"]["code"] == "agent_auth_failed"
    # the agent is gone
    await pool.execute("UPDATE nodes SET agent_addr = '127.0.0.1:1'")
    r = await client.get(f"/v1/jobs/{job_id}/logs", headers=auth(ALPHA))
    assert r.status_code == 503 and r.json()["error"]["code"] == "agent_unreachable"
    # no agent registered for the node
    await pool.execute("UPDATE nodes SET agent_addr = NULL")
    r = await client.get(f"/v1/jobs/{job_id}/logs", headers=auth(ALPHA))
    assert r.status_code == 503 and r.json()["error"]["code"] == "agent_unreachable"


async def test_logs_of_an_earlier_attempt(client, pool, agent):
    job_id = (await submit(client)).json()["job_id"]
    [a1] = await place(pool, job_id, ["b0-n0"], agent.addr)
    await allocations.release_job(pool, job_id, 1, reason="preempted", actor="test")
    await force_job_state(pool, "UPDATE jobs SET state = 'QUEUED', attempt = 2 WHERE job_id = $1", job_id)
    [a2] = await place(pool, job_id, ["b1-n1"], agent.addr, attempt=2)
    agent.logs[a1] = b"attempt one\n"
    agent.logs[a2] = b"attempt two\n"
    assert (await client.get(f"/v1/jobs/{job_id}/logs", headers=auth(ALPHA))).text == "[stdout] attempt two\n"
    r = await client.get(f"/v1/jobs/{job_id}/logs", params={"attempt": 1}, headers=auth(ALPHA))
    assert r.text == "[stdout] attempt one\n" and r.headers["x-attempt"] == "1"


async def test_proxy_function_directly(agent):
    from api.errors import ApiError
    from api.logs_proxy import open_agent_log

    agent.logs["L1"] = b"ab\ncd\nef\n"
    body = await open_agent_log(agent.addr, "L1", token=token("L1"), offset=2)  # the agent's offset: records
    assert b"".join([c async for c in body]) == b"ef\n"
    with pytest.raises(ApiError) as e:
        await open_agent_log(agent.addr, "nope", token=token("nope"))
    assert e.value.status == 404
    with pytest.raises(ApiError) as e:
        await open_agent_log("127.0.0.1:1", "L1", token="agent-secret")
    assert e.value.code == "agent_unreachable"
