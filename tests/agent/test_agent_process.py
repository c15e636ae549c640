"""The agent as a real process (``python -m cli.agent_cmd run``) driven through Temporal.

* killed with SIGKILL and restarted, it re-adopts its running rank (same pid, one launch);
* with the Temporal server stopped, the rank keeps running and its workflow is still
  RUNNING, same attempt, once the server is back. The outage is scaled: 3 minutes in
  the issue, ``GPUFLEET_TEST_TEMPORAL_OUTAGE_S`` (default 6 s) here — much longer than
  the heartbeat (0.2 s) and the agent's reconnect backoff, shorter than the
  unconfirmed-lease kill (which would not fire anyway: the control link keeps
  confirming the lease while Temporal is down).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import uuid
from pathlib import Path

import pytest
from temporalio.client import Client

from common.contracts import TaskState
from common.embedded import any_free_port
from common.temporal import DATA_CONVERTER, make_worker
from tests.agent.conftest import (
    PY,
    Control,
    kill_group_quietly,
    make_settings,
    pid_alive,
    script,
    start_task,
    wait_for,
)  # fmt: skip
from tests.agent.rank_workflow import RankJob, RankOutcome, RankWorkflow
from tests.support import eventually, holds

ROOT = Path(__file__).resolve().parents[2]
OUTAGE_S = float(os.environ.get("GPUFLEET_TEST_TEMPORAL_OUTAGE_S", "6"))
SLEEPER = """
    import os, sys, time
    open(sys.argv[1], "a").write(f"{os.getpid()}\\n")
    while True:
        time.sleep(0.05)
"""


class AgentProc:
    """`python -m cli.agent_cmd run --nodes ...` with scaled settings in its environment."""

    def __init__(self, settings, temporal_address: str, nodes: list[str], log: Path) -> None:
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")} | {
            "GPUFLEET_ENV": "dev",
            "GPUFLEET_AGENT_RANK_ISOLATION": "false",  # the ranks run this venv's interpreter
            "GPUFLEET_STATE_DIR": str(settings.state_dir),
            "GPUFLEET_TEMPORAL_ADDRESS": temporal_address,
            "GPUFLEET_CONTROL_ADDRESSES": json.dumps(settings.control_addresses),
            "GPUFLEET_AGENT_TASK_QUEUE_PREFIX": settings.agent_task_queue_prefix,
            "GPUFLEET_HEARTBEAT_INTERVAL_S": str(settings.heartbeat_interval_s),
            "GPUFLEET_AGENT_POLL_S": str(settings.agent_poll_s),
            "GPUFLEET_UNCONFIRMED_KILL_S": str(settings.unconfirmed_kill_s),
            "GPUFLEET_AGENT_FENCE_GRACE_S": str(settings.agent_fence_grace_s),
            "GPUFLEET_AGENT_SHARED_SECRET": settings.agent_shared_secret,
            "GPUFLEET_AGENT_NVML_BACKEND": "simulated",
            "PYTHONUNBUFFERED": "1",
        }
        self.nodes = nodes
        self.log = log
        self.proc: subprocess.Popen | None = None

    async def start(self) -> None:
        out = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [PY, "-m", "cli.agent_cmd", "run", "--nodes", ",".join(self.nodes), "--log-level", "INFO"],
            cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        out.close()
        await wait_for(lambda: b'"agent": "up"' in self.log.read_bytes() or self.proc.poll() is not None,
                       timeout=30, what="agent up")  # fmt: skip
        assert self.proc.poll() is None, self.log.read_text()[-3000:]

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


async def _run_worker_forever(client: Client, task_queue: str) -> None:
    """The test's workflow worker, rebuilt if an outage ends it."""
    while True:
        try:
            await make_worker(client, task_queue, workflows=[RankWorkflow]).run()
        except asyncio.CancelledError:
            raise
        except Exception:
            await asyncio.sleep(0.5)  # a restart backoff, not a wait: the loop runs until cancelled


async def _query(handle):
    try:
        return await handle.query(RankWorkflow.status)
    except Exception:
        return None


