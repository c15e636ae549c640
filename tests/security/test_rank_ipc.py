"""A job's System V IPC is its own (worker_agent.rank_ipc; docs/security.md, "The host"):
its ranks on a node share one IPC namespace, no other job lists or opens its objects (a
segment made 0666 included), and the agent lets the namespace go once the job's last rank on
the node has ended, with every object in it."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shutil
import subprocess
import uuid

import pytest

from tests.agent.conftest import close_node, make_settings, start_task, wait_for
from tests.security.conftest import sections
from worker_agent import rank_ipc, rank_mounts
from worker_agent import statefiles as sf
from worker_agent.node import NodeAgent
from worker_agent.nvml import make_backend


def _own_ipc_here() -> str:
    if os.geteuid() != 0:
        return "the agent must be root to give a job its own IPC namespace"
    if not (shutil.which("ipcmk") and shutil.which("ipcs")):
        return "util-linux's ipcmk and ipcs are not installed"
    rank_mounts.problem.cache_clear()
    return rank_mounts.problem() or ""


pytestmark = pytest.mark.skipif(bool(_own_ipc_here()), reason=_own_ipc_here() or "-")

WAIT_FOR_GO = 'while [ ! -e "$HOME/go" ]; do sleep 0.05; done'


@pytest.fixture
async def node(tmp_path, work_root, request):
    node_id = f"node-ipc-{uuid.uuid4().hex[:6]}"
    settings = make_settings(
        tmp_path, agent_rank_isolation=True, agent_work_dir=work_root, **getattr(request, "param", {})
    )
    n = NodeAgent(settings, node_id, backend=make_backend(settings, node_id, "simulated"))
    await n.start()
    yield n
    await close_node(n)


async def _start(node: NodeAgent, lease: str, job: str, job_rank_id: int, body: str, gpu: int):
    t = dataclasses.replace(
        start_task(node.node_id, lease, ["/bin/sh", "-c", body], gpus=(gpu,)), job_id=job, team="alpha",
        team_rank_id=1, job_rank_id=job_rank_id,
    )  # fmt: skip
    assert (await node.start_task(t)).accepted
    return node.leases[lease]


async def _said(st, header: str) -> dict[str, str]:
    await wait_for(lambda: f"== {header}" in (st.dir / sf.STDOUT).read_text(), timeout=20, what=header)
    return sections((st.dir / sf.STDOUT).read_text())


async def _ended(st) -> dict[str, str]:
    await wait_for(lambda: st.exit is not None and not st.live, timeout=20, what=f"{st.task.lease_id} to end")
    return sections((st.dir / sf.STDOUT).read_text())


def _shmid(made: str) -> int:
    m = re.search(r"Shared memory id: (\d+)", made)
    assert m, made
    return int(m.group(1))


async def test_a_jobs_ranks_share_its_ipc_and_no_other_job_sees_it(node):
    # the job's first rank makes a segment anyone may open, and lives on until told to end
    holder = await _start(
        node, "lease-a1", "job-a", 1_000_001, f'echo "== made"; ipcmk -M 4096 -p 0666; echo "== end"; {WAIT_FOR_GO}',
        gpu=0,
    )  # fmt: skip
    shmid = _shmid((await _said(holder, "end"))["made"])
    probe = (
        f'echo "== list"; ipcs -m | awk \'$2 == {shmid}\' | grep -c 666; echo "== ids"; grep -c job-a'
        f' /proc/self/mountinfo; echo "== end"; {WAIT_FOR_GO}'
    )
    same_job = await _start(node, "lease-a2", "job-a", 1_000_001, probe, gpu=1)
    other_job = await _start(node, "lease-b1", "job-b", 1_000_002, probe, gpu=2)
    assert (await _said(same_job, "end"))["list"].strip() == "1"  # another rank of the job, beside it
    seen = await _said(other_job, "end")
    assert seen["list"].strip() == "0"  # not there for another job
    assert seen["ids"].strip() == "0"  # nor the job's id: the pins, mounts it sees, are not named by it
    listed = (await asyncio.to_thread(subprocess.run, ["ipcs", "-m"], capture_output=True, text=True)).stdout
    assert not any(line.split()[1:2] == [str(shmid)] and "666" in line for line in listed.splitlines()[3:])
    pinned = node.ipc_pin("job-a")
    assert rank_ipc.pinned(str(pinned)) and sf.read_json(holder.dir / sf.SPEC)["ipc"] == str(pinned)
    # the job's last rank here ends without removing its segment: the namespace goes
    for lease in ("lease-a1", "lease-a2"):
        (node.work_dir / lease / "go").touch()
        await _ended(node.leases[lease])
    assert not pinned.exists() and not pinned.with_name(pinned.name + ".lock").exists()
    # the other job's rank, still running, held a copy of every mount: the unpinning reached it
    assert str(pinned) not in open(f"/proc/{other_job.pid}/mountinfo").read()
    (node.work_dir / "lease-b1" / "go").touch()
    await _ended(other_job)
    assert not node.ipc_pin("job-b").exists()


@pytest.mark.parametrize("node", [{"agent_rank_private_ipc": False}], indirect=True)
async def test_without_its_jobs_own_ipc_a_rank_lists_another_jobs_segment(node):
    """The same probe with the setting off: what the setting takes away."""
    made = await _ended(await _start(node, "lease-a1", "job-a", 1_000_001, 'echo "== made"; ipcmk -M 4096 -p 0666',
                                     gpu=0))  # fmt: skip
    shmid = _shmid(made["made"])
    try:
        found = await _ended(
            await _start(
                node, "lease-b1", "job-b", 1_000_002, f"echo '== list'; ipcs -m | awk '$2 == {shmid}' | wc -l", gpu=1
            )
        )
        assert found["list"].strip() == "1", found
        assert sf.read_json(node.leases["lease-b1"].dir / sf.SPEC)["ipc"] is None
    finally:
        await asyncio.to_thread(subprocess.run, ["ipcrm", "-m", str(shmid)])  # on the host: it outlives its job


async def test_a_restarted_agent_lets_go_the_ipc_of_jobs_that_ended_meanwhile(node):
    gone = str(node.ipc_pin("job-gone"))
    claim = rank_ipc.JobIpc(gone).claim()  # a namespace pinned by a rank that has since ended
    sleeper = subprocess.Popen(["sleep", "30"], preexec_fn=claim.enter)
    assert claim.pin(sleeper.pid) is None
    sleeper.kill()
    sleeper.wait()
    st = await _start(node, "lease-live", "job-live", 1_000_003, "sleep 30", gpu=0)
    await wait_for(lambda: st.pid is not None and rank_ipc.pinned(str(node.ipc_pin("job-live"))), timeout=20,
                   what="the live job's namespace")  # fmt: skip
    assert rank_ipc.pinned(gone)
    await node.close()  # the agent goes; the rank lives on
    again = NodeAgent(node.settings, node.node_id, backend=make_backend(node.settings, node.node_id, "simulated"))
    await again.start()
    try:
        assert not os.path.exists(gone)  # no rank of its job here
        assert rank_ipc.pinned(str(again.ipc_pin("job-live")))  # its rank was re-adopted: kept (the same key)
    finally:
        await close_node(again)
