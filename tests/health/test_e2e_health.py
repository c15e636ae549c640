"""Health end to end on the embedded stack: the real control process (leader, health monitor),
real node agents on simulated GPUs, real rank processes. Durations scaled to seconds
(suspect 1.5 s, down 3 s, unconfirmed kill 4 s, fence margin 1.5, hang 2 s, missing-task
release 2 s). The failed gang is the real shape of a multi-node gang, 4 replicas x 8 GPUs
(4 whole nodes of a 6-node block), not 32 single GPUs."""

from __future__ import annotations

import os
import shutil
import signal
import time
from datetime import UTC, datetime

import pytest

from common.contracts import StartTask, TaskState, TaskStatus
from tests.e2e.conftest import PY, TRAIN_COUNTER
from tests.support import eventually, holds, workflow_status
from worker_agent.nvml import write_fault

pytestmark = pytest.mark.e2e


def monitor(stack):
    return stack.controls[0].health


async def node_state(stack, node_id):
    return await stack.pool.fetchval("SELECT state FROM nodes WHERE node_id = $1", node_id)


async def wait_node(stack, node_id, *states, timeout=20.0):
    async def probe():
        return (await node_state(stack, node_id)) in states

    await eventually(probe, timeout=timeout, interval=0.05, what=f"{node_id} in {states}")


async def kill_node_agent(stack, node_id: str) -> None:
    """The node's agent dies: no heartbeats, no activities; its ranks keep running under their
    supervisors until they fence themselves (unconfirmed_kill_s)."""
    agent = stack.agent
    for t in agent._tasks:
        if t.get_name() == f"link-{node_id}":
            t.cancel()
    idx = list(agent.nodes).index(node_id)
    if idx < len(agent._workers):
        await agent._workers[idx].shutdown()
    await agent.nodes[node_id].close()


async def gang_checkpoint(stack, job):
    async def probe():
        return (await workflow_status(stack.client, job)).get("checkpoint")

    return await eventually(probe, timeout=30, what="a checkpoint every rank reported")


async def requeued_ahead_not_its_fault(stack, job):
    ev = await stack.pool.fetchrow(
        "SELECT * FROM job_events WHERE job_id = $1 AND event = 'requeued' ORDER BY id LIMIT 1", job
    )
    assert ev["detail"]["cause"] == "failed" and ev["detail"]["job_fault"] is False, dict(ev)
    row = await stack.job(job)
    assert row["failed_attempts"] == 0, "a node failure is not the job's fault"


def train(steps=400):
    return [PY, TRAIN_COUNTER, "--steps", str(steps), "--step-time", "0.03", "--checkpoint-every", "10"]


async def test_dead_agent_node_suspect_then_down_gang_restarted_elsewhere_from_checkpoint(stack):
    steps = 400
    job = await stack.submit(
        replicas=4, gpus_per_replica=8, command=train(steps), checkpoint={"preemptible": True, "grace_seconds": 5}
    )
    await stack.wait_state(job, "RUNNING", timeout=40)
    await gang_checkpoint(stack, job)
    leases = await stack.pool.fetch("SELECT * FROM leases WHERE job_id = $1 AND attempt = 1 ORDER BY rank", job)
    dead = leases[1]["node_id"]
    t0 = time.monotonic()
    killed_at = datetime.now(UTC)
    await kill_node_agent(stack, dead)

    await wait_node(stack, dead, "suspect", "down", timeout=10)
    suspect_s = time.monotonic() - t0
    await wait_node(stack, dead, "down", timeout=10)
    down_s = time.monotonic() - t0
    assert suspect_s < 1.5 + 2.0 and down_s < 3.0 + 2.0, (suspect_s, down_s)

    row = await stack.wait_state(job, "RUNNING", attempt=2, timeout=60)
    await requeued_ahead_not_its_fault(stack, job)
    assert row["last_checkpoint"], "restarted from its last checkpoint"
    again = await stack.pool.fetch("SELECT * FROM leases WHERE job_id = $1 AND attempt = 2", job)
    assert dead not in {lz["node_id"] for lz in again}

    async def measured():
        return [r for r in monitor(stack).restarts if r.job_id == job]

    sample = (await eventually(measured, timeout=10, what="failure -> restart measured"))[0]
    print(
        f"\nfailure -> restart (node down, 4x8 gang): {sample.seconds:.2f}s "
        f"(suspect after {suspect_s:.2f}s, down after {down_s:.2f}s)"
    )
    assert sample.cause == "node_down" and 0 < sample.seconds < 30

    # the dead node's GPUs are not handed out again: it stays down (no confirmation; the fence window
    # 4 s x 1.5 = 6 s passes but a silent node cannot come back without its agent)
    final = await stack.wait_state(job, "SUCCEEDED", timeout=60)
    assert final["attempt"] == 2
    assert await node_state(stack, dead) == "down"
    reused = await stack.pool.fetchval(
        "SELECT count(*) FROM leases WHERE node_id = $1 AND created_at > $2", dead, killed_at
    )
    assert reused == 0
    audit = await stack.pool.fetch(
        "SELECT detail FROM audit WHERE subject = $1 AND action = 'node_state' ORDER BY id", dead
    )
    assert [(a["detail"]["from"], a["detail"]["to"]) for a in audit] == [("ready", "suspect"), ("suspect", "down")]
    for lz in again:
        text = (stack.lease_dir(lz["node_id"], lz["lease_id"]) / "stdout.log").read_text()
        assert "resumed from step" in text


