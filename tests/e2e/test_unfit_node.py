"""A node whose disk is full takes no new work (worker_agent.node_fitness, the health table's
`unfit` event), on the embedded stack with real ranks and a real full filesystem: a tmpfs
mounted over one node's work dir and filled to the last byte.

Such a node still heartbeats healthy GPUs, so before this the leader placed job after job on
it, each refused ("cannot prepare the rank's dirs: No space left on device") and re-queued
at the front of its class, often onto the same empty node again."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.e2e.conftest import PY
from tests.support import eventually, fill_disk

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mount") is None, reason="mounting a small tmpfs needs root"
)


FULL = "b0-n0"  # the first node the stack seeds
# a rank that writes 64 KiB to its working dir, as most jobs write something there
WRITES_WORK = [PY, "-c", "open('out', 'wb').write(bytes(65536))"]


@pytest.fixture
def stack_overrides(tmp_path):
    """A 1 MiB tmpfs as the first node's work dir, mounted before its agent starts (as a disk
    is there before the agent: every process sees it, the ranks' supervisors included)."""
    work = tmp_path / "state" / "work" / FULL
    work.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0711", "tmpfs", str(work)], check=True)
    try:
        yield {"_nodes": 2, "agent_node_fitness_check_s": 0.5, "agent_min_free_disk_bytes": 256 * 1024}
    finally:
        subprocess.run(["umount", "-l", str(work)], check=False)


async def test_a_node_whose_disk_is_full_is_cordoned_and_its_jobs_run_elsewhere(stack):
    full, other = stack.nodes[0], stack.nodes[1]
    assert full == FULL
    work = stack.agent.nodes[full].work_dir
    assert os.path.ismount(work)
    fill_disk(work / "filler")
    row = await eventually(
        lambda: stack.pool.fetchrow("SELECT state, reason FROM nodes WHERE node_id = $1 AND state <> 'ready'", full),
        timeout=20, what=f"{full} out of service",
    )  # fmt: skip
    assert row["state"] == "cordoned" and row["reason"].startswith("unfit: disk"), dict(row)
    assert "free, below" in row["reason"], row["reason"]
    audit = await stack.pool.fetchval(
        "SELECT count(*) FROM audit WHERE subject = $1 AND action = 'node_state' AND reason LIKE 'unfit:%'", full
    )
    assert audit == 1
    # whole-node jobs that write to their working dir, one after another: each runs on the
    # other node, at its first attempt
    for _ in range(3):
        job = await stack.submit(gpus_per_replica=8, command=WRITES_WORK)
        row = await stack.wait_state(job, "SUCCEEDED", timeout=60)
        assert row["attempt"] == 1
        nodes = await stack.pool.fetch("SELECT DISTINCT node_id FROM leases WHERE job_id = $1", job)
        assert [r["node_id"] for r in nodes] == [other]
    # the disk freed: the node comes back through burn-in
    (work / "filler").unlink()
    await eventually(
        lambda: stack.pool.fetchval("SELECT state FROM nodes WHERE node_id = $1 AND state <> 'cordoned'", full),
        timeout=20, what=f"{full} past cordoned",
    )  # fmt: skip
