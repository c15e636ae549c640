"""Migrations apply once, in order; a database migrated before they were renumbered keeps
every migration it applied (only its schema_migrations rows are renamed)."""

from __future__ import annotations

import hashlib
import uuid

import asyncpg

from common.db import RENAMED_MIGRATIONS, migrate, migration_files
from tests.support import dsn_with_db


def test_migrations_are_numbered_once_each():
    numbers = [name.split("_", 1)[0] for name, _ in migration_files()]
    assert numbers == [f"{i:04d}" for i in range(1, len(numbers) + 1)]


async def test_a_database_with_the_old_names_is_renamed_not_migrated_again(pg_admin_dsn):
    name = "t_mig_" + uuid.uuid4().hex[:12]
    admin = await asyncpg.connect(pg_admin_dsn)
    await admin.execute(f"CREATE DATABASE {name}")
    conn = await asyncpg.connect(dsn_with_db(pg_admin_dsn, name))
    try:
        old_of = {new: old for old, new in RENAMED_MIGRATIONS.items()}
        files = migration_files()
        # as a version before the renumbering left it: every migration of that time applied
        # (the last one, new here, not yet), recorded under its old name
        for migration, sql in files[:-1]:
            async with conn.transaction():
                await conn.execute(sql)
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " name text PRIMARY KEY, checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            await conn.execute(
                "INSERT INTO schema_migrations (name, checksum) VALUES ($1, $2)",
                old_of.get(migration, migration),
                hashlib.sha256(sql.encode()).hexdigest(),
            )
        applied = await migrate(conn)
        assert applied == [files[-1][0]]  # only the new one: none of the renamed ones ran twice
        names = [r["name"] for r in await conn.fetch("SELECT name FROM schema_migrations ORDER BY name")]
        assert names == [n for n, _ in files]
        assert await migrate(conn) == []
    finally:
        await conn.close()
        await admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
        await admin.close()
