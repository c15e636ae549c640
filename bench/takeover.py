"""`gpufleet bench takeover --json`: a frozen leader at cluster scale restarts nothing.

    run(blocks=94, nodes_per_block=32, jobs=300, gang_gpus=1024, freeze_s=30.0) -> dict

Starts its own embedded Postgres and Temporal dev server in a temporary state dir, seeds
``blocks x nodes_per_block`` nodes of 8 GPUs, and runs two real ``gpufleet control``
processes (c1 leads, c2 stands by) and one agent process (``python -m bench.takeover agent``)
processes (``python -m bench.takeover agent``, ``agent_procs`` of them, 4 by default) hosting
every node with simulated ranks (``worker_agent.node``, "Simulated ranks": every check of a real
agent, no rank processes), each node streaming heartbeats to the leader over its own gRPC
connection as separate hosts would. The REST API runs in this process.

It submits a 1,024-GPU gang (``gang_gpus``) and ``jobs`` more (1 GPU, one node of 8, gangs
of 2 nodes), waits until all run, then freezes the leader's process tree (SIGSTOP) for
``freeze_s`` and kills it (SIGKILL). A few probe jobs are submitted during the freeze, so the
new leader has something to place. What it reports:

* ``takeover_s``: the freeze -> c2's lease (``leader.acquired_at``);
* ``takeover_to_first_placement_s``: c2's lease -> its first allocation (audit, its epoch);
* ``takeover_to_all_relinked_s`` (and the median): c2's lease -> every node's first
  acknowledged heartbeat from c2 (the agents report it);
* ``jobs_restarted``: jobs running before the freeze that are not running in the same
  attempt at the end; ``nodes_marked_down`` / ``nodes_marked_suspect``: nodes audited into
  those states after the freeze (both must stay 0);
* the mass-silence guard's audited changes, the gang's blocks, and the settings used.

Node activities reach the right agent process through the task queue recorded for each node
(``nodes.task_queue``, which the control plane uses in ``per_node`` mode): the bench records one
queue per agent process, and each process serves it with one worker for all its nodes
(``worker_agent.node.FleetActivities``). Several processes, because one Python process hosting
3,008 nodes is CPU-bound on its own event loop (the issue's run used one).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from common.embedded import any_free_port

# what the report quotes from the settings the stack ran with
REPORTED_SETTINGS = (
    "heartbeat_interval_s",
    "agent_ack_timeout_s",
    "agent_connect_timeout_s",
    "leader_renew_s",
    "leader_ttl_s",
    "takeover_quiet_s",
    "suspect_after_s",
    "down_after_s",
    "health_mass_silence_fraction",
    "health_mass_silence_min_nodes",
    "unconfirmed_kill_s",
    "agent_poll_s",
)
PROBE_JOBS = 4  # submitted during the freeze: what the new leader places first


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def _workload(jobs: int, gang_gpus: int) -> list[tuple[int, int]]:
    """(replicas, gpus per replica): the gang first, then 1-GPU jobs, single nodes and 2-node gangs."""
    kinds = [(1, 1), (1, 8), (1, 1), (2, 8)]
    out = [(gang_gpus // 8, 8)] if gang_gpus >= 8 else []
    out += [kinds[i % len(kinds)] for i in range(jobs)]
    return out


class _Control:
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


class _Agents:
    """The agent processes; reads their ``linked NODE ADDR WALLTIME`` lines as they come."""

    def __init__(self) -> None:
        self.procs: list[asyncio.subprocess.Process] = []
        self.linked: list[tuple[str, str, float]] = []  # (node, control address, wall time of its first ack)
        self.ready = 0
        self._readers: list[asyncio.Task] = []

    async def start(self, settings: Any, nodes_file: Path, queue: str, log_dir: Path, links: str = "own") -> None:
        with open(log_dir / f"agent-{len(self.procs)}.log", "ab") as log:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "bench.takeover", "agent", str(nodes_file), queue, links,
                env=settings.to_env(), stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True,
            )  # fmt: skip
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

    async def stop(self) -> None:
        for proc in self.procs:
            if proc.returncode is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await proc.wait()
        for r in self._readers:
            r.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)


async def _until(probe: Any, timeout: float, what: str, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f}s")
        await asyncio.sleep(interval)


async def _bench(
    root: Path,
    log_dir: Path,
    *,
    blocks: int,
    nodes_per_block: int,
    jobs: int,
    gang_gpus: int,
    freeze_s: float,
    observe_s: float,
    settle_s: float,
    agent_procs: int,
    overrides: dict[str, Any],
    links: str = "own",
) -> dict[str, Any]:
    import httpx

    from api.main import create_app
    from common.db import create_pool, migrate
    from common.embedded import EmbeddedPostgres, EmbeddedTemporal
    from common.settings import Principal, Settings
    from common.temporal import connect
    from store.seed import ensure_cluster
    from store.teams import TeamQuota, set_quota

    t_setup = time.monotonic()
    pg = EmbeddedPostgres(root / "pgdata")
    dsn = pg.start()
    temporal = EmbeddedTemporal(
        root / "temporal" / "temporal.db", port=any_free_port(), ui=False, log_file=log_dir / "temporal.log"
    )
    controls: list[_Control] = []
    agents = _Agents()
    pool = None
    http = None
    try:
        address = temporal.start()
        token = "bench-" + uuid.uuid4().hex
        ports = [any_free_port(), any_free_port()]
        values: dict[str, Any] = dict(
            env="dev",
            state_dir=root / "state",
            database_url=dsn,
            temporal_address=address,
            # simulated ranks have no exits or progress files to look at: the agents' per-node
            # watch loop would only cost the CPU the links need (heartbeats keep their interval)
            agent_poll_s=2.0,
            agent_shared_secret="bench-" + uuid.uuid4().hex,
            control_addresses=[f"127.0.0.1:{p}" for p in ports],
            api_tokens={token: Principal(name="bench", team="bench")},
            max_queued_per_team=max(5000, 2 * jobs),
            db_pool_max=20,
        )
        values.update(overrides)
        settings = Settings(**values)
        pool = await create_pool(dsn, min_size=2, max_size=20)
        async with pool.acquire() as conn:
            await migrate(conn)
            nodes = await ensure_cluster(
                conn, gpu_type="h100", blocks=blocks, nodes_per_block=nodes_per_block,
                task_queue_prefix=settings.agent_task_queue_prefix,
            )  # fmt: skip
            total = len(nodes) * 8
            # one task queue per agent process, recorded per node (module docstring)
            run_id = uuid.uuid4().hex[:6]
            groups = [nodes[k::agent_procs] for k in range(agent_procs)]
            queues = [f"bench-agents-{run_id}-{k}" for k in range(agent_procs)]
            for group, queue in zip(groups, queues, strict=True):
                await conn.execute("UPDATE nodes SET task_queue = $1 WHERE node_id = ANY($2)", queue, group)
            await set_quota(conn, TeamQuota("bench", "h100", total, 0), actor="bench", reason="bench takeover")

        async def leader() -> Any:
            return await pool.fetchrow(
                "SELECT holder, epoch, acquired_at FROM leader WHERE scope = $1 AND expires_at > now()",
                settings.leader_scope,
            )

        # c1 first, so it leads; the agents start meanwhile (their links retry until it serves),
        # so the new leader hears them well within its first suspect window; c2 once c1 leads
        c1 = _Control(settings, "c1", ports[0], log_dir)
        controls.append(c1)
        for k, (group, queue) in enumerate(zip(groups, queues, strict=True)):
            nodes_file = root / f"nodes-{k}.txt"
            nodes_file.write_text("\n".join(group))
            await agents.start(settings, nodes_file, queue, log_dir, links)
        await _until(leader, 180, "c1 leads")  # the agent processes start meanwhile
        c2 = _Control(settings, "c2", ports[1], log_dir)
        controls.append(c2)

        async def agents_ready() -> bool:
            return agents.ready == agent_procs

        await _until(agents_ready, 120 + len(nodes) / 10, "the agent processes up")

        seen = {"linked": 0, "ready": 0}

        async def all_ready() -> bool:
            seen["linked"] = len(agents.linked_to(c1.addr))
            seen["ready"] = await pool.fetchval("SELECT count(*) FROM nodes WHERE state = 'ready'")
            return seen["linked"] == seen["ready"] == len(nodes)

        try:
            await _until(all_ready, 120 + len(nodes) / 5, "every node streaming to c1 and ready")
        except RuntimeError as e:
            raise RuntimeError(f"{e} ({seen['linked']} linked, {seen['ready']} ready of {len(nodes)})") from None

        client = await connect(settings)
        app = create_app(settings, pool=pool, temporal_client=client)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://api", timeout=120)

        async def submit(name: str, replicas: int, gpus: int) -> str:
            body = {
                "team": "bench", "priority_class": "research", "image": "registry/bench:1", "command": ["true"],
                "gpu_type": "h100", "replicas": replicas, "gpus_per_replica": gpus, "max_runtime": "4h",
                "name": name,
            }  # fmt: skip
            headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": uuid.uuid4().hex}
            r = await http.post("/v1/jobs", json=body, headers=headers)
            if r.status_code != 202:
                raise RuntimeError(f"submit {name}: HTTP {r.status_code} {r.text[:300]}")
            return str(r.json()["job_id"])

        work = _workload(jobs, gang_gpus)
        sem = asyncio.Semaphore(20)

        async def one(i: int, replicas: int, gpus: int) -> str:
            async with sem:
                return await submit(f"bench-{i}", replicas, gpus)

        gang_id = await submit("gang", *work[0]) if gang_gpus >= 8 else None
        job_ids = ([gang_id] if gang_id else []) + list(
            await asyncio.gather(*(one(i, r, g) for i, (r, g) in enumerate(work[1 if gang_id else 0 :])))
        )

        async def all_running() -> bool:
            n = await pool.fetchval("SELECT count(*) FROM jobs WHERE state = 'RUNNING' AND job_id = ANY($1)", job_ids)
            return n == len(job_ids)

        await _until(all_running, settle_s, f"all {len(job_ids)} jobs running", interval=0.5)
        before = {
            r["job_id"]: r["attempt"]
            for r in await pool.fetch("SELECT job_id, attempt FROM jobs WHERE job_id = ANY($1)", job_ids)
        }
        first = await leader()
        assert first is not None and first["holder"] == "c1", first
        setup_s = time.monotonic() - t_setup

        # ---------------------------------------------------------------- the freeze
        c1.signal(signal.SIGSTOP)
        frozen_at = time.time()
        t_frozen = time.monotonic()
        await asyncio.sleep(min(2.0, freeze_s / 4))
        probes = [await submit(f"probe-{i}", 1, 1) for i in range(PROBE_JOBS)]
        took: Any = None
        while time.monotonic() - t_frozen < freeze_s:
            if took is None:
                row = await leader()
                if row is not None and row["holder"] == "c2":
                    took = row
            await asyncio.sleep(0.2)
        c1.signal(signal.SIGKILL)
        killed_at = time.time()
        if took is None:
            took = await _until(
                lambda: _holder_is(leader, "c2"), settings.leader_ttl_s * 3, "c2 takes over after the kill"
            )
        took_at = took["acquired_at"].timestamp()

        async def relinked() -> bool:
            return len(agents.linked_to(c2.addr, since=frozen_at)) == len(nodes)

        try:
            await _until(relinked, max(observe_s, 30.0), "every node relinked to c2")
        except RuntimeError:
            pass  # reported below as nodes_not_relinked
        # look on for a while: any node the new leader judged silent would be suspect by now
        await asyncio.sleep(max(0.0, took_at + observe_s - time.time()))

        # ---------------------------------------------------------------- the figures
        at_c2 = agents.linked_to(c2.addr, since=frozen_at)
        relink = [t - took_at for t in at_c2.values()]
        after = {
            r["job_id"]: (r["state"], r["attempt"])
            for r in await pool.fetch("SELECT job_id, state, attempt FROM jobs WHERE job_id = ANY($1)", job_ids)
        }
        restarted = sorted(j for j, a in before.items() if after.get(j) != ("RUNNING", a))
        since = datetime.fromtimestamp(frozen_at).astimezone()

        async def audited_into(state: str) -> list[str]:
            rows = await pool.fetch(
                "SELECT DISTINCT subject FROM audit WHERE action = 'node_state' AND detail->>'to' = $1 AND at >= $2",
                state, since,
            )  # fmt: skip
            return sorted(r["subject"] for r in rows)

        down = await audited_into("down")
        suspect = await audited_into("suspect")
        first_alloc = await pool.fetchval(
            "SELECT min(at) FROM audit WHERE action = 'allocate' AND (detail->>'epoch')::bigint = $1", took["epoch"]
        )
        probe_states = {
            r["state"]: r["n"]
            for r in await pool.fetch("SELECT state, count(*) AS n FROM jobs WHERE job_id = ANY($1) GROUP BY 1", probes)
        }
        guard = [
            {
                "at_s": round(r["at"].timestamp() - frozen_at, 2),
                "reason": r["reason"],
                "detail": json.loads(r["detail"]),
            }
            for r in await pool.fetch(
                "SELECT at, reason, detail::text AS detail FROM audit WHERE action = 'health_guard' AND at >= $1"
                " ORDER BY id",
                since,
            )
        ]
        gang_blocks = None
        if gang_id is not None:
            gang_blocks = await pool.fetchval(
                "SELECT count(DISTINCT n.block_id) FROM leases l JOIN nodes n USING (node_id)"
                " WHERE l.job_id = $1 AND l.state = 'live'",
                gang_id,
            )
        node_states = {
            r["state"]: r["n"] for r in await pool.fetch("SELECT state, count(*) AS n FROM nodes GROUP BY 1")
        }
        return {
            "nodes": len(nodes),
            "blocks": blocks,
            "nodes_per_block": nodes_per_block,
            "gpus": total,
            "agent_processes": agent_procs,
            # own: one connection per node, as real agents; shared: one per agent process and address
            "agent_links": links,
            "running_jobs_before": len(before),
            "gang_gpus": gang_gpus if gang_id else 0,
            "gang_blocks_after": gang_blocks,
            "gang_restarted": bool(gang_id and gang_id in restarted),
            "freeze_s": freeze_s,
            "killed_after_s": round(killed_at - frozen_at, 2),
            "takeover_s": round(took_at - frozen_at, 2),
            "takeover_epoch": took["epoch"],
            "takeover_to_first_placement_s": (
                round(first_alloc.timestamp() - took_at, 2) if first_alloc is not None else None
            ),
            "probe_jobs": len(probes),
            "probe_job_states": probe_states,
            "takeover_to_all_relinked_s": round(max(relink), 2) if len(at_c2) == len(nodes) else None,
            "takeover_to_relinked_median_s": _median(relink),
            "takeover_to_relinked_p90_s": (round(sorted(relink)[int(0.9 * (len(relink) - 1))], 2) if relink else None),
            "nodes_relinked": len(at_c2),
            "nodes_not_relinked": len(nodes) - len(at_c2),
            "jobs_restarted": len(restarted),
            "jobs_restarted_sample": restarted[:10],
            "nodes_marked_down": len(down),
            "nodes_marked_suspect": len(suspect),
            "node_states_after": node_states,
            "health_guard_changes": guard,
            "observed_after_takeover_s": observe_s,
            "setup_s": round(setup_s, 1),
            "settings": {k: getattr(settings, k, None) for k in REPORTED_SETTINGS},
            "stack": "embedded Postgres + Temporal dev server, two control processes (c1 frozen then killed,"
            f" c2 takes over), {agent_procs} agent processes hosting the nodes with simulated ranks, API in-process",
            "measured": "takeover_s from SIGSTOP to c2's lease; relinks from c2's lease to each node's first"
            " acknowledged heartbeat from c2; restarts and down/suspect marks since the freeze",
        }
    finally:
        if http is not None:
            await http.aclose()
        await agents.stop()
        for c in controls:
            c.stop()
        if pool is not None:
            await pool.close()
        temporal.stop()
        pg.stop()


async def _holder_is(leader: Any, holder: str) -> Any:
    row = await leader()
    return row if row is not None and row["holder"] == holder else None


def run(
    blocks: int = 94,
    nodes_per_block: int = 32,
    jobs: int = 300,
    gang_gpus: int = 1024,
    freeze_s: float = 30.0,
    observe_s: float = 60.0,
    settle_s: float = 600.0,
    agent_procs: int = 4,
    overrides: dict[str, Any] | None = None,
    keep: bool = False,
    shared_connections: bool = False,
) -> dict[str, Any]:
    """Run the benchmark once on a fresh stack (see the module docstring); ``overrides`` are
    settings (tests scale the timings down); ``keep`` keeps the logs and state dir."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    if gang_gpus % 8 or gang_gpus > blocks * nodes_per_block * 8:
        raise ValueError(f"gang_gpus={gang_gpus}: whole nodes of 8 GPUs, and no more than the cluster has")
    root = Path(tempfile.mkdtemp(prefix="gpufleet-bench-takeover-"))
    log_dir = root / "logs"
    log_dir.mkdir(parents=True)
    try:
        result = asyncio.run(
            _bench(
                root, log_dir, blocks=blocks, nodes_per_block=nodes_per_block, jobs=jobs, gang_gpus=gang_gpus,
                freeze_s=freeze_s, observe_s=observe_s, settle_s=settle_s, agent_procs=max(1, min(agent_procs, blocks * nodes_per_block)),
                overrides=dict(overrides or {}), links="shared" if shared_connections else "own",
            )
        )  # fmt: skip
        result["logs"] = str(log_dir) if keep else None
        return result
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


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


if __name__ == "__main__":  # python -m bench.takeover agent NODES_FILE TASK_QUEUE (the bench's agent process)
    import logging

    if sys.argv[1:2] != ["agent"] or len(sys.argv) not in (4, 5):
        sys.exit("usage: python -m bench.takeover agent NODES_FILE TASK_QUEUE")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_agent_main(*sys.argv[2:]))
