"""A rank is fenced to its share of the node (docs/security.md, "Fencing a rank to its share"):
under the process runtime with ``agent_rank_cgroups``, the supervisor puts it in its own
cgroups. Real cgroups here (CI runs as root on a host with them): a rank past its memory
share is ended by the kernel and says so in its stderr, a process that leaves the rank's
process group dies with the rank, and nothing is left behind.

The ranks are /bin/sh scripts run as the unprivileged rank user (tests/security/test_rank_isolation.py
says why)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from common.contracts import StopTask
from tests.agent.conftest import close_node, make_settings, start_task, wait_for
from tests.security.conftest import run_sh_rank
from worker_agent import exit_cause, rank_cgroup
from worker_agent import statefiles as sf
from worker_agent.node import NodeAgent
from worker_agent.nvml import make_backend

ROOT = Path("/sys/fs/cgroup")


def _cgroups_here() -> str:
    if os.geteuid() != 0:
        return "the agent must run as root to make cgroups (it does on a GPU node)"
    try:
        rank_cgroup.hierarchy(ROOT)
    except OSError as e:
        return f"no usable cgroups here: {e}"
    return ""


pytestmark = pytest.mark.skipif(bool(_cgroups_here()), reason=_cgroups_here() or "-")

MIB = 1 << 20


@pytest.fixture
def parent(tmp_path):
    """A cgroup parent of this test's own; removed (with anything a failed test left) after it."""
    name = f"gpufleet-test-{os.getpid()}-{tmp_path.name}"
    yield name
    for d in sorted(ROOT.glob(f"**/{name}"), key=lambda p: len(p.parts)):
        for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            sub.rmdir()
        d.rmdir()


@pytest.fixture
async def node(tmp_path, work_root, parent, gpu_dev):
    # a 512 MiB, 8-CPU node with nothing reserved: one GPU of eight is 64 MiB and one CPU
    settings = make_settings(
        tmp_path, agent_rank_isolation=True, agent_work_dir=work_root, agent_rank_cgroups=True,
        agent_cgroup_parent=parent, agent_node_memory_gib=0.5, agent_node_cpus=8,
        agent_node_reserved_memory_gib=0, agent_node_reserved_cpus=0, agent_gpu_device_dir=gpu_dev,
    )  # fmt: skip
    n = NodeAgent(settings, "node-f", backend=make_backend(settings, "node-f", "simulated"))
    await n.start()
    yield n
    await close_node(n)


def rank_dirs(parent: str, lease_id: str) -> list[Path]:
    return [p for p in ROOT.glob(f"**/{parent}/node-f/{lease_id}")]


async def test_a_rank_runs_in_its_own_cgroups_with_its_share(node, parent):
    st = await run_sh_rank(node, "lease-share", 'cat /proc/self/cgroup; echo "$GPUFLEET_CPUS"; id -u', gpus=(0, 1))
    out = (st.dir / sf.STDOUT).read_text()
    assert f"/{parent}/node-f/lease-share" in out  # in its cgroups ...
    assert out.split()[-1] == "65534"  # ... and still its own unprivileged user
    assert out.split()[-2] == "2"  # told its share
    assert st.exit["exit_code"] == 0
    spec = sf.read_json(st.dir / sf.SPEC)
    assert spec["cgroup"]["memory_bytes"] == 128 * MIB and spec["cgroup"]["cpus"] == 2.0  # two GPUs of eight
    assert rank_dirs(parent, "lease-share") == []  # removed when it ended


@pytest.mark.skipif(not rank_cgroup.has_v1_devices(ROOT), reason="no cgroup v1 devices controller here")
async def test_a_rank_cannot_open_another_gpus_device_node(node, parent, gpu_dev):
    """CUDA_VISIBLE_DEVICES is advisory: the devices cgroup is what keeps a rank off the GPUs
    beside its own."""
    assert node.gpu_fence
    body = "".join(
        f'echo "== {n}"; cat "{gpu_dev / n}" 2>&1\n' for n in ("nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl")
    )
    st = await run_sh_rank(node, "lease-gpu", body, gpus=(1,))
    out = (st.dir / sf.STDOUT).read_text()
    opened = {
        n: out.split(f"== {n}\n", 1)[1].split("\n== ", 1)[0]
        for n in ("nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl")
    }
    assert "No such device or address" in opened["nvidia1"], out  # its own GPU: the fence lets it through
    assert "No such device or address" in opened["nvidiactl"], out  # CUDA's control node stays open
    for other in ("nvidia0", "nvidia2", "nvidia3"):
        assert "Operation not permitted" in opened[other], out
    spec = sf.read_json(st.dir / sf.SPEC)
    assert spec["cgroup"]["deny_devices"] == [[195, 0], [195, 2], [195, 3]]
    assert rank_dirs(parent, "lease-gpu") == []  # its devices cgroup too


