"""`gpufleet api`: serve the public REST API with uvicorn.

With ``api_reuse_port`` (``GPUFLEET_API_REUSE_PORT=true``) the process binds its port with
SO_REUSEPORT, so several ``gpufleet api`` processes share one address: the kernel spreads new
connections across the listening sockets, and when one process dies its socket leaves the group
and the others take every new connection (what the dead one had accepted or queued is reset; the
CLI retries it with the same Idempotency-Key). The socket is bound at start but listens only
once the app has started, so a process still starting takes no connection from the others.

``api_commands`` / ``start_apis`` / ``wait_listening`` start N of them (``gpufleet up --ha``,
the tests).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    from common.settings import Settings


def serve(
    host: Annotated[str | None, typer.Option(help="bind address (default: GPUFLEET_API_HOST)")] = None,
    port: Annotated[int | None, typer.Option(help="port (default: GPUFLEET_API_PORT)")] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
) -> None:
    """Run the REST API (uvicorn) on settings.api_host:api_port with create_app()."""
    import uvicorn

    from api.main import create_app
    from common.embedded import PlatformError
    from common.secrets import require_production_ready
    from common.settings import Settings
    from common.temporal import hard_exit
    from common.tls import TlsSettingsError, client_verify, uvicorn_tls

    settings = Settings()
    try:
        require_production_ready(settings, "api")
    except PlatformError as e:
        print(f"error: {e}", file=sys.stderr)
        hard_exit(2)
    try:
        tls = uvicorn_tls(settings)  # {} for plain HTTP
        client_verify(settings)  # the CA it checks agents' log endpoints with loads, or it says so now
    except TlsSettingsError as e:
        print(f"error: {e}", file=sys.stderr)
        hard_exit(2)
    host = host or settings.api_host
    port = port or settings.api_port
    sock: socket.socket | None = None
    if settings.api_reuse_port:
        try:
            sock = bind_socket(host, port, reuse_port=True)
        except OSError as e:
            print(f"error: cannot bind {host}:{port} with SO_REUSEPORT: {e}", file=sys.stderr)
            hard_exit(1)
    app = create_app(settings)
    code = 0
    try:
        if sock is None:
            uvicorn.run(app, host=host, port=port, log_level=log_level, proxy_headers=False, server_header=False, **tls)
        else:
            config = uvicorn.Config(
                app, host=host, port=port, log_level=log_level, proxy_headers=False, server_header=False, **tls
            )
            server = uvicorn.Server(config)
            server.run(sockets=[sock])
            if not server.started:  # as uvicorn.run: a failed startup is exit code 3
                code = 3
    except SystemExit as e:  # uvicorn exits(1) when startup fails
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    # docs/design.md, Known pitfalls: a process that used temporalio can crash at interpreter exit
    hard_exit(code)


def bind_socket(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to ``host:port`` and not yet listening (uvicorn listens once the app
    has started). With ``reuse_port``, SO_REUSEPORT: every process that binds the same address
    with it joins one group the kernel spreads connections across."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def api_commands(settings: Settings, count: int = 2) -> dict[str, tuple[list[str], dict[str, str]]]:
    """``count`` ``gpufleet api`` processes on ``settings.api_host:api_port``, in the shape of
    ``gpufleet up``'s children: name -> (arguments after ``python -m cli.main``, environment).

    One process is ``{"api": ...}`` as before; more are ``api-1``, ``api-2``, ... with
    ``api_reuse_port`` on, each with the API's secrets only (``role_env``)."""
    from common.secrets import role_env

    if count < 1:
        raise ValueError("count must be at least 1")
    if count == 1:
        return {"api": (["api"], role_env(settings, "api"))}
    shared = settings.model_copy(update={"api_reuse_port": True})
    return {f"api-{i}": (["api"], role_env(shared, "api")) for i in range(1, count + 1)}


def start_apis(
    settings: Settings,
    count: int,
    log_dir: Path,
    *,
    names: Collection[str] | None = None,
    cwd: Path | None = None,
    **popen: Any,
) -> dict[str, subprocess.Popen]:
    """Start ``api_commands(settings, count)`` (or only those in ``names``: one that died,
    started again), each in its own process group (the terminal's Ctrl-C reaches the parent
    alone), output appended to ``log_dir/<name>.log``. Returns name -> process; wait for each
    with ``wait_listening``."""
    from cli.children import spawn_gpufleet

    return {
        name: spawn_gpufleet(args, env, log_dir / f"{name}.log", cwd=cwd, **popen)
        for name, (args, env) in api_commands(settings, count).items()
        if names is None or name in names
    }


def listening(pid: int, port: int) -> bool:
    """Whether process ``pid`` has a TCP socket listening on ``port`` (Linux: several processes
    may, with SO_REUSEPORT, so a connect to the port says nothing about which one answers)."""
    import psutil

    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


def wait_listening(
    procs: dict[str, subprocess.Popen], port: int, timeout_s: float = 60.0, log_dir: Path | None = None
) -> None:
    """Wait until every process in ``procs`` listens on ``port``; PlatformError when one exits
    first (with the last line of ``log_dir/<name>.log``, where given) or the time runs out."""
    from common.embedded import PlatformError, last_log_line

    deadline = time.monotonic() + timeout_s
    waiting = dict(procs)
    while waiting:
        for name, proc in list(waiting.items()):
            if proc.poll() is not None:
                said = f"; last log line: {last_log_line(log_dir / f'{name}.log')}" if log_dir else ""
                raise PlatformError(f"{name} exited with code {proc.returncode} before listening on {port}{said}")
            if listening(proc.pid, port):
                del waiting[name]
        if not waiting:
            return
        if time.monotonic() > deadline:
            raise PlatformError(f"{', '.join(waiting)} not listening on {port} after {timeout_s:.0f}s")
        time.sleep(0.1)
