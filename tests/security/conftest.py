"""The security tests run on the e2e stack (one control process with its gRPC server, real
agents for every node, the API in-process); the rank tests run /bin/sh ranks on a node agent
as root, in work dirs the ranks' user can reach."""

import os
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.agent.conftest import start_task, wait_for
from tests.e2e.conftest import stack, stack_overrides  # noqa: F401


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
