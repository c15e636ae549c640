"""Unit tests: wire conversions and credentials, runtimes' command lines, NVML backends, job helper, bench."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import types
from datetime import UTC, datetime

import pytest

from common.contracts import StopTask, TaskState, TaskStatus
from proto import agent_pb2 as pb
from proto.auth import check_credential, node_credential
from proto.convert import heartbeat_report_from_pb, task_status_from_pb, task_status_to_pb
from tests.agent.conftest import make_settings, start_task
from worker_agent.jobhelper import Job
from worker_agent.nvml import NvmlBackend, NvmlUnavailable, SimulatedBackend, make_backend, write_fault
from worker_agent.runtime import ContainerRuntime, ProcessRuntime, master_port_for, rank_env

# ------------------------------------------------------------------ wire


def test_task_status_round_trips_through_the_wire():
    for state in TaskState:
        s = TaskStatus("n1", "l1", "j1", 2, 9, 3, state, datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
                       exit_code=143 if state != TaskState.STARTED else None,
                       checkpoint_uri="file:///c/step-00000010", step=10, boot_id="b", seq=77)  # fmt: skip
        assert task_status_from_pb(task_status_to_pb(s)) == s
    bare = TaskStatus("n1", "l1", "j1", 1, 1, 0, TaskState.LOST, datetime.now(UTC))
    back = task_status_from_pb(task_status_to_pb(bare))
    assert back.exit_code is None and back.checkpoint_uri is None and back.step is None


def test_heartbeat_report_keeps_unsupported_fields_unset():
    hb = pb.Heartbeat(node_id="n", boot_id="b", seq=3, sent_at=1.5)
    hb.gpus.add(index=0, health=pb.GPU_HEALTH_FAILED, sm_util=0.0, xids=[79], faults=["xid:79"])
    hb.running.add(lease_id="l", job_id="j", epoch=2, step=-1, pid=0)
    r = heartbeat_report_from_pb(hb)
    g = r.gpus[0]
    assert (g.health, g.sm_util, g.mem_used, g.temperature_c, g.xids) == ("failed", 0.0, None, None, (79,))
    assert r.running[0].step is None and r.running[0].pid is None and r.running[0].checkpoint_uri is None


def test_node_credentials(tmp_path):
    s = make_settings(tmp_path, agent_credentials={"prov": "provisioned-cred"})
    assert node_credential(s, "prov") == "provisioned-cred"
    a, b = node_credential(s, "n1"), node_credential(s, "n2")
    assert a and b and a != b and len(a) == 64
    assert check_credential(a, a) and not check_credential(a, b) and not check_credential(None, None)
    assert node_credential(make_settings(tmp_path, agent_shared_secret=""), "n1") is None


# --------------------------------------------------------------- runtimes


def test_rank_env_and_per_lease_master_port():
    t = start_task("n", "lease-1", ["python", "x.py"], gpus=(3,), env={"MASTER_PORT": "1", "GPUFLEET_X": "y", "A": "b"})
    host = {"PATH": "/bin", "HOME": "/h", "GPUFLEET_AGENT_SHARED_SECRET": "s", "AWS_SECRET_ACCESS_KEY": "k",
            "NCCL_DEBUG": "INFO", "NCCL_AUTH_TOKEN": "nope", "RANDOM": "1"}  # fmt: skip
    env = rank_env(t, progress_file="/p/progress.json", host_env=host)
    assert env["MASTER_PORT"] == str(master_port_for(t)) and env["A"] == "b" and "GPUFLEET_X" not in env
    assert env["PATH"] == "/bin" and env["NCCL_DEBUG"] == "INFO"
    assert not {"GPUFLEET_AGENT_SHARED_SECRET", "AWS_SECRET_ACCESS_KEY", "NCCL_AUTH_TOKEN", "RANDOM"} & set(env)
    other = start_task("n", "lease-2", ["x"])
    assert master_port_for(t) != master_port_for(other)
    assert master_port_for(dataclasses.replace(t, master_port=29999)) == 29999
    assert "GPUFLEET_RESUME_FROM" not in env


def test_process_runtime_runs_the_command_as_is():
    t = start_task("n", "l", ["/usr/bin/python3", "-u", "train.py", "--lr", "0.1"])
    launch = ProcessRuntime().launch(t, progress_file="/s/rank/progress.json", host_env={})
    assert launch.argv == ["/usr/bin/python3", "-u", "train.py", "--lr", "0.1"] and launch.kill_argv == []


def test_docker_command_line():
    t = start_task("n", "lease-7", ["python", "train.py"], gpus=(2, 5), checkpoint_dir="file:///ckpt/job-1",
                   resume_from="file:///ckpt/job-1/step-00000100", env={"LR": "0.1"})  # fmt: skip
    launch = ContainerRuntime("docker").launch(t, progress_file="/state/leases/lease-7/rank/progress.json",
                                               host_env={"PATH": "/usr/bin", "HOME": "/root", "SECRET_TOKEN": "x"})  # fmt: skip
    argv = launch.argv
    assert argv[:6] == ["docker", "run", "--rm", "--init", "--name", "gpufleet-lease-7"]
    assert argv[argv.index("--gpus") + 1] == '"device=2,5"'
    assert argv[-3:] == ["registry/test:1", "python", "train.py"]
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a == "-v"]
    assert mounts == ["/state/leases/lease-7/rank:/state/leases/lease-7/rank", "/ckpt/job-1:/ckpt/job-1"]
    env_names = [argv[i + 1] for i, a in enumerate(argv) if a == "-e"]
    assert {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LR", "GPUFLEET_JOB_ID"} <= set(env_names)
    assert all("=" not in n for n in env_names)  # values ride in the engine CLI's environment, not argv
    assert "PATH" not in env_names and "SECRET_TOKEN" not in launch.env
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "0,1"  # inside the container the GPUs are renumbered
    assert launch.env["LR"] == "0.1" and launch.env["PATH"] == "/usr/bin"
    assert launch.kill_argv == ["docker", "kill", "--signal", "KILL", "gpufleet-lease-7"]
    assert ["--network", "host"] == argv[argv.index("--network") : argv.index("--network") + 2]


def test_podman_command_line_uses_cdi_devices():
    t = start_task("n", "lease-8", ["serve"], gpus=(0, 7))
    argv = ContainerRuntime("podman").launch(t, progress_file="/s/rank/progress.json", host_env={}).argv
    assert argv[0] == "podman" and "--gpus" not in argv
    devices = [argv[i + 1] for i, a in enumerate(argv) if a == "--device"]
    assert devices == ["nvidia.com/gpu=0", "nvidia.com/gpu=7"]
    with pytest.raises(ValueError):
        ContainerRuntime("podman").launch(dataclasses.replace(t, image=""), progress_file="/p", host_env={})


# ------------------------------------------------------------------- NVML


class FakeNVML(types.SimpleNamespace):
    """Enough of pynvml to drive NvmlBackend: GPU 1 supports little, GPU 2 is lost."""

    def __init__(self, real):
        super().__init__()
        for name in dir(real):
            if name.startswith(("NVML_", "NVMLError", "nvmlEventType", "nvmlClocks")):
                setattr(self, name, getattr(real, name))
        self.real = real
        self.xid_events = []

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 3

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def _ns(self, h, ok=(0,)):
        if h == 2:
            raise self.real.NVMLError(self.real.NVML_ERROR_GPU_IS_LOST)
        if h not in ok:
            raise self.real.NVMLError(self.real.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}"

    def nvmlDeviceGetUtilizationRates(self, h):
        self._ns(h, (0, 1))
        return types.SimpleNamespace(gpu=97, memory=40)

    def nvmlDeviceGetMemoryInfo(self, h):
        self._ns(h, (0, 1))
        return types.SimpleNamespace(used=10, total=100)

    def nvmlDeviceGetMinorNumber(self, h):
        self._ns(h, ok=(0, 1))
        return {0: 3, 1: 0}[h]  # /dev/nvidiaN need not follow NVML's (PCI) order

    def nvmlDeviceGetTemperature(self, h, sensor):
        self._ns(h)
        return 71

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        self._ns(h)
        return 2 if kind == self.real.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 5

    def nvmlDeviceGetRemappedRows(self, h):
        self._ns(h)
        return (0, 0, 1, 0)

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        self._ns(h)
        return 0x40

    def nvmlDeviceGetNvLinkState(self, h, link):
        if h == 0 and link < 2:
            return 1 if not getattr(self, "link_down", False) or link == 0 else 0
        raise self.real.NVMLError(self.real.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlEventSetCreate(self):
        raise self.real.NVMLError(self.real.NVML_ERROR_NOT_SUPPORTED)


def test_real_backend_treats_unsupported_fields_as_unset_and_classifies_faults():
    import pynvml

    fake = FakeNVML(pynvml)
    b = NvmlBackend([48, 79], nvml=fake)
    s0, s1, s2 = b.sample()
    # GPU 0: everything supported: DBE -> failed; thermal throttle and pending remap -> listed too
    assert (s0.sm_util, s0.mem_used, s0.temperature_c, s0.ecc_dbe, s0.ecc_sbe) == (97.0, 10, 71.0, 2, 5)
    assert s0.health == "failed" and "ecc:dbe=2" in s0.faults
    assert "throttle:hw-thermal" in s0.faults and "row-remap:pending" in s0.faults
    # GPU 1: only utilization and memory: the rest is None, not an error
    assert (s1.sm_util, s1.mem_used, s1.temperature_c, s1.ecc_dbe) == (97.0, 10, None, None)
    assert s1.health == "ok" and s1.faults == []
    # GPU 2: lost
    assert s2.health == "failed" and any(f.startswith("gpu-lost") for f in s2.faults)
    # each GPU's device node, by NVML's minor number, not its index (a lost GPU's is unknown)
    assert [b.device_minor(i) for i in range(4)] == [3, 0, None, None]
    # an NVLink that was up at start and is down now
    fake.link_down = True
    assert "nvlink:1:down" in b.sample()[0].faults
    # Xids from the event thread
    b._xids[1].append(79)
    b._xids[1].append(31)
    s1 = b.sample()[1]
    assert s1.health == "failed" and s1.faults[:2] == ["xid:79", "xid:31"]
    b.close()


def test_real_backend_without_nvml_raises_a_clear_error(tmp_path):
    import pynvml

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVML")
    except pynvml.NVMLError:
        pass
    with pytest.raises(NvmlUnavailable, match=r"NVML is not usable on this host.*simulated"):
        make_backend(make_settings(tmp_path), "n", "real")
    with pytest.raises(ValueError):
        make_backend(make_settings(tmp_path), "n", "fake")


def test_simulated_backend_faults(tmp_path):
    s = make_settings(tmp_path)
    b = make_backend(s, "sim-1", "simulated")
    assert isinstance(b, SimulatedBackend) and b.gpu_count() == 8
    # a rank (pid 4242) that spends 0.9 CPU seconds per second, on a clock the test moves
    clock = {"t": 0.0}
    b._clock = lambda: clock["t"]
    b._cpu_reader = lambda pid: (1, 0.9 * clock["t"]) if pid == 4242 else None
    b.set_ranks({0: [4242]})
    b.sample()  # the baseline
    clock["t"] = 2.0
    base = b.sample()
    assert base[0].sm_util > 80 and base[1].sm_util == 0 and all(g.health == "ok" for g in base)
    write_fault(s.state_dir, "sim-1", gpu=0, hang=True)
    write_fault(s.state_dir, "sim-1", gpu=1, ecc="sbe")
    assert b.poll_faults() and not b.poll_faults()
    g = b.sample()
    assert g[0].sm_util == 0 and b.hung_gpus() == {0} and g[1].ecc_sbe == 1 and g[1].health == "ok"
    write_fault(s.state_dir, "sim-1", gpu=0, clear=True)
    assert b.sample()[0].sm_util > 80 and b.hung_gpus() == set()
    with pytest.raises(ValueError):
        b.inject(9, xid=79)
    # faults written before the agent started apply when it starts
    write_fault(s.state_dir, "sim-2", gpu=3, xid=48)
    assert make_backend(s, "sim-2", "simulated").sample()[3].health == "failed"


# ---------------------------------------------------------------- job helper


def test_job_helper_checkpoints_resume_and_latest(tmp_path):
    progress = tmp_path / "progress.json"
    env = {"GPUFLEET_CHECKPOINT_DIR": f"file://{tmp_path}/ck", "GPUFLEET_PROGRESS_FILE": str(progress), "RANK": "1"}
    job = Job(env=env, handle_sigterm=False, checkpoint_every_steps=10)
    assert job.resume() is None and job.latest_checkpoint() is None
    assert job.maybe_checkpoint(5, {"v": 5}) is None
    uri10 = job.maybe_checkpoint(10, {"v": 10})
    uri20 = job.checkpoint(20, {"v": 20})
    job.wait_for_checkpoints(timeout=10)
    assert uri10 == f"file://{tmp_path}/ck/step-00000010"
    assert (tmp_path / "ck" / "step-00000020" / "rank-1" / "COMPLETE").exists()
    p = json.loads(progress.read_text())
    assert (p["checkpoint_uri"], p["checkpoint_step"]) == (uri20, 20)
    assert job.latest_checkpoint() == uri20
    fresh = Job(env={**env, "GPUFLEET_RESUME_FROM": uri10}, handle_sigterm=False)
    assert fresh.resume() == (10, {"v": 10})
    try:
        import fsspec  # noqa: F401
    except ImportError:  # object stores need fsspec: a clear error, not a silent local write
        with pytest.raises(RuntimeError, match="fsspec"):
            Job(env={**env, "GPUFLEET_CHECKPOINT_DIR": "s3://bucket/x"}, handle_sigterm=False).checkpoint(
                1, {}, sync=True
            )


@pytest.mark.parametrize("ending", ["returns", "checkpoints and returns", "exits for preemption"])
def test_job_helper_removes_the_staging_dir_it_made(tmp_path, ending):
    """A rank's local checkpoint staging dir goes with the rank: ranks that run as the agent's
    user share the host's /tmp, where every rank of a CI run used to leave one."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    body = {
        "returns": "job = Job(env=env, handle_sigterm=False)",
        "checkpoints and returns": "job = Job(env=env, handle_sigterm=False); job.checkpoint(1, {'v': 1}, sync=True)",
        "exits for preemption": "job = Job(env=env, handle_sigterm=False); job.exit_for_preemption(2, {'v': 2})",
    }[ending]
    code = (
        f"from worker_agent.jobhelper import Job\nenv = {{'GPUFLEET_CHECKPOINT_DIR': 'file://{tmp_path}/ck'}}\n{body}\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmp)}, capture_output=True,
                       text=True, timeout=60, check=False)  # fmt: skip
    assert r.returncode in (0, 143), r.stderr
    assert list(tmp.iterdir()) == []
    if ending != "returns":
        assert list((tmp_path / "ck").glob("step-*/rank-0/COMPLETE"))
    kept = Job(env={}, handle_sigterm=False, local_dir=str(tmp))  # given, not made: left to its owner
    kept._remove_local_dir()
    assert tmp.is_dir()