async def test_xid_79_cordons_at_once_gang_restarts_elsewhere_burn_in_returns_the_node(stack):
    job = await stack.submit(
        replicas=4, gpus_per_replica=8, command=train(400), checkpoint={"preemptible": True, "grace_seconds": 5}
    )
    await stack.wait_state(job, "RUNNING", timeout=40)
    leases = await stack.pool.fetch("SELECT * FROM leases WHERE job_id = $1 AND attempt = 1 ORDER BY rank", job)
    bad = leases[2]["node_id"]
    t0 = time.monotonic()
    write_fault(stack.settings.state_dir, bad, gpu=3, xid=79)
    await wait_node(stack, bad, "cordoned", timeout=5)
    cordon_s = time.monotonic() - t0
    assert cordon_s < 1.5, f"cordoned {cordon_s:.2f}s after the Xid: at once"
    await stack.wait_state(job, "RUNNING", attempt=2, timeout=60)
    await requeued_ahead_not_its_fault(stack, job)
    again = await stack.pool.fetch("SELECT node_id FROM leases WHERE job_id = $1 AND attempt = 2", job)
    assert bad not in {lz["node_id"] for lz in again}
    sample = (
        await eventually(
            lambda: _v([r for r in monitor(stack).restarts if r.job_id == job]), timeout=10, what="restart measured"
        )
    )[0]
    print(f"\nfailure -> restart (Xid 79, 4x8 gang): {sample.seconds:.2f}s (cordoned after {cordon_s:.2f}s)")
    assert sample.cause == "fatal_fault"
    # still faulty: it stays cordoned (no burn-in while the GPU reports the Xid)
    await holds(lambda: _eq(node_state(stack, bad), "cordoned"), for_s=1.0, what=f"{bad} cordoned")
    # an operator resets the GPU: it burns in, passes and returns
    write_fault(stack.settings.state_dir, bad, gpu=3, clear=True)
    await wait_node(stack, bad, "burn_in", "ready", timeout=15)
    await wait_node(stack, bad, "ready", timeout=30)
    audit = await stack.pool.fetch(
        "SELECT detail FROM audit WHERE subject = $1 AND action = 'node_state' ORDER BY id", bad
    )
    assert [(a["detail"]["from"], a["detail"]["to"]) for a in audit] == [
        ("ready", "cordoned"),
        ("cordoned", "burn_in"),
        ("burn_in", "ready"),
    ]
    assert audit[0]["detail"]["event"] == "fatal"
    await stack.wait_state(job, "SUCCEEDED", timeout=60)


async def test_stalled_steps_with_idle_gpus_is_a_hang_and_is_recovered(stack):
    job = await stack.submit(
        replicas=1, gpus_per_replica=8, command=train(2000), checkpoint={"preemptible": True, "grace_seconds": 3}
    )
    await stack.wait_state(job, "RUNNING", timeout=40)
    lz = await stack.pool.fetchrow("SELECT * FROM leases WHERE job_id = $1 AND attempt = 1", job)

    async def stepping():
        # a rank that has not reported a step yet can never look hung: wait for its first one
        st = stack.agent.nodes[lz["node_id"]].leases.get(lz["lease_id"])
        return st is not None and st.step is not None

    await eventually(stepping, timeout=30, what="the rank's first step report")
    write_fault(stack.settings.state_dir, lz["node_id"], hang=True)
    await wait_node(stack, lz["node_id"], "cordoned", timeout=30)
    audit = await stack.pool.fetchrow(
        "SELECT detail, reason FROM audit WHERE subject = $1 AND action = 'node_state' ORDER BY id DESC LIMIT 1",
        lz["node_id"],
    )
    assert audit["detail"]["event"] == "hang" and lz["lease_id"] in audit["reason"]
    await stack.wait_state(job, "RUNNING", attempt=2, timeout=40)
    await requeued_ahead_not_its_fault(stack, job)
    assert (await stack.pool.fetchval("SELECT node_id FROM leases WHERE job_id = $1 AND attempt = 2", job)) != lz[
        "node_id"
    ]
    assert [r.cause for r in monitor(stack).restarts if r.job_id == job] in ([], ["hang"])
    await stack.cancel(job)