@pytest.fixture
def names():
    u = uuid.uuid4().hex[:8]
    return {"prefix": f"agent-test-{u}-", "wf_queue": f"rank-wf-{u}", "wf": f"rank-{u}"}


async def test_agent_killed_and_restarted_readopts_its_rank(temporal_env, tmp_path, names):
    target = temporal_env.client.service_client.config.target_host
    c = Control(make_settings(tmp_path))
    await c.start()
    settings = make_settings(tmp_path, agent_task_queue_prefix=names["prefix"], control_addresses=[c.server.address])
    client = temporal_env.client
    worker = asyncio.create_task(_run_worker_forever(client, names["wf_queue"]))
    launches = tmp_path / "launches.txt"
    task = start_task("node-p", "lease-p", [*script(tmp_path, "sleeper.py", SLEEPER), str(launches)], epoch=3)
    queue = settings.node_task_queue("node-p")
    a = AgentProc(settings, target, ["node-p"], tmp_path / "agent-a.log")
    b = AgentProc(settings, target, ["node-p"], tmp_path / "agent-b.log")
    pid = None
    try:
        await a.start()
        h = await client.start_workflow(
            RankWorkflow.run, RankJob(task, queue), id=names["wf"], task_queue=names["wf_queue"]
        )
        st = await wait_for(lambda: _query_running(h), timeout=30, what="rank RUNNING")
        pid = st["pid"]
        await wait_for(lambda: c.server.table.get("node-p") and c.server.table.get("node-p").lease_ids == ["lease-p"],
                       what="lease in heartbeats")  # fmt: skip

        a.kill9()  # the agent dies; its rank does not
        await holds(lambda: pid_alive(pid), for_s=0.5, what="the rank alive with its agent dead")
        await b.start()

        # the restarted agent reports the rank in its heartbeats, same pid
        def readopted():
            e = c.server.table.get("node-p")
            return e is not None and e.report().running and e.report().running[0].pid == pid and e.message.seq

        seq = await wait_for(readopted, timeout=15, what="re-adopted rank in a heartbeat")
        # a redelivered StartTask (e.g. the workflow's retry) does not start a second process
        dup: RankOutcome = await client.execute_workflow(
            RankWorkflow.run, RankJob(task, queue, wait_for_stop=False), id=names["wf"] + "-dup",
            task_queue=names["wf_queue"],
        )  # fmt: skip
        assert dup.start.accepted and dup.start.already_running and dup.start.pid == pid
        # and it is stopped by the new agent, through the original workflow
        await h.signal(RankWorkflow.stop)
        out: RankOutcome = await asyncio.wait_for(h.result(), 30)
        assert out.stop.accepted and out.stop.reason.startswith("STOPPED")
        assert not pid_alive(pid)
        assert launches.read_text().split() == [str(pid)]
        await wait_for(lambda: "STOPPED" in c.states("lease-p"), what="STOPPED report")
        await wait_for(lambda: c.server.table.get("node-p").message.seq > seq, what="heartbeats go on")
        assert b.terminate() == 0
    finally:
        worker.cancel()
        a.terminate()
        b.terminate()
        kill_group_quietly(pid)
        await c.stop()


async def _query_running(h):
    st = await _query(h)
    return st if st and st["state"] == "RUNNING" else None


