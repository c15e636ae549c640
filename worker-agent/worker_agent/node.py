"""NodeAgent: one GPU node's ranks, epochs and reports (docs/design.md, Job lifecycle and Health).

Activities (Temporal, on ``settings.node_task_queue(node_id)``), bound methods of a
``NodeAgent``::

    start_task(StartTask) -> StartTaskResult    idempotent on lease id + epoch
    stop_task(StopTask)   -> StopTaskResult     epoch-checked; SIGTERM, grace, SIGKILL

``build_agent_activities(node)`` returns them for ``common.temporal.make_worker``.
In the shared-queue mode (``settings.agent_task_queue_mode == "shared"``) a
``FleetActivities`` routes by ``node_id`` to the nodes one process hosts.

Rules it keeps:

* a command whose epoch is lower than the newest seen for its lease is refused
  (the newest epoch is kept in the lease's state dir, fsynced); a StopTask for a
  lease never started leaves a tombstone so a late StartTask of that epoch is refused;
* a duplicate StartTask (same lease) never starts a second process: it answers
  ``already_running`` with the pid, or re-reports how the rank ended;
* ranks run under a per-rank supervisor (``worker_agent.supervisor``) that records
  exits and enforces the unconfirmed-lease kill even when this agent is dead;
* a restarted agent re-adopts running ranks from the state dir (same pid), reports
  the exits it missed, and reports ranks of a previous boot as LOST;
* TaskStatus reports wait in an outbox until the leader acknowledges them
  (``worker_agent.link`` retries them across reconnects).

**Simulated ranks** (``NodeAgent(..., simulated_ranks=True)``; benchmarks and tests only,
never a setting): ``start_task`` keeps every check above (epochs, GPUs, duplicates) but
starts no process. The rank "runs" in this agent's memory until a StopTask (STOPPED, exit
code 143) or until its lease has gone unconfirmed for ``unconfirmed_kill_s`` (FENCED, as its
supervisor would kill it); heartbeats report it as running, so the leader confirms its lease
and reconciliation sees it. It reports no steps (never a hang), writes no logs, and is not
re-adopted by a restarted agent. It lets one machine host hundreds of running jobs on
thousands of simulated nodes (``bench/fleet.py``), where a Python supervisor per rank
would not fit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from temporalio import activity

from common.contracts import (
    START_TASK,
    STOP_TASK,
    StartTask,
    StartTaskResult,
    StopTask,
    StopTaskResult,
    TaskState,
    TaskStatus,
)
from proto import agent_pb2 as pb
from proto.convert import HEALTH_TO_PB, task_status_to_pb
from worker_agent import exit_cause, gpu_devices, job_spaces, rank_cgroup, rank_mounts, rank_users
from worker_agent import statefiles as sf
from worker_agent.checkpoints import checkpoint_within, local_path
from worker_agent.job_spaces import JobSpaces
from worker_agent.node_fitness import NodeFitness
from worker_agent.node_lock import NodeLock
from worker_agent.nvml import GpuBackend, GpuSample
from worker_agent.rank_access import RankAccessError, hand_over_tree, require_reachable
from worker_agent.rank_limits import filesystem_bytes, node_rank_limits
from worker_agent.runtime import ContainerRuntime, ProcessRuntime

log = logging.getLogger("gpufleet.agent")

AGENT_VERSION = "0.1.0"
FINISHED_RETENTION_S = 3 * 24 * 3600.0  # finished, reported lease dirs (and their logs) are kept this long
IMAGES_REFRESH_S = 60.0
TERMINAL = {TaskState.EXITED, TaskState.STOPPED, TaskState.FENCED, TaskState.LOST}


@dataclass
class Lease:
    """What the agent knows about one lease's rank (mirrors its state dir)."""

    task: StartTask
    dir: Path
    epoch: int
    live: bool = True
    pid: int | None = None
    rank_start: int | None = None
    pgid: int | None = None
    sup_pid: int | None = None
    sup_start: int | None = None
    started_clock: float = 0.0
    confirmed_clock: float = 0.0
    start_deadline: float | None = None  # recovered before its supervisor recorded the rank
    adopting_since: float | None = None
    exit: dict | None = None
    step: int | None = None
    step_clock: float = 0.0
    frozen: tuple[int | None, float] | None = None  # simulated hang: the step we keep reporting
    checkpoint_uri: str | None = None
    checkpoint_step: int | None = None
    progress_mtime: int = 0
    progress: Path | None = None  # the rank's progress file (in its work dir)
    reported: bool = False
    starting: bool = False  # start_task is bringing it up: the watcher keeps off
    simulated: bool = False  # a simulated rank: no process, lives in memory (NodeAgent simulated_ranks)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def lease_id(self) -> str:
        return self.task.lease_id

    @property
    def state(self) -> TaskState:
        if self.live or self.exit is None:
            return TaskState.STARTED
        return TaskState(self.exit.get("state", "LOST"))


