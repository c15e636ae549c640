"""A rank's /dev/shm is its job's own (worker_agent.rank_mounts; docs/security.md, "The
host"): the job's ranks on a node share it (NCCL's shared-memory transport joins them there),
no other job lists or opens it, and the agent deletes it once the job's last rank on the node
has ended, so what a killed rank never unlinked gives its memory back."""

from __future__ import annotations

import os
import uuid

import pytest

from tests.agent.conftest import close_node, wait_for
from tests.security.conftest import ended, own_namespaces_problem, start_job_rank
from worker_agent import rank_mounts
from worker_agent import statefiles as sf
from worker_agent.node import NodeAgent
from worker_agent.nvml import make_backend


def _own_shm_here() -> str:
    if not os.path.isdir(rank_mounts.SHM_DIR):
        return "no /dev/shm here"
    return own_namespaces_problem("a rank its job's own /dev/shm")


pytestmark = pytest.mark.skipif(bool(_own_shm_here()), reason=_own_shm_here() or "-")


async def test_a_jobs_ranks_share_its_shm_and_no_other_job_sees_it(job_node):
    seg = f"seg-{uuid.uuid4().hex[:8]}"
    # the job's first rank leaves a segment and lives on until told to end (a file in its work dir)
    holder = await start_job_rank(
        job_node, "lease-a1", "job-a", 1_000_001,
        f'echo ours > /dev/shm/{seg}; echo "== made"; while [ ! -e "$HOME/go" ]; do sleep 0.05; done', gpu=0,
    )  # fmt: skip
    await wait_for(lambda: "== made" in (holder.dir / sf.STDOUT).read_text(), timeout=20, what="the segment")
    probe = f'echo "== read"; cat /dev/shm/{seg} 2>&1; echo "== list"; ls -A /dev/shm | grep -c . ; true'
    same_job = await ended(await start_job_rank(job_node, "lease-a2", "job-a", 1_000_001, probe, gpu=1))
    other_job = await ended(await start_job_rank(job_node, "lease-b1", "job-b", 1_000_002, probe, gpu=2))
    assert same_job["read"].strip() == "ours", same_job  # another rank of the job, beside it
    assert "No such file" in other_job["read"], other_job
    assert other_job["list"].strip() == "0", other_job  # not even its name
    assert not os.path.exists(f"/dev/shm/{seg}")  # the host's /dev/shm never saw it ...
    job_a = job_node.spaces.shm_dir / "job-a"
    assert (job_a / seg).read_text() == "ours\n"  # ... it is in the job's own dir
    spec = sf.read_json(holder.dir / sf.SPEC)
    assert spec["shm"] == str(job_a)
    assert os.stat(job_a).st_mode & 0o777 == 0o700 and os.stat(job_a).st_uid == spec["user"][0]
    assert not (job_node.spaces.shm_dir / "job-b").exists()  # its last rank here ended: its dir went with it
    # the job's last rank here ends without unlinking its segment: the agent deletes the dir
    (job_node.work_dir / "lease-a1" / "go").touch()
    await ended(holder)
    assert not job_a.exists()


@pytest.mark.parametrize("job_node", [{"agent_rank_private_shm": False}], indirect=True)
async def test_without_its_jobs_own_shm_a_rank_lists_another_jobs_segments(job_node):
    """The same probe with the setting off: what the setting takes away."""
    seg = f"gpufleet-test-seg-{uuid.uuid4().hex[:8]}"
    try:
        made = await ended(
            await start_job_rank(job_node, "lease-a1", "job-a", 1_000_001, f"echo ours > /dev/shm/{seg}", gpu=0)
        )
        found = await ended(
            await start_job_rank(
                job_node, "lease-b1", "job-b", 1_000_002, f'echo "== list"; ls /dev/shm | grep -c {seg}', gpu=1
            )
        )
        assert made == {} and found["list"].strip() == "1", found
        assert sf.read_json(job_node.leases["lease-b1"].dir / sf.SPEC)["shm"] is None
    finally:
        if os.path.exists(f"/dev/shm/{seg}"):
            os.unlink(f"/dev/shm/{seg}")


async def test_a_restarted_agent_deletes_the_shm_of_jobs_that_ended_meanwhile(job_node):
    stale = job_node.spaces.shm_dir / "job-gone"
    stale.mkdir(parents=True)
    (stale / "leaked").write_bytes(b"x" * 4096)
    st = await start_job_rank(job_node, "lease-live", "job-live", 1_000_003, "sleep 30", gpu=0)
    await wait_for(lambda: st.pid is not None, timeout=20, what="the rank to start")
    assert stale.exists()
    await job_node.close()  # the agent goes; the rank lives on
    again = NodeAgent(
        job_node.settings, job_node.node_id, backend=make_backend(job_node.settings, job_node.node_id, "simulated")
    )
    await again.start()
    try:
        assert not stale.exists()  # no rank of its job here
        assert (again.spaces.shm_dir / "job-live").is_dir()  # its rank was re-adopted: kept
        assert again.leases["lease-live"].live and again.leases["lease-live"].pid == st.pid
    finally:
        await close_node(again)
