"""Who may speak for a node on the agents' gRPC stream (docs/design.md, Security).

``NodeAuth.verify(node_id, presented)`` accepts a stream when the credential matches the one
an admin issued for the node (``store.node_credentials``: only its SHA-256 is kept, read
into memory and refreshed every ``node_credentials_refresh_s``, so a revocation takes
effect within that). A node whose credential was revoked is refused. A node that never got
one is accepted only in dev, with the credential derived from ``agent_shared_secret``.

``NodeAuth.owner_of(lease_id)`` says which node the store assigns a lease to, so a report
is accepted only from the node that holds the lease (a burn-in lease names its node).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from common.settings import Settings
from control.health.burn_in import BURN_IN_PREFIX
from proto.auth import check_credential, node_credential
from store import allocations, node_credentials
from store.tx import Pool

log = logging.getLogger("gpufleet.control.auth")

OWNERS_KEPT = 200_000


class NodeAuth:
    def __init__(self, pool: Pool, settings: Settings) -> None:
        self.pool = pool
        self.settings = settings
        self._digests: dict[str, str | None] = {}
        self._loaded_at = float("-inf")
        self._reading: asyncio.Task | None = None  # the one read in flight; concurrent callers share it
        self._owners: dict[str, str] = {}  # lease -> node, as the store has it (a lease never moves)

    async def _refresh(self, force: bool = False) -> None:
        """Read the table when it is older than the refresh interval, or (``force``: an unknown
        node, issued a moment ago?) when no read has started since this call. Callers share
        reads: after a leader change every agent re-links at once, and in dev most nodes have
        no issued credential, so one read per stream would be thousands of reads."""
        asked_at = time.monotonic()
        if not force and asked_at - self._loaded_at < self.settings.node_credentials_refresh_s:
            return
        while self._loaded_at < asked_at:
            if self._reading is None or self._reading.done():
                self._reading = asyncio.create_task(self._read())
            reading = self._reading
            await asyncio.shield(reading)
            if self._reading is reading and self._loaded_at < asked_at:
                # the read we waited for had started before we asked: start one now
                self._reading = None

    async def _read(self) -> None:
        started = time.monotonic()
        self._digests = await node_credentials.digests(self.pool)
        self._loaded_at = started

    async def verify(self, node_id: str, presented: str | None) -> bool:
        if not presented:
            return False
        await self._refresh()
        if node_id not in self._digests:
            await self._refresh(force=True)  # issued a moment ago?
        if node_id in self._digests:
            want = self._digests[node_id]
            return want is not None and hmac.compare_digest(want, node_credentials.digest(presented))
        if self.settings.env == "dev":
            return check_credential(node_credential(self.settings, node_id), presented)
        return False

    async def owner_of(self, lease_id: str) -> str | None:
        """The node the store assigns ``lease_id`` to (None: no such lease)."""
        if lease_id.startswith(BURN_IN_PREFIX):
            return None  # a burn-in lease is not in the store; the health monitor checks its node
        node = self._owners.get(lease_id)
        if node is None:
            rows = await allocations.lease_rows(self.pool, [lease_id])
            row = rows.get(lease_id)
            if row is None:
                return None
            node = self._owners[lease_id] = row.node_id
            if len(self._owners) > OWNERS_KEPT:
                for stale in list(self._owners)[: OWNERS_KEPT // 2]:
                    del self._owners[stale]
        return node