async def test_reconciliation_orphans_vanished_ranks_and_stale_exits(stack):
    keep = stack.nodes[0]
    await stack.pool.execute(
        "UPDATE nodes SET state = 'draining', reason = 'test: one node only' WHERE node_id <> $1", keep
    )
    node = stack.agent.nodes[keep]

    # (1) an orphan rank started outside any lease is stopped
    orphan = StartTask(
        lease_id="orphan.a1.r0",
        job_id="orphan",
        attempt=1,
        epoch=1,
        node_id=keep,
        rank=0,
        world_size=1,
        image="registry/x:1",
        command=[PY, "-c", "import time; time.sleep(120)"],
        gpu_indices=[7],
        master_addr="127.0.0.1",
        master_port=29999,
    )
    assert (await node.start_task(orphan)).accepted

    async def orphan_stopped():
        st = node.leases.get("orphan.a1.r0")
        return st is not None and not st.live

    await eventually(orphan_stopped, timeout=20, what="orphan stopped")

    # (2) a lease whose rank vanished (no exit, no report) is released after 2 s and its job re-queued
    job = await stack.submit(replicas=1, gpus_per_replica=1, command=[PY, "-c", "import time; time.sleep(120)"])
    await stack.wait_state(job, "RUNNING", timeout=40)
    old = await stack.pool.fetchrow("SELECT * FROM leases WHERE job_id = $1 AND attempt = 1", job)
    st = node.leases.pop(old["lease_id"])  # the agent forgets it ...
    for pid in (st.sup_pid, st.pid):  # ... and it is gone from the host
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, TypeError):
            pass
    shutil.rmtree(st.dir, ignore_errors=True)
    node._update_busy()
    t0 = time.monotonic()

    async def released():
        return (
            await stack.pool.fetchval("SELECT state FROM leases WHERE lease_id = $1", old["lease_id"])
        ) == "released"

    await eventually(released, timeout=20, what="missing lease released")
    assert time.monotonic() - t0 >= 2.0 - 0.6  # not before missing_task_release_s (heartbeat granularity)
    audit = await stack.pool.fetchrow(
        "SELECT reason FROM audit WHERE subject = $1 AND action = 'release' ORDER BY id LIMIT 1", job
    )
    assert audit["reason"].startswith("reconciliation: task missing")
    await stack.wait_state(job, "RUNNING", attempt=2, timeout=40)
    new = await stack.pool.fetchrow("SELECT * FROM leases WHERE job_id = $1 AND attempt = 2", job)
    same_gpu = (new["node_id"], list(new["gpu_indices"])) == (old["node_id"], list(old["gpu_indices"]))

    # (3) a stale "task exited" of the old lease does not release the new lease (same GPU). Its
    # code is the one the SIGKILLed rank really had: an exit 0 of every rank of an earlier
    # attempt would say the work is done and finish the job (tests/faults/test_lost_node.py)
    stale = TaskStatus(
        node_id=keep,
        lease_id=old["lease_id"],
        job_id=job,
        attempt=1,
        epoch=old["epoch"],
        rank=0,
        state=TaskState.EXITED,
        at=datetime.now(UTC),
        exit_code=137,
        seq=1,
    )
    await stack.controls[0]._on_task_status(stale)

    async def untouched() -> bool:
        lease = await stack.pool.fetchval("SELECT state FROM leases WHERE lease_id = $1", new["lease_id"])
        return lease == "live" and (await stack.job(job))["state"] == "RUNNING"

    # a wrong release gets every chance to happen (1 s), and fails the test the moment it does
    await holds(untouched, for_s=1.0, what="the new lease live and its job RUNNING")
    assert same_gpu, "one ready node, one GPU job: attempt 2 reuses the GPU of attempt 1"
    await stack.cancel(job)


async def _v(x):
    return x


async def _eq(value, want) -> bool:
    return (await value) == want


async def test_drain_with_evict_preempts_now_and_an_admin_return_burns_in(stack):
    from store import nodes

    job = await stack.submit(
        replicas=1, gpus_per_replica=8, command=train(2000), checkpoint={"preemptible": True, "grace_seconds": 5}
    )
    await stack.wait_state(job, "RUNNING", timeout=40)
    await gang_checkpoint(stack, job)
    node = await stack.pool.fetchval("SELECT node_id FROM leases WHERE job_id = $1 AND attempt = 1", job)
    r = await stack.http.post(
        f"/v1/nodes/{node}:drain",
        json={"reason": "maintenance", "evict": True},
        headers={"Authorization": "Bearer tok-admin", "Idempotency-Key": "drain-1"},
    )
    assert r.status_code < 300, r.text
    row = await stack.wait_state(job, "RUNNING", attempt=2, timeout=40)
    assert row["preemptions"] == 1 and row["last_checkpoint"], "evicted: checkpointed and re-queued"
    assert await stack.pool.fetchval("SELECT node_id FROM leases WHERE job_id = $1 AND attempt = 2", job) != node
    assert await node_state(stack, node) == "draining"  # drained: waits for an admin return
    assert await nodes.return_node(stack.pool, node, actor="root", reason="maintenance done") == "draining"
    await wait_node(stack, node, "ready", timeout=30)
    await stack.cancel(job)
