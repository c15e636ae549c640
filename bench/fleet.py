"""A simulated fleet on its own embedded stack, for the benchmarks that break it at scale
(``bench.takeover``: the leader; ``bench.node_loss``: nodes).

``Fleet.start`` starts embedded Postgres and a Temporal dev server in a state dir, seeds
``blocks x nodes_per_block`` nodes of 8 GPUs, and runs real ``gpufleet control`` processes
(c1 leads; c2 stands by when asked for) and agent processes (``python -m bench.fleet agent``)
hosting every node with simulated ranks (``worker_agent.node``, "Simulated ranks": every check
of a real agent, no rank processes), each node streaming heartbeats to the leader as a separate
host would. The REST API runs in this process. ``Fleet.stop`` tears everything down.

Node activities reach the right agent process through the task queue recorded for each node
(``nodes.task_queue``, which the control plane uses in ``per_node`` mode): one queue per agent
process, served by one worker for all its nodes (``worker_agent.node.FleetActivities``). Several
processes, because one Python process hosting 3,008 nodes is CPU-bound on its own event loop.
Which nodes share a process is the caller's choice (``groups``): spread over the blocks, or a
process per run of consecutive blocks (``by_blocks``), so that killing one process fails those nodes, as a
switch or power failure would.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

from common.embedded import any_free_port


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def quantile(values: list[float], q: float) -> float | None:
    """The value at rank ``q`` of the sorted values (nearest rank below), rounded."""
    if not values:
        return None
    s = sorted(values)
    return round(s[int(q * (len(s) - 1))], 2)


def workload(jobs: int, gang_gpus: int) -> list[tuple[int, int]]:
    """(replicas, gpus per replica): the gang first, then 1-GPU jobs, single nodes and 2-node gangs."""
    kinds = [(1, 1), (1, 8), (1, 1), (2, 8)]
    out = [(gang_gpus // 8, 8)] if gang_gpus >= 8 else []
    out += [kinds[i % len(kinds)] for i in range(jobs)]
    return out


def spread(nodes: list[str], procs: int) -> list[list[str]]:
    """Every ``procs``-th node to one process: each process hosts part of every block."""
    return [nodes[k::procs] for k in range(procs)]


def by_blocks(nodes: list[str], procs: int) -> list[list[str]]:
    """Runs of consecutive nodes (``ensure_cluster`` numbers them block by block) to each
    process, the first ones one node larger when the count does not divide."""
    size, extra = divmod(len(nodes), procs)
    out, at = [], 0
    for k in range(procs):
        n = size + (1 if k < extra else 0)
        out.append(nodes[at : at + n])
        at += n
    return out


class TwoLeaseWatch:
    """GPUs under two live leases, read from the leases (not from the allocations' key, which
    would forbid it): ``sample`` counts them now, ``most`` is the most any sample saw."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.most = 0

    async def sample(self) -> int:
        n = int(
            await self.pool.fetchval(
                "SELECT count(*) FROM (SELECT node_id, g FROM leases, unnest(gpu_indices) AS g"
                " WHERE state = 'live' GROUP BY 1, 2 HAVING count(*) > 1) AS d"
            )
        )
        self.most = max(self.most, n)
        return n


async def until(probe: Callable[[], Awaitable[Any]], timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll ``probe`` until it returns something truthy (returned), or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f}s")
        await asyncio.sleep(interval)


class ControlProcess:
    """One ``gpufleet control`` process in its own process group (frozen and killed as a host would be)."""

    def __init__(self, settings: Any, holder: str, port: int, log_dir: Path) -> None:
        self.holder = holder
        self.addr = f"127.0.0.1:{port}"
        env = settings.to_env()
        env["GPUFLEET_CONTROL_GRPC_PORT"] = str(port)
        env["GPUFLEET_CONTROL_METRICS_LISTEN"] = "127.0.0.1:0"  # several controls on one host
        with open(log_dir / f"{holder}.log", "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cli.main", "control", "--holder", holder, "--log-level", "WARNING"],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass


