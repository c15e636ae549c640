"""Idempotency on every write, after the IETF Idempotency-Key draft.

* the key is required (400 if missing), 1-255 printable ASCII characters;
* it is scoped to the caller (the principal's name);
* the first successful response is stored and replayed for retries
  (``Idempotent-Replayed: true``);
* the same key with a different request (method, path, query or body) -> 422;
* while the first request is still in flight -> 409 (a retry waits
  ``idempotency_wait_s`` for it first);
* keys are kept ``idempotency_ttl_s`` (24 h by default), then may be reused.

The key claim and the business write are one transaction: the claim row is
inserted first, the work runs on the same connection, the response is stored,
and everything commits together. A rejected request rolls back the claim too,
so nothing is written for it and a corrected retry may reuse the key.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

from api.errors import ApiError
from common.settings import Principal, Settings
from store import idempotency as idempotency_keys
from store import tx

MAX_KEY_LENGTH = 255
REPLAYED_HEADER = "Idempotent-Replayed"


@dataclass
class Outcome:
    """What a write's work returns: the response to store, and work to do after commit."""

    status: int
    body: dict[str, Any]
    after_commit: Callable[[], Awaitable[None]] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    # what is stored for replays, when the response carries a secret that must not be kept
    stored_body: dict[str, Any] | None = None


def validate_key(key: str | None) -> str:
    if key is None or key == "":
        raise ApiError(
            400, "idempotency_key_missing", "this write needs an Idempotency-Key header (a unique string per request)"
        )
    if len(key) >= 2 and key[0] == key[-1] == '"':  # the draft sends it as a structured-field string
        key = key[1:-1]
    if not key or len(key) > MAX_KEY_LENGTH or not all(0x21 <= ord(c) <= 0x7E for c in key):
        raise ApiError(
            400, "idempotency_key_invalid", f"the Idempotency-Key must be 1-{MAX_KEY_LENGTH} printable ASCII characters"
        )
    return key


async def fingerprint(request: Request) -> str:
    """Method, path, sorted query and the body (canonical JSON when it parses)."""
    raw = await request.body()
    try:
        body = json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")) if raw else ""
    except (ValueError, UnicodeDecodeError):
        body = raw.decode("latin-1")
    query = "&".join(f"{k}={v}" for k, v in sorted(request.query_params.multi_items()))
    h = hashlib.sha256()
    for part in (request.method, request.url.path, query, body):
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()


async def run(
    request: Request,
    principal: Principal,
    key: str | None,
    work: Callable[[asyncpg.Connection], Awaitable[Outcome]],
) -> JSONResponse:
    """Claim ``key``, run ``work`` in the same transaction, store and return its response."""
    key = validate_key(key)
    settings: Settings = request.app.state.settings
    pool: asyncpg.Pool = request.app.state.pool
    request_hash = await fingerprint(request)
    method, path = request.method, request.url.path
    replay: tuple[int, dict[str, Any]] | None = None
    outcome: Outcome | None = None
    async with pool.acquire() as conn:
        async with conn.transaction():
            if random.random() < 0.01:  # keep the table small without a separate janitor
                await idempotency_keys.purge_expired_keys(conn)
            await tx.set_lock_timeout(conn, settings.idempotency_wait_s)
            try:
                await idempotency_keys.delete_expired_key(conn, principal.name, key)
                claimed = await idempotency_keys.claim_key(
                    conn,
                    principal=principal.name,
                    key=key,
                    method=method,
                    path=path,
                    request_hash=request_hash,
                    ttl_s=settings.idempotency_ttl_s,
                )
            except asyncpg.LockNotAvailableError as e:
                raise _in_flight() from e
            await tx.set_lock_timeout(conn, 0)
            if not claimed:
                row = await idempotency_keys.get_key(conn, principal.name, key)
                if row is None:  # expired and purged between the two statements: tell the client to retry
                    raise _in_flight()
                if row["request_hash"] != request_hash:
                    raise ApiError(
                        422,
                        "idempotency_key_reused",
                        "this Idempotency-Key was already used for a different request; use a new key",
                        {"first_request": f"{row['method']} {row['path']}"},
                    )
                if row["status"] != "done":
                    raise _in_flight()
                replay = (row["response_code"], row["response_body"])
            else:
                outcome = await work(conn)
                outcome.body = jsonable_encoder(outcome.body)
                stored = outcome.body if outcome.stored_body is None else jsonable_encoder(outcome.stored_body)
                await idempotency_keys.complete_key(conn, principal.name, key, outcome.status, stored)
    if replay is not None:
        return JSONResponse(replay[1], status_code=replay[0], headers={REPLAYED_HEADER: "true"})
    assert outcome is not None
    if outcome.after_commit is not None:
        await outcome.after_commit()
    return JSONResponse(outcome.body, status_code=outcome.status, headers=outcome.headers)


def _in_flight() -> ApiError:
    return ApiError(
        409,
        "idempotency_key_in_flight",
        "a request with this Idempotency-Key is still being processed; retry shortly with the same key",
        headers={"Retry-After": "1"},
    )
