"""Rank logs, proxied from the agent on the node that holds (or held) the rank.

The agent's contract (the integrator aligns the agent to it):

    GET http://{nodes.agent_addr}/v1/leases/{lease_id}/logs?offset=N&follow=0|1
    Authorization: Bearer {a token for this lease only, valid for log_token_ttl_s}
    -> 200 text/plain, chunked; with follow=1 the agent keeps the response open
       and writes new output as the rank produces it, closing when the rank exits.

``open_agent_log`` is the one function the API calls: it connects and checks the
agent's status before the API commits to a 200, so every failure becomes the
API's JSON error shape; then it yields the body chunk by chunk and closes the
upstream connection when the client goes away.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from urllib.parse import quote

import httpx

from api.errors import ApiError
from common.settings import Settings
from proto.auth import lease_log_token, node_log_key

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 30.0


def log_token(settings: Settings, node_id: str, lease_id: str) -> str:
    """The token the API presents for one lease's logs: scoped to the lease, short-lived, and
    signed with the node's own key, so neither a leaked token, nor one lease's token, nor a
    key held by another node opens these logs."""
    key = node_log_key(settings.log_signing_key, node_id)
    return lease_log_token(key, lease_id, now=time.time(), ttl_s=settings.log_token_ttl_s)


async def open_agent_log(
    agent_addr: str,
    lease_id: str,
    *,
    token: str,
    offset: int = 0,
    follow: bool = False,
) -> AsyncIterator[bytes]:
    """Open the agent's log stream for one lease; raise ApiError before any byte is sent."""
    base = agent_addr if agent_addr.startswith(("http://", "https://")) else f"http://{agent_addr}"
    url = f"{base.rstrip('/')}/v1/leases/{quote(lease_id, safe='')}/logs"
    timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=None if follow else READ_TIMEOUT_S)
    client = httpx.AsyncClient(timeout=timeout)
    try:
        request = client.build_request(
            "GET",
            url,
            params={"offset": str(offset), "follow": "1" if follow else "0"},
            headers={"Authorization": f"Bearer {token}"},
        )
        response = await client.send(request, stream=True)
    except httpx.HTTPError as e:
        await client.aclose()
        raise ApiError(
            503, "agent_unreachable", f"the agent at {agent_addr} that holds this rank's logs is unreachable"
        ) from e
    if response.status_code != 200:
        status = response.status_code
        await response.aclose()
        await client.aclose()
        if status == 404:
            raise ApiError(404, "logs_not_found", f"the agent at {agent_addr} has no logs for lease {lease_id}")
        if status in (401, 403):
            raise ApiError(502, "agent_auth_failed", f"the agent at {agent_addr} refused the API's log token")
        raise ApiError(502, "agent_error", f"the agent at {agent_addr} answered {status} for lease {lease_id}")

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in response.aiter_raw():
                if chunk:
                    yield chunk
        except httpx.HTTPError:
            return  # the agent went away mid-stream: end the response
        finally:
            await response.aclose()
            await client.aclose()

    return body()
