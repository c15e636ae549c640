"""Injects a planned schedule (``chaos.schedule``) into a running ``ChaosStack``, one fault
after another, and records each as a ``chaos.timeline.Fault`` (when it began, when the
harness undid it, what it hit):

* ``agent_kill``: SIGKILL an agent process (its ranks live on under their supervisors),
  start it again after ``down_s``;
* ``agent_stop``: SIGSTOP an agent process (a hung agent: its ranks run on under their
  supervisors, unconfirmed), SIGCONT after ``down_s``; it resumes with what it held in
  memory, which the control plane may have re-placed meanwhile;
* ``leader_stop``: SIGSTOP the leading control process past its lease, then SIGCONT;
* ``leader_kill``: SIGKILL the leading control process, start it again after ``down_s``;
* ``temporal_restart``: stop the Temporal dev server (SIGTERM, or SIGKILL when ``hard``) while
  the workload submits a burst, and start it again on the same port and database file;
* ``postgres_restart``: stop Postgres (fast, or immediate when ``hard``), start it again;
  with ``--ha`` the *standby* goes (stopped or SIGKILLed) and the supervisor brings a new one
  (commits go asynchronous after its ``after_s``, then synchronous again);
* ``postgres_failover`` (``--ha`` only): SIGKILL the primary and its backends while the
  workload submits a burst; the supervisor promotes the standby; recorded: when it was
  promoted, when a write went through again, when every burst submission was accepted and
  when commits waited for a new standby again;
* ``xid``: a fatal Xid (79) on a GPU of a running rank (simulated NVML); the GPU is repaired
  (its faults cleared) after ``down_s``, so the node can burn in and return;
* ``rank_hang``: the GPUs of a running training rank hang (utilization 0, its step counter
  frozen in heartbeats) until cleared after ``down_s``.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from chaos.schedule import PlannedFault
from chaos.stack import ChaosStack
from chaos.timeline import Fault
from worker_agent.nvml import write_fault

FATAL_XID = 79  # fallen off the bus


class FaultInjector:
    def __init__(
        self,
        stack: ChaosStack,
        *,
        burst: Callable[[int], Awaitable[Any]] | None = None,
        log: Callable[[str], None] = lambda _msg: None,
    ) -> None:
        self.stack = stack
        self.burst = burst  # the workload submits n jobs now (while Temporal goes down)
        self.log = log
        self.faults: list[Fault] = []

    async def run(self, plan: list[PlannedFault], t0: float) -> list[Fault]:
        """Inject every planned fault at its time (or as soon as the previous one is undone)."""
        for pf in plan:
            delay = t0 + pf.at_s - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            fault = await self.inject(pf)
            self.faults.append(fault)
            self.log(f"fault {fault.kind} on {fault.target}: {fault.ended_at - fault.started_at:.1f}s")
        return self.faults

    async def inject(self, pf: PlannedFault) -> Fault:
        kinds: dict[str, Callable[[PlannedFault], Awaitable[Fault]]] = {
            "agent_kill": self.agent_kill,
            "agent_stop": self.agent_stop,
            "leader_stop": self.leader_stop,
            "leader_kill": self.leader_kill,
            "temporal_restart": self.temporal_restart,
            "postgres_restart": self.postgres_restart,
            "postgres_failover": self.postgres_failover,
            "xid": self.xid,
            "rank_hang": self.rank_hang,
        }
        return await kinds[pf.kind](pf)

    # ------------------------------------------------------------------ processes

    def _agent(self, pf: PlannedFault) -> str:
        agents = sorted(self.stack.agent_nodes)
        return agents[pf.pick % len(agents)]

    async def _frozen(self, name: str, seconds: float) -> None:
        """SIGSTOP ``name``'s process group for ``seconds``, then SIGCONT (whatever happens)."""
        self.stack.signal(name, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            self.stack.signal(name, signal.SIGCONT)

    async def agent_kill(self, pf: PlannedFault) -> Fault:
        name = self._agent(pf)
        t = time.time()
        self.stack.kill(name)
        await asyncio.sleep(pf.down_s)
        self.stack.spawn(name)
        return Fault("agent_kill", t, time.time(), name, tuple(self.stack.agent_nodes[name]), {"down_s": pf.down_s})

    async def agent_stop(self, pf: PlannedFault) -> Fault:
        name = self._agent(pf)
        t = time.time()
        await self._frozen(name, pf.down_s)
        return Fault("agent_stop", t, time.time(), name, tuple(self.stack.agent_nodes[name]), {"stopped_s": pf.down_s})

    async def _leader(self, pf: PlannedFault) -> tuple[str, bool]:
        """The leading control (True), or one picked when no one leads now (False)."""
        try:
            holder = await self.stack.leader_holder()
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
            holder = None
        if holder in self.stack.commands:
            return str(holder), True
        controls = list(self.stack.layout.controls)
        return controls[pf.pick % len(controls)], False

    async def leader_stop(self, pf: PlannedFault) -> Fault:
        name, leading = await self._leader(pf)
        t = time.time()
        await self._frozen(name, pf.down_s)
        return Fault("leader_stop", t, time.time(), name, (), {"stopped_s": pf.down_s, "was_leading": leading})

    async def leader_kill(self, pf: PlannedFault) -> Fault:
        name, leading = await self._leader(pf)
        t = time.time()
        self.stack.kill(name)
        await asyncio.sleep(pf.down_s)
        self.stack.spawn(name)
        return Fault("leader_kill", t, time.time(), name, (), {"down_s": pf.down_s, "was_leading": leading})

    # ------------------------------------------------------------------ servers

    async def temporal_restart(self, pf: PlannedFault) -> Fault:
        burst: asyncio.Future[None] | None = None
        if self.burst is not None:  # jobs being submitted and placed while the server goes
            burst = asyncio.ensure_future(self.burst(3 + pf.pick % 3))
            await asyncio.sleep(0.3)
        t = time.time()
        await self.stack.restart_temporal(pf.down_s, hard=pf.hard)
        end = time.time()
        if burst is not None:
            await burst
        return Fault("temporal_restart", t, end, "temporal", (), {"down_s": pf.down_s, "kill": pf.hard})

    async def postgres_restart(self, pf: PlannedFault) -> Fault:
        if self.stack.pair is not None:
            return await self._standby_loss(pf)
        t = time.time()
        await self.stack.restart_postgres(pf.down_s, immediate=pf.hard)
        return Fault("postgres_restart", t, time.time(), "postgres", (), {"down_s": pf.down_s, "immediate": pf.hard})

    async def _standby_loss(self, pf: PlannedFault) -> Fault:
        pair, sup = self.stack.pair, self.stack.supervisor
        assert pair is not None and sup is not None
        standby = pair.standby
        seen = len(sup.events)
        t = time.time()
        await asyncio.to_thread(standby.kill if pf.hard else standby.stop)
        synchronous = await self.stack.wait_synchronous(seen, 90)
        return Fault(
            "postgres_restart", t, time.time(), f"postgres standby {standby.name}", (),
            {"kill": pf.hard, "synchronous_again_after_s": round(synchronous - t, 2) if synchronous else None},
        )  # fmt: skip

    async def _writes_go_through(self, since: float, deadline_s: float) -> float | None:
        """Seconds from ``since`` (wall clock) until a fresh connection commits (a primary's
        xid), or None after ``deadline_s``."""
        while time.time() - since < deadline_s:
            try:
                conn = await asyncpg.connect(self.stack.dsn, timeout=1.0)
                try:
                    await conn.fetchval("SELECT txid_current()", timeout=1.0)
                    return round(time.time() - since, 2)
                finally:
                    conn.terminate()
            except Exception:  # refused, a standby, mid-promotion: try again
                await asyncio.sleep(0.1)
        return None

    async def postgres_failover(self, pf: PlannedFault) -> Fault:
        pair, sup = self.stack.pair, self.stack.supervisor
        if pair is None or sup is None:
            raise RuntimeError("postgres_failover needs the stack's Postgres pair (--ha)")
        old = pair.primary.name
        seen = len(sup.events)
        t = time.time()
        killing = asyncio.ensure_future(asyncio.to_thread(pair.primary.kill))
        burst: asyncio.Future[Any] | None = None
        if self.burst is not None:  # jobs submitted while the primary dies and until the standby takes over
            burst = asyncio.ensure_future(self.burst(3 + pf.pick % 3))
        await killing
        writes_s = await self._writes_go_through(t, 60.0)
        promoted = [e for e in sup.events[seen:] if e["kind"] == "promoted"]
        submissions_s = None
        if burst is not None:
            sent = await burst
            accepted = [x.accepted_at for x in sent or () if x.accepted_at is not None]
            if accepted and len(accepted) == len(sent):
                submissions_s = round(max(accepted) - t, 2)
        synchronous = await self.stack.wait_synchronous(seen, 90)
        detail = {
            "old_primary": old,
            "new_primary": pair.primary.name,
            "promoted_after_s": round(promoted[0]["at"] - t, 2) if promoted else None,
            "writes_after_s": writes_s,
            "burst_accepted_after_s": submissions_s,  # the last of the burst's submissions accepted
            "synchronous_again_after_s": round(synchronous - t, 2) if synchronous else None,
        }
        return Fault("postgres_failover", t, time.time(), f"postgres primary {old}", (), detail)

    # ------------------------------------------------------------------ GPUs

    async def _running_leases(self, *, training: bool) -> list[dict[str, Any]]:
        """Live leases of RUNNING jobs whose agents are up (training ranks only: they report steps)."""
        assert self.stack.pool is not None
        try:
            rows = await self.stack.pool.fetch(
                "SELECT l.lease_id, l.node_id, l.gpu_indices, j.spec::text AS spec FROM leases l"
                " JOIN jobs j USING (job_id) WHERE l.state = 'live' AND j.state = 'RUNNING' ORDER BY l.lease_id"
            )
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
            return []
        up = {n for a, nodes in self.stack.agent_nodes.items() if self.stack.alive(a) for n in nodes}
        return [
            dict(r) for r in rows if r["node_id"] in up and (not training or "train_counter" in r["spec"])
        ]  # fmt: skip

    async def _target(self, pf: PlannedFault, *, training: bool) -> tuple[str, list[int], str]:
        """(node, GPUs, what) of a running rank; waits a little for one, else any node's GPU 0."""
        deadline = time.monotonic() + 15
        while True:
            leases = await self._running_leases(training=training)
            if leases:
                lz = leases[pf.pick % len(leases)]
                return lz["node_id"], list(lz["gpu_indices"]), f"lease {lz['lease_id']}"
            if time.monotonic() > deadline:
                nodes = self.stack.nodes
                return nodes[pf.pick % len(nodes)], [0], "no running rank: an idle GPU"
            await asyncio.sleep(1.0)

    async def xid(self, pf: PlannedFault) -> Fault:
        node, gpus, what = await self._target(pf, training=False)
        gpu = gpus[pf.pick % len(gpus)]
        t = time.time()
        write_fault(self.stack.state, node, gpu=gpu, xid=FATAL_XID)
        await asyncio.sleep(pf.down_s)
        write_fault(self.stack.state, node, gpu=gpu, clear=True)  # repaired: it may burn in and return
        return Fault("xid", t, time.time(), f"{node} GPU {gpu}", (node,), {"xid": FATAL_XID, "hit": what})

    async def rank_hang(self, pf: PlannedFault) -> Fault:
        node, gpus, what = await self._target(pf, training=True)
        t = time.time()
        for g in gpus:
            write_fault(self.stack.state, node, gpu=g, hang=True)
        await asyncio.sleep(pf.down_s)
        for g in gpus:
            write_fault(self.stack.state, node, gpu=g, clear=True)
        return Fault("rank_hang", t, time.time(), f"{node} GPUs {gpus}", (node,), {"hit": what})