async def test_rank_survives_a_temporal_outage_and_is_still_running_after(tmp_path, names):
    from common.embedded import EmbeddedTemporal

    port = any_free_port()
    server = EmbeddedTemporal(tmp_path / "temporal" / "t.db", port=port, ui=False, log_file=tmp_path / "temporal.log")
    server.start()
    address = f"127.0.0.1:{port}"
    c = Control(make_settings(tmp_path))
    await c.start()
    settings = make_settings(tmp_path, agent_task_queue_prefix=names["prefix"], control_addresses=[c.server.address])
    client = await _connect_retrying(address)
    worker = asyncio.create_task(_run_worker_forever(client, names["wf_queue"]))
    launches = tmp_path / "launches.txt"
    task = start_task("node-o", "lease-o", [*script(tmp_path, "sleeper.py", SLEEPER), str(launches)], attempt=1)
    agent = AgentProc(settings, address, ["node-o"], tmp_path / "agent.log")
    pid = None
    try:
        await agent.start()
        h = await client.start_workflow(RankWorkflow.run, RankJob(task, settings.node_task_queue("node-o")),
                                        id=names["wf"], task_queue=names["wf_queue"])  # fmt: skip
        st = await wait_for(lambda: _query_running(h), timeout=30, what="rank RUNNING")
        pid = st["pid"]

        server.stop()  # Temporal is down (scaled: OUTAGE_S stands for 3 minutes)
        seq0 = c.server.table.get("node-o").seq
        await holds(lambda: pid_alive(pid), for_s=OUTAGE_S, interval=0.25,
                    what="the rank running while Temporal is down")  # fmt: skip
        # the agent stayed in touch with control the whole time, and the lease stayed confirmed
        e = c.server.table.get("node-o")
        assert e.seq > seq0 and e.age() < 1.0 and e.lease_ids == ["lease-o"]
        assert e.report().running[0].unconfirmed_s < 1.0

        server.start()  # back, same database
        st = await wait_for(lambda: _query(h), timeout=60, interval=0.25, what="workflow query after the outage")
        assert st == {"state": "RUNNING", "attempt": 1, "pid": pid}
        assert pid_alive(pid)
        # the agent's worker is back too: the stop goes through it
        await h.signal(RankWorkflow.stop)
        out: RankOutcome = await asyncio.wait_for(h.result(), 60)
        assert out.stop.accepted and out.stop.exit_code is not None and not pid_alive(pid)
        assert launches.read_text().split() == [str(pid)]
        await wait_for(lambda: c.states("lease-o")[-1:] == ["STOPPED"], what="STOPPED report")
        assert TaskState.STARTED.value in c.states("lease-o")
    finally:
        worker.cancel()
        agent.terminate()
        kill_group_quietly(pid)
        await c.stop()
        server.stop()


async def _connect_retrying(address: str) -> Client:
    errors: list[Exception] = []

    async def connect() -> Client | None:
        try:
            return await Client.connect(address, data_converter=DATA_CONVERTER)
        except Exception as e:
            errors.append(e)
            return None

    try:
        return await eventually(connect, timeout=30, interval=0.2, what=f"Temporal at {address}")
    except AssertionError as e:
        raise e from (errors[-1] if errors else None)


def test_cli_inject_fault_and_ps(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")} | {
        "GPUFLEET_STATE_DIR": str(tmp_path),
        "GPUFLEET_ENV": "dev",
    }
    out = subprocess.run(
        [PY, "-m", "cli.agent_cmd", "inject-fault", "--node", "node-003", "--gpu", "2", "--xid", "79"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["fault"] == {"gpu": 2, "xid": 79}
    line = (tmp_path / "agent" / "node-003" / "faults.jsonl").read_text()
    assert json.loads(line) == {"gpu": 2, "xid": 79}
    bad = subprocess.run([PY, "-m", "cli.agent_cmd", "inject-fault", "--node", "node-003"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode != 0
    ps = subprocess.run([PY, "-m", "cli.agent_cmd", "ps", "--node", "node-003"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=60)  # fmt: skip
    assert ps.returncode == 0 and ps.stdout == ""


def test_real_backend_without_nvml_is_a_clear_error(tmp_path):
    import pynvml

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML")
    except pynvml.NVMLError:
        pass
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")} | {
        "GPUFLEET_STATE_DIR": str(tmp_path),
        "GPUFLEET_ENV": "dev",
        "GPUFLEET_AGENT_NVML_BACKEND": "real",
        "LD_LIBRARY_PATH": "/nonexistent",
    }
    out = subprocess.run([PY, "-m", "cli.agent_cmd", "run", "--nodes", "gpu-node", "--no-temporal"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2
    assert "NVML is not usable on this host" in out.stderr and "GPUFLEET_AGENT_NVML_BACKEND=simulated" in out.stderr
    assert "Traceback" not in out.stderr
