"""The leader row and its fencing epoch (invariant 3; docs/design.md, Leadership).

A control process takes the row when it is free or expired (epoch + 1), renews it,
and gives it up on a clean stop. Every write the leader makes calls ``check_epoch``
in its own transaction, so a deposed leader's writes fail with ``StaleEpoch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

from store.errors import StaleEpoch
from store.tx import Db, transaction

# A deliberately broken build for the chaos checker's own tests (settings ``test_faults``:
# ``skip_epoch_check``, set by the control process at start, refused outside dev).
SKIP_EPOCH_CHECK = False


async def check_epoch(conn: asyncpg.Connection, scope: str, epoch: int) -> None:
    """Invariant 3: raise StaleEpoch unless ``epoch`` is the leader's, and hold the
    row (FOR SHARE) so no takeover can commit until this transaction ends."""
    current = await conn.fetchval("SELECT epoch FROM leader WHERE scope = $1 FOR SHARE", scope)
    if SKIP_EPOCH_CHECK:
        return
    if current is None or current != epoch:
        raise StaleEpoch(f"epoch {epoch} is not the current leader epoch ({current}) for scope {scope!r}")


async def acquire_leadership(db: Db, *, scope: str, holder: str, grpc_addr: str, ttl_s: float) -> int | None:
    """Take the leader row when it is free or expired; return the new epoch (strictly
    increasing), or None while another holder's lease is live."""
    async with transaction(db) as conn:
        return await conn.fetchval(
            "INSERT INTO leader (scope, epoch, holder, expires_at, grpc_addr)"
            " VALUES ($1, 1, $2, now() + make_interval(secs => $3), $4)"
            " ON CONFLICT (scope) DO UPDATE SET epoch = leader.epoch + 1, holder = EXCLUDED.holder,"
            "   expires_at = EXCLUDED.expires_at, grpc_addr = EXCLUDED.grpc_addr, acquired_at = now()"
            " WHERE leader.expires_at < now()"
            " RETURNING epoch",
            scope,
            holder,
            ttl_s,
            grpc_addr,
        )


async def renew_leadership(db: Db, *, scope: str, holder: str, epoch: int, ttl_s: float) -> bool:
    """Extend our lease; False means we are no longer the leader (expired or deposed)."""
    async with transaction(db) as conn:
        status = await conn.execute(
            "UPDATE leader SET expires_at = now() + make_interval(secs => $4)"
            " WHERE scope = $1 AND holder = $2 AND epoch = $3 AND expires_at > now()",
            scope,
            holder,
            epoch,
            ttl_s,
        )
        return status.endswith(" 1")


async def resign_leadership(db: Db, *, scope: str, holder: str, epoch: int) -> None:
    """Give the lease up on a clean shutdown so a successor need not wait for expiry."""
    async with transaction(db) as conn:
        await conn.execute(
            "UPDATE leader SET expires_at = now() - interval '1 second' WHERE scope = $1 AND holder = $2 AND epoch = $3",
            scope,
            holder,
            epoch,
        )


async def leader_grpc_addr(db: Db, scope: str) -> str:
    """Where the current leader serves the agents' stream ("" when no leader is recorded)."""
    addr = await db.fetchval("SELECT grpc_addr FROM leader WHERE scope = $1", scope)
    return addr or ""


@dataclass(frozen=True)
class LeaderLease:
    grpc_addr: str  # where the leader serves the agents' stream ("" when it recorded none)
    expires_in_s: float  # by the database's clock; negative once expired


async def leader_lease(db: Db, scope: str) -> LeaderLease | None:
    """The current leader row's address and the time its lease has left (None: no row)."""
    row = await db.fetchrow(
        "SELECT grpc_addr, extract(epoch FROM expires_at - now())::float8 AS left_s FROM leader WHERE scope = $1",
        scope,
    )
    return LeaderLease(row["grpc_addr"] or "", float(row["left_s"])) if row is not None else None