class AgentProcesses:
    """The agent processes; reads their ``linked NODE ADDR WALLTIME`` lines as they come."""

    def __init__(self) -> None:
        self.procs: list[asyncio.subprocess.Process] = []
        self.linked: list[tuple[str, str, float]] = []  # (node, control address, wall time of its first ack)
        self.ready = 0
        self._readers: list[asyncio.Task] = []
        self._launch: list[Callable[[], Awaitable[asyncio.subprocess.Process]]] = []

    async def start(self, settings: Any, nodes_file: Path, queue: str, log_dir: Path, links: str = "own") -> None:
        log_file = log_dir / f"agent-{len(self.procs)}.log"

        async def launch() -> asyncio.subprocess.Process:
            with open(log_file, "ab") as log:
                return await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "bench.fleet", "agent", str(nodes_file), queue, links,
                    env=settings.to_env(), stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True,
                )  # fmt: skip

        proc = await launch()
        self._launch.append(launch)
        self.procs.append(proc)
        self._readers.append(asyncio.create_task(self._read(proc)))

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            parts = raw.decode().split()
            if parts[:1] == ["ready"]:
                self.ready += 1
            elif parts[:1] == ["linked"] and len(parts) == 4:
                self.linked.append((parts[1], parts[2], float(parts[3])))

    def linked_to(self, addr: str, since: float = 0.0) -> dict[str, float]:
        """node -> its first acknowledged heartbeat from ``addr`` at or after ``since`` (wall time)."""
        out: dict[str, float] = {}
        for node, a, t in self.linked:
            if a == addr and t >= since and node not in out:
                out[node] = t
        return out

    async def kill(self, k: int) -> None:
        """SIGKILL agent process ``k`` and everything it started: its nodes fall silent at once."""
        proc = self.procs[k]
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await proc.wait()

    def freeze(self, k: int) -> None:
        """SIGSTOP agent process ``k``'s group: its nodes fall silent, and its simulated ranks
        stay in its memory, as under a network partition (it resumes with them on ``thaw``)."""
        self._signal(k, signal.SIGSTOP)

    def thaw(self, k: int) -> None:
        self._signal(k, signal.SIGCONT)

    def _signal(self, k: int, sig: int) -> None:
        if self.procs[k].returncode is None:
            try:
                os.killpg(self.procs[k].pid, sig)
            except ProcessLookupError:
                pass

    async def restart(self, k: int) -> None:
        """Start agent process ``k`` again (after ``kill``): its nodes come back empty, as after a reboot."""
        await self.kill(k)
        proc = await self._launch[k]()
        self.procs[k] = proc
        self._readers.append(asyncio.create_task(self._read(proc)))

    async def stop(self) -> None:
        for k in range(len(self.procs)):
            await self.kill(k)
        for r in self._readers:
            r.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)


