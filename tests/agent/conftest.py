"""Fixtures for the node agent's tests: fast settings, a node, a control server, rank scripts.

Durations are scaled to seconds: heartbeat 0.2 s, agent poll 0.05 s, unconfirmed
kill 3 s (15 min in production), fence grace 1 s.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from common.contracts import StartTask, TaskStatus
from common.settings import Settings
from tests.support import eventually
from worker_agent import statefiles as sf

PY = sys.executable
TRAIN_COUNTER = str(
    Path(__file__).resolve().parents[2] / "worker-agent" / "worker_agent" / "examples" / "train_counter.py"
)

FAST = {
    "heartbeat_interval_s": 0.2,
    "agent_poll_s": 0.05,
    "unconfirmed_kill_s": 3.0,
    "agent_fence_grace_s": 1.0,
    "default_grace_s": 1.0,
    "agent_shared_secret": "test-agent-secret",
    "log_signing_key": "test-log-signing-key",
}


def make_settings(tmp_path: Path, **overrides) -> Settings:
    values = {"state_dir": tmp_path / "state", "control_addresses": ["127.0.0.1:1"], **FAST, **overrides}
    return Settings(**values)


def start_task(node_id: str, lease_id: str, command: list[str], *, epoch: int = 1, gpus=(0,), rank: int = 0,
               world_size: int = 1, attempt: int = 1, checkpoint_dir: str = "", resume_from: str | None = None,
               env: dict | None = None) -> StartTask:  # fmt: skip
    return StartTask(
        lease_id=lease_id, job_id=f"job-{lease_id}", attempt=attempt, epoch=epoch, node_id=node_id, rank=rank,
        world_size=world_size, image="registry/test:1", command=command, gpu_indices=list(gpus),
        master_addr="10.0.0.1", master_port=0, env=env or {}, checkpoint_dir=checkpoint_dir, resume_from=resume_from,
    )  # fmt: skip


def script(tmp_path: Path, name: str, body: str) -> list[str]:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return [PY, str(path)]


def pid_alive(pid: int | None) -> bool:
    return sf.process_start_ticks(pid) is not None if pid else False


async def wait_for(probe, *, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    """``tests.support.eventually`` (sync or async probe) with this suite's finer poll interval."""
    return await eventually(probe, timeout=timeout, interval=interval, what=what)


def kill_group_quietly(pid: int | None) -> None:
    if not pid:
        return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture
def settings(tmp_path) -> Settings:
    return make_settings(tmp_path)


@pytest.fixture
async def node(settings):
    """A NodeAgent on a simulated 8-GPU node; ranks it started are killed at teardown."""
    from worker_agent.node import NodeAgent
    from worker_agent.nvml import make_backend

    n = NodeAgent(settings, "node-t", backend=make_backend(settings, "node-t", "simulated"))
    await n.start()
    yield n
    await close_node(n)


async def close_node(n) -> None:
    """Close a test's NodeAgent and kill what it started: every rank's group and supervisor."""
    await n.close()
    for st in n.leases.values():
        kill_group_quietly(st.pid)
        sup = sf.read_json(st.dir / sf.SUPERVISOR) or {}
        if sup.get("supervisor_pid") and sf.process_alive(sup["supervisor_pid"], sup.get("supervisor_start")):
            os.kill(sup["supervisor_pid"], signal.SIGKILL)
    n.spaces.close()  # its jobs' /dev/shm dirs and IPC namespaces (a root agent's): none lives now


class Control:
    """A HeartbeatServer that confirms every lease it hears about and records what arrives."""

    def __init__(self, settings, **kwargs) -> None:
        from control.heartbeat_server import HeartbeatServer

        self.statuses: list[TaskStatus] = []
        self.heartbeats: list = []
        self.auth_failures: list = []
        self.confirm = True

        def confirmed(node_id):
            e = self.server.table.get(node_id)
            return e.lease_ids if (e is not None and self.confirm) else []

        kwargs.setdefault("confirmed_leases", confirmed)
        kwargs.setdefault("on_task_status", self.statuses.append)
        kwargs.setdefault("on_heartbeat", self.heartbeats.append)
        kwargs.setdefault("on_auth_failure", self.auth_failures.append)
        self.server = HeartbeatServer(settings, host="127.0.0.1", port=0, **kwargs)

    async def start(self) -> str:
        return await self.server.start()

    async def stop(self) -> None:
        await self.server.stop(0.2)

    def states(self, lease_id: str) -> list[str]:
        return [s.state.value for s in self.statuses if s.lease_id == lease_id]


@pytest.fixture
async def control(settings):
    c = Control(settings)
    await c.start()
    yield c
    await c.stop()


@pytest.fixture
async def agent(settings, control):
    """An agent process hosting two simulated nodes, linked to the fake control (no Temporal)."""
    from worker_agent.agent import AgentProcess

    a = AgentProcess(settings, ["node-a", "node-b"], backend="simulated", temporal=False,
                     control_addresses=[control.server.address], listen="127.0.0.1:0")  # fmt: skip
    await a.start()
    yield a
    await a.stop()
    for node in a.nodes.values():
        for st in node.leases.values():
            kill_group_quietly(st.pid)
