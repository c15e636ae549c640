"""One agent per node state dir (worker_agent.node_lock): a second agent for the same node
refuses to start and names the holder; the node is free again once the first closes, fails
to start, or is SIGKILLed; no rank or supervisor it started keeps the node held."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent.conftest import close_node, make_settings, pid_alive, script, start_task, wait_for
from worker_agent import statefiles as sf
from worker_agent.agent import AgentProcess
from worker_agent.node import NodeAgent
from worker_agent.node_lock import NodeLock, NodeLockHeld
from worker_agent.nvml import make_backend

ROOT = Path(__file__).resolve().parents[2]
SLEEPER = """
    import time
    while True:
        time.sleep(0.05)
"""

# a stand-in agent process: takes the node's lock, says so, and waits to be killed
HOLDER = """
import sys, time
from pathlib import Path
from worker_agent.node_lock import NodeLock
NodeLock(Path(sys.argv[1])).acquire("n")
print("held", flush=True)
time.sleep(120)
"""


def _node(settings, node_id: str) -> NodeAgent:
    return NodeAgent(settings, node_id, backend=make_backend(settings, node_id, "simulated"))


async def test_a_second_agent_for_the_node_refuses_to_start_until_the_first_closes(tmp_path):
    settings = make_settings(tmp_path)
    first, second = _node(settings, "node-l"), _node(settings, "node-l")
    await first.start()
    try:
        with pytest.raises(NodeLockHeld, match=rf"node node-l: another agent serves .* \(pid {os.getpid()}\)"):
            await second.start()
        assert not second.lock.held
        other = _node(settings, "node-m")  # another node of the same state dir is free
        await other.start()
        await close_node(other)
    finally:
        await close_node(first)
    await second.start()
    await close_node(second)


async def test_an_agent_that_fails_to_start_leaves_the_node_free(tmp_path):
    refusing = make_settings(tmp_path, agent_rank_cgroups=True, agent_cgroup_root=tmp_path / "no-cgroups")
    with pytest.raises(RuntimeError, match="agent_rank_cgroups is on but ranks cannot be fenced"):
        await _node(refusing, "node-x").start()
    n = _node(make_settings(tmp_path), "node-x")
    await n.start()
    await close_node(n)


async def test_an_agent_process_that_cannot_start_one_node_lets_the_others_go(tmp_path):
    """`AgentProcess` hosting two nodes, the second served by another agent: the start fails
    naming it, and the first node, started before, is free again (it was held until the
    process exited), with nothing left listening for logs."""
    settings = make_settings(tmp_path)
    other = NodeLock(sf.node_dir(settings.state_dir, "node-q"))
    other.acquire("node-q")
    agent = AgentProcess(settings, ["node-p", "node-q"], backend="simulated", temporal=False)
    try:
        with pytest.raises(NodeLockHeld, match="node node-q: another agent serves"):
            await agent.start()
    finally:
        other.release()
    again = _node(settings, "node-p")
    await again.start()
    await close_node(again)
    host, port = agent.http_log_addr.rsplit(":", 1)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()


async def test_a_sigkilled_agent_frees_its_node(tmp_path):
    settings = make_settings(tmp_path)
    node_dir = sf.node_dir(settings.state_dir, "node-k")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(node_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        n = _node(settings, "node-k")
        with pytest.raises(NodeLockHeld, match=rf"\(pid {holder.pid}\)"):
            await n.start()
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        await n.start()  # the kernel let the lock go with the process
        await close_node(n)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


async def test_a_rank_that_outlives_its_agent_does_not_hold_the_node(tmp_path):
    """The agent goes, its rank and the rank's supervisor stay: a new agent starts and
    adopts the rank (they hold no copy of the lock's descriptor)."""
    settings = make_settings(tmp_path)
    cmd = script(tmp_path, "sleeper.py", SLEEPER)
    first = _node(settings, "node-r")
    await first.start()
    res = await first.start_task(start_task("node-r", "lease-r", cmd))
    assert res.accepted and pid_alive(res.pid)
    await first.close()  # as its death would: the lock goes, the rank stays
    again = _node(settings, "node-r")
    try:
        await again.start()
        assert again.leases["lease-r"].live and pid_alive(res.pid)
        other = NodeLock(again.dir)
        with pytest.raises(NodeLockHeld):
            other.acquire("node-r")
    finally:
        await close_node(again)
        await wait_for(lambda: not pid_alive(res.pid), what="the rank to be killed")


def test_gpufleet_agent_run_for_a_node_another_agent_serves_exits_2_naming_it(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(tmp_path, 0o755)  # the ranks' user passes through to the work dir
    env = {**os.environ, "GPUFLEET_ENV": "dev", "GPUFLEET_STATE_DIR": str(state), "GPUFLEET_AGENT_RANK_FIREWALL": "off"}
    cmd = [sys.executable, "-m", "cli.main", "agent", "run", "--nodes", "n1", "--backend", "simulated", "--no-temporal",
           "--control", "127.0.0.1:1"]  # fmt: skip
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)
    try:
        assert first.stdout is not None and '"agent": "up"' in first.stdout.readline()
        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"node n1: another agent serves its state dir {state}/agent/n1 (pid {first.pid})" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.send_signal(signal.SIGTERM)
        try:
            first.wait(20)
        except subprocess.TimeoutExpired:
            first.kill()
            first.wait()
