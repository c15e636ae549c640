"""The embedded Postgres (common/embedded.py) trusts every local connection, so its socket
must be reachable by the platform alone: as root, a rank's user must not reach it, even
where pgdata's path is too long for a unix socket and pgserver puts it elsewhere."""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import asyncpg
import pytest

from common.embedded import EmbeddedPostgres
from common.postgres_pair import PostgresNode
from common.postgres_pair import connect as pair_connect

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="pgserver runs Postgres as another user only as root; setpriv tries the socket as a rank's user",
)


@pytest.fixture
def long_pgdata():
    root = Path(tempfile.mkdtemp(prefix="gpufleet-pg-"))
    pgdata = root / ("deep-" * 18) / "pgdata"  # > 107 bytes with the socket's name
    yield pgdata
    shutil.rmtree(root, ignore_errors=True)


async def _select_one(dsn: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval("SELECT 1")
    finally:
        await conn.close()


def test_a_socket_outside_pgdata_is_the_servers_alone(long_pgdata):
    pg = EmbeddedPostgres(long_pgdata)
    dsn = pg.start()
    try:
        sock_dir = Path(dsn.split("host=", 1)[1])
        assert sock_dir.resolve() != long_pgdata.resolve()  # the case this is about
        st = sock_dir.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid != 0, oct(st.st_mode)
        assert asyncio.run(_select_one(dsn)) == 1  # the platform (root) still connects
        # a rank's user cannot reach the socket, so cannot connect as the trusted superuser
        probe = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "ls", str(sock_dir)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert probe.returncode != 0 and "Permission denied" in probe.stderr, probe
    finally:
        pg.stop()


def test_a_pair_nodes_socket_outside_pgdata_is_the_servers_alone(long_pgdata):
    """The same for each server of `gpufleet up --ha`'s pair (common/postgres_pair.py)."""
    node = PostgresNode("pg-a", long_pgdata)
    node.initdb()
    node.start()
    try:
        sock_dir = node.socket_dir
        assert sock_dir.resolve() != long_pgdata.resolve()
        st = sock_dir.stat()
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid != 0, oct(st.st_mode)

        async def select_one() -> int:
            conn = await pair_connect(node)
            try:
                return await conn.fetchval("SELECT 1")
            finally:
                await conn.close()

        assert asyncio.run(select_one()) == 1
    finally:
        node.stop()
        shutil.rmtree(node.socket_dir, ignore_errors=True)