class NodeAgent:
    """One node. Construct, ``await start()``, register ``build_agent_activities(node)``
    on a worker, and connect a ``worker_agent.link.ControlLink``; ``await close()``
    leaves every rank running (a restarted agent re-adopts them)."""

    def __init__(
        self,
        settings,
        node_id: str,
        *,
        backend: GpuBackend,
        runtime: ProcessRuntime | ContainerRuntime | None = None,
        boot_id: str | None = None,
        agent_addr: str = "",
        host_env: dict[str, str] | None = None,
        simulated_ranks: bool = False,
    ) -> None:
        self.settings = settings
        self.simulated_ranks = simulated_ranks  # benchmarks and tests only (module docstring)
        self.node_id = node_id
        self.backend = backend
        self.runtime = runtime or ProcessRuntime()
        self.boot_id = boot_id or sf.host_boot_id()
        self.agent_addr = agent_addr
        self.host_env = host_env
        self.dir = sf.node_dir(settings.state_dir, node_id)
        self.leases_dir = self.dir / "leases"
        # ranks' working dirs: outside the agent's private state, one per lease
        self.work_dir = Path(settings.agent_work_dir or Path(settings.state_dir) / "work") / node_id
        # ranks run as another user only when the agent can switch users (it runs as root)
        self.isolated = rank_users.ranks_isolated(settings)
        # ranks in their own cgroups: the process runtime's fence (the container engine has its own)
        self.cgroups = (
            bool(settings.agent_rank_cgroups) and bool(settings.agent_rank_limits)
            and isinstance(self.runtime, ProcessRuntime) and not simulated_ranks
        )  # fmt: skip
        self.gpu_fence = False  # ranks denied the other GPUs' device nodes (decided at start)
        self.private_proc = False  # ranks start with their own /proc (decided at start)
        self.gpu_mask = False  # ... and there the GPU nodes beside theirs masked (decided at start)
        self.private_tmp = False  # ... and their own /tmp and /var/tmp (decided at start)
        self.private_shm = False  # ... and their job's own /dev/shm (decided at start)
        self.shm_tmpfs = False  # ... a tmpfs of its own, sized to its memory share (decided at start)
        self.private_ipc = False  # ... and their job's own SysV IPC namespace (decided at start)
        self.spaces = JobSpaces(self.dir, node_id)  # where those live on the host
        self.lock = NodeLock(self.dir)  # one agent per node state dir, from start to close
        # whether new ranks can start here (simulated ranks write nothing: benchmarks skip it)
        self.fitness = NodeFitness(
            node_id, [self.dir, self.work_dir], int(settings.agent_min_free_disk_bytes),
            float(settings.agent_node_fitness_check_s), probes=[self.runtime.problem],
        )  # fmt: skip
        self._recovered = False  # every lease of the state dir is known (before it, none is "the last")
        self.poll_s = float(settings.agent_poll_s)
        self.leases: dict[str, Lease] = {}
        self.outbox: dict[int, pb.TaskStatus] = {}  # seq -> status, until acknowledged
        self.outbox_sent: dict[int, float] = {}
        self.wake = asyncio.Event()  # ask the link to send now (new status, new fault)
        self.on_status: Callable[[TaskStatus], None] | None = None  # observer (tests, logs)
        self._locks: dict[str, asyncio.Lock] = {}
        self._seq = 0
        self._watch_task: asyncio.Task | None = None
        self._images: list[str] = []
        self._images_at = -1e9
        self._gc_at = 0.0
        self._bg: set[asyncio.Task] = set()
        self._heartbeat_requested = False
        # the latest GPU samples (heartbeats take them; /metrics reads them) and when (monotonic)
        self.samples: list[GpuSample] = []
        self.samples_at = -1e18
        self._sample_lock = asyncio.Lock()  # one sample at a time: the backends keep state between samples

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.lock.acquire(self.node_id)  # NodeLockHeld: another agent serves this node
        try:
            await self._start()
        except BaseException:
            self.lock.release()
            raise

    async def _start(self) -> None:
        self.leases_dir.mkdir(parents=True, exist_ok=True)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        if self.isolated:
            # the agent's state (credentials aside, every lease's logs and records) is the agent's
            # alone; ranks may pass through the work root to their own dirs, not list it
            os.chmod(self.dir.parent, 0o700)
            os.chmod(self.work_dir, 0o711)
            os.chmod(self.work_dir.parent, 0o711)
            clash = rank_users.host_clashes(
                int(self.settings.agent_rank_id_base), [int(u) for u, _ in self.settings.agent_team_rank_ids.values()]
            )
            if clash:  # a team's ranks would run as that account, or inside that range
                raise RankAccessError(
                    f"the jobs' users (from agent_rank_id_base {self.settings.agent_rank_id_base}) are not free"
                    f" on this host: {'; '.join(clash[:5])}; set GPUFLEET_AGENT_RANK_ID_BASE above them"
                )
            for uid, gid in self.rank_users():
                require_reachable(
                    self.work_dir, uid, gid, "the ranks' work dir",
                    "set GPUFLEET_AGENT_WORK_DIR to a directory others may pass through",
                )  # fmt: skip
        elif self.settings.agent_rank_isolation:
            log.warning(
                "%s: the agent runs as uid %d, not root: ranks run as this user and can read what it can"
                " (no isolation between ranks and the agent)", self.node_id, os.geteuid(),
            )  # fmt: skip
        if self.cgroups:
            # fail closed: an operator who asked for the fence gets it or a clear refusal to start
            try:
                rank_cgroup.hierarchy(Path(self.settings.agent_cgroup_root))
            except rank_cgroup.CgroupError as e:
                raise RuntimeError(f"agent_rank_cgroups is on but ranks cannot be fenced: {e}") from e
            if os.geteuid() != 0:
                raise RuntimeError("agent_rank_cgroups is on but the agent is not root: it cannot create cgroups")
            self.gpu_fence = self._gpu_fence_possible()
        self.private_proc = (
            bool(self.settings.agent_rank_private_proc) and self.isolated
            and isinstance(self.runtime, ProcessRuntime) and not self.simulated_ranks
            and rank_mounts.problem() is None
        )  # fmt: skip
        # the mask stands in for the cgroup fence where there is none; a GPU without a known
        # minor could be the rank's own, so then nothing is masked
        self.gpu_mask = self.private_proc and not self.gpu_fence and self._gpu_minors_known()
        self.private_tmp = self.private_proc and bool(self.settings.agent_rank_private_tmp)
        self.private_shm = (
            self.private_proc and bool(self.settings.agent_rank_private_shm) and os.path.isdir(rank_mounts.SHM_DIR)
        )
        self.private_ipc = self.private_proc and bool(self.settings.agent_rank_private_ipc)
        self.shm_tmpfs = self.private_shm and self._shm_tmpfs_possible()
        self.recover()
        self._watch_task = asyncio.create_task(self._watch(), name=f"agent-watch-{self.node_id}")

    def _shm_tmpfs_possible(self) -> bool:
        why = job_spaces.tmpfs_problem()
        if why is not None:
            log.warning(
                "%s: a job's /dev/shm is a dir on the host's, not a tmpfs of its own sized to its memory share (%s):"
                " one job can fill the host's /dev/shm", self.node_id, why,
            )  # fmt: skip
        return why is None

    def _gpu_fence_possible(self) -> bool:
        """Whether ranks can be denied the other GPUs' device nodes here; if not, say why
        (CPU, memory and processes are still fenced: that is not a reason to refuse to start)."""
        why = rank_cgroup.device_fence_problem(
            self.settings.agent_cgroup_root, f"{self.settings.agent_cgroup_parent}/{self.node_id}"
        )
        if why is None and not self._gpu_minors_known():
            why = "NVML gives no device minor number for every GPU"
        if why is None:
            return True
        log.warning(
            "%s: a rank's GPUs are not fenced: %s; CUDA_VISIBLE_DEVICES is advisory, so a rank that opens"
            " another GPU's device node uses it (agent_runtime=container passes only its own)", self.node_id, why,
        )  # fmt: skip
        return False

    def _gpu_minors_known(self) -> bool:
        return all(self.backend.device_minor(i) is not None for i in range(self.backend.gpu_count()))

    def _granted_minors(self, gpu_indices: list[int]) -> list[int]:
        mine = [self.backend.device_minor(i) for i in gpu_indices]
        return [m for m in mine if m is not None]

    def _masked_gpu_nodes(self, gpu_indices: list[int]) -> list[str]:
        """The GPU nodes the rank's own mount namespace masks: every GPU node but its own."""
        if not self.gpu_mask:
            return []
        return gpu_devices.denied_paths(self.settings.agent_gpu_device_dir, self._granted_minors(gpu_indices))

    def _job_spaces(self, work: Path, req: StartTask, user: tuple[int, int] | None) -> dict:
        """The spec's fields for the rank's own tmp dir and its job's /dev/shm dir and IPC pin
        (worker_agent.job_spaces), made here where the rank will have them."""
        if user is None:
            return {"private_tmp": None, "shm": None, "ipc": None}
        needed = [str(work), local_path(req.checkpoint_dir), str(self.settings.agent_gpu_device_dir)]
        return {
            "private_tmp": self.spaces.rank_tmp(work, user, needed) if self.private_tmp else None,
            "shm": self.spaces.job_shm(req.job_id, user, self._job_shm_bytes(req)) if self.private_shm else None,
            "ipc": str(self.spaces.ipc_pin(req.job_id)) if self.private_ipc else None,
        }

    def _job_shm_bytes(self, req: StartTask) -> int | None:
        """The size of the job's own /dev/shm on this node: the memory share of the GPUs its
        live ranks here and this one hold (the container runtime's ``--shm-size`` is the
        rank's); the host's /dev/shm's size when ranks have no share (``agent_rank_limits``
        off). None: no tmpfs of its own here."""
        if not self.shm_tmpfs:
            return None
        gpus = len(req.gpu_indices) + sum(
            len(o.task.gpu_indices) for o in self.leases.values() if o.live and o.task.job_id == req.job_id
        )
        limits = node_rank_limits(self.settings, gpus=gpus, node_gpus=self.backend.gpu_count())
        return limits.memory_bytes if limits is not None else filesystem_bytes(rank_mounts.SHM_DIR)

    def _release_job_spaces(self) -> None:
        """Let go the /dev/shm dir and IPC namespace of every job with no live rank here (not
        before every lease of the state dir is known)."""
        if self._recovered:
            self.spaces.release({st.task.job_id for st in self.leases.values() if st.live})

    def _denied_gpu_devices(self, gpu_indices: list[int]) -> list[tuple[int, int]]:
        """The device numbers of the node's GPU nodes other than these GPUs'."""
        nodes = gpu_devices.gpu_device_numbers(self.settings.agent_gpu_device_dir)
        return gpu_devices.denied_devices(nodes, self._granted_minors(gpu_indices))

    async def close(self) -> None:
        for t in [self._watch_task, *self._bg]:
            if t is not None:
                t.cancel()
        for t in [self._watch_task, *self._bg]:
            if t is not None:
                try:
                    await t
                except (asyncio.CancelledError, Exception):
                    pass
        self._watch_task = None
        if self._recovered and not any(st.live for st in self.leases.values()):
            self.spaces.close()  # no rank left to need them: the node leaves nothing in /dev/shm
        self.backend.close()
        self.lock.release()

    def request_heartbeat(self) -> None:
        self._heartbeat_requested = True
        self.wake.set()

    def take_heartbeat_request(self) -> bool:
        requested, self._heartbeat_requested = self._heartbeat_requested, False
        return requested

    def next_seq(self) -> int:
        """Strictly increasing per node and across agent restarts (ms-based)."""
        self._seq = max(self._seq + 1, int(time.time() * 1000))
        return self._seq

    # ------------------------------------------------------------------- recovery
    def recover(self) -> None:
        """Rebuild from the state dir: re-adopt running ranks, report missed exits, LOST after a reboot."""
        now = sf.boot_clock()
        for d in sorted(self.leases_dir.iterdir()) if self.leases_dir.exists() else []:
            task_d = sf.read_json(d / sf.TASK)
            if task_d is None or d.name in self.leases:
                continue
            try:
                task = StartTask(**task_d)
            except TypeError:
                log.warning("%s: unreadable task in %s", self.node_id, d)
                continue
            ep = sf.read_json(d / sf.EPOCH) or {}
            st = Lease(task=task, dir=d, epoch=max(task.epoch, int(ep.get("epoch", task.epoch))))
            st.reported = (d / sf.REPORTED).exists()
            self.leases[task.lease_id] = st
            self._read_progress(st)
            rec = sf.read_json(d / sf.EXIT)
            if rec is not None:
                self._finish(st, rec, emit=not st.reported)
                continue
            sup = sf.read_json(d / sf.SUPERVISOR)
            spec = sf.read_json(d / sf.SPEC) or {}
            boot = (sup or {}).get("boot_id") or spec.get("boot_id")
            if boot and boot != self.boot_id:
                self._mark_lost(st, "node rebooted: rank of a previous boot")
                continue
            conf = sf.read_json(d / sf.CONFIRMED)
            st.started_clock = float((sup or {}).get("started_clock") or now)
            st.confirmed_clock = st.started_clock
            if conf and conf.get("boot_id") == self.boot_id:
                st.confirmed_clock = max(st.confirmed_clock, float(conf.get("clock", 0.0)))
            if sup is None or not sup.get("rank_pid"):
                st.start_deadline = now + self._start_timeout()
            else:
                self._adopt_fields(st, sup)
                log.info("%s: re-adopted lease %s (rank pid %s)", self.node_id, st.lease_id, st.pid)
            # The leader may have missed our STARTED (it was in the dead agent's outbox).
            if st.pid:
                self._emit(st, TaskState.STARTED)
            self._check(st)
        self._update_busy()
        self._recovered = True
        self._release_job_spaces()  # of jobs whose ranks here ended while no agent watched

    def _adopt_fields(self, st: Lease, sup: dict) -> None:
        st.pid = sup.get("rank_pid")
        st.rank_start = sup.get("rank_start")
        st.pgid = sup.get("pgid") or st.pid
        st.sup_pid = sup.get("supervisor_pid")
        st.sup_start = sup.get("supervisor_start")
        if sup.get("started_clock"):
            st.started_clock = float(sup["started_clock"])
            st.confirmed_clock = max(st.confirmed_clock, st.started_clock)

    def rank_users(self) -> set[tuple[int, int]]:
        """The users ranks run as here, for the checks that they can reach their dirs."""
        return rank_users.rank_users(self.settings)

    def rank_user(
        self, team: str, team_rank_id: int | None = None, job_rank_id: int | None = None
    ) -> tuple[int, int] | None:
        """The uid and gid a job's ranks run as (worker_agent.rank_users.rank_user); None: as
        the agent's own user (no isolation). ValueError when the job's number is past the range."""
        if not self.isolated:
            return None
        return rank_users.rank_user(self.settings, team, team_rank_id, job_rank_id)

    def _work_dir(self, req: StartTask, user: tuple[int, int] | None) -> Path:
        """The rank's own working dir (0700, its user's), and its job's local checkpoint dir
        made writable by it. Nothing of the agent's state is in either."""
        work = self.work_dir / req.lease_id
        work.mkdir(parents=True, exist_ok=True)
        if user is not None:
            os.chown(work, *user)
            os.chmod(work, 0o700)
            local_text = local_path(req.checkpoint_dir)
            if local_text is not None:
                local = Path(local_text)
                require_reachable(  # the way to it: the dir itself is the rank's, or handed to it, below
                    local.parent,
                    *user,
                    "the way to the job's checkpoint dir",
                    "keep checkpoints where others may pass through",
                )
                # the dirs above it that the agent makes (<state>/checkpoints/<job>) may be passed
                # through, not listed: a listing would show every team's job ids to any rank
                for above in reversed(local.parents):
                    if not above.exists():
                        above.mkdir(exist_ok=True)
                        os.chmod(above, 0o711)
                try:
                    local.mkdir()
                except FileExistsError:
                    # hand over only a dir that is already this user's (another rank of the job's
                    # on this node, or a restart of this one), never one of the host's or of another
                    # job's that a checkpoint path happens to name: that would give its files away.
                    # One exception: the job's team's user, which ran the job's earlier attempts
                    # before jobs were numbered, hands over the whole dir
                    owner = local.stat().st_uid
                    former = rank_users.team_user(self.settings, req.team_rank_id)
                    if former is not None and owner == former[0] and owner != user[0]:
                        hand_over_tree(local, former[0], user)
                    elif owner != user[0]:
                        raise RankAccessError(
                            f"the job's checkpoint dir {local} exists and belongs to uid {owner},"
                            f" not to this rank's user {user[0]}"
                        ) from None
                os.chown(local, *user)
                os.chmod(local, 0o700)
        return work

    def _start_timeout(self) -> float:
        return max(10.0, 20 * self.poll_s)

    # ----------------------------------------------------------------- activities
    @activity.defn(name=START_TASK)
    async def start_task(self, req: StartTask) -> StartTaskResult:
        def refuse(reason: str) -> StartTaskResult:
            log.warning("%s: StartTask %s epoch %s refused: %s", self.node_id, req.lease_id, req.epoch, reason)
            return StartTaskResult(lease_id=req.lease_id, epoch=req.epoch, accepted=False, reason=reason)

        if req.node_id != self.node_id:
            return refuse(f"this agent is node {self.node_id}, not {req.node_id}")
        if not sf.valid_lease_id(req.lease_id):
            return refuse("invalid lease id")
        async with self._lock(req.lease_id):
            newest, stopped_first = self._newest_epoch(req.lease_id)
            if newest is not None and req.epoch < newest:
                return refuse(f"stale epoch {req.epoch} < {newest}")
            st = self.leases.get(req.lease_id)
            if st is None and stopped_first and newest is not None and req.epoch <= newest:
                return refuse(f"lease was stopped at epoch {newest} before it started")
            self._record_epoch(req.lease_id, req.epoch)
            if st is not None:
                st.epoch = max(st.epoch, req.epoch)
                if st.live:
                    return StartTaskResult(
                        lease_id=req.lease_id, epoch=req.epoch, accepted=True, pid=st.pid, already_running=True,
                        reason="already running",
                    )  # fmt: skip
                self._emit_terminal(st)  # the caller may have missed it
                return StartTaskResult(
                    lease_id=req.lease_id, epoch=req.epoch, accepted=True, pid=st.pid, already_running=False,
                    reason=f"already finished: {st.state.value} exit_code={st.exit.get('exit_code') if st.exit else None}",
                )  # fmt: skip
            if not req.command:
                return refuse("empty command")
            n = self.backend.gpu_count()
            if len(set(req.gpu_indices)) != len(req.gpu_indices) or any(not 0 <= g < n for g in req.gpu_indices):
                return refuse(f"bad GPU indices {req.gpu_indices} (node has {n})")
            busy = {g: o.lease_id for o in self.leases.values() if o.live for g in o.task.gpu_indices}
            clash = {g: busy[g] for g in req.gpu_indices if g in busy}
            if clash:
                return refuse(f"GPUs busy: {clash}")
            if self.simulated_ranks:
                return self._start_simulated(req)
            d = self.leases_dir / req.lease_id
            d.mkdir(parents=True, exist_ok=True)
            try:
                user = self.rank_user(req.team, req.team_rank_id, req.job_rank_id)
            except ValueError as e:
                return refuse(str(e))
            try:
                work = self._work_dir(req, user)
                spaces = self._job_spaces(work, req, user)
            except (OSError, RankAccessError, ValueError) as e:  # ValueError: no share (node_rank_limits)
                if isinstance(e, OSError):
                    self.fitness.recheck()  # a full or read-only disk: say so in the next heartbeat
                return refuse(f"cannot prepare the rank's dirs: {e}")
            progress_file = str(work / "progress.json")
            try:
                limits = node_rank_limits(self.settings, gpus=len(req.gpu_indices), node_gpus=n, work_dir=self.work_dir)
                launch = self.runtime.launch(
                    req, progress_file=progress_file, host_env=self.host_env, workdir=str(work), user=user,
                    limits=limits,
                )  # fmt: skip
            except ValueError as e:
                return refuse(str(e))
            masked = self._masked_gpu_nodes(req.gpu_indices)
            if masked:  # an empty file of root's, mode 0: what the rank finds at those paths
                (d / "masked").touch()
                os.chmod(d / "masked", 0o000)
            cgroup = None
            if self.cgroups and limits is not None:  # the supervisor makes it (it outlives the agent)
                cgroup = {
                    "root": str(self.settings.agent_cgroup_root),
                    "parent": f"{self.settings.agent_cgroup_parent}/{self.node_id}",
                    "name": req.lease_id,
                    **limits.as_json(),
                    "deny_devices": self._denied_gpu_devices(req.gpu_indices) if self.gpu_fence else [],
                }
            sf.write_json_atomic(d / sf.TASK, dataclasses.asdict(req))
            sf.write_json_atomic(
                d / sf.SPEC,
                {
                    "argv": launch.argv,
                    "env": launch.env,
                    "kill_argv": launch.kill_argv,
                    "cwd": str(work),
                    "progress": progress_file,
                    "checkpoint_dir": req.checkpoint_dir,
                    "user": list(user) if user else None,
                    "stdout": str(d / sf.STDOUT),
                    "stderr": str(d / sf.STDERR),
                    "log_max_bytes": int(self.settings.agent_log_max_bytes),
                    "log_keep": int(self.settings.agent_log_keep),
                    "poll_s": self.poll_s,
                    "unconfirmed_kill_s": float(self.settings.unconfirmed_kill_s),
                    "fence_grace_s": float(self.settings.agent_fence_grace_s),
                    "boot_id": self.boot_id,
                    "image": req.image,
                    "cgroup": cgroup,
                    "private_proc": self.private_proc,
                    "masked_gpus": masked,
                    "mask_file": str(d / "masked") if masked else None,
                    **spaces,
                    "disk": (
                        {"limit_bytes": limits.disk_bytes, "check_s": float(self.settings.agent_rank_disk_check_s)}
                        if limits is not None and limits.disk_bytes
                        else None
                    ),
                },
            )
            now = sf.boot_clock()
            st = Lease(task=req, dir=d, epoch=req.epoch, started_clock=now, confirmed_clock=now, starting=True)
            st.start_deadline = now + self._start_timeout()
            self.leases[req.lease_id] = st
            log.info(
                "%s: starting lease %s (job %s attempt %s rank %s/%s, GPUs %s, image %s)", self.node_id,
                req.lease_id, req.job_id, req.attempt, req.rank, req.world_size, req.gpu_indices, req.image or "-",
            )  # fmt: skip
            try:
                await asyncio.to_thread(self._spawn_supervisor, d, False)
                await self._await_rank(st)
            finally:
                st.starting = False
            if st.pid:
                self._emit(st, TaskState.STARTED)
            self._check(st)  # an immediate exit (e.g. command not found) is reported now
            if st.live and not st.pid:
                self._mark_lost(st, "the rank supervisor did not start (see supervisor.log)")
                return refuse("rank supervisor did not start")
            self._update_busy()
            return StartTaskResult(lease_id=req.lease_id, epoch=req.epoch, accepted=True, pid=st.pid)

    def _start_simulated(self, req: StartTask) -> StartTaskResult:
        """A simulated rank (benchmarks and tests): running from now on, in memory only."""
        now = sf.boot_clock()
        st = Lease(task=req, dir=self.leases_dir / req.lease_id, epoch=req.epoch, started_clock=now,
                   confirmed_clock=now, simulated=True)  # fmt: skip
        self.leases[req.lease_id] = st
        log.debug("%s: simulated rank of lease %s (job %s rank %s)", self.node_id, req.lease_id, req.job_id, req.rank)
        self._emit(st, TaskState.STARTED)
        self._update_busy()
        return StartTaskResult(lease_id=req.lease_id, epoch=req.epoch, accepted=True, pid=None)

    def _end_simulated(self, st: Lease, state: TaskState, reason: str, exit_code: int | None) -> None:
        rec = {"state": state.value, "exit_code": exit_code, "signal": None, "reason": reason,
               "finished_at": time.time(), "boot_id": self.boot_id, "by": "agent (simulated rank)"}  # fmt: skip
        self._finish(st, rec)

    async def _await_rank(self, st: Lease) -> None:
        """Until the supervisor has recorded the rank's pid, or an exit, or the start deadline."""
        d = st.dir
        deadline = st.start_deadline
        assert deadline is not None, "a rank being started has a start deadline"
        while True:
            sup = sf.read_json(d / sf.SUPERVISOR)
            if sup and sup.get("rank_pid"):
                self._adopt_fields(st, sup)
                st.start_deadline = None
                return
            if (d / sf.EXIT).exists() or sf.boot_clock() > deadline:
                return
            await asyncio.sleep(0.01)

    @activity.defn(name=STOP_TASK)
    async def stop_task(self, req: StopTask) -> StopTaskResult:
        def refuse(reason: str) -> StopTaskResult:
            log.warning("%s: StopTask %s epoch %s refused: %s", self.node_id, req.lease_id, req.epoch, reason)
            return StopTaskResult(lease_id=req.lease_id, epoch=req.epoch, accepted=False, reason=reason)

        if req.node_id != self.node_id:
            return refuse(f"this agent is node {self.node_id}, not {req.node_id}")
        if not sf.valid_lease_id(req.lease_id):
            return refuse("invalid lease id")
        async with self._lock(req.lease_id):
            newest, _ = self._newest_epoch(req.lease_id)
            if newest is not None and req.epoch < newest:
                return refuse(f"stale epoch {req.epoch} < {newest}")
            st = self.leases.get(req.lease_id)
            if st is None:
                self._record_epoch(req.lease_id, req.epoch, stopped_first=True)
                return StopTaskResult(
                    lease_id=req.lease_id, epoch=req.epoch, accepted=True, reason="unknown lease: nothing to stop"
                )
            self._record_epoch(req.lease_id, req.epoch)
            st.epoch = max(st.epoch, req.epoch)
            if st.live and st.simulated:
                self._end_simulated(st, TaskState.STOPPED, req.reason or "stopped", 143)
            elif st.live and not (st.dir / sf.STOP).exists():
                grace = max(0.0, float(req.grace_seconds))
                sf.write_json_atomic(
                    st.dir / sf.STOP,
                    {"epoch": req.epoch, "grace_s": grace, "reason": req.reason, "clock": sf.boot_clock()},
                )
                log.info("%s: stopping lease %s (epoch %s, grace %ss): %s", self.node_id, req.lease_id,
                         req.epoch, grace, req.reason)  # fmt: skip
                self._poke_supervisor(st)
        await self._wait_stopped(st, max(0.0, float(req.grace_seconds)))
        rec = st.exit or {}
        return StopTaskResult(
            lease_id=req.lease_id,
            epoch=req.epoch,
            accepted=True,
            exit_code=rec.get("exit_code"),
            checkpoint_uri=rec.get("checkpoint_uri") or st.checkpoint_uri,
            reason=f"{st.state.value}" + (f": {rec['reason']}" if rec.get("reason") else ""),
            state=rec.get("state"),
        )

    async def _wait_stopped(self, st: Lease, grace: float) -> None:
        margin = 2.0 + 4 * self.poll_s
        deadline = time.monotonic() + grace + margin
        forced = False
        while st.live:
            if activity.in_activity():
                activity.heartbeat(st.lease_id)
            remaining = deadline - time.monotonic()
            try:
                await asyncio.wait_for(st.done.wait(), timeout=max(0.01, min(1.0, self.poll_s, remaining)))
            except TimeoutError:
                pass
            self._check(st)
            if st.live and time.monotonic() > deadline and not forced:
                # The supervisor did not end it in time (dead or stuck): do it ourselves.
                log.error(
                    "%s: lease %s still running after grace + margin: SIGKILL by the agent", self.node_id, st.lease_id
                )
                if st.pgid:
                    try:
                        os.killpg(st.pgid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                forced = True
                deadline = time.monotonic() + margin
            elif st.live and forced and time.monotonic() > deadline:
                self._end_leftovers(st)  # a daemon in its cgroups outlives the group kill
                self._finish(st, self._write_exit(st, "STOPPED", "killed by the agent; supervisor unresponsive"))

    # -------------------------------------------------------------- confirmations
    def confirm(self, lease_ids) -> None:
        """The leader confirmed these leases: restart their unconfirmed clocks (supervisors read the file)."""
        now = sf.boot_clock()
        for lid in lease_ids:
            st = self.leases.get(lid)
            if st is None or not st.live:
                continue
            st.confirmed_clock = now
            if st.simulated:
                continue  # no supervisor reads the file
            try:
                sf.write_json_atomic(st.dir / sf.CONFIRMED, {"clock": now, "boot_id": self.boot_id, "at": time.time()})
            except OSError as e:
                log.error("%s: cannot record confirmation of %s: %s", self.node_id, lid, e)

    def on_ack(self, ack: pb.HeartbeatAck) -> None:
        self.confirm(ack.confirmed_lease_ids)
        for ref in ack.stop:
            st = self.leases.get(ref.lease_id)
            if st is None or not st.live:
                continue
            req = StopTask(
                lease_id=ref.lease_id,
                epoch=ref.epoch,
                node_id=self.node_id,
                grace_seconds=self.settings.default_grace_s,
                reason=ref.reason or "reconciliation: no live lease",
            )
            t = asyncio.create_task(self.stop_task(req))
            self._bg.add(t)
            t.add_done_callback(self._bg.discard)

    # ------------------------------------------------------------------- statuses
    def _emit(
        self,
        st: Lease,
        state: TaskState,
        *,
        exit_code: int | None = None,
        signal: int | None = None,
        stderr_tail: str = "",
        reason: str = "",
    ) -> None:
        s = TaskStatus(
            node_id=self.node_id,
            lease_id=st.lease_id,
            job_id=st.task.job_id,
            attempt=st.task.attempt,
            epoch=st.epoch,
            rank=st.task.rank,
            state=state,
            at=datetime.now(UTC),
            exit_code=exit_code,
            checkpoint_uri=st.checkpoint_uri,
            step=st.step,
            boot_id=self.boot_id,
            seq=self.next_seq(),
            signal=signal,
            stderr_tail=stderr_tail,
            reason=reason,
        )
        self.outbox[s.seq] = task_status_to_pb(s)
        self.wake.set()
        if self.on_status is not None:
            try:
                self.on_status(s)
            except Exception:  # an observer never breaks the agent
                log.exception("on_status observer failed")

    def _emit_terminal(self, st: Lease) -> None:
        """The rank's end with its cause: the signal that killed it, the last lines of its
        stderr (read again on every re-send: the file outlives the report), why it was ended."""
        rec = st.exit or {}
        tail = ""
        if not st.simulated:
            spec = sf.read_json(st.dir / sf.SPEC) or {}
            tail = exit_cause.stderr_tail(spec.get("stderr") or st.dir / sf.STDERR)
        reason = str(rec.get("reason") or rec.get("error") or "")[:1000]
        self._emit(st, st.state, exit_code=rec.get("exit_code"), signal=exit_cause.exit_signal(rec),
                   stderr_tail=tail, reason=reason)  # fmt: skip

    def pending_statuses(self, retry_after_s: float) -> list[pb.TaskStatus]:
        """Statuses not sent yet, or sent more than ``retry_after_s`` ago and not acknowledged.

        In order per lease: a later report of a lease waits until the earlier one is
        acknowledged, so the leader never sees STOPPED before STARTED.
        """
        now = time.monotonic()
        out = []
        blocked: set[str] = set()
        for seq, m in self.outbox.items():
            if m.lease_id in blocked:
                continue
            blocked.add(m.lease_id)
            if now - self.outbox_sent.get(seq, -1e18) >= retry_after_s:
                self.outbox_sent[seq] = now
                out.append(m)
        return out

    def forget_sent(self) -> None:
        """A new stream: everything unacknowledged goes again."""
        self.outbox_sent.clear()

    def status_acked(self, seq: int, ok: bool) -> None:
        m = self.outbox.get(seq)
        if m is None:
            return
        if not ok:  # the leader could not take it now; retry after the retry interval
            return
        del self.outbox[seq]
        self.outbox_sent.pop(seq, None)
        if self.outbox:
            self.wake.set()  # the lease's next report may go now
        st = self.leases.get(m.lease_id)
        if st is not None and not st.live and m.state != pb.STARTED and not st.reported:
            st.reported = True
            try:
                sf.write_json_atomic(st.dir / sf.REPORTED, {"seq": seq, "at": time.time()})
            except OSError:
                pass

    # ------------------------------------------------------------------ heartbeat
    async def sample_gpus(self) -> list[GpuSample]:
        """Sample every GPU now (the latest samples stay in ``samples`` for /metrics)."""
        async with self._sample_lock:
            self._update_busy()  # a rank's pid may have been learnt since its start (adoption)
            if self.backend.name == "real":
                samples = await asyncio.to_thread(self.backend.sample)
            else:
                samples = self.backend.sample()
            self.samples, self.samples_at = samples, time.monotonic()
            return samples

    def allocated_gpus(self) -> set[int]:
        return {g for st in self.leases.values() if st.live for g in st.task.gpu_indices}

    async def heartbeat(self) -> pb.Heartbeat:
        samples = await self.sample_gpus()
        util = {s.index: s.sm_util for s in samples if s.sm_util is not None}
        hb = pb.Heartbeat(
            node_id=self.node_id,
            boot_id=self.boot_id,
            seq=self.next_seq(),
            sent_at=time.time(),
            agent_addr=self.agent_addr,
            agent_version=AGENT_VERSION,
        )
        for s in samples:
            g = hb.gpus.add(index=s.index, health=HEALTH_TO_PB.get(s.health, 0), uuid=s.uuid)
            for name in ("sm_util", "mem_util", "mem_used", "mem_total", "temperature_c", "ecc_sbe", "ecc_dbe"):
                v = getattr(s, name)
                if v is not None:
                    setattr(g, name, v)
            g.xids.extend(s.xids)
            g.faults.extend(s.faults)
        hung = self.backend.hung_gpus()
        now = sf.boot_clock()
        for st in self.leases.values():
            if not st.live:
                continue
            step, step_clock = st.step, st.step_clock or st.started_clock
            if hung.intersection(st.task.gpu_indices):
                if st.frozen is None:
                    st.frozen = (step, step_clock)
                step, step_clock = st.frozen
            else:
                st.frozen = None
            lease = hb.running.add(
                lease_id=st.lease_id,
                job_id=st.task.job_id,
                epoch=st.epoch,
                step=-1 if step is None else step,
                attempt=st.task.attempt,
                rank=st.task.rank,
                pid=st.pid or 0,
                checkpoint_uri=st.checkpoint_uri or "",
                checkpoint_step=st.checkpoint_step or 0,
                step_age_s=max(0.0, now - step_clock),
                gpu_indices=st.task.gpu_indices,
                unconfirmed_s=max(0.0, now - st.confirmed_clock),
            )
            used = [util[g] for g in st.task.gpu_indices if g in util]
            if used:
                lease.gpu_util = sum(used) / len(used)
        try:
            hb.free_disk_bytes = shutil.disk_usage(self.dir).free
        except OSError:
            pass
        hb.cached_images.extend(await self._cached_images())
        if not self.simulated_ranks:
            hb.node_faults.extend(await self.fitness.faults())
        return hb

    async def _cached_images(self) -> list[str]:
        if isinstance(self.runtime, ContainerRuntime):
            if time.monotonic() - self._images_at > IMAGES_REFRESH_S:
                self._images_at = time.monotonic()
                self._images = await asyncio.to_thread(self.runtime.cached_images)
            return self._images
        # process runtime: the images of the ranks this node ran (kept for locality hints)
        return sorted({st.task.image for st in self.leases.values() if st.task.image})[:64]

    def running(self) -> list[Lease]:
        return [st for st in self.leases.values() if st.live]

    def log_path(self, lease_id: str, stream: str) -> Path | None:
        if not sf.valid_lease_id(lease_id) or stream not in ("stdout", "stderr"):
            return None
        st = self.leases.get(lease_id)
        if st is None:
            return None
        return st.dir / (sf.STDOUT if stream == "stdout" else sf.STDERR)

    # -------------------------------------------------------------------- watcher
    async def _watch(self) -> None:
        while True:
            try:
                for st in list(self.leases.values()):
                    if st.live:
                        self._check(st)
                if self.backend.poll_faults():
                    self.request_heartbeat()  # a new fault is reported now, not at the next interval
                if time.monotonic() - self.samples_at > 2 * float(self.settings.heartbeat_interval_s):
                    # no heartbeat sampled lately (the leader is unreachable): /metrics stays current
                    await self.sample_gpus()
                if time.monotonic() - self._gc_at > 60.0:
                    self._gc_at = time.monotonic()
                    self._gc()
            except Exception:
                log.exception("%s: watcher pass failed", self.node_id)
            await asyncio.sleep(self.poll_s)

    def _check(self, st: Lease) -> None:
        """Look at one live rank's files: exit, progress, supervisor liveness."""
        if not st.live or st.starting:
            return
        if st.simulated:  # no files: only the self-fence its supervisor would carry out
            unconfirmed = sf.boot_clock() - st.confirmed_clock
            if unconfirmed > float(self.settings.unconfirmed_kill_s):
                self._end_simulated(st, TaskState.FENCED, f"lease unconfirmed for {unconfirmed:.0f}s", None)
            return
        rec = sf.read_json(st.dir / sf.EXIT)
        if rec is not None:
            self._read_progress(st)
            self._finish(st, rec)
            return
        self._read_progress(st, report=True)
        now = sf.boot_clock()
        if not st.pid:
            sup = sf.read_json(st.dir / sf.SUPERVISOR)
            if sup and sup.get("rank_pid"):
                self._adopt_fields(st, sup)
                st.start_deadline = None
                self._emit(st, TaskState.STARTED)
            elif st.start_deadline is not None and now > st.start_deadline:
                self._mark_lost(st, "never started")
            return
        if sf.process_alive(st.sup_pid, st.sup_start):
            st.adopting_since = None
            return
        # The supervisor is gone without an exit record.
        sup = sf.read_json(st.dir / sf.SUPERVISOR) or {}
        if sup.get("supervisor_pid") and sup.get("supervisor_pid") != st.sup_pid:
            self._adopt_fields(st, sup)  # a new (adopting) supervisor took over
            return
        if (st.dir / sf.EXIT).exists():
            return  # written just now; next pass
        if sf.process_alive(st.pid, st.rank_start):
            if st.adopting_since is None or now - st.adopting_since > self._start_timeout():
                log.warning("%s: supervisor of lease %s died; adopting rank pid %s", self.node_id, st.lease_id, st.pid)
                st.adopting_since = now
                try:
                    self._spawn_supervisor(st.dir, True)
                except OSError as e:
                    log.error("%s: cannot start an adopting supervisor: %s", self.node_id, e)
            return
        self._end_leftovers(st)
        self._mark_lost(st, "rank and its supervisor vanished")

    def _read_progress(self, st: Lease, report: bool = False) -> None:
        if st.progress is None:
            st.progress = sf.progress_path(st.dir)
        path = st.progress
        try:
            mtime = path.stat().st_mtime_ns
        except OSError:
            return
        if mtime == st.progress_mtime:
            return
        st.progress_mtime = mtime
        p = sf.read_rank_json(path)
        if not p:
            return
        step = p.get("step")
        if isinstance(step, int) and step != st.step:
            st.step = step
            st.step_clock = sf.boot_clock()
        uri = p.get("checkpoint_uri")
        if uri and not (isinstance(uri, str) and checkpoint_within(uri, st.task.checkpoint_dir)):
            log.warning(
                "%s: lease %s reports a checkpoint outside its dir (%r): ignored", self.node_id, st.lease_id, uri
            )
            uri = None
        if uri and uri != st.checkpoint_uri:
            st.checkpoint_uri = uri
            st.checkpoint_step = p.get("checkpoint_step")
            if report and st.live:
                # A completed checkpoint: tell the leader (victim choice counts the lost work).
                self._emit(st, TaskState.STARTED)

    def _write_exit(self, st: Lease, state: str, reason: str) -> dict:
        rec = {
            "state": state,
            "exit_code": None,
            "signal": None,
            "reason": reason,
            "checkpoint_uri": st.checkpoint_uri,
            "checkpoint_step": st.checkpoint_step,
            "step": st.step,
            "finished_at": time.time(),
            "boot_id": self.boot_id,
            "by": "agent",
        }
        if not (st.dir / sf.EXIT).exists():
            sf.write_json_atomic(st.dir / sf.EXIT, rec, fsync=True)
        return sf.read_json(st.dir / sf.EXIT) or rec

    def _end_leftovers(self, st: Lease) -> None:
        """Kill what a rank whose supervisor is gone left behind: its workers (torchrun's, say)
        would keep its GPUs after the lease is reported LOST and the GPUs go to the next job.

        The rank leads its process group, so its group's id is still reserved while a member
        lives; a process that now holds that pid is another one (the rank is dead), and its
        group is not ours to kill. Its cgroups hold everything it started, a ``setsid``
        daemon included: those are emptied and removed (off the event loop: removal waits
        for the kernel to reap)."""
        if st.pgid and not sf.process_alive(st.pgid, None):
            try:
                os.killpg(st.pgid, signal.SIGKILL)
                log.warning("%s: lease %s: killed what its rank left in its process group", self.node_id, st.lease_id)
            except (ProcessLookupError, PermissionError):
                pass
        sup = sf.read_json(st.dir / sf.SUPERVISOR) or {}
        if not sup.get("cgroup"):
            return
        cgroup = rank_cgroup.RankCgroup.from_json(sup["cgroup"])
        cgroup.kill_all()

        def remove() -> None:
            if not cgroup.remove():
                log.error("%s: could not remove lease %s's cgroups %s", self.node_id, st.lease_id, cgroup.dirs)

        try:
            t = asyncio.get_running_loop().create_task(asyncio.to_thread(remove))
        except RuntimeError:  # no loop (a caller outside the agent's): do it here
            remove()
            return
        self._bg.add(t)
        t.add_done_callback(self._bg.discard)

    def _mark_lost(self, st: Lease, reason: str) -> None:
        log.warning("%s: lease %s LOST: %s", self.node_id, st.lease_id, reason)
        self._finish(st, self._write_exit(st, "LOST", reason))

    def _finish(self, st: Lease, rec: dict, emit: bool = True) -> None:
        was_live = st.live
        st.live = False
        if was_live:
            self._release_job_spaces()
        st.exit = rec
        if rec.get("checkpoint_uri"):
            st.checkpoint_uri = rec["checkpoint_uri"]
            st.checkpoint_step = rec.get("checkpoint_step")
        if isinstance(rec.get("step"), int):
            st.step = rec["step"]
        st.done.set()
        if emit:
            log.info("%s: lease %s %s (exit code %s%s)", self.node_id, st.lease_id, rec.get("state"),
                     rec.get("exit_code"), f", {rec['reason']}" if rec.get("reason") else "")  # fmt: skip
            self._emit_terminal(st)
        if was_live:
            self._update_busy()

    def _update_busy(self) -> None:
        """Tell the backend which rank processes sit on which GPUs (the simulated one measures them).
        A simulated rank has no process: its GPUs read idle."""
        ranks: dict[int, list[int]] = {}
        for st in self.leases.values():
            if st.live and st.pid and not st.simulated:
                for g in st.task.gpu_indices:
                    ranks.setdefault(g, []).append(st.pid)
        self.backend.set_ranks(ranks)

    def _gc(self) -> None:
        self._release_job_spaces()  # also what a restarted agent finds of jobs that ended meanwhile
        cutoff = time.time() - FINISHED_RETENTION_S
        for lid, st in list(self.leases.items()):
            if st.live or not st.reported or not st.exit:
                continue
            if float(st.exit.get("finished_at") or 0) < cutoff:
                shutil.rmtree(st.dir, ignore_errors=True)
                shutil.rmtree(self.work_dir / lid, ignore_errors=True)
                del self.leases[lid]

    # -------------------------------------------------------------------- helpers
    def _lock(self, lease_id: str) -> asyncio.Lock:
        lock = self._locks.get(lease_id)
        if lock is None:
            lock = self._locks[lease_id] = asyncio.Lock()
        return lock

    def _newest_epoch(self, lease_id: str) -> tuple[int | None, bool]:
        rec = sf.read_json(self.leases_dir / lease_id / sf.EPOCH)
        if rec is None:
            st = self.leases.get(lease_id)
            return (st.epoch if st else None), False
        return int(rec["epoch"]), bool(rec.get("stopped_first"))

    def _record_epoch(self, lease_id: str, epoch: int, stopped_first: bool = False) -> None:
        d = self.leases_dir / lease_id
        d.mkdir(parents=True, exist_ok=True)
        old = sf.read_json(d / sf.EPOCH) or {}
        if int(old.get("epoch", -(2**62))) > epoch:
            return
        rec = {"epoch": epoch}
        if stopped_first or (old.get("stopped_first") and int(old.get("epoch", -1)) == epoch):
            rec["stopped_first"] = True
        if rec != old:
            sf.write_json_atomic(d / sf.EPOCH, rec, fsync=True)

    def _poke_supervisor(self, st: Lease) -> None:
        if st.sup_pid and sf.process_alive(st.sup_pid, st.sup_start):
            try:
                os.kill(st.sup_pid, signal.SIGUSR1)
            except (ProcessLookupError, PermissionError):
                pass

    def _spawn_supervisor(self, d: Path, adopt: bool) -> None:
        pkg_root = str(Path(__file__).resolve().parent.parent)
        env = {
            "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
            "PYTHONPATH": pkg_root,
            "LANG": os.environ.get("LANG", "C.UTF-8"),
        }
        with open(d / sf.SUPERVISOR_LOG, "ab") as logf:
            p = subprocess.Popen(
                [sys.executable, "-m", "worker_agent.supervisor", str(d), *(["--adopt"] if adopt else [])],
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=logf,
                env=env,
                cwd=str(d),
                close_fds=True,
                start_new_session=True,
            )
        p.wait()  # the supervisor forks and detaches; this first process exits at once


def build_agent_activities(node: NodeAgent) -> list:
    """The node's activities, named ``start_task`` and ``stop_task``."""
    return [node.start_task, node.stop_task]


class FleetActivities:
    """Shared-queue mode: one worker for the nodes of this process, routing by ``node_id``.

    Only correct when this one process hosts every node that callers send to the
    shared queue (a simulated fleet); production uses one queue per node.
    """

    def __init__(self, nodes: dict[str, NodeAgent]) -> None:
        self.nodes = nodes

    @activity.defn(name=START_TASK)
    async def start_task(self, req: StartTask) -> StartTaskResult:
        node = self.nodes.get(req.node_id)
        if node is None:
            return StartTaskResult(req.lease_id, req.epoch, False, reason=f"node {req.node_id} not hosted here")
        return await node.start_task(req)

    @activity.defn(name=STOP_TASK)
    async def stop_task(self, req: StopTask) -> StopTaskResult:
        node = self.nodes.get(req.node_id)
        if node is None:
            return StopTaskResult(req.lease_id, req.epoch, False, reason=f"node {req.node_id} not hosted here")
        return await node.stop_task(req)

    def activities(self) -> list:
        return [self.start_task, self.stop_task]
