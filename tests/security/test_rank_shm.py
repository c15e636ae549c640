"""A rank's /dev/shm is its job's own (worker_agent.rank_mounts; docs/security.md, "The
host"): the job's ranks on a node share it (NCCL's shared-memory transport joins them there),
no other job lists or opens it, and the agent deletes it once the job's last rank on the node
has ended, so what a killed rank never unlinked gives its memory back."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from tests.agent.conftest import close_node, wait_for
from tests.security.conftest import ended, own_namespaces_problem, start_job_rank
from worker_agent import rank_mounts
from worker_agent import statefiles as sf
from worker_agent.node import NodeAgent
from worker_agent.nvml import make_backend
from worker_agent.rank_limits import filesystem_bytes


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
    probe = (
        f'echo "== read"; cat /dev/shm/{seg} 2>&1; echo "== list"; ls -A /dev/shm | grep -c . ; echo "== ids";'
        " grep -c job-a /proc/self/mountinfo; true"
    )
    same_job = await ended(await start_job_rank(job_node, "lease-a2", "job-a", 1_000_001, probe, gpu=1))
    other_job = await ended(await start_job_rank(job_node, "lease-b1", "job-b", 1_000_002, probe, gpu=2))
    assert same_job["read"].strip() == "ours", same_job  # another rank of the job, beside it
    assert "No such file" in other_job["read"], other_job
    assert other_job["list"].strip() == "0", other_job  # not even its name
    assert other_job["ids"].strip() == "0", other_job  # nor the job's id: its mount is not named by it
    assert not os.path.exists(f"/dev/shm/{seg}")  # the host's /dev/shm never saw it ...
    spec = sf.read_json(holder.dir / sf.SPEC)
    job_a = Path(spec["shm"])
    assert job_a.parent == job_node.spaces.shm_dir and os.path.ismount(job_a)
    assert (job_a / seg).read_text() == "ours\n"  # ... it is in the job's own tmpfs
    assert os.stat(job_a).st_mode & 0o777 == 0o700 and os.stat(job_a).st_uid == spec["user"][0]
    assert [d.name for d in job_node.spaces.shm_dir.iterdir()] == [job_a.name]  # job-b's last rank here ended
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
    stale_mount = Path(job_node.spaces.job_shm("job-gone-mounted", (65534, 65534), 1 << 20))
    assert os.path.ismount(stale_mount)  # its agent was killed before its rank's end let it go
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
        assert not stale_mount.exists() and str(stale_mount) not in Path("/proc/mounts").read_text()
        assert Path(sf.read_json(st.dir / sf.SPEC)["shm"]).is_dir()  # its rank was re-adopted: kept
        assert again.leases["lease-live"].live and again.leases["lease-live"].pid == st.pid
    finally:
        await close_node(again)


# 0.5 GiB of node memory, none kept back: a rank's share is 64 MiB a GPU of the node's 8
SHARE_64_MIB = {"agent_node_memory_gib": 0.5, "agent_node_reserved_memory_gib": 0}
MIB = 1 << 20


def _fill(mib: int) -> str:
    return f"if dd if=/dev/zero of=/dev/shm/blob-$$ bs=1M count={mib} 2>/dev/null; then echo wrote; else echo full; fi"


def _size_kib() -> str:
    return "df -k /dev/shm | tail -1 | awk '{print $2}'"


@pytest.mark.parametrize("job_node", [SHARE_64_MIB], indirect=True)
async def test_a_job_fills_its_own_shm_not_the_one_the_nodes_jobs_share(job_node):
    """Before, a job's /dev/shm dir lay on the host's tmpfs: a 1-GPU rank wrote 80 MiB past
    its 64 MiB memory share, and could have written half the host's memory, which nothing
    swaps or reclaims, leaving the other jobs on the node no shared memory. Now it is a tmpfs
    of the job's own, of its share: the write fails there, and another job's ranks on the
    node still have theirs."""
    hog = await start_job_rank(
        job_node, "lease-a1", "job-a", 1_000_001,
        f'echo "== size"; {_size_kib()}; echo "== fill"; {_fill(80)}; echo "== done";'
        ' while [ ! -e "$HOME/go" ]; do sleep 0.05; done', gpu=0,
    )  # fmt: skip
    await wait_for(lambda: "== done" in (hog.dir / sf.STDOUT).read_text(), timeout=20, what="the hog's write")
    other = await ended(
        await start_job_rank(
            job_node,
            "lease-b1",
            "job-b",
            1_000_002,
            f'echo "== size"; {_size_kib()}; echo "== fill"; {_fill(48)}',
            gpu=1,
        )
    )
    (job_node.work_dir / "lease-a1" / "go").touch()
    out = await ended(hog)
    assert out["size"].strip() == str(64 * 1024) and out["fill"].strip() == "full", out
    assert other["size"].strip() == str(64 * 1024) and other["fill"].strip() == "wrote", other


@pytest.mark.parametrize("job_node", [SHARE_64_MIB], indirect=True)
async def test_a_jobs_shm_grows_with_its_ranks_on_the_node_and_goes_with_the_last(job_node):
    first = await start_job_rank(
        job_node, "lease-c1", "job-c", 1_000_001, 'while [ ! -e "$HOME/go" ]; do sleep 0.05; done', gpu=0
    )
    await wait_for(lambda: first.pid is not None, timeout=20, what="the first rank")
    shm = Path(sf.read_json(first.dir / sf.SPEC)["shm"])
    assert os.path.ismount(shm) and filesystem_bytes(shm) == 64 * MIB
    second = await ended(
        await start_job_rank(job_node, "lease-c2", "job-c", 1_000_001, f'echo "== size"; {_size_kib()}', gpu=1)
    )
    assert second["size"].strip() == str(128 * 1024), second  # both ranks' shares: they share it
    assert filesystem_bytes(shm) == 128 * MIB  # the second's end leaves it: the first still runs
    (job_node.work_dir / "lease-c1" / "go").touch()
    await ended(first)
    assert not shm.exists() and str(shm) not in Path("/proc/mounts").read_text()


def test_a_jobs_shm_dir_from_before_its_own_tmpfs_stays_its_dir(tmp_path):
    """A rank started by an agent before this one (or with no size) uses a dir named by its
    job's id: the job's next rank here gets that dir, not a new tmpfs apart from it, and the
    dir stays while the job has a live rank."""
    from worker_agent.job_spaces import JobSpaces

    spaces = JobSpaces(tmp_path, f"node-{uuid.uuid4().hex[:6]}")
    user = (65534, 65534)
    try:
        before = Path(spaces.job_shm("job-old", user))
        (before / "seg").write_text("kept")
        assert spaces.job_shm("job-old", user, 64 * MIB) == str(before) and not os.path.ismount(before)
        new = Path(spaces.job_shm("job-new", user, 64 * MIB))
        assert os.path.ismount(new) and new.name != "job-new" and os.stat(new).st_uid == user[0]
        spaces.release({"job-old", "job-new"})
        assert (before / "seg").read_text() == "kept" and os.path.ismount(new)
        spaces.release({"job-new"})
        assert not before.exists() and os.path.ismount(new)
    finally:
        spaces.close()
    assert not spaces.shm_dir.exists() and str(new) not in Path("/proc/mounts").read_text()
