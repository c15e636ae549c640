"""Authorization matrix, built from the app's own route table: every route x
{no token, teamless, other team, own team, admin}. A route without an entry here
fails the test, so a new route cannot ship without a decision on who may call it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from api.main import route_table
from store import allocations, leadership
from tests.api.agent_server import AgentLogServer
from tests.api.conftest import ADMIN, ALPHA, BETA, auth, job_body, new_key, start_as_placed, submit
from tests.foundation.builders import gang

WHO = {"none": None, "teamless": "tok-nobody", "other": BETA, "own": ALPHA, "admin": ADMIN}
PUBLIC = {w: 200 for w in WHO}


def expect(none=401, teamless=403, other=404, own=200, admin=200) -> dict[str, int]:
    return {"none": none, "teamless": teamless, "other": other, "own": own, "admin": admin}


TEAM_READ = expect(other=403)
ADMIN_WRITE = expect(other=403, own=403, admin=200)
ANY_MEMBER = expect(other=200)

# "other" is a member of team beta acting on team alpha's job / team; "own" is alpha.
MATRIX: dict[tuple[str, str], dict[str, int]] = {
    ("GET", "/openapi.json"): PUBLIC,
    ("GET", "/docs"): PUBLIC,
    ("GET", "/docs/oauth2-redirect"): PUBLIC,
    ("GET", "/redoc"): PUBLIC,
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/metrics"): PUBLIC,  # Prometheus scrapes it: aggregate counts only
    ("GET", "/v1/me"): ANY_MEMBER,
    ("POST", "/v1/jobs"): expect(other=403, own=202, admin=202),
    ("GET", "/v1/jobs"): TEAM_READ,
    ("GET", "/v1/jobs/{job_id}"): expect(),
    ("GET", "/v1/jobs/{job_id}/events"): expect(),
    ("GET", "/v1/jobs/{job_id}/explain"): expect(),
    ("GET", "/v1/jobs/{job_id}/logs"): expect(),
    ("DELETE", "/v1/jobs/{job_id}"): expect(own=202, admin=202),
    ("POST", "/v1/jobs/{job_id}:extend"): expect(),
    ("GET", "/v1/teams/{team}/quota"): TEAM_READ,
    ("PUT", "/v1/teams/{team}/quota"): ADMIN_WRITE,
    ("GET", "/v1/teams/{team}/priority-classes"): TEAM_READ,
    ("PUT", "/v1/teams/{team}/priority-classes"): ADMIN_WRITE,
    ("GET", "/v1/teams/{team}/queue"): TEAM_READ,
    ("GET", "/v1/nodes"): ANY_MEMBER,
    ("GET", "/v1/nodes/{node_id}"): ANY_MEMBER,
    ("POST", "/v1/nodes/{node_id}:drain"): expect(other=403, own=403, admin=202),
    ("POST", "/v1/nodes/{node_id}:return"): expect(other=403, own=403, admin=202),
    ("POST", "/v1/nodes/{node_id}:issue-credential"): expect(other=403, own=403, admin=201),
    ("POST", "/v1/nodes/{node_id}:revoke-credential"): expect(other=403, own=403, admin=200),
    ("GET", "/v1/cluster"): ANY_MEMBER,  # the whole map; other teams' job ids and reasons redacted
}


@dataclass
class Ctx:
    client: Any
    pool: Any
    agent: AgentLogServer
    temporal_env: Any
    task_queue: str

    async def job(self) -> str:
        """A fresh job of team alpha with its workflow started, as a placed one has (a cancel
        or extend gets its own)."""
        r = await submit(self.client, token=ADMIN)
        assert r.status_code == 202, r.text
        job_id = r.json()["job_id"]
        await start_as_placed(self.temporal_env, self.task_queue, job_id)
        return job_id

    async def running_job(self) -> str:
        job_id = await self.job()
        epoch = await leadership.acquire_leadership(
            self.pool, scope="placement", holder="m", grpc_addr="x", ttl_s=60
        ) or await self.pool.fetchval("SELECT epoch FROM leader")
        await self.pool.execute("UPDATE nodes SET agent_addr = $1", self.agent.addr)
        free = await self.pool.fetchval(
            "SELECT gpu FROM generate_series(0, 7) gpu WHERE gpu NOT IN"
            " (SELECT gpu_index FROM allocations WHERE node_id = 'b1-n1') LIMIT 1"
        )
        [lease] = await allocations.commit_gang(
            self.pool, scope="placement", epoch=epoch, job_id=job_id, attempt=1, placements=gang(("b1-n1", (free,)))
        )
        self.agent.logs[lease] = b"hello from rank 0\n"
        return job_id


Request = Callable[[Ctx], Awaitable[tuple[str, dict | None]]]


async def _path(ctx: Ctx, method: str, template: str) -> tuple[str, dict | None]:
    if "{job_id}" in template:
        job_id = await (ctx.running_job() if template.endswith("/logs") else ctx.job())
        path = template.replace("{job_id}", job_id)
    else:
        path = template.replace("{team}", "alpha").replace("{node_id}", "b0-n1")
        if template.endswith(":return"):  # only a draining or cordoned node can be returned
            await ctx.pool.execute("UPDATE nodes SET state = 'draining' WHERE node_id = 'b0-n1'")
    if (method, template) == ("GET", "/v1/jobs"):
        path += "?team=alpha"  # listing team alpha's jobs
    return path, None


BODIES: dict[tuple[str, str], dict] = {
    ("POST", "/v1/jobs"): job_body(),
    ("POST", "/v1/jobs/{job_id}:extend"): {"by": "30m", "reason": "matrix"},
    ("PUT", "/v1/teams/{team}/quota"): {"gpu_type": "h100", "guaranteed": 16, "reason": "matrix"},
    # every class: the matrix's later submits stay allowed
    ("PUT", "/v1/teams/{team}/priority-classes"): {"priority_classes": None, "reason": "matrix"},
    ("POST", "/v1/nodes/{node_id}:drain"): {"reason": "matrix"},
    ("POST", "/v1/nodes/{node_id}:return"): {"reason": "matrix"},
    ("POST", "/v1/nodes/{node_id}:issue-credential"): {"reason": "matrix"},
    ("POST", "/v1/nodes/{node_id}:revoke-credential"): {"reason": "matrix"},
}


@pytest.fixture
def agent():
    with AgentLogServer(key="test-log-signing-key") as server:
        yield server


async def test_every_route_has_a_matrix_entry(app):
    routes = set(route_table(app))
    assert routes - set(MATRIX) == set(), "new routes need an authorization entry in MATRIX"
    assert set(MATRIX) - routes == set(), "MATRIX names routes the app no longer serves"


async def test_authorization_matrix(app, client, pool, worker, agent, temporal_env, task_queue):
    ctx = Ctx(client, pool, agent, temporal_env, task_queue)
    failures = []
    for method, template in route_table(app):
        for who, token in WHO.items():
            path, _ = await _path(ctx, method, template)
            headers = auth(token, new_key() if method != "GET" else None)
            body = BODIES.get((method, template))
            r = await client.request(method, path, json=body, headers=headers)
            want = MATRIX[(method, template)][who]
            if r.status_code != want:
                failures.append(f"{method} {template} as {who}: {r.status_code} (want {want}) {r.text[:200]}")
            elif r.status_code >= 400:
                assert r.json()["error"]["code"]  # the one error shape
                if r.status_code == 401:
                    assert r.headers["www-authenticate"] == "Bearer"
    assert not failures, "\n".join(failures)


async def test_writes_record_the_principal_in_the_audit_trail(client, pool, worker, temporal_env, task_queue):
    job_id = (await submit(client)).json()["job_id"]
    await start_as_placed(temporal_env, task_queue, job_id)
    await client.post(f"/v1/jobs/{job_id}:extend", json={"by": "10m"}, headers=auth(ALPHA, new_key()))
    await client.delete(f"/v1/jobs/{job_id}", headers=auth(ALPHA, new_key()))
    await client.put(
        "/v1/teams/beta/quota",
        json={"gpu_type": "h100", "guaranteed": 8, "reason": "r"},
        headers=auth(ADMIN, new_key()),
    )
    await client.post("/v1/nodes/b0-n0:drain", json={"reason": "r"}, headers=auth(ADMIN, new_key()))
    rows = await pool.fetch("SELECT actor, action FROM audit WHERE actor IN ('alice', 'root') ORDER BY id")
    assert [tuple(r) for r in rows] == [
        ("alice", "submit"),
        ("alice", "extend_request"),
        ("alice", "cancel_request"),
        ("root", "quota_change"),
        ("root", "drain"),
    ]


async def test_unknown_token_is_401_and_malformed_authorization_too(client):
    for headers in ({"Authorization": "Bearer nope"}, {"Authorization": "Basic YTpi"}, {"Authorization": "Bearer"}):
        r = await client.get("/v1/me", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated", (headers, r.text)


async def test_admin_routes_refuse_team_tokens_before_looking_at_the_request(client):
    """Whatever the body or headers, a team token on an admin route is 403 (not 400/422)."""
    for method, path in (
        ("PUT", "/v1/teams/alpha/quota"),
        ("PUT", "/v1/teams/alpha/priority-classes"),
        ("POST", "/v1/nodes/b0-n0:drain"),
        ("POST", "/v1/nodes/b0-n0:return"),
        ("POST", "/v1/nodes/b0-n0:issue-credential"),
        ("POST", "/v1/nodes/b0-n0:revoke-credential"),
    ):
        for headers, body in ((auth(ALPHA), None), (auth(ALPHA), {"junk": 1}), (auth(ALPHA, new_key()), {"x": []})):
            r = await client.request(method, path, json=body, headers=headers)
            assert r.status_code == 403 and r.json()["error"]["code"] == "admin_required", (method, headers, r.text)
