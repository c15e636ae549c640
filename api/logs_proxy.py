"""Rank logs, proxied from the agents on the nodes that hold (or held) the ranks.

The agent's contract (worker_agent/log_http.py):

    GET http://{nodes.agent_addr}/v1/leases/{lease_id}/logs
        ?offset=N&follow=0|1&stream=stdout|stderr|all&tail=N&format=text|ndjson
    Authorization: Bearer {a token for this lease only, valid for log_token_ttl_s}
    -> 200, chunked; format=ndjson: one output record a line
       ({"offset", "time", "stream", "line", "partial"}), then {"end": offset};
       with follow=1 the agent keeps the response open and writes new output as the
       rank produces it, closing once the rank has exited.

``open_agent_log`` connects and checks the agent's status before the API commits to a
200, so every failure becomes the API's JSON error shape; then it yields the body chunk
by chunk and closes the upstream connection when the client goes away.

``job_log_stream`` is what GET /v1/jobs/{id}/logs serves: the records of one rank or of
every rank, merged by time (each agent's records are in time order; with ``tail`` the
last N of the merge), rendered as text or NDJSON; with ``follow``, then what each rank
writes next as it arrives, until every followed rank has ended (the job's end).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import httpx

from api.errors import ApiError
from common.settings import Settings
from common.tls import client_verify
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
    stream: str = "stdout",
    tail: int | None = None,
    fmt: str = "text",
    verify: ssl.SSLContext | bool = True,
) -> AsyncIterator[bytes]:
    """Open the agent's log stream for one lease; raise ApiError before any byte is sent.
    ``verify``: an https agent's certificate is checked against it (common.tls.client_verify)."""
    base = agent_addr if agent_addr.startswith(("http://", "https://")) else f"http://{agent_addr}"
    url = f"{base.rstrip('/')}/v1/leases/{quote(lease_id, safe='')}/logs"
    timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=None if follow else READ_TIMEOUT_S)
    client = httpx.AsyncClient(timeout=timeout, verify=verify)
    try:
        request = client.build_request(
            "GET",
            url,
            params={
                "offset": str(offset),
                "follow": "1" if follow else "0",
                "stream": stream,
                "format": fmt,
                **({"tail": str(tail)} if tail is not None else {}),
            },
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


# --- one job's logs: ranks merged by time --------------------------------------------------


@dataclass
class RankSource:
    """Where one rank's output is: its lease, on the agent of its node."""

    rank: int
    lease_id: str
    node_id: str
    agent_addr: str
    end: int = 0  # where the records read so far end (to follow from)


@dataclass(frozen=True)
class LogQuery:
    stream: str = "all"  # stdout | stderr | all
    tail: int | None = None
    follow: bool = False
    fmt: str = "text"  # text | ndjson
    all_ranks: bool = False


async def _records(body: AsyncIterator[bytes], source: RankSource) -> AsyncIterator[dict[str, Any]]:
    """An agent's NDJSON records; its closing ``{"end": N}`` moves ``source.end``."""
    buf = b""
    async for chunk in body:
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if not line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if not isinstance(rec, dict):
                continue
            if "end" in rec:
                source.end = max(source.end, int(rec["end"]))
                continue
            source.end = max(source.end, int(rec.get("offset", 0)))
            rec["rank"] = source.rank
            yield rec


def render(rec: dict[str, Any], q: LogQuery) -> bytes:
    """A record as the user asked for it: NDJSON (rank, stream, time, line, partial) or a
    line of text, prefixed with its rank (all ranks) and its stream (both streams); one
    stream of one rank comes out as the rank wrote it."""
    if q.fmt == "ndjson":
        t = rec.get("time")
        at = datetime.fromtimestamp(float(t), UTC).isoformat() if isinstance(t, int | float) else None
        obj = {
            "rank": rec["rank"],
            "stream": rec.get("stream"),
            "time": at,
            "line": rec.get("line", ""),
            "partial": bool(rec.get("partial")),
        }
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
    prefix = ""
    if q.all_ranks:
        prefix += f"[rank {rec['rank']}] "
    if q.stream == "all":
        prefix += f"[{rec.get('stream')}] "
    line = str(rec.get("line", ""))
    if not prefix and rec.get("partial"):
        return line.encode()
    return (prefix + line + "\n").encode()


async def _merge(iters: list[AsyncIterator[dict[str, Any]]]) -> AsyncIterator[dict[str, Any]]:
    """Merge streams each in time order into one in time order (ties: by rank)."""
    heads: dict[int, dict[str, Any]] = {}
    for i, it in enumerate(iters):
        with contextlib.suppress(StopAsyncIteration):
            heads[i] = await anext(it)
    while heads:
        i = min(heads, key=lambda k: (float(heads[k].get("time") or 0.0), heads[k]["rank"], k))
        yield heads[i]
        try:
            heads[i] = await anext(iters[i])
        except StopAsyncIteration:
            del heads[i]


async def job_log_stream(
    settings: Settings, sources: list[RankSource], q: LogQuery, skip: int = 0
) -> AsyncIterator[bytes]:
    """Open every rank's log (errors raise here, before a 200) and return the response body.
    ``skip``: bytes of the rendered output to leave out (a client resuming a dropped stream)."""

    verify = client_verify(settings)

    async def open_one(src: RankSource, follow: bool, tail: int | None) -> AsyncIterator[bytes]:
        return await open_agent_log(
            src.agent_addr,
            src.lease_id,
            token=log_token(settings, src.node_id, src.lease_id),
            offset=src.end,
            follow=follow,
            stream=q.stream,
            tail=tail,
            fmt="ndjson",
            verify=verify,
        )

    bodies = await asyncio.gather(*(open_one(s, False, q.tail) for s in sources), return_exceptions=True)
    errors = [b for b in bodies if isinstance(b, BaseException)]
    if errors:
        for b in bodies:
            if not isinstance(b, BaseException):
                await b.aclose()  # type: ignore[attr-defined]
        raise errors[0]
    opened: list[AsyncIterator[bytes]] = [b for b in bodies if not isinstance(b, BaseException)]

    async def records() -> AsyncIterator[dict[str, Any]]:
        merged = _merge([_records(b, s) for b, s in zip(opened, sources, strict=True)])
        if q.tail is not None:
            last: deque[dict[str, Any]] = deque(maxlen=q.tail)
            async for rec in merged:
                last.append(rec)
            for rec in last:
                yield rec
        else:
            async for rec in merged:
                yield rec
        if not q.follow:
            return
        # then what each rank writes next, as it comes, until every one has ended
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=1000)

        async def pump(src: RankSource) -> None:
            try:
                body = await open_one(src, True, None)
                async for rec in _records(body, src):
                    await queue.put(rec)
            except ApiError:
                pass  # the agent went away: that rank's output ends here
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(s)) for s in sources]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()

    async def body() -> AsyncIterator[bytes]:
        left = skip
        async for rec in records():
            out = render(rec, q)
            if left:
                cut = min(left, len(out))
                out, left = out[cut:], left - cut
            if out:
                yield out

    return body()
