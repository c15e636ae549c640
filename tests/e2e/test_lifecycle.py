"""End to end on the embedded stack: the API, control (JobWorkflow, PlacementWorkflow,
the leader's cycle), real node agents on simulated GPUs running real rank processes."""

from __future__ import annotations

import re

import pytest

from tests.e2e.conftest import PY, TRAIN_COUNTER
from tests.support import eventually, workflow_status
from worker_agent import statefiles as sf

pytestmark = pytest.mark.e2e


async def test_one_gpu_job_runs_to_success_with_matching_events_and_audit(stack):
    job = await stack.submit(command=[PY, "-c", "import time; time.sleep(0.5); print('hello')"])
    row = await stack.wait_state(job, "SUCCEEDED")
    assert row["exit_code"] == 0 and row["attempt"] == 1
    assert await stack.transitions(job) == [
        (1, None, "QUEUED"),
        (1, "QUEUED", "STARTING"),
        (1, "STARTING", "RUNNING"),
        (1, "RUNNING", "SUCCEEDED"),
    ]
    audit = await stack.audit(job)
    assert [a["action"] for a in audit] == ["submit", "allocate", "release"]
    alloc = audit[1]["detail"]
    lease = await stack.pool.fetchrow("SELECT * FROM leases WHERE job_id = $1", job)
    assert alloc["placements"] == [
        {"rank": 0, "node": lease["node_id"], "gpus": list(lease["gpu_indices"]), "borrowed": False}
    ]
    assert audit[2]["detail"]["leases"][0]["lease_id"] == lease["lease_id"]
    assert lease["state"] == "released" and await stack.pool.fetchval("SELECT count(*) FROM allocations") == 0
    out = (stack.lease_dir(lease["node_id"], lease["lease_id"]) / "stdout.log").read_text()
    assert "hello" in out
    r = await stack.http.get(f"/v1/jobs/{job}/events", headers={"Authorization": "Bearer tok-alpha"})
    assert [e["to_state"] for e in r.json()["events"] if e["to_state"]][-1] == "SUCCEEDED"