class Fleet:
    """The running stack (``start``): its settings, pool, nodes, processes and an API client."""

    def __init__(self, root: Path, log_dir: Path) -> None:
        self.root = root
        self.log_dir = log_dir
        self.controls: list[ControlProcess] = []
        self.agents = AgentProcesses()
        self.nodes: list[str] = []
        self.groups: list[list[str]] = []
        self.pool: Any = None
        self.http: Any = None
        self.settings: Any = None
        self.token = "bench-" + uuid.uuid4().hex
        self._pg: Any = None
        self._temporal: Any = None

    @property
    def gpus(self) -> int:
        return len(self.nodes) * 8

    async def start(
        self,
        *,
        blocks: int,
        nodes_per_block: int,
        agent_procs: int,
        group: Callable[[list[str], int], list[list[str]]],
        overrides: dict[str, Any],
        links: str = "own",
        standby: bool = True,
        max_queued: int = 5000,
    ) -> None:
        """Bring the stack up until every node streams to c1 and is ready; on failure, ``stop``."""
        try:
            import httpx

            from api.main import create_app
            from common.db import create_pool, migrate
            from common.embedded import EmbeddedPostgres, EmbeddedTemporal
            from common.settings import Principal, Settings
            from common.temporal import connect
            from store.seed import ensure_cluster
            from store.teams import TeamQuota, set_quota

            self._pg = EmbeddedPostgres(self.root / "pgdata")
            dsn = self._pg.start()
            self._temporal = EmbeddedTemporal(
                self.root / "temporal" / "temporal.db", port=any_free_port(), ui=False,
                log_file=self.log_dir / "temporal.log",
            )  # fmt: skip
            address = self._temporal.start()
            ports = [any_free_port(), any_free_port()]
            values: dict[str, Any] = dict(
                env="dev",
                state_dir=self.root / "state",
                database_url=dsn,
                temporal_address=address,
                # simulated ranks have no exits or progress files to look at: the agents' per-node
                # watch loop would only cost the CPU the links need (heartbeats keep their interval)
                agent_poll_s=2.0,
                agent_shared_secret="bench-" + uuid.uuid4().hex,
                control_addresses=[f"127.0.0.1:{p}" for p in ports],
                api_tokens={self.token: Principal(name="bench", team="bench")},
                max_queued_per_team=max_queued,
                db_pool_max=20,
            )
            values.update(overrides)
            self.settings = settings = Settings(**values)
            self.pool = pool = await create_pool(dsn, min_size=2, max_size=20)
            async with pool.acquire() as conn:
                await migrate(conn)
                self.nodes = await ensure_cluster(
                    conn, gpu_type="h100", blocks=blocks, nodes_per_block=nodes_per_block,
                    task_queue_prefix=settings.agent_task_queue_prefix,
                )  # fmt: skip
                # one task queue per agent process, recorded per node (module docstring)
                run_id = uuid.uuid4().hex[:6]
                self.groups = [g for g in group(self.nodes, agent_procs) if g]
                queues = [f"bench-agents-{run_id}-{k}" for k in range(len(self.groups))]
                for nodes, queue in zip(self.groups, queues, strict=True):
                    await conn.execute("UPDATE nodes SET task_queue = $1 WHERE node_id = ANY($2)", queue, nodes)
                await set_quota(conn, TeamQuota("bench", "h100", self.gpus, 0), actor="bench", reason="bench fleet")

            # c1 first, so it leads; the agents start meanwhile (their links retry until it serves),
            # so the new leader hears them well within its first suspect window; c2 once c1 leads
            c1 = ControlProcess(settings, "c1", ports[0], self.log_dir)
            self.controls.append(c1)
            for k, (nodes, queue) in enumerate(zip(self.groups, queues, strict=True)):
                nodes_file = self.root / f"nodes-{k}.txt"
                nodes_file.write_text("\n".join(nodes))
                await self.agents.start(settings, nodes_file, queue, self.log_dir, links)
            await until(self.leader, 180, "c1 leads")  # the agent processes start meanwhile
            if standby:
                self.controls.append(ControlProcess(settings, "c2", ports[1], self.log_dir))

            async def agents_ready() -> bool:
                return self.agents.ready == len(self.groups)

            await until(agents_ready, 120 + len(self.nodes) / 10, "the agent processes up")
            seen = {"linked": 0, "ready": 0}

            async def all_ready() -> bool:
                seen["linked"] = len(self.agents.linked_to(c1.addr))
                seen["ready"] = await pool.fetchval("SELECT count(*) FROM nodes WHERE state = 'ready'")
                return seen["linked"] == seen["ready"] == len(self.nodes)

            try:
                await until(all_ready, 120 + len(self.nodes) / 5, "every node streaming to c1 and ready")
            except RuntimeError as e:
                raise RuntimeError(
                    f"{e} ({seen['linked']} linked, {seen['ready']} ready of {len(self.nodes)})"
                ) from None

            client = await connect(settings)
            app = create_app(settings, pool=pool, temporal_client=client)
            self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api", timeout=120)
        except BaseException:
            await self.stop()
            raise

    async def service_down(self, service: str, *, hard: bool) -> None:
        """Stop ``postgres`` or ``temporal``: cleanly, or as a crash (``hard``)."""
        if service == "postgres":
            stop = self._pg.crash if hard else self._pg.stop
        else:
            stop = self._temporal.kill if hard else self._temporal.stop
        await asyncio.to_thread(stop)

    async def service_up(self, service: str) -> None:
        """Start it again, on the same data (and, for Temporal, the same port)."""
        svc = {"postgres": self._pg, "temporal": self._temporal}[service]
        await asyncio.to_thread(svc.start)

    async def leader(self) -> Any:
        return await self.pool.fetchrow(
            "SELECT holder, epoch, acquired_at FROM leader WHERE scope = $1 AND expires_at > now()",
            self.settings.leader_scope,
        )

    async def attempts(self, job_ids: list[str]) -> dict[str, int]:
        """Each job's current attempt."""
        rows = await self.pool.fetch("SELECT job_id, attempt FROM jobs WHERE job_id = ANY($1)", job_ids)
        return {r["job_id"]: r["attempt"] for r in rows}

    async def past_takeover_quiet(self) -> Any:
        """Wait out the leader's quiet period (it judges no silence within ``takeover_quiet_s`` of
        taking over, docs/design.md, Leadership); returns the leader row."""
        took = await self.leader()
        await asyncio.sleep(max(0.0, took["acquired_at"].timestamp() + self.settings.takeover_quiet_s - time.time()))
        return took

    async def nodes_audited_into(self, state: str, since: Any) -> list[str]:
        """Nodes whose state was audited into ``state`` at or after ``since`` (a datetime)."""
        rows = await self.pool.fetch(
            "SELECT DISTINCT subject FROM audit WHERE action = 'node_state' AND detail->>'to' = $1 AND at >= $2",
            state, since,
        )  # fmt: skip
        return sorted(r["subject"] for r in rows)

    async def submit(self, name: str, replicas: int, gpus: int, key: str | None = None) -> str:
        """Submit a research job of ``replicas x gpus``; ``key``: its Idempotency-Key (a retry
        passes the same one), new by default."""
        body = {
            "team": "bench", "priority_class": "research", "image": "registry/bench:1", "command": ["true"],
            "gpu_type": "h100", "replicas": replicas, "gpus_per_replica": gpus, "max_runtime": "4h",
            "name": name,
        }  # fmt: skip
        headers = {"Authorization": f"Bearer {self.token}", "Idempotency-Key": key or uuid.uuid4().hex}
        r = await self.http.post("/v1/jobs", json=body, headers=headers)
        if r.status_code != 202:
            raise RuntimeError(f"submit {name}: HTTP {r.status_code} {r.text[:300]}")
        return str(r.json()["job_id"])

    async def submit_workload(self, jobs: int, gang_gpus: int) -> tuple[str | None, list[str]]:
        """The gang (when ``gang_gpus`` >= 8) first, then ``jobs`` more (``workload``): (gang, all ids)."""
        work = workload(jobs, gang_gpus)
        sem = asyncio.Semaphore(20)

        async def one(i: int, replicas: int, gpus: int) -> str:
            async with sem:
                return await self.submit(f"bench-{i}", replicas, gpus)

        gang_id = await self.submit("gang", *work[0]) if gang_gpus >= 8 else None
        rest = work[1 if gang_id else 0 :]
        job_ids = ([gang_id] if gang_id else []) + list(
            await asyncio.gather(*(one(i, r, g) for i, (r, g) in enumerate(rest)))
        )
        return gang_id, job_ids

    async def all_running(self, job_ids: list[str], timeout: float) -> None:
        async def probe() -> bool:
            n = await self.pool.fetchval(
                "SELECT count(*) FROM jobs WHERE state = 'RUNNING' AND job_id = ANY($1)", job_ids
            )
            return n == len(job_ids)

        await until(probe, timeout, f"all {len(job_ids)} jobs running", interval=0.5)

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.aclose()
        await self.agents.stop()
        for c in self.controls:
            c.stop()
        if self.pool is not None:
            await self.pool.close()
        if self._temporal is not None:
            self._temporal.stop()
        if self._pg is not None:
            self._pg.stop()


