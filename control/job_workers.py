"""Job workflow workers in child processes of ``control``.

Python runs one thread of workflow code at a time (the GIL). In a burst of submits the
job workflows' tasks would otherwise share the control process with the leader's
placement cycle, the heartbeat stream and the health monitor, and placement would wait
seconds behind them. With ``control_job_workers = N > 0`` the control process starts N
children (``gpufleet control --job-worker``) that serve the control task queue
(``JobWorkflow``, ``BurnInWorkflow`` and their local activities); the control process
itself keeps placement, leadership, heartbeats and health. With 0 it serves the
queue itself (tests that run the control plane in one process).

A child exits when its parent dies (it never outlives the control process that owns
it); the parent restarts a child that died, at most once per ``RESTART_AFTER_S``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from temporalio.client import Client
from temporalio.worker import PollerBehaviorAutoscaling, Worker

from activities.job_activities import JobActivities
from common.aio import cancel_and_wait
from common.secrets import for_role
from common.settings import Settings
from common.temporal import make_worker
from store.tx import Pool
from workflows.burn_in import BurnInWorkflow
from workflows.job import JobWorkflow

log = logging.getLogger("gpufleet.control.jobs")

RESTART_AFTER_S = 2.0
SETTINGS_FILE_ENV = "GPUFLEET_JOB_WORKER_SETTINGS_FILE"


def settings_for_child() -> Settings | None:
    """In a job-worker child: the parent's settings from the file it named, else None."""
    path = os.environ.get(SETTINGS_FILE_ENV)
    return Settings.model_validate_json(Path(path).read_text()) if path else None


STOP_GRACE_S = 10.0


def control_queue_worker(client: Client, pool: Pool, settings: Settings) -> Worker:
    """The worker for ``settings.control_task_queue`` (in a child or in control itself)."""
    return make_worker(
        client,
        settings.control_task_queue,
        workflows=[JobWorkflow, BurnInWorkflow],
        activities=JobActivities(pool, settings).all(),
        # a few tasks at a time: more only queue as concurrent writes on the server
        max_concurrent_workflow_tasks=20,
        max_concurrent_local_activities=50,
        # activations run under the GIL anyway: a few threads, not one per slot
        # (fewer thread hand-offs per workflow task)
        workflow_task_executor=ThreadPoolExecutor(max_workers=2, thread_name_prefix="wft"),
        max_cached_workflows=settings.control_cached_workflows,
        # new job workflows' first tasks come from the shared (non-sticky) queue: with the
        # default pollers (one of five non-sticky) they wait seconds in a burst
        workflow_task_poller_behavior=PollerBehaviorAutoscaling(minimum=2, maximum=10, initial=5),
        nonsticky_to_sticky_poll_ratio=1.0,
    )


class JobWorkerChildren:
    """Starts, watches and stops the ``--job-worker`` children of one control process."""

    def __init__(self, settings: Settings, count: int) -> None:
        self.settings = settings
        self.count = count
        self.procs: list[subprocess.Popen | None] = [None] * count
        self.restarts = 0
        self._task: asyncio.Task | None = None
        self._started_at = [0.0] * count
        self._settings_path: Path | None = None

    def _ready_file(self, i: int) -> Path:
        return self.settings.state_dir / "control" / f"job-worker-{os.getpid()}-{i}.ready"

    def _settings_file(self) -> Path:
        """This process's settings for its children, as a file (0600: it holds the database
        login), without the secrets a job worker does not use."""
        path = self.settings.state_dir / "control" / f"job-worker-{os.getpid()}.settings.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(for_role(self.settings, "job-worker").model_dump_json())
        return path

    def _spawn(self, i: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
        env["PYTHONUNBUFFERED"] = "1"
        env[SETTINGS_FILE_ENV] = str(self._settings_path)
        env["GPUFLEET_PARENT_PID"] = str(os.getpid())
        ready = self._ready_file(i)
        ready.parent.mkdir(parents=True, exist_ok=True)
        ready.unlink(missing_ok=True)
        env["GPUFLEET_JOB_WORKER_READY_FILE"] = str(ready)
        self.procs[i] = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "control", "--job-worker", "--log-level",
             logging.getLevelName(logging.getLogger().getEffectiveLevel())],
            env=env,
        )  # fmt: skip
        self._started_at[i] = time.monotonic()

    async def start(self, ready_timeout_s: float = 60.0) -> None:
        """Start the children and wait until each serves the queue (or has died, or the
        timeout passed: the watcher keeps restarting it; placement does not wait)."""
        self._settings_path = self._settings_file()
        for i in range(self.count):
            self._spawn(i)
        self._task = asyncio.create_task(self._watch(), name="job-worker-children")
        deadline = time.monotonic() + ready_timeout_s
        for i, p in enumerate(self.procs):
            while not self._ready_file(i).exists() and p is not None and p.poll() is None:
                if time.monotonic() > deadline:
                    log.warning("job worker %d is not serving after %.0f s", i, ready_timeout_s)
                    return
                await asyncio.sleep(0.05)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            for i, p in enumerate(self.procs):
                if p is not None and p.poll() is not None and time.monotonic() - self._started_at[i] > RESTART_AFTER_S:
                    log.warning("job worker %d (pid %d) exited with code %s: restarting it", i, p.pid, p.returncode)
                    self.restarts += 1
                    self._spawn(i)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None and p.poll() is None]

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in live:
            try:
                await asyncio.to_thread(p.wait, max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self._settings_path is not None:
            self._settings_path.unlink(missing_ok=True)


async def _reach(settings: Settings) -> tuple[Pool, Client]:
    from common.db import pool_when_reachable
    from common.temporal import connect_when_reachable

    pool = await pool_when_reachable(settings, log)
    try:
        return pool, await connect_when_reachable(settings, log)
    except BaseException:
        await pool.close()
        raise


async def serve_job_worker(settings: Settings, stop: asyncio.Event) -> None:
    """A child's life: serve the control task queue until ``stop`` or the parent is gone."""
    parent = int(os.environ.get("GPUFLEET_PARENT_PID", "0")) or os.getppid()
    # a child restarted during an outage waits for it (like its parent) rather than crash-loop
    from common.aio import Stopped, unless_stopped

    try:
        pool, client = await unless_stopped(_reach(settings), stop)
    except Stopped:
        return
    worker = control_queue_worker(client, pool, settings)
    run = asyncio.create_task(worker.run())
    await asyncio.sleep(0)  # let the worker start its pollers (it is connected to Temporal and Postgres)
    ready = os.environ.get("GPUFLEET_JOB_WORKER_READY_FILE")
    if ready:
        Path(ready).touch()
    log.info("job worker %d serves %s", os.getpid(), settings.control_task_queue)
    try:
        while not stop.is_set() and not run.done():
            if os.getppid() != parent:
                log.warning("control process %d is gone: job worker %d exits", parent, os.getpid())
                break
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
    finally:
        if not run.done():
            await worker.shutdown()
        await asyncio.gather(run, return_exceptions=True)
        await pool.close()
        if ready:
            Path(ready).unlink(missing_ok=True)


__all__ = ["JobWorkerChildren", "control_queue_worker", "serve_job_worker"]