def test_job_helper_sigterm_sets_the_flag():
    job = Job(env={}, handle_sigterm=True)
    try:
        signal.raise_signal(signal.SIGTERM)
        assert job.stop_requested
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


# ------------------------------------------------------------ shared queue


async def test_shared_queue_routes_by_node_id(tmp_path):
    from worker_agent.node import FleetActivities, NodeAgent

    s = make_settings(tmp_path)
    nodes = {n: NodeAgent(s, n, backend=make_backend(s, n, "simulated")) for n in ("a", "b")}
    fleet = FleetActivities(nodes)
    r = await fleet.start_task(start_task("zzz", "l1", ["true"]))
    assert not r.accepted and "not hosted" in r.reason
    r = await fleet.stop_task(StopTask("l1", 1, "b", 0.1, "x"))
    assert r.accepted and "nothing to stop" in r.reason
    assert [a.__name__ for a in fleet.activities()] == ["start_task", "stop_task"]


# ------------------------------------------------------------------- bench


def test_bench_heartbeat_small():
    from bench.heartbeat import run

    r = run(nodes=60, seconds=1.0, rates=[60, 120], generators=1, ramp_s=1.0)
    assert r["steps"][0]["kept_up"] and r["sustained_per_s"] > 100 and r["p99_ms"] is not None
    assert {"sustained_per_s", "p99_ms", "server_cpu_pct", "steps"} <= set(r)
    assert r["generator_errors"] == 0