def _result(stack, node, lease_id) -> tuple[int, int] | None:
    try:
        text = (stack.lease_dir(node, lease_id) / "stdout.log").read_text()
    except OSError:
        return None
    m = re.search(r"RESULT steps=(\d+) value=(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else None


async def test_research_job_preempted_by_prod_batch_resumes_from_its_checkpoint(stack):
    from importlib import util

    spec = util.spec_from_file_location("train_counter", TRAIN_COUNTER)
    tc = util.module_from_spec(spec)
    spec.loader.exec_module(tc)
    steps = 150
    research = await stack.submit(
        token="tok-beta",
        team="beta",
        priority_class="research",
        replicas=4,
        gpus_per_replica=8,
        command=[PY, TRAIN_COUNTER, "--steps", str(steps), "--step-time", "0.03", "--checkpoint-every", "10"],
        checkpoint={"preemptible": True, "grace_seconds": 10},
    )
    await stack.wait_state(research, "RUNNING")
    leases = await stack.pool.fetch("SELECT * FROM leases WHERE job_id = $1 AND attempt = 1 ORDER BY rank", research)

    async def checkpointed():
        return (await workflow_status(stack.client, research)).get("state") == "RUNNING" and all(
            sf.progress_path(stack.lease_dir(lz["node_id"], lz["lease_id"])).exists() for lz in leases
        )

    await eventually(checkpointed, timeout=20, what="first checkpoints")

    async def gang_checkpoint():
        return (await workflow_status(stack.client, research)).get("checkpoint")

    await eventually(gang_checkpoint, timeout=20, what="a checkpoint every rank reported")
    prod = await stack.submit(
        priority_class="prod-batch", replicas=1, gpus_per_replica=8, command=[PY, "-c", "import time; time.sleep(1)"]
    )
    row = await stack.wait_state(research, "QUEUED", "STARTING", "RUNNING", attempt=2, timeout=40)
    ck = row["last_checkpoint"]
    assert ck, "the preempted job recorded its checkpoint"
    assert (await stack.wait_state(prod, "SUCCEEDED", timeout=40))["exit_code"] == 0
    final = await stack.wait_state(research, "SUCCEEDED", timeout=60)
    assert final["attempt"] == 2 and final["preemptions"] == 1
    # attempt 1 was stopped by SIGTERM and checkpointed within its grace (exit 143, not SIGKILL)
    stopped = await stack.pool.fetch(
        "SELECT reason, detail FROM audit WHERE subject = $1 AND action = 'release'", research
    )
    assert stopped[0]["reason"] == "preempted"
    for lz in leases:
        text = (stack.lease_dir(lz["node_id"], lz["lease_id"]) / "stdout.log").read_text()
        assert "SIGTERM: checkpointing" in text
    attempt2 = await stack.pool.fetch("SELECT * FROM leases WHERE job_id = $1 AND attempt = 2 ORDER BY rank", research)
    for lz in attempt2:
        text = (stack.lease_dir(lz["node_id"], lz["lease_id"]) / "stdout.log").read_text()
        assert "resumed from step" in text
        assert _result(stack, lz["node_id"], lz["lease_id"]) == (steps, tc.expected(steps))
    assert await stack.transitions(research) == [
        (1, None, "QUEUED"),
        (1, "QUEUED", "STARTING"),
        (1, "STARTING", "RUNNING"),
        (1, "RUNNING", "PREEMPTING"),
        (2, "PREEMPTING", "QUEUED"),
        (2, "QUEUED", "STARTING"),
        (2, "STARTING", "RUNNING"),
        (2, "RUNNING", "SUCCEEDED"),
    ]


async def test_gang_rank_failure_releases_all_32_gpus_and_reruns_ahead_of_later_jobs(stack):
    crash_once = (
        "import os, sys, time, pathlib; d = pathlib.Path(os.environ['GPUFLEET_CHECKPOINT_DIR']); "
        "d.mkdir(parents=True, exist_ok=True); m = d / 'crashed'; "
        "first = os.environ['GPUFLEET_ATTEMPT'] == '1'; "
        "time.sleep(1.0); "
        "sys.exit(7) if (first and os.environ['RANK'] == '2') else time.sleep(1.5 if not first else 60)"
    )
    gang = await stack.submit(
        replicas=4,
        gpus_per_replica=8,
        command=[PY, "-c", crash_once],
        checkpoint={"preemptible": False, "grace_seconds": 2},
    )
    await stack.wait_state(gang, "RUNNING")
    later = await stack.submit(replicas=4, gpus_per_replica=8, command=[PY, "-c", "pass"])
    row = await stack.wait_state(gang, "QUEUED", "STARTING", "RUNNING", "SUCCEEDED", attempt=2, timeout=40)
    assert row["failed_attempts"] == 1
    released = [a for a in await stack.audit(gang) if a["action"] == "release"]
    assert len(released[0]["detail"]["leases"]) == 4
    assert sum(len(lz["gpus"]) for lz in released[0]["detail"]["leases"]) == 32
    failed = await stack.pool.fetchrow("SELECT * FROM job_events WHERE job_id = $1 AND event = 'attempt_failed'", gang)
    assert failed["detail"]["job_fault"] is True and "rank 2 exited with code 7" in failed["reason"]
    # every rank of attempt 1 stopped: none is left running on the agents
    for lz in await stack.pool.fetch("SELECT * FROM leases WHERE job_id = $1 AND attempt = 1", gang):
        exit_rec = stack.lease_dir(lz["node_id"], lz["lease_id"]) / "exit.json"
        await eventually(lambda exit_rec=exit_rec: _exists(exit_rec), timeout=10, what=f"{lz['lease_id']} exited")
    await stack.wait_state(gang, "SUCCEEDED", timeout=40)
    await stack.wait_state(later, "SUCCEEDED", timeout=40)
    # attempt 2 of the failed gang ran before the later job of the same class
    g2 = await stack.pool.fetchval("SELECT min(created_at) FROM leases WHERE job_id = $1 AND attempt = 2", gang)
    lt = await stack.pool.fetchval("SELECT min(created_at) FROM leases WHERE job_id = $1", later)
    assert g2 < lt


async def _exists(path):
    return path.exists()


@pytest.mark.parametrize("stack_overrides", [{"_agent_nodes": 3, "gang_start_timeout_s": 60.0}])
async def test_cancel_while_queued_starting_and_running(stack):
    silent = stack.nodes[3]  # no agent serves this node: a gang that needs it stays STARTING
    # STARTING: ranks 0-2 start, rank 3 never does
    starting = await stack.submit(command=[PY, "-c", "import time; time.sleep(60)"], replicas=4, gpus_per_replica=8)
    await stack.wait_state(starting, "STARTING")

    async def three_started():
        s = await workflow_status(stack.client, starting)
        return s.get("ranks_started") == 3

    await eventually(three_started, timeout=20, what="three ranks started")
    # QUEUED: the cluster is full (and the lowest class preempts nobody)
    queued = await stack.submit(replicas=1, gpus_per_replica=8, priority_class="preemptible")
    await stack.wait_state(queued, "QUEUED")
    assert (await stack.cancel(queued)).status_code == 202
    await stack.wait_state(queued, "CANCELLED")
    assert (await stack.cancel(starting)).status_code == 202
    await stack.wait_state(starting, "CANCELLED")
    # RUNNING (keep the silent node out of placement)
    await stack.pool.execute("UPDATE nodes SET state = 'cordoned' WHERE node_id = $1", silent)
    running = await stack.submit(command=[PY, "-c", "import time; time.sleep(60)"])
    await stack.wait_state(running, "RUNNING")
    assert (await stack.cancel(running)).status_code == 202
    await stack.wait_state(running, "CANCELLED")
    for job in (queued, starting, running):
        assert "cancel" in [a["action"] for a in await stack.audit(job)]
    assert (await stack.transitions(queued))[-1] == (1, "QUEUED", "CANCELLED")
    assert (await stack.transitions(starting))[-2:] == [(1, "STARTING", "CANCELLING"), (1, "CANCELLING", "CANCELLED")]
    assert (await stack.transitions(running))[-2:] == [(1, "RUNNING", "CANCELLING"), (1, "CANCELLING", "CANCELLED")]
    assert await stack.pool.fetchval("SELECT count(*) FROM allocations") == 0
    # the started ranks of the cancelled gang were stopped
    for lz in await stack.pool.fetch("SELECT * FROM leases WHERE job_id = $1 AND node_id <> $2", starting, silent):
        exit_rec = stack.lease_dir(lz["node_id"], lz["lease_id"]) / "exit.json"
        await eventually(lambda exit_rec=exit_rec: _exists(exit_rec), timeout=10, what=f"{lz['lease_id']} stopped")


async def test_max_runtime_expiry_and_extensions(stack):
    job = await stack.submit(
        command=[PY, "-c", "import time; time.sleep(60)"],
        max_runtime=8,
        checkpoint={"preemptible": False, "grace_seconds": 1},
    )
    await stack.wait_state(job, "RUNNING")
    refused = await stack.extend(job, 3)  # > 25% of 8 s
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "extension_too_long"
    granted = await stack.extend(job, 2)
    assert granted.status_code == 200, granted.text
    assert granted.json()["granted"] is True
    row = await stack.wait_state(job, "TIMED_OUT", timeout=30)
    assert (row["finished_at"] - row["started_at"]).total_seconds() >= 10
    actions = [a["action"] for a in await stack.audit(job)]
    assert "extend_refused" in actions and "extend" in actions and "timeout" in actions


async def test_a_task_without_a_live_lease_is_stopped_and_its_attempt_requeued(stack):
    from store import allocations

    job = await stack.submit(
        command=[PY, "-c", "import time; time.sleep(60)"], checkpoint={"preemptible": False, "grace_seconds": 1}
    )
    await stack.wait_state(job, "RUNNING")
    lease = await stack.pool.fetchrow("SELECT * FROM leases WHERE job_id = $1", job)
    # the lease goes away behind the job's back (e.g. released by an operator's repair)
    assert await allocations.release_lease(stack.pool, lease["lease_id"], reason="test", actor="test")
    exit_rec = stack.lease_dir(lease["node_id"], lease["lease_id"]) / "exit.json"
    await eventually(lambda: _exists(exit_rec), timeout=20, what="the orphaned rank stopped by reconciliation")
    row = await stack.wait_state(job, "QUEUED", "STARTING", "RUNNING", attempt=2, timeout=30)
    assert row["failed_attempts"] == 0  # not the job's fault
