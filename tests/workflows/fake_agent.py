"""A minimal in-test node agent: runs ranks as real subprocesses.

It implements the agent's two activities (``start_task`` / ``stop_task`` with the
``common.contracts`` payloads) on one shared node task queue, and reports
``TaskStatus`` through the control plane's ``ReportDelivery`` (stored, then delivered)
as the leader does with the real agent's gRPC reports. The rank environment follows the
real agent's (``RANK``, ``WORLD_SIZE``, ``GPUFLEET_CHECKPOINT_DIR``,
``GPUFLEET_RESUME_FROM``, ``GPUFLEET_PROGRESS_FILE``).

Test images: ``fake/refuse`` is refused; ``fake/hang`` never finishes starting.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
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


@dataclass
class _Task:
    req: StartTask
    proc: asyncio.subprocess.Process
    progress: Path
    stop_requested: bool = False
    exit_code: int | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class FakeAgent:
    def __init__(self, reports, root: Path) -> None:
        self.reports = reports  # control.report_delivery.ReportDelivery (or anything with submit)
        self.root = root
        self.tasks: dict[str, _Task] = {}
        self.starts: list[StartTask] = []
        self.stops: list[StopTask] = []
        self.signals_seen: dict[str, list[str]] = {}
        self.held_exits: set[str] = set()  # leases whose exit report is late (not sent until released)
        self.stop_says_state = True  # False: stop results without ``state``, as an older agent's

    def activities(self) -> list:
        return [self.start_task, self.stop_task]

    def _report(self, t: _Task, state: TaskState, exit_code: int | None = None) -> None:
        ck = None
        try:
            ck = json.loads(t.progress.read_text()).get("checkpoint_uri")
        except (OSError, ValueError):
            pass
        self.reports.submit(
            TaskStatus(
                node_id=t.req.node_id,
                lease_id=t.req.lease_id,
                job_id=t.req.job_id,
                attempt=t.req.attempt,
                epoch=t.req.epoch,
                rank=t.req.rank,
                state=state,
                at=datetime.now(UTC),
                exit_code=exit_code,
                checkpoint_uri=ck,
            )
        )

    @activity.defn(name=START_TASK)
    async def start_task(self, req: StartTask) -> StartTaskResult:
        self.starts.append(req)
        if req.image == "fake/refuse":
            return StartTaskResult(req.lease_id, req.epoch, accepted=False, reason="refused by the test agent")
        if req.image == "fake/hang":
            await asyncio.sleep(3600)
        t = self.tasks.get(req.lease_id)
        if t is not None and not t.done.is_set():
            return StartTaskResult(req.lease_id, req.epoch, accepted=True, pid=t.proc.pid, already_running=True)
        lease_dir = self.root / req.node_id / req.lease_id
        lease_dir.mkdir(parents=True, exist_ok=True)
        progress = lease_dir / "progress.json"
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "PYTHONPATH", "LANG")}
        env.update(req.env)
        env.update(
            RANK=str(req.rank),
            WORLD_SIZE=str(req.world_size),
            MASTER_ADDR=req.master_addr,
            MASTER_PORT=str(req.master_port),
            CUDA_VISIBLE_DEVICES=",".join(map(str, req.gpu_indices)),
            GPUFLEET_JOB_ID=req.job_id,
            GPUFLEET_ATTEMPT=str(req.attempt),
            GPUFLEET_LEASE_ID=req.lease_id,
            GPUFLEET_CHECKPOINT_DIR=req.checkpoint_dir,
            GPUFLEET_PROGRESS_FILE=str(progress),
        )
        if req.resume_from:
            env["GPUFLEET_RESUME_FROM"] = req.resume_from
        proc = await asyncio.create_subprocess_exec(
            *req.command,
            env=env,
            cwd=str(lease_dir),
            stdout=open(lease_dir / "stdout.log", "ab"),
            stderr=open(lease_dir / "stderr.log", "ab"),
            start_new_session=True,
        )
        t = _Task(req, proc, progress)
        self.tasks[req.lease_id] = t
        self._report(t, TaskState.STARTED)
        asyncio.get_running_loop().create_task(self._watch(t))
        return StartTaskResult(req.lease_id, req.epoch, accepted=True, pid=proc.pid)

    async def _watch(self, t: _Task) -> None:
        last = None
        while True:  # like the real agent: a completed checkpoint is reported while running
            try:
                rc = await asyncio.wait_for(asyncio.shield(t.proc.wait()), 0.05)
                break
            except TimeoutError:
                pass
            try:
                uri = json.loads(t.progress.read_text()).get("checkpoint_uri")
            except (OSError, ValueError):
                uri = None
            if uri and uri != last:
                last = uri
                self._report(t, TaskState.STARTED)
        t.exit_code = 128 - rc if rc < 0 else rc
        t.done.set()
        if t.req.lease_id not in self.held_exits:
            self._report(t, self._end_state(t), t.exit_code)

    def release_exit(self, lease_id: str) -> None:
        """Send a held exit report now (it was late)."""
        self.held_exits.discard(lease_id)
        t = self.tasks[lease_id]
        if t.done.is_set():
            self._report(t, self._end_state(t), t.exit_code)

    @staticmethod
    def _end_state(t: _Task) -> TaskState:
        return TaskState.STOPPED if t.stop_requested else TaskState.EXITED

    @activity.defn(name=STOP_TASK)
    async def stop_task(self, req: StopTask) -> StopTaskResult:
        self.stops.append(req)
        t = self.tasks.get(req.lease_id)
        if t is None:
            return StopTaskResult(req.lease_id, req.epoch, accepted=False, reason="unknown lease")
        if not t.done.is_set():
            t.stop_requested = True
            self.signals_seen.setdefault(req.lease_id, []).append("SIGTERM")
            try:
                os.killpg(t.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(t.done.wait(), req.grace_seconds)
            except TimeoutError:
                self.signals_seen[req.lease_id].append("SIGKILL")
                try:
                    os.killpg(t.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await t.done.wait()
        ck = None
        try:
            ck = json.loads(t.progress.read_text()).get("checkpoint_uri")
        except (OSError, ValueError):
            pass
        state = self._end_state(t).value if self.stop_says_state else None
        return StopTaskResult(
            req.lease_id, req.epoch, accepted=True, exit_code=t.exit_code, checkpoint_uri=ck, state=state
        )

    async def kill_all(self) -> None:
        for t in self.tasks.values():
            if not t.done.is_set():
                try:
                    os.killpg(t.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for t in self.tasks.values():
            try:
                await asyncio.wait_for(t.done.wait(), 5)
            except TimeoutError:
                pass
