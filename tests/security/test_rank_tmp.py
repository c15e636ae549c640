"""A rank's /tmp and /var/tmp are its own (worker_agent.rank_mounts; docs/security.md, "The
host"): one dir in its work dir, bound over both in its own mount namespace, so another job
can neither see nor plant a file there, and what it writes there counts against its disk
share. The paths it needs under /tmp (here its work dir, its checkpoint dir and the GPU
device dir: the test's work root is under /tmp) stay reachable at the same paths."""

from __future__ import annotations

import dataclasses
import os
import uuid

import pytest

from tests.agent.conftest import close_node, start_task, wait_for
from tests.security.conftest import isolated_node, own_namespaces_problem, sections
from worker_agent import rank_mounts
from worker_agent import statefiles as sf
from worker_agent.node import NodeAgent
from worker_agent.rank_limits import MIB


@pytest.mark.parametrize(
    "path, top, rel",
    [("/tmp/a/b", "/tmp", "a/b"), ("/tmp", "/tmp", None), ("/tmpfoo/a", "/tmp", None), ("/var/tmp/x", "/tmp", None),
     ("/var/tmp/x/", "/var/tmp", "x"), ("/srv/work", "/tmp", None)],
)  # fmt: skip
def test_which_paths_lie_under_a_tmp_dir(path, top, rel):
    assert rank_mounts.under(path, top) == rel


def _own_tmp_here() -> str:
    return own_namespaces_problem("a rank its own /tmp")


async def _run(node: NodeAgent, lease: str, body: str, **task) -> tuple[dict[str, str], object]:
    t = dataclasses.replace(start_task(node.node_id, lease, ["/bin/sh", "-c", body]), team="alpha", team_rank_id=1,
                            job_rank_id=1_000_001, **task)  # fmt: skip
    assert (await node.start_task(t)).accepted
    st = node.leases[lease]
    await wait_for(lambda: st.exit is not None and not st.live, timeout=20, what=f"{lease} to end")
    return sections((st.dir / sf.STDOUT).read_text()), st


@pytest.fixture
def planted():
    """A file another job left in the host's /tmp, readable by all."""
    path = f"/tmp/gpufleet-planted-{uuid.uuid4().hex[:8]}"
    with open(path, "w") as f:
        f.write("planted by another job\n")
    os.chmod(path, 0o644)
    yield path
    os.unlink(path)


@pytest.mark.skipif(bool(_own_tmp_here()), reason=_own_tmp_here() or "-")
async def test_a_rank_writes_and_reads_only_its_own_tmp(tmp_path, work_root, planted, gpu_dev):
    ckpt = work_root / "checkpoints" / "job-1"
    node = await isolated_node(tmp_path, work_root, "node-tmp", agent_gpu_device_dir=gpu_dev)
    mine = f"/tmp/gpufleet-rank-wrote-{uuid.uuid4().hex[:8]}"
    body = (
        f'echo "== planted"; cat {planted} 2>&1\n'
        f'echo "== listing"; ls -a /tmp | grep -c gpufleet-planted\n'
        f'echo "== write"; echo mine > {mine} && echo late > /var/tmp/{os.path.basename(mine)}-var && echo ok\n'
        'echo "== pwd"; pwd\n'
        'echo "== home"; echo kept > "$HOME/kept" && cat "$HOME/kept"\n'
        'echo "== ckpt"; echo saved > "$GPUFLEET_CHECKPOINT_DIR/step-1" && cat "$GPUFLEET_CHECKPOINT_DIR/step-1"\n'
        f'echo "== gpu"; cat {gpu_dev / "nvidia0"} 2>&1; true\n'
    )
    try:
        assert node.private_tmp
        found, st = await _run(node, "lease-tmp", body, checkpoint_dir=str(ckpt))
        assert "No such file" in found["planted"], found
        assert found["listing"].strip() == "0", found
        assert found["write"].strip() == "ok", found
        work = node.work_dir / "lease-tmp"
        assert found["pwd"].strip() == str(work), found  # the same path, bound back in
        assert found["home"].strip() == "kept", found
        assert found["ckpt"].strip() == "saved", found
        assert "No such device or address" in found["gpu"], found  # its own GPU's node, reached
        assert st.exit["exit_code"] == 0, st.exit
        spec = sf.read_json(st.dir / sf.SPEC)
        assert spec["private_tmp"]["dir"] == str(work / "tmp")
        assert set(spec["private_tmp"]["keep"]) == {str(work), str(ckpt), str(gpu_dev)}
    finally:
        await close_node(node)
    assert not os.path.exists(mine)  # the host's /tmp never saw it ...
    assert (work / "tmp" / os.path.basename(mine)).read_text() == "mine\n"  # ... it is in the work dir
    assert (work / "tmp" / f"{os.path.basename(mine)}-var").read_text() == "late\n"  # /var/tmp: the same dir
    assert not os.path.exists(f"/var/tmp/{os.path.basename(mine)}-var")
    assert (ckpt / "step-1").read_text() == "saved\n"


@pytest.mark.skipif(bool(_own_tmp_here()), reason=_own_tmp_here() or "-")
async def test_without_its_own_tmp_a_rank_reads_what_another_job_left_there(tmp_path, work_root, planted):
    """The same probe with the setting off: what the setting takes away."""
    node = await isolated_node(tmp_path, work_root, "node-shared-tmp", agent_rank_private_tmp=False)
    try:
        assert node.private_proc and not node.private_tmp
        found, st = await _run(node, "lease-shared", f'echo "== planted"; cat {planted} 2>&1\n')
        assert "planted by another job" in found["planted"], found
        assert sf.read_json(st.dir / sf.SPEC)["private_tmp"] is None
    finally:
        await close_node(node)


@pytest.mark.skipif(bool(_own_tmp_here()), reason=_own_tmp_here() or "-")
async def test_what_a_rank_writes_to_tmp_counts_against_its_disk_share(tmp_path, work_root):
    # 64 MiB for the node's work dirs, nothing reserved: one GPU of eight may hold 8 MiB
    node = await isolated_node(tmp_path, work_root, "node-tmp-disk", agent_node_disk_gib=0.0625,
                       agent_node_reserved_disk_gib=0, agent_rank_disk_check_s=0.1)  # fmt: skip
    try:
        _, st = await _run(node, "lease-tmp-hog", "head -c 20971520 /dev/zero > /tmp/big; echo wrote; sleep 60")
        assert st.exit["exit_code"] != 0, st.exit
        assert st.exit["disk_exceeded"]["limit_bytes"] == 8 * MIB, st.exit
        assert st.exit["disk_exceeded"]["used_bytes"] > 8 * MIB, st.exit
    finally:
        await close_node(node)
