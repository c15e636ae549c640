"""GPU use as the agent reads and exposes it (issue 21, "Operators see the cluster").

* the simulated backend derives a GPU's use from the CPU time its rank processes really
  spend: a sleeping rank reads idle, a computing one (or one whose child computes) busy;
* the real backend reads power and SM activity (GPM) from NVML, None where unsupported;
* heartbeats carry each lease's mean GPU use; ``GET /metrics`` on an agent process serves
  the families of ``worker_agent.metrics.METRIC_NAMES`` per node and GPU.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import types
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.agent.conftest import PY, TRAIN_COUNTER, Control, kill_group_quietly, script, start_task, wait_for
from tests.agent.test_units import FakeNVML
from worker_agent.metrics import METRIC_NAMES
from worker_agent.nvml import NvmlBackend, SimulatedBackend

ROOT = Path(__file__).resolve().parents[2]
SLEEP = "import time\nwhile True:\n    time.sleep(0.05)\n"
SPIN = "while True:\n    pass\n"
# the rank is a launcher (as torchrun is) whose child does the work
LAUNCHER = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'while True:\\n    pass\\n'])\n"


def _spawn(code: str) -> subprocess.Popen:
    return subprocess.Popen([PY, "-c", code], start_new_session=True)


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield lambda code: started.append(_spawn(code)) or started[-1]
    for p in started:
        kill_group_quietly(p.pid)
        p.wait()


# ------------------------------------------------------------- simulated backend


async def test_a_sleeping_rank_reads_idle_and_a_computing_one_busy(procs):
    sleeper, spinner = procs(SLEEP), procs(SPIN)
    b = SimulatedBackend(4, node_id="m")
    b.set_ranks({0: [sleeper.pid], 1: [spinner.pid]})

    def measured():
        g = b.sample()
        return g[0].sm_util < 5 and g[1].sm_util > 50 and g

    g = await wait_for(measured, timeout=30, interval=0.2, what="the ranks' use measured")
    assert g[2].sm_util == 0 and g[3].sm_util == 0  # no rank: idle
    # memory, temperature and power follow the use
    assert g[1].power_w > g[0].power_w and g[1].temperature_c > g[0].temperature_c and g[1].mem_used > g[0].mem_used
    assert g[0].mem_total == g[1].mem_total and g[1].sm_active is not None
    # faults still apply on top: a hung GPU reads idle, a slow one less
    b.inject(1, slow=0.5)
    slow = b.sample()[1]
    assert slow.health == "degraded" and slow.sm_util <= 50
    b.inject(1, hang=True)
    assert b.sample()[1].sm_util == 0 and b.hung_gpus() == {1}
    # a rank gone from the GPU: idle again, and its process is no longer read
    b.inject(1, clear=True)
    b.set_ranks({0: [sleeper.pid]})
    assert b.sample()[1].sm_util == 0 and set(b._cpu) == {sleeper.pid}


async def test_a_ranks_children_count_as_its_use(procs):
    launcher = procs(LAUNCHER)
    b = SimulatedBackend(2, node_id="m")
    b.set_ranks({0: [launcher.pid], 1: [launcher.pid]})  # one rank on two GPUs drives both

    def busy():
        g = b.sample()
        return g[0].sm_util > 50 and g[1].sm_util > 50 and g

    await wait_for(busy, timeout=30, interval=0.2, what="the child's use on the rank's GPUs")


def test_a_vanished_rank_reads_idle():
    p = subprocess.Popen([PY, "-c", "pass"])
    p.wait()
    b = SimulatedBackend(1, node_id="m")
    b.set_ranks({0: [p.pid]})
    assert [g.sm_util for g in (b.sample()[0], b.sample()[0])] == [0.0, 0.0]


# ------------------------------------------------------------------ real backend


class GpmNVML(FakeNVML):
    """FakeNVML plus power and GPM: GPU 0 has both, GPU 1 neither (GPU 2 is lost)."""

    def __init__(self, real):
        super().__init__(real)
        self.sm_busy_s = 0.0  # GPU 0's SM-busy time, as the GPM counters would advance it
        self.clock_s = 0.0
        self.live_samples: set[int] = set()
        self._next = 0

    def nvmlDeviceGetPowerUsage(self, h):
        self._ns(h)
        return 412_500  # mW

    def nvmlGpmQueryDeviceSupport(self, h):
        self._ns(h, (0, 1))
        return types.SimpleNamespace(isSupportedDevice=int(h == 0))

    def nvmlGpmSampleAlloc(self):
        self._next += 1
        self.live_samples.add(self._next)
        return types.SimpleNamespace(id=self._next, at=None)

    def nvmlGpmSampleGet(self, h, sample):
        self._ns(h)
        sample.at = (self.clock_s, self.sm_busy_s)
        return sample

    def nvmlGpmSampleFree(self, sample):
        self.live_samples.remove(sample.id)

    def c_nvmlGpmMetricsGet_t(self):
        return types.SimpleNamespace(metrics=[types.SimpleNamespace(metricId=0, nvmlReturn=-1, value=0.0)])

    def nvmlGpmMetricsGet(self, req):
        (t1, b1), (t2, b2) = req.sample1.at, req.sample2.at
        assert req.metrics[0].metricId == self.real.NVML_GPM_METRIC_SM_UTIL and req.numMetrics == 1
        req.metrics[0].value = 100.0 * (b2 - b1) / (t2 - t1)
        req.metrics[0].nvmlReturn = self.real.NVML_SUCCESS
        return req


def test_real_backend_reads_power_and_sm_activity_where_the_gpu_has_them():
    import pynvml

    fake = GpmNVML(pynvml)
    b = NvmlBackend([79], nvml=fake)
    s0, s1, s2 = b.sample()
    assert s0.power_w == 412.5 and s0.sm_active is None  # GPM needs two samples: none yet
    assert (s1.power_w, s1.sm_active) == (None, None) and s1.health == "ok" and s1.faults == []
    assert s2.health == "failed" and s2.power_w is None and s2.sm_active is None
    fake.clock_s, fake.sm_busy_s = 2.0, 1.5
    s0 = b.sample()[0]
    assert s0.sm_active == 75.0 and not [f for f in s0.faults if f.startswith("nvml:")]
    assert len(fake.live_samples) == 1  # only the latest sample is kept for the next interval
    b.close()
    assert fake.live_samples == set()


def test_real_backend_counts_xids_beyond_the_history():
    import pynvml

    b = NvmlBackend([79], nvml=FakeNVML(pynvml))
    for _ in range(20):
        b._xids[1].append(31)
        b._xid_counts[1] += 1  # as the event thread does
    s1 = b.sample()[1]
    assert len(s1.xids) == 16 and s1.xid_count == 20
    b.close()


# ------------------------------------------------- heartbeats and /metrics (in process)


def _families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(fams: dict, family: str, sample: str, **labels) -> float:
    got = [s.value for s in fams[family].samples if s.name == sample and labels.items() <= s.labels.items()]
    assert len(got) == 1, (sample, labels, got)
    return got[0]


async def test_heartbeats_carry_each_leases_gpu_use_and_metrics_show_it(agent, tmp_path):
    node = agent.nodes["node-a"]
    train = [PY, TRAIN_COUNTER, "--steps", "100000", "--step-time", "0.005", "--compute-time", "0.1"]
    await node.start_task(start_task("node-a", "lease-train", train, gpus=(2, 3)))
    await node.start_task(start_task("node-a", "lease-idle", script(tmp_path, "idle.py", SLEEP), gpus=(5,)))

    async def measured():
        hb = await node.heartbeat()
        use = {r.lease_id: r.gpu_util for r in hb.running if r.HasField("gpu_util")}
        return use.get("lease-train", 0) > 50 and use.get("lease-idle", 100) < 5 and use

    use = await wait_for(measured, timeout=30, interval=0.2, what="the leases' GPU use in a heartbeat")
    assert set(use) == {"lease-train", "lease-idle"}

    async with httpx.AsyncClient() as client:
        r = await client.get(f"http://{agent.http_log_addr}/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert (await client.post(f"http://{agent.http_log_addr}/metrics")).status_code == 405
    fams = _families(r.text)
    assert _value(fams, "gpufleet_gpu_utilization_percent", "gpufleet_gpu_utilization_percent",
                  node="node-a", gpu="2") > 50  # fmt: skip
    assert _value(fams, "gpufleet_gpu_utilization_percent", "gpufleet_gpu_utilization_percent",
                  node="node-a", gpu="5") < 5  # fmt: skip
    allocated = {(s.labels["node"], s.labels["gpu"]) for s in fams["gpufleet_gpu_allocated"].samples if s.value == 1}
    assert allocated == {("node-a", "2"), ("node-a", "3"), ("node-a", "5")}
    assert _value(fams, "gpufleet_agent_running_ranks", "gpufleet_agent_running_ranks") == 2
    assert _value(fams, "gpufleet_agent_nodes", "gpufleet_agent_nodes") == 2
    assert "job-lease" not in r.text and "lease-train" not in r.text  # no job ids on an unauthenticated endpoint


# ------------------------------------------------------- /metrics of an agent process


async def test_metrics_endpoint_of_an_agent_process(settings, tmp_path):
    control = Control(settings)
    await control.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")} | {
        "GPUFLEET_ENV": "dev",
        "GPUFLEET_AGENT_RANK_ISOLATION": "false",  # no ranks here; and the test's tmp dir is private
        "GPUFLEET_STATE_DIR": str(settings.state_dir),
        "GPUFLEET_AGENT_SHARED_SECRET": settings.agent_shared_secret,
        "GPUFLEET_HEARTBEAT_INTERVAL_S": str(settings.heartbeat_interval_s),
        "GPUFLEET_AGENT_POLL_S": str(settings.agent_poll_s),
        "GPUFLEET_AGENT_NVML_BACKEND": "simulated",
        "PYTHONUNBUFFERED": "1",
    }
    argv = [PY, "-m", "cli.agent_cmd", "run", "--nodes", "node-x,node-y", "--no-temporal",
            "--control", control.server.address, "--listen", "127.0.0.1:0"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=open(tmp_path / "agent.log", "ab"),
                            start_new_session=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        up = json.loads(await asyncio.to_thread(proc.stdout.readline) or "{}")
        assert up.get("agent") == "up", (tmp_path / "agent.log").read_text()[-2000:]
        async with httpx.AsyncClient() as client:

            async def scraped():
                r = await client.get(f"http://{up['http_log_addr']}/metrics")
                fams = _families(r.text)
                gpus = {(s.labels["node"], s.labels["gpu"]) for s in fams["gpufleet_gpu_info"].samples}
                return r.status_code == 200 and len(gpus) == 16 and fams

            fams = await wait_for(scraped, timeout=30, interval=0.1, what="both nodes' GPUs on /metrics")
        exposed = {s.name for f in fams.values() for s in f.samples}
        assert exposed == set(METRIC_NAMES)
        for f in fams.values():
            for s in f.samples:
                want = {"node", "gpu"} if s.name.startswith("gpufleet_gpu_") else set()
                want |= {"gpufleet_gpu_info": {"gpu_uuid"}, "gpufleet_gpu_ecc_errors_total": {"kind"},
                         "gpufleet_gpu_health": {"state"}}.get(s.name, set())  # fmt: skip
                assert set(s.labels) == want, s
        assert _value(
            fams, "gpufleet_gpu_info", "gpufleet_gpu_info", node="node-y", gpu="7", gpu_uuid="GPU-sim-node-y-7"
        )
        states = {s.labels["state"]: s.value for s in fams["gpufleet_gpu_health"].samples
                  if s.labels["node"] == "node-x" and s.labels["gpu"] == "0"}  # fmt: skip
        assert states == {"ok": 1.0, "degraded": 0.0, "failed": 0.0, "unknown": 0.0}
        # the parser names a counter family without _total (its samples keep it)
        kinds = {s.labels["kind"] for s in fams["gpufleet_gpu_ecc_errors"].samples}
        assert kinds == {"corrected", "uncorrected"}
        assert _value(fams, "gpufleet_agent_nodes", "gpufleet_agent_nodes") == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            kill_group_quietly(proc.pid)
            proc.wait()
        await control.stop()


def test_a_short_rank_is_measured_within_its_life():
    """The first CPU mark is taken when the rank is placed on its GPUs, not at the next sample:
    a burn-in of a second is seen busy while it runs."""
    clock = {"t": 0.0}
    b = SimulatedBackend(1, node_id="m", clock=lambda: clock["t"], cpu_reader=lambda pid: (7, 0.95 * clock["t"]))
    b.set_ranks({0: [321]})
    clock["t"] = 0.2
    assert b.sample()[0].sm_util == 0  # less than a window yet
    clock["t"] = 0.6
    assert b.sample()[0].sm_util == 95.0
