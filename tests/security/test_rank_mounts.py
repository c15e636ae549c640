"""A rank sees only its own user's processes (worker_agent.rank_mounts; docs/security.md,
"The host"): it starts in its own mount namespace with a procfs mounted hidepid=2, as root
on a kernel that keeps procfs options per mount (this one, in CI). The host's /proc is left
as it was."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess

import pytest

from tests.agent.conftest import close_node, start_task, wait_for
from tests.security.conftest import isolated_node, own_namespaces_problem, sections
from worker_agent import rank_mounts
from worker_agent import statefiles as sf
from worker_agent.node import NodeAgent
from worker_agent.proc_visibility import this_host_hides_pids


@pytest.mark.parametrize(
    "release, ok",
    [("6.18.44-fc-v1300", True), ("5.8.0", True), ("5.15.0-91-generic", True), ("5.4.0-150-generic", False),
     ("4.18.0-513.el8.x86_64", False), ("10.0", True), ("garbage", False)],
)  # fmt: skip
def test_which_kernels_keep_procfs_options_per_mount(release, ok):
    assert rank_mounts.kernel_release_ok(release) is ok


def _private_proc_here() -> str:
    return own_namespaces_problem("a rank its own /proc")


async def _probe_beside(node: NodeAgent, beside_pid: int) -> dict[str, str]:
    """What a rank (another job's user) finds of a process beside it, of pid 1 and of itself."""
    probes = {
        "beside": f"cat /proc/{beside_pid}/cmdline",
        "init": "cat /proc/1/cmdline",
        "self": "cat /proc/self/status | head -1",
        "count": "ls /proc | grep -c '^[0-9]'",
    }
    body = "".join(f'echo "== {name}"; {cmd} 2>&1\n' for name, cmd in probes.items())
    task = dataclasses.replace(
        start_task(node.node_id, "lease-probe", ["/bin/sh", "-c", body]), team="alpha", team_rank_id=1,
        job_rank_id=1_000_001,
    )  # fmt: skip
    assert (await node.start_task(task)).accepted
    st = node.leases["lease-probe"]
    await wait_for(lambda: st.exit is not None and not st.live, timeout=20, what="the probe to end")
    out = (st.dir / sf.STDOUT).read_text()
    return sections(out)


@pytest.fixture
def beside():
    """A process of the host's beside the rank."""
    proc = subprocess.Popen(["sleep", "61"])
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.skipif(bool(_private_proc_here()), reason=_private_proc_here() or "-")
async def test_a_rank_sees_only_its_own_processes(tmp_path, work_root, beside):
    host_before = this_host_hides_pids()
    node = await isolated_node(tmp_path, work_root, "node-proc")
    try:
        assert node.private_proc
        found = await _probe_beside(node, beside.pid)
        assert "No such file" in found["beside"], found
        assert "No such file" in found["init"], found
        assert found["self"].startswith("Name:"), found  # its own, still there
        assert int(found["count"].strip()) <= 5, found  # sh, cat/ls/grep of its own: no one else's
        spec = sf.read_json(node.leases["lease-probe"].dir / sf.SPEC)
        assert spec["private_proc"] is True
    finally:
        await close_node(node)
    assert this_host_hides_pids() == host_before  # the host's /proc is as it was
    assert os.path.exists(f"/proc/{beside.pid}")


@pytest.mark.skipif(os.geteuid() != 0, reason="ranks run as another user only under a root agent")
async def test_without_its_own_proc_a_rank_reads_the_command_lines_beside_it(tmp_path, work_root, beside):
    """The same probe with the setting off: what the setting takes away."""
    node = await isolated_node(tmp_path, work_root, "node-open", agent_rank_private_proc=False)
    try:
        assert not node.private_proc
        found = await _probe_beside(node, beside.pid)
        assert "sleep" in found["beside"] and "61" in found["beside"], found
        assert int(found["count"].strip()) > 5, found
    finally:
        await close_node(node)


@pytest.mark.skipif(bool(_private_proc_here()), reason=_private_proc_here() or "-")
async def test_without_cgroups_a_rank_finds_the_gpus_beside_its_own_masked(tmp_path, work_root, gpu_dev):
    """No cgroup fence (agent_rank_cgroups off): the rank's own mount namespace masks every
    GPU node but its own, so opening one is refused; its own and nvidiactl reach the driver
    (ENXIO here: no driver behind the nodes made for the test). The host's nodes are as
    they were."""
    dev = gpu_dev
    node = await isolated_node(tmp_path, work_root, "node-mask", agent_gpu_device_dir=dev)
    try:
        assert node.private_proc and not node.gpu_fence
        names = ["nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl"]
        body = "".join(f'echo "== {n}"; cat "{dev / n}" 2>&1\n' for n in names)
        task = dataclasses.replace(start_task(node.node_id, "lease-mask", ["/bin/sh", "-c", body], gpus=(1,)), team="a")
        assert (await node.start_task(task)).accepted
        st = node.leases["lease-mask"]
        await wait_for(lambda: st.exit is not None and not st.live, timeout=20, what="the rank to end")
        opened = sections((st.dir / sf.STDOUT).read_text())
        assert "No such device or address" in opened["nvidia1"], opened  # its own GPU
        assert "No such device or address" in opened["nvidiactl"], opened
        for other in ("nvidia0", "nvidia2", "nvidia3"):
            assert "Permission denied" in opened[other], opened
        assert sf.read_json(st.dir / sf.SPEC)["masked_gpus"] == [
            str(dev / n) for n in ("nvidia0", "nvidia2", "nvidia3")
        ]
    finally:
        await close_node(node)
    for name in names:  # the host's nodes are untouched: still character devices
        assert stat.S_ISCHR(os.stat(dev / name).st_mode), name
