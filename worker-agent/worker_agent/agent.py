"""An agent process: one or many nodes, their Temporal workers, control links and the log server (HTTP).

    from worker_agent.agent import run_agent, AgentProcess

    await run_agent(settings, ["node-a"])              # until cancelled (or ``stop`` is set)

    agent = AgentProcess(settings, ["n1", "n2"])       # or drive it yourself
    await agent.start(); ...; await agent.stop()       # stop() leaves every rank running

Per node: a ``NodeAgent`` (state dir, supervisors, epochs), a ``ControlLink``
(heartbeats + TaskStatus to the leader) and, by ``settings.agent_task_queue_mode``:

* ``per_node`` (default, production): one Temporal worker per node on
  ``settings.node_task_queue(node_id)`` with activities ``start_task``/``stop_task``;
  fine for a 16-node simulated fleet in one process;
* ``shared``: one worker on ``settings.agent_shared_task_queue`` whose activities
  route by ``node_id`` (``FleetActivities``) — for large simulated fleets, where
  thousands of pollers would be wasteful. The job workflow must then schedule on
  that queue, and one process must host every node of the fleet.

Temporal being unreachable never stops the node: ranks keep running, heartbeats
and reports keep flowing over gRPC, and the workers are rebuilt when it is back.

``simulated_ranks=True`` (benchmarks and tests only; no setting turns it on) hosts ranks
without processes (``worker_agent.node``, "Simulated ranks"): how ``bench/fleet.py`` runs
hundreds of jobs on thousands of simulated nodes on one machine.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence

from common.temporal import connect, make_worker
from worker_agent import proc_visibility, rank_firewall, rank_mounts, rank_users
from worker_agent.link import ControlLink
from worker_agent.log_http import LogHttpServer
from worker_agent.node import FleetActivities, NodeAgent, build_agent_activities
from worker_agent.nvml import make_backend
from worker_agent.runtime import make_runtime

log = logging.getLogger("gpufleet.agent")


class AgentProcess:
    def __init__(
        self,
        settings,
        node_ids: Sequence[str],
        *,
        backend: str | None = None,
        boot_id: str | None = None,
        temporal: bool = True,
        temporal_address: str | None = None,
        control_addresses: list[str] | None = None,
        listen: str | None = None,
        simulated_ranks: bool = False,
        link_spread_s: float = 0.0,
        link_own_connection: bool = True,
    ) -> None:
        if not node_ids:
            raise ValueError("no nodes to host")
        if len(set(node_ids)) != len(node_ids):
            raise ValueError("duplicate node ids")
        self.settings = settings
        self.node_ids = list(node_ids)
        self.backend_kind = backend or settings.agent_nvml_backend
        self.boot_id = boot_id
        self.temporal = temporal
        self.temporal_address = temporal_address
        self.control_addresses = control_addresses
        self.listen = listen
        self.simulated_ranks = simulated_ranks
        # benchmarks: the links start spread over this long, as a fleet's hosts come up over
        # time, not all in the same instant (a leader change is what they measure)
        self.link_spread_s = link_spread_s
        self.link_own_connection = link_own_connection  # benchmarks only (worker_agent.link.channel_options)
        self.nodes: dict[str, NodeAgent] = {}
        self.links: dict[str, ControlLink] = {}
        self.http_log_addr = ""  # the API's HTTP log contract; advertised in heartbeats as agent_addr
        self._http_log_server: LogHttpServer | None = None
        self.temporal_connected = False
        self.temporal_error = ""
        self._tasks: list[asyncio.Task] = []
        self._workers: list = []
        self._stopping = False  # stop() has begun: workers ending is expected, not an outage
        # the ranks' firewall, once in: what it was asked to close, and what it closes now
        self._firewall_addresses: list[tuple[str, str]] = []
        self._firewall_endpoints: set[rank_firewall.Endpoint] = set()
        self._firewall_problems: set[str] = set()
        self._firewall_table = rank_firewall.table_for(settings.agent_rank_firewall_table, settings.state_dir)
        self._firewall_mutex = threading.Lock()  # renewals (in threads) against the stop's removal

    async def start(self) -> None:
        s = self.settings
        if self.backend_kind == "real" and len(self.node_ids) > 1:
            raise ValueError("the real NVML backend hosts exactly one node per process")
        if self.simulated_ranks and self.backend_kind == "real":
            raise ValueError("simulated ranks run on simulated nodes only")
        if not self.simulated_ranks:
            self._keep_ranks_off_the_control_plane()
            self._say_whether_ranks_see_other_processes()
        self._http_log_server = LogHttpServer(s, self.nodes)
        self.http_log_addr = await self._http_log_server.start(self.listen or s.agent_http_listen)
        runtime = make_runtime(s)
        try:
            for node_id in self.node_ids:
                backend = make_backend(s, node_id, self.backend_kind)  # NvmlUnavailable: a clear error
                node = NodeAgent(
                    s, node_id, backend=backend, runtime=runtime, boot_id=self.boot_id, agent_addr=self.http_log_addr,
                    simulated_ranks=self.simulated_ranks,
                )  # fmt: skip
                await node.start()
                self.nodes[node_id] = node
        except BaseException:
            # a node that cannot start (another agent serves it, no NVML) fails the whole
            # start: the nodes started before it let their locks go, as a stop would
            await self.stop()
            raise
        for i, (node_id, node) in enumerate(self.nodes.items()):
            link = ControlLink(s, node, self.control_addresses, own_connection=self.link_own_connection)
            self.links[node_id] = link
            delay = self.link_spread_s * i / len(self.nodes)
            self._tasks.append(asyncio.create_task(_after(delay, link.run), name=f"link-{node_id}"))
        if self.temporal:
            self._tasks.append(asyncio.create_task(self._temporal_loop(), name="agent-temporal"))
        if self._firewall_addresses:
            self._tasks.append(asyncio.create_task(self._refresh_rank_firewall(), name="agent-rank-firewall"))
        log.info(
            "agent up: %d node(s) %s, NVML backend %s, runtime %s, queue mode %s, logs at %s",
            len(self.nodes), ",".join(self.node_ids[:4]) + ("..." if len(self.node_ids) > 4 else ""),
            self.backend_kind, runtime.name, s.agent_task_queue_mode, self.http_log_addr,
        )  # fmt: skip

    def _keep_ranks_off_the_control_plane(self) -> None:
        """Reject TCP connections from the ranks' users to Temporal, control and the listed
        addresses (worker_agent.rank_firewall); where that cannot be done, say so, or, with
        ``agent_rank_firewall=required``, refuse to start. Once the rules are in, they are
        kept current (``_refresh_rank_firewall``)."""
        s = self.settings
        if s.agent_rank_firewall == "off" or not rank_users.ranks_isolated(s):
            return  # ranks run as the agent's own user: no uid to match (the agent says so)
        addresses = [(a, "control") for a in (self.control_addresses or s.control_addresses)]
        if self.temporal:
            addresses.append(
                (self.temporal_address or s.temporal_address or f"127.0.0.1:{s.temporal_port}", "temporal")
            )
        addresses += [(a, "listed") for a in s.agent_rank_blocked_addresses]
        required = s.agent_rank_firewall == "required"
        endpoints, problems = rank_firewall.resolve(addresses)
        if problems and required:
            raise RuntimeError(f"agent_rank_firewall is required but ranks cannot be kept off: {'; '.join(problems)}")
        for problem in problems:  # the rest are still closed
            log.warning("ranks can connect to what this names: %s (tried again every %gs)", problem,
                        s.agent_rank_firewall_refresh_s)  # fmt: skip
        try:
            self._apply_rank_firewall(endpoints)
        except (rank_firewall.FirewallError, OSError, subprocess.SubprocessError) as e:
            if required:
                raise RuntimeError(f"agent_rank_firewall is required but ranks cannot be kept off: {e}") from e
            log.warning(
                "ranks can connect to %s: %s (install nftables, or keep those endpoints behind client"
                " certificates: docs/security.md)", ", ".join(a for a, _ in addresses), e,
            )  # fmt: skip
            return
        log.info(
            "ranks may not connect to %s (nftables table inet %s)",
            ", ".join(f"{e.ip}:{e.port}" for e in endpoints), self._firewall_table,
        )  # fmt: skip
        self._firewall_addresses = addresses
        self._firewall_endpoints = set(endpoints)
        self._firewall_problems = set(problems)

    def _apply_rank_firewall(self, endpoints: Iterable[rank_firewall.Endpoint]) -> None:
        s = self.settings
        base = int(s.agent_rank_id_base) or None
        uids = {uid for uid, _ in rank_users.rank_users(s)}
        rank_firewall.apply(
            rank_firewall.ruleset(self._firewall_table, rank_firewall.uid_set(uids, base), sorted(endpoints))
        )

    async def _refresh_rank_firewall(self) -> None:
        """Resolve the addresses again now and then and close any new one: a name behind a load
        balancer moves, and one that did not resolve at start (DNS down) would stay open for
        the agent's life. The rules only grow: an address a name left may come back. A table
        gone from the host (a firewall service's reload flushes the whole ruleset) is put back."""
        s = self.settings
        while True:
            await asyncio.sleep(float(s.agent_rank_firewall_refresh_s))
            try:
                endpoints, problems = await asyncio.to_thread(rank_firewall.resolve, self._firewall_addresses)
                for problem in sorted(set(problems) - self._firewall_problems):
                    log.warning("ranks can connect to what this names: %s", problem)
                self._firewall_problems = set(problems)
                new = set(endpoints) - self._firewall_endpoints
                gone = await asyncio.to_thread(self._renew_rank_firewall, new)
                if gone is None:
                    return  # stopping: the rules are the stop's to keep or remove
                if gone:
                    log.warning(
                        "the ranks' rules were gone from the host (nftables table inet %s): put back",
                        self._firewall_table,
                    )  # fmt: skip
                if new:
                    log.info(
                        "ranks may no longer connect to %s either (resolved again; nftables table inet %s)",
                        ", ".join(f"{e.ip}:{e.port}" for e in sorted(new)), self._firewall_table,
                    )  # fmt: skip
            except Exception as e:  # the loop outlives any one failure; the rules in place stay
                log.warning("cannot renew the ranks' rules (the last ones stand): %s", e)

    def _renew_rank_firewall(self, new: set[rank_firewall.Endpoint]) -> bool | None:
        """Apply the rules again with ``new`` if there are new endpoints or the table is gone
        from the host; whether it was gone, or None once the agent is stopping. Under the
        lock the stop's removal takes too: a renewal still running when the loop is cancelled
        must not put the table back after the stop removed it."""
        with self._firewall_mutex:
            if self._stopping:
                return None
            gone = not rank_firewall.present(self._firewall_table)
            if new or gone:
                self._apply_rank_firewall(self._firewall_endpoints | new)
                self._firewall_endpoints |= new
            return gone

    def _release_rank_firewall(self) -> bool:
        with self._firewall_mutex:
            return rank_firewall.release_if_unused(self.settings.state_dir, self._firewall_table)

    def _say_whether_ranks_see_other_processes(self) -> None:
        """Under the process runtime a rank reads every process's command line unless its
        /proc hides them: its own /proc (worker_agent.rank_mounts), else the host's with hidepid.
        Said once per agent process."""
        s = self.settings
        if s.agent_runtime != "process" or not rank_users.ranks_isolated(s):
            return
        why = rank_mounts.problem() if s.agent_rank_private_proc else "agent_rank_private_proc is off"
        if why is None:
            own = [
                what for on, what in (
                    (s.agent_rank_private_tmp, "its own /tmp"), (s.agent_rank_private_shm, "its job's /dev/shm"),
                    (s.agent_rank_private_ipc, "its job's SysV IPC"),
                ) if on
            ]  # fmt: skip
            log.info("ranks see only their own processes: each mounts its own /proc (hidepid=2)%s",
                     f", and has {', '.join(own)}" if own else "")  # fmt: skip
            return
        if proc_visibility.this_host_hides_pids() is False:
            log.warning(
                "ranks can read every process's command line on this host, other jobs' included: they cannot have"
                " their own /proc (%s), and the host's is mounted without hidepid (mount -o"
                " remount,hidepid=invisible,gid=<monitoring group> /proc; docs/security.md)", why,
            )  # fmt: skip

    def _make_workers(self, client) -> list:
        s = self.settings
        if s.agent_task_queue_mode == "shared":
            fleet = FleetActivities(self.nodes)
            return [make_worker(client, s.agent_shared_task_queue, activities=fleet.activities())]
        return [
            make_worker(client, s.node_task_queue(node_id), activities=build_agent_activities(node))
            for node_id, node in self.nodes.items()
        ]

    async def _temporal_loop(self) -> None:
        backoff = 0.5
        max_backoff = max(5.0, float(self.settings.heartbeat_interval_s))
        while True:
            try:
                client = await connect(self.settings, self.temporal_address)
                self._workers = self._make_workers(client)
                self.temporal_connected = True
                self.temporal_error = ""
                backoff = 0.5
                log.info("agent: Temporal workers running (%d)", len(self._workers))
                await asyncio.gather(*(w.run() for w in self._workers))
                if self._stopping:
                    return
                raise RuntimeError("Temporal workers stopped")
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if self._stopping:
                    log.debug("agent: Temporal workers ended while stopping: %s", e)
                    return
                self.temporal_connected = False
                self.temporal_error = f"{type(e).__name__}: {str(e)[:300]}"
                log.warning("agent: Temporal unavailable (%s); ranks keep running; retrying in %.1fs",
                            self.temporal_error, backoff)  # fmt: skip
                await self._shutdown_workers()
                await asyncio.sleep(backoff)
                backoff = min(max_backoff, backoff * 2)

    async def _shutdown_workers(self) -> None:
        workers, self._workers = self._workers, []
        for w in workers:
            try:
                await asyncio.wait_for(w.shutdown(), timeout=5.0)
            except Exception:
                pass

    async def stop(self) -> None:
        """Stop serving; every rank keeps running under its supervisor."""
        self._stopping = True
        await self._shutdown_workers()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks.clear()
        for node in self.nodes.values():
            await node.close()
        if self._firewall_addresses:  # the rules go with the state dir's last rank and agent
            try:
                if await asyncio.to_thread(self._release_rank_firewall):
                    log.info("no rank left: the ranks' rules are gone (nftables table inet %s)", self._firewall_table)
            except Exception as e:  # stopping goes on; the next start replaces the table
                log.warning("cannot remove the ranks' rules (nftables table inet %s): %s", self._firewall_table, e)
        if self._http_log_server is not None:
            await self._http_log_server.stop()
            self._http_log_server = None


async def _after(delay: float, run: Callable[[], Awaitable[None]]) -> None:
    if delay > 0:
        await asyncio.sleep(delay)
    await run()


async def run_agent(settings, node_ids: Sequence[str], *, stop: asyncio.Event | None = None, **kwargs) -> None:
    """Host ``node_ids`` until cancelled or ``stop`` is set (see ``AgentProcess`` for kwargs)."""
    agent = AgentProcess(settings, node_ids, **kwargs)
    await agent.start()
    try:
        if stop is None:
            await asyncio.Future()
        else:
            await stop.wait()
    finally:
        await agent.stop()
