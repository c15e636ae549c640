"""asyncpg pool and the migration runner."""

from __future__ import annotations

import hashlib
import json
import logging
from importlib import resources
from typing import Any

import asyncpg

from common.aio import retry_until_reachable
from common.settings import Settings


async def _init_connection(conn: asyncpg.Connection) -> None:
    for typ in ("json", "jsonb"):
        await conn.set_type_codec(typ, encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


class _OneLine(logging.Filter):
    """asyncpg logs a full traceback each time it fails to refill the pool's floor (every
    second of a Postgres outage or failover): one line with the error says the same."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            e = record.exc_info[1]
            record.msg, record.args = f"{record.getMessage()}: {type(e).__name__}: {e}", ()
            record.exc_info, record.exc_text = None, None
        return True


_POOL_LOG = logging.getLogger("asyncpg.pool")
if not any(isinstance(f, _OneLine) for f in _POOL_LOG.filters):
    _POOL_LOG.addFilter(_OneLine())


async def create_pool(dsn: str, *, min_size: int = 1, max_size: int = 10, **kwargs: Any) -> asyncpg.Pool:
    return await asyncpg.create_pool(dsn, min_size=min_size, max_size=max_size, init=_init_connection, **kwargs)


# a server that is down, starting or full, as opposed to a refusal (password, database name)
POSTGRES_UNREACHABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.CannotConnectNowError,
    asyncpg.TooManyConnectionsError,
)


async def pool_when_reachable(settings: Settings, log: logging.Logger) -> asyncpg.Pool:
    """``pool_from_settings``, waiting out a Postgres that is down or starting (one line per
    try, up to ``connect_retry_max_s`` apart); a refusal is raised at once."""
    return await retry_until_reachable(
        lambda: pool_from_settings(settings), what="Postgres", retry_on=POSTGRES_UNREACHABLE,
        max_interval_s=settings.connect_retry_max_s, log=log,
    )  # fmt: skip


async def pool_from_settings(settings: Settings, dsn: str | None = None) -> asyncpg.Pool:
    url = dsn or settings.database_url
    if not url:
        raise RuntimeError("no database URL: set GPUFLEET_DATABASE_URL or start the embedded Postgres")
    return await create_pool(
        url, min_size=settings.db_pool_min, max_size=settings.db_pool_max, **pool_deadlines(settings)
    )


def pool_deadlines(settings: Settings) -> dict[str, Any]:
    """What every process's pool waits at most, on each end of a connection:

    * ours: a statement on a silent connection fails after ``db_command_timeout_s`` rather
      than never, and asyncpg drops the connection (a connection attempt has asyncpg's own
      deadline, 60 s unless given);
    * the server's: a session of ours idle inside a transaction for
      ``db_idle_in_transaction_s`` is ended by Postgres, its locks with it. Cut off from us
      by a partition, its end of the connection would otherwise hold them until TCP
      keepalive gave up (over 2 h by default). A startup parameter, not a SET: the pool's
      reset (RESET ALL) keeps it.
    """
    ms = max(1, round(settings.db_idle_in_transaction_s * 1000))
    return {
        "command_timeout": settings.db_command_timeout_s,
        "server_settings": {"idle_in_transaction_session_timeout": str(ms)},
    }


# Migrations renumbered after they shipped (three were numbered 0003, none 0004): a
# database that recorded the old names gets the new ones (same files, same checksums)
# before anything is applied.
RENAMED_MIGRATIONS = {
    "0003_replica_restart.sql": "0004_replica_restart.sql",
    "0003_wake_notify.sql": "0005_wake_notify.sql",
    "0005_hot_spares.sql": "0006_hot_spares.sql",
    "0006_job_state_changes.sql": "0007_job_state_changes.sql",
}


def migration_files() -> list[tuple[str, str]]:
    """(name, sql) for every migration, in order."""
    folder = resources.files("db") / "migrations"
    names = sorted(p.name for p in folder.iterdir() if p.name.endswith(".sql"))
    return [(n, (folder / n).read_text()) for n in names]


async def migrate(conn: asyncpg.Connection) -> list[str]:
    """Apply migrations not yet recorded; safe to re-run and to race (advisory lock)."""
    applied: list[str] = []
    await conn.execute("SELECT pg_advisory_lock(727274)")
    try:
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " name text PRIMARY KEY, checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
        )
        for old, new in RENAMED_MIGRATIONS.items():
            await conn.execute("UPDATE schema_migrations SET name = $2 WHERE name = $1", old, new)
        done = {r["name"]: r["checksum"] for r in await conn.fetch("SELECT name, checksum FROM schema_migrations")}
        for name, sql in migration_files():
            digest = hashlib.sha256(sql.encode()).hexdigest()
            if name in done:
                if done[name] != digest:
                    raise RuntimeError(f"migration {name} changed after it was applied; add a new migration instead")
                continue
            async with conn.transaction():
                await conn.execute(sql)
                await conn.execute("INSERT INTO schema_migrations (name, checksum) VALUES ($1, $2)", name, digest)
            applied.append(name)
    finally:
        await conn.execute("SELECT pg_advisory_unlock(727274)")
    return applied
