"""The security tests run on the e2e stack (one control process with its gRPC server, real
agents for every node, the API in-process); the rank tests run /bin/sh ranks on a node agent
as root, in work dirs the ranks' user can reach."""

import dataclasses
import os
import stat
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.agent.conftest import close_node, make_settings, start_task, wait_for
from tests.e2e.conftest import stack, stack_overrides  # noqa: F401
from worker_agent import rank_mounts
from worker_agent import statefiles as sf
from worker_agent.node import Lease, NodeAgent
from worker_agent.nvml import make_backend


@pytest.fixture
def work_root():
    """Ranks' work dirs outside pytest's tmp (private to root), reachable by the rank's user."""
    root = Path(tempfile.mkdtemp(prefix="gpufleet-work-"))
    root.chmod(0o711)
    yield root
    subprocess.run(["rm", "-rf", str(root)], check=False)


GPU_NODES = ("nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl")


@pytest.fixture
def gpu_dev(work_root) -> Path:
    """Device nodes for a node's first four GPUs (NVIDIA's major, 195) and its control node
    (minor 255), mode 0666, where the rank's user can reach them. With no driver behind them,
    opening one that a fence lets through fails with ENXIO; one it denies, otherwise."""
    dev = work_root / "dev"
    dev.mkdir(mode=0o755)
    for name in GPU_NODES:
        minor = 255 if name == "nvidiactl" else int(name.removeprefix("nvidia"))
        os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(195, minor))
        os.chmod(dev / name, 0o666)
    return dev


async def run_sh_rank(node, lease_id: str, body: str, **kw):
    """Start ``/bin/sh -c body`` as a rank of ``node`` and wait for it to end; its lease."""
    res = await node.start_task(start_task(node.node_id, lease_id, ["/bin/sh", "-c", body], **kw))
    assert res.accepted, res
    st = node.leases[lease_id]
    await wait_for(lambda: st.exit is not None and not st.live, timeout=20, what=f"{lease_id} to exit")
    return st


def sections(out: str) -> dict[str, str]:
    """A probe's output, ``== name`` headers each followed by what its command printed."""
    return {part.split("\n", 1)[0]: part.split("\n", 1)[1] for part in out.split("== ")[1:]}


def own_namespaces_problem(what: str) -> str:
    """Why a rank cannot get its own namespaces here (/proc, /tmp, its job's /dev/shm and IPC:
    worker_agent.rank_mounts), for a test of them to skip with; "" where it can."""
    if os.geteuid() != 0:
        return f"the agent must be root to give {what}"
    rank_mounts.problem.cache_clear()
    return rank_mounts.problem() or ""


async def isolated_node(tmp_path, work_root, node_id: str, **overrides) -> NodeAgent:
    """A started node agent whose ranks run as their job's own user, in work dirs under ``work_root``."""
    settings = make_settings(tmp_path, agent_rank_isolation=True, agent_work_dir=work_root, **overrides)
    n = NodeAgent(settings, node_id, backend=make_backend(settings, node_id, "simulated"))
    await n.start()
    return n


@pytest.fixture
async def job_node(tmp_path, work_root, request):
    """``isolated_node`` with a fresh id, and a test's settings as its indirect parameter."""
    n = await isolated_node(tmp_path, work_root, f"node-{uuid.uuid4().hex[:6]}", **getattr(request, "param", {}))
    yield n
    await close_node(n)


async def start_job_rank(node: NodeAgent, lease: str, job: str, job_rank_id: int, body: str, gpu: int) -> Lease:
    """Start ``/bin/sh -c body`` as a rank of job ``job`` (numbered ``job_rank_id``, team alpha); its lease."""
    t = dataclasses.replace(
        start_task(node.node_id, lease, ["/bin/sh", "-c", body], gpus=(gpu,)), job_id=job, team="alpha",
        team_rank_id=1, job_rank_id=job_rank_id,
    )  # fmt: skip
    assert (await node.start_task(t)).accepted
    return node.leases[lease]


async def ended(st: Lease) -> dict[str, str]:
    """Wait for the rank to end; its output's sections."""
    await wait_for(lambda: st.exit is not None and not st.live, timeout=20, what=f"{st.task.lease_id} to end")
    return sections((st.dir / sf.STDOUT).read_text())