def run_bench(
    prefix: str, keep: bool, bench: Callable[[Path, Path], Coroutine[Any, Any, dict[str, Any]]]
) -> dict[str, Any]:
    """Run ``bench(root, log_dir)`` once in a fresh state dir (kept with ``keep``, its logs'
    path then in the result's ``logs``)."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    root = Path(tempfile.mkdtemp(prefix=prefix))
    log_dir = root / "logs"
    log_dir.mkdir(parents=True)
    try:
        result = asyncio.run(bench(root, log_dir))
        result["logs"] = str(log_dir) if keep else None
        return result
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def check_gang(gang_gpus: int, blocks: int, nodes_per_block: int) -> None:
    if gang_gpus % 8 or gang_gpus > blocks * nodes_per_block * 8:
        raise ValueError(f"gang_gpus={gang_gpus}: whole nodes of 8 GPUs, and no more than the cluster has")


# ---------------------------------------------------------------------- the agent process


async def _agent_main(nodes_file: str, queue: str, links: str = "own") -> None:
    """Host the nodes of ``nodes_file`` with simulated ranks, serving their activities on
    ``queue``; print ``ready``, then a ``linked NODE ADDR WALLTIME`` line whenever a node's
    stream is acknowledged by another control address than before (WALLTIME: its latest
    acknowledgement, seen within 0.1 s)."""
    from common.settings import get_settings
    from common.temporal import connect, make_worker
    from worker_agent.agent import AgentProcess
    from worker_agent.node import FleetActivities

    settings = get_settings()
    node_ids = [n for n in Path(nodes_file).read_text().split() if n]
    # the links come up over a few seconds (about 100 a second), as a running fleet's did
    agent = AgentProcess(settings, node_ids, backend="simulated", temporal=False, simulated_ranks=True,
                         link_spread_s=len(node_ids) / 100, link_own_connection=links == "own")  # fmt: skip
    await agent.start()
    client = await connect(settings)
    worker = make_worker(client, queue, activities=FleetActivities(agent.nodes).activities())
    serving = asyncio.create_task(worker.run())
    out = sys.stdout
    out.write("ready\n")
    seen: dict[str, str | None] = {}
    try:
        while True:
            # polled, not hooked into the link: what a stream's first acknowledgement looks
            # like from the outside (``connected_to`` is set by every acknowledgement)
            for node_id, link in agent.links.items():
                addr = link.connected_to
                if addr != seen.get(node_id):
                    seen[node_id] = addr
                    if addr is not None:
                        out.write(f"linked {node_id} {addr} {link.last_ack_at or time.time():.3f}\n")
            out.flush()
            await asyncio.sleep(0.1)
    finally:
        serving.cancel()
        await agent.stop()


if __name__ == "__main__":  # python -m bench.fleet agent NODES_FILE TASK_QUEUE [own|shared]
    import logging

    if sys.argv[1:2] != ["agent"] or len(sys.argv) not in (4, 5):
        sys.exit("usage: python -m bench.fleet agent NODES_FILE TASK_QUEUE [own|shared]")
    # BENCH_AGENT_LOG_LEVEL=INFO: every link's reconnects in agent-K.log (a diagnosis)
    level = os.environ.get("BENCH_AGENT_LOG_LEVEL", "WARNING").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_agent_main(*sys.argv[2:]))
