"""Idempotency keys of the API's writes: claimed, completed and expired in Postgres, so a
retried request gets the first answer from any API process."""

from __future__ import annotations

from typing import Any

import asyncpg


async def delete_expired_key(conn: asyncpg.Connection, principal: str, key: str) -> None:
    await conn.execute(
        "DELETE FROM idempotency_keys WHERE principal = $1 AND key = $2 AND expires_at < now()", principal, key
    )


async def purge_expired_keys(conn: asyncpg.Connection, limit: int = 100) -> int:
    status = await conn.execute(
        "DELETE FROM idempotency_keys WHERE ctid = ANY(ARRAY("
        " SELECT ctid FROM idempotency_keys WHERE expires_at < now() LIMIT $1 FOR UPDATE SKIP LOCKED))",
        limit,
    )
    return int(status.split()[-1])


async def claim_key(
    conn: asyncpg.Connection,
    *,
    principal: str,
    key: str,
    method: str,
    path: str,
    request_hash: str,
    ttl_s: float,
) -> bool:
    """Insert the key as in flight; False if a (committed) row already holds it.

    A concurrent claim of the same key blocks here until the first transaction
    ends (Postgres waits on the uncommitted unique key); the caller bounds that wait
    with a lock timeout and answers 409 when it runs out.
    """
    row = await conn.fetchval(
        "INSERT INTO idempotency_keys (principal, key, method, path, request_hash, status, expires_at)"
        " VALUES ($1, $2, $3, $4, $5, 'in_flight', now() + make_interval(secs => $6))"
        " ON CONFLICT (principal, key) DO NOTHING RETURNING 1",
        principal,
        key,
        method,
        path,
        request_hash,
        ttl_s,
    )
    return row is not None


async def get_key(conn: asyncpg.Connection, principal: str, key: str) -> asyncpg.Record | None:
    return await conn.fetchrow(
        "SELECT method, path, request_hash, status, response_code, response_body, expires_at"
        " FROM idempotency_keys WHERE principal = $1 AND key = $2",
        principal,
        key,
    )


async def complete_key(conn: asyncpg.Connection, principal: str, key: str, code: int, body: Any) -> None:
    await conn.execute(
        "UPDATE idempotency_keys SET status = 'done', response_code = $3, response_body = $4"
        " WHERE principal = $1 AND key = $2",
        principal,
        key,
        code,
        body,
    )
