"""A job's System V IPC is its own (worker_agent.rank_ipc; docs/security.md, "The host"):
its ranks on a node share one IPC namespace, no other job lists or opens its objects (a
segment made 0666 included), and the agent lets the namespace go once the job's last rank on
the node has ended, with every object in it."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli.up import release_job_spaces
from tests.agent.conftest import close_node, wait_for
from tests.security.conftest import ended, own_namespaces_problem, sections, start_job_rank
from worker_agent import rank_ipc
from worker_agent import statefiles as sf
from worker_agent.job_spaces import JobSpaces
from worker_agent.node import NodeAgent
from worker_agent.node_lock import NodeLock
from worker_agent.nvml import make_backend


def _own_ipc_here() -> str:
    if not (shutil.which("ipcmk") and shutil.which("ipcs")):
        return "util-linux's ipcmk and ipcs are not installed"
    return own_namespaces_problem("a job its own IPC namespace")


pytestmark = pytest.mark.skipif(bool(_own_ipc_here()), reason=_own_ipc_here() or "-")

ROOT = Path(__file__).resolve().parents[2]
WAIT_FOR_GO = 'while [ ! -e "$HOME/go" ]; do sleep 0.05; done'


async def _said(st, header: str) -> dict[str, str]:
    await wait_for(lambda: f"== {header}" in (st.dir / sf.STDOUT).read_text(), timeout=20, what=header)
    return sections((st.dir / sf.STDOUT).read_text())


def _shmid(made: str) -> int:
    m = re.search(r"Shared memory id: (\d+)", made)
    assert m, made
    return int(m.group(1))


async def test_a_jobs_ranks_share_its_ipc_and_no_other_job_sees_it(job_node):
    # the job's first rank makes a segment anyone may open, and lives on until told to end
    holder = await start_job_rank(
        job_node, "lease-a1", "job-a", 1_000_001, f'echo "== made"; ipcmk -M 4096 -p 0666; echo "== end"; {WAIT_FOR_GO}',
        gpu=0,
    )  # fmt: skip
    shmid = _shmid((await _said(holder, "end"))["made"])
    probe = (
        f'echo "== list"; ipcs -m | awk \'$2 == {shmid}\' | grep -c 666; echo "== ids"; grep -c job-a'
        f' /proc/self/mountinfo; echo "== end"; {WAIT_FOR_GO}'
    )
    same_job = await start_job_rank(job_node, "lease-a2", "job-a", 1_000_001, probe, gpu=1)
    other_job = await start_job_rank(job_node, "lease-b1", "job-b", 1_000_002, probe, gpu=2)
    assert (await _said(same_job, "end"))["list"].strip() == "1"  # another rank of the job, beside it
    seen = await _said(other_job, "end")
    assert seen["list"].strip() == "0"  # not there for another job
    assert seen["ids"].strip() == "0"  # nor the job's id: the pins, mounts it sees, are not named by it
    listed = (await asyncio.to_thread(subprocess.run, ["ipcs", "-m"], capture_output=True, text=True)).stdout
    assert not any(line.split()[1:2] == [str(shmid)] and "666" in line for line in listed.splitlines()[3:])
    pinned = job_node.spaces.ipc_pin("job-a")
    assert rank_ipc.pinned(str(pinned)) and sf.read_json(holder.dir / sf.SPEC)["ipc"] == str(pinned)
    # the job's last rank here ends without removing its segment: the namespace goes
    for lease in ("lease-a1", "lease-a2"):
        (job_node.work_dir / lease / "go").touch()
        await ended(job_node.leases[lease])
    assert not pinned.exists() and not pinned.with_name(pinned.name + ".lock").exists()
    # the other job's rank, still running, held a copy of every mount: the unpinning reached it
    assert str(pinned) not in open(f"/proc/{other_job.pid}/mountinfo").read()
    (job_node.work_dir / "lease-b1" / "go").touch()
    await ended(other_job)
    assert not job_node.spaces.ipc_pin("job-b").exists()


@pytest.mark.parametrize("job_node", [{"agent_rank_private_ipc": False}], indirect=True)
async def test_without_its_jobs_own_ipc_a_rank_lists_another_jobs_segment(job_node):
    """The same probe with the setting off: what the setting takes away."""
    made = await ended(await start_job_rank(job_node, "lease-a1", "job-a", 1_000_001, 'echo "== made"; ipcmk -M 4096 -p 0666',
                                     gpu=0))  # fmt: skip
    shmid = _shmid(made["made"])
    try:
        found = await ended(
            await start_job_rank(
                job_node,
                "lease-b1",
                "job-b",
                1_000_002,
                f"echo '== list'; ipcs -m | awk '$2 == {shmid}' | wc -l",
                gpu=1,
            )
        )
        assert found["list"].strip() == "1", found
        assert sf.read_json(job_node.leases["lease-b1"].dir / sf.SPEC)["ipc"] is None
    finally:
        await asyncio.to_thread(subprocess.run, ["ipcrm", "-m", str(shmid)])  # on the host: it outlives its job


async def test_a_restarted_agent_lets_go_the_ipc_of_jobs_that_ended_meanwhile(job_node):
    gone = str(job_node.spaces.ipc_pin("job-gone"))
    claim = rank_ipc.JobIpc(gone).claim()  # a namespace pinned by a rank that has since ended
    sleeper = subprocess.Popen(["sleep", "30"], preexec_fn=claim.enter)
    assert claim.pin(sleeper.pid) is None
    sleeper.kill()
    sleeper.wait()
    st = await start_job_rank(job_node, "lease-live", "job-live", 1_000_003, "sleep 30", gpu=0)
    await wait_for(lambda: st.pid is not None and rank_ipc.pinned(str(job_node.spaces.ipc_pin("job-live"))), timeout=20,
                   what="the live job's namespace")  # fmt: skip
    assert rank_ipc.pinned(gone)
    await job_node.close()  # the agent goes; the rank lives on
    again = NodeAgent(
        job_node.settings, job_node.node_id, backend=make_backend(job_node.settings, job_node.node_id, "simulated")
    )
    await again.start()
    try:
        assert not os.path.exists(gone)  # no rank of its job here
        assert rank_ipc.pinned(str(again.spaces.ipc_pin("job-live")))  # its rank was re-adopted: kept (the same key)
    finally:
        await close_node(again)


def _spaces_left_by_a_stopped_agent(state, node_id: str = "b0-n0") -> tuple[JobSpaces, str, str]:
    """A node's spaces for a job whose rank has ended while its agent was gone: a pinned IPC
    namespace and a /dev/shm dir."""
    node_dir = state / "agent" / node_id
    node_dir.mkdir(parents=True)
    spaces = JobSpaces(node_dir, node_id)
    shm = spaces.job_shm("job-a", (65534, 65534))
    pin = str(spaces.ipc_pin("job-a"))
    claim = rank_ipc.JobIpc(pin).claim()
    sleeper = subprocess.Popen(["sleep", "30"], preexec_fn=claim.enter)
    assert claim.pin(sleeper.pid) is None
    sleeper.kill()
    sleeper.wait()
    assert rank_ipc.pinned(pin) and os.path.isdir(shm)
    return spaces, pin, shm


def test_up_stopped_with_no_rank_left_lets_every_nodes_job_spaces_go(tmp_path):
    """`gpufleet up` stopped while a job's ranks were ending: its agent, gone, kept their
    spaces; with no rank left, `up` lets them go (cli.up.release_job_spaces)."""
    spaces, pin, shm = _spaces_left_by_a_stopped_agent(tmp_path / "state")
    release_job_spaces(tmp_path / "state")
    assert not os.path.exists(pin) and not os.path.exists(shm) and not spaces.shm_dir.exists()


def test_a_node_with_no_rank_left_lets_its_job_spaces_go_while_another_nodes_rank_runs(tmp_path):
    """`up` stopped with one node's rank still running: that node keeps its spaces for it,
    and every other node's go (until this, one rank anywhere kept every node's)."""
    state = tmp_path / "state"
    idle, idle_pin, idle_shm = _spaces_left_by_a_stopped_agent(state, "b0-n0")
    busy, busy_pin, busy_shm = _spaces_left_by_a_stopped_agent(state, "b0-n1")
    lease = state / "agent" / "b0-n1" / "leases" / "job-b.a1.r0"
    lease.mkdir(parents=True)
    start = sf.process_start_ticks(os.getpid())  # this process stands in for the rank that runs on
    sf.write_json_atomic(lease / sf.SUPERVISOR, {"rank_pid": os.getpid(), "rank_start": start, "pgid": os.getpgid(0)})
    try:
        release_job_spaces(state)
        assert not os.path.exists(idle_pin) and not os.path.exists(idle_shm) and not idle.shm_dir.exists()
        assert rank_ipc.pinned(busy_pin) and os.path.isdir(busy_shm)
    finally:
        idle.close()
        busy.close()


def test_job_spaces_of_a_node_an_agent_still_serves_are_left_to_it(tmp_path):
    """`stop-ranks` run beside a running agent: that agent may be starting a rank of the
    job, so the node's spaces are its to let go (it holds the node's lock)."""
    _, pin, shm = _spaces_left_by_a_stopped_agent(tmp_path / "state")
    agent = NodeLock(tmp_path / "state" / "agent" / "b0-n0")
    agent.acquire("b0-n0")
    try:
        release_job_spaces(tmp_path / "state")
        assert rank_ipc.pinned(pin) and os.path.isdir(shm)
    finally:
        agent.release()
    release_job_spaces(tmp_path / "state")
    assert not os.path.exists(pin) and not os.path.exists(shm)


def test_gpufleet_stop_ranks_with_no_rank_left_lets_the_job_spaces_go(tmp_path):
    """What `up` left for ranks that ran on after it: once they are stopped (or ended by
    themselves), `gpufleet stop-ranks` lets their spaces go."""
    spaces, pin, shm = _spaces_left_by_a_stopped_agent(tmp_path / "state")
    try:
        r = subprocess.run(
            [sys.executable, "-m", "cli.main", "stop-ranks", "--state-dir", str(tmp_path / "state")],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 0 and "no rank runs under" in r.stdout, r.stdout + r.stderr
        assert not os.path.exists(pin) and not os.path.exists(shm) and not spaces.shm_dir.exists()
    finally:
        spaces.close()