async def test_a_rank_past_its_memory_share_is_ended_and_says_why(node, parent):
    # `tail` keeps a line without a newline whole: 300 MiB of zeros against a 64 MiB share
    st = await run_sh_rank(node, "lease-oom", "head -c 314572800 /dev/zero | tail >/dev/null; echo survived")
    tail = exit_cause.stderr_tail(st.dir / sf.STDERR)
    assert "out-of-memory killer" in tail and "0.1 GiB" in tail, tail
    assert st.exit.get("oom_kills", 0) >= 1
    assert "survived" not in (st.dir / sf.STDOUT).read_text() or st.exit["oom_kills"] >= 1
    assert rank_dirs(parent, "lease-oom") == []


async def test_a_process_that_leaves_the_group_dies_with_the_rank(node, parent, work_root):
    # the daemon starts its own session, out of reach of a kill to the rank's process group;
    # the rank exits once the daemon is in it
    daemonize = "setsid sh -c 'echo $$ > daemon.pid; exec sleep 300' </dev/null >/dev/null 2>&1 &"
    st = await run_sh_rank(
        node, "lease-daemon", daemonize + " while [ ! -s daemon.pid ]; do sleep 0.05; done; cat daemon.pid"
    )
    daemon = int((st.dir / sf.STDOUT).read_text().split()[0])
    assert st.exit["exit_code"] == 0
    await wait_for(lambda: not sf.process_alive(daemon, None), timeout=5, what="the daemon to die with its rank")
    assert rank_dirs(parent, "lease-daemon") == []


async def test_a_rank_and_supervisor_killed_together_leave_no_daemon_and_no_cgroup(node, parent):
    """With its supervisor gone nobody else empties the rank's cgroups: the agent does, when it
    reports the lease LOST, or a daemon the rank started would hold its GPUs for the next job."""
    daemonize = "setsid sh -c 'echo $$ > daemon.pid; exec sleep 300' </dev/null >/dev/null 2>&1 &"
    res = await node.start_task(start_task("node-f", "lease-lost", ["/bin/sh", "-c", daemonize + " sleep 300"]))
    assert res.accepted
    st = node.leases["lease-lost"]
    pid_file = node.work_dir / "lease-lost" / "daemon.pid"
    await wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), what="the rank's daemon")
    daemon = int(pid_file.read_text())
    os.kill(st.sup_pid, signal.SIGKILL)
    os.kill(res.pid, signal.SIGKILL)
    await wait_for(lambda: st.exit is not None, what="the lease to end")
    assert st.exit["state"] == "LOST"
    await wait_for(lambda: not sf.process_alive(daemon, None), timeout=5, what="the daemon to be killed")
    await wait_for(lambda: rank_dirs(parent, "lease-lost") == [], timeout=10, what="its cgroups to be removed")


async def test_a_stopped_rank_leaves_no_process_and_no_cgroup(node, parent):
    res = await node.start_task(start_task("node-f", "lease-stop", ["/bin/sh", "-c", "sleep 300 & sleep 300"]))
    assert res.accepted
    assert len(rank_dirs(parent, "lease-stop")) >= 1
    procs = rank_cgroup.RankCgroup.from_json(sf.read_json(node.leases["lease-stop"].dir / sf.SUPERVISOR)["cgroup"])
    await wait_for(lambda: len(procs.pids()) >= 3, what="the rank's processes in its cgroup")
    inside = procs.pids()
    stop = await node.stop_task(StopTask("lease-stop", 1, "node-f", grace_seconds=0.5, reason="preempted"))
    assert stop.accepted
    assert not [p for p in inside if sf.process_alive(p, None)]
    assert rank_dirs(parent, "lease-stop") == []


async def test_an_adopting_supervisor_keeps_the_fence_and_cleans_it_up(node, parent):
    res = await node.start_task(start_task("node-f", "lease-adopt", ["/bin/sh", "-c", "sleep 300"]))
    st = node.leases["lease-adopt"]
    os.kill(st.sup_pid, signal.SIGKILL)  # the supervisor dies; its rank and cgroups live on
    await wait_for(lambda: (sf.read_json(st.dir / sf.SUPERVISOR) or {}).get("adopted"), what="an adopting supervisor")
    assert (sf.read_json(st.dir / sf.SUPERVISOR) or {}).get("cgroup")
    assert len(rank_dirs(parent, "lease-adopt")) >= 1 and sf.process_alive(res.pid, None)
    stop = await node.stop_task(StopTask("lease-adopt", 1, "node-f", grace_seconds=0.5, reason="done"))
    assert stop.accepted and not sf.process_alive(res.pid, None)
    assert rank_dirs(parent, "lease-adopt") == []
