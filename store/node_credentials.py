"""Per-node credentials an admin issues and revokes (docs/design.md, Security).

Only a SHA-256 of each credential is stored; ``issue`` returns the credential itself once.
Issuing again rotates it (the old one stops working); ``revoke`` leaves the node without one
(its agent is refused until a new credential is issued). Both are audited.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime

import asyncpg

from store.audit import write_audit
from store.tx import Db, transaction


def digest(credential: str) -> str:
    return hashlib.sha256(credential.encode()).hexdigest()


@dataclass(frozen=True)
class Issued:
    node_id: str
    credential: str
    issued_at: datetime


async def issue(conn: asyncpg.Connection, node_id: str, *, actor: str, reason: str | None = None) -> Issued:
    """A new credential for ``node_id`` (in the caller's transaction), replacing any before."""
    credential = secrets.token_urlsafe(32)
    issued_at = await conn.fetchval(
        "INSERT INTO node_credentials (node_id, credential_sha256, issued_by) VALUES ($1, $2, $3)"
        " ON CONFLICT (node_id) DO UPDATE SET credential_sha256 = EXCLUDED.credential_sha256,"
        "   issued_at = now(), issued_by = EXCLUDED.issued_by, revoked_at = NULL, revoked_by = NULL"
        " RETURNING issued_at",
        node_id,
        digest(credential),
        actor,
    )
    await write_audit(conn, actor, "node_credential_issue", node_id, reason, {})
    return Issued(node_id, credential, issued_at)


async def revoke(conn: asyncpg.Connection, node_id: str, *, actor: str, reason: str | None = None) -> bool:
    """Revoke the node's credential (in the caller's transaction); False when it had none live."""
    status = await conn.execute(
        "UPDATE node_credentials SET revoked_at = now(), revoked_by = $2 WHERE node_id = $1 AND revoked_at IS NULL",
        node_id,
        actor,
    )
    if not status.endswith(" 1"):
        return False
    await write_audit(conn, actor, "node_credential_revoke", node_id, reason, {})
    return True


async def digests(db: Db) -> dict[str, str | None]:
    """node -> the SHA-256 of its live credential, or None where it was revoked."""
    rows = await db.fetch("SELECT node_id, credential_sha256, revoked_at FROM node_credentials")
    return {r["node_id"]: (None if r["revoked_at"] is not None else r["credential_sha256"]) for r in rows}


async def audit_security_event(db: Db, *, actor: str, node_id: str, what: str, detail: dict[str, object]) -> None:
    """A node spoke for something that is not its own (docs/design.md, Security)."""
    async with transaction(db) as conn:
        await write_audit(conn, actor, "security_event", node_id, what, detail)
