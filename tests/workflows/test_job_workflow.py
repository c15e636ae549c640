"""JobWorkflow against the real Temporal dev server, Postgres and real rank processes.

Placement is played by the test (commit_gang + the allocation signal), so each test
pins one path of docs/design.md's job lifecycle.
"""

from __future__ import annotations

from datetime import UTC

import pytest

from tests.support import eventually, workflow_status
from tests.workflows.harness import PY, TRAIN, read_json


async def test_one_gpu_job_succeeds_with_matching_events_and_audit(stand):
    job = await stand.submit("j-ok", command=[PY, "-c", "import time; time.sleep(0.3)"])
    await stand.allocate(job, (stand.nodes[0], (0,)))
    res = await stand.result(job)
    assert res.state == "SUCCEEDED"
    row = await stand.job(job)
    assert row["state"] == "SUCCEEDED" and row["exit_code"] == 0 and row["finished_at"] is not None
    assert await stand.transitions(job) == [
        (1, None, "QUEUED"),
        (1, "QUEUED", "STARTING"),
        (1, "STARTING", "RUNNING"),
        (1, "RUNNING", "SUCCEEDED"),
    ]
    actions = [a["action"] for a in await stand.audit(job)]
    assert actions == ["allocate", "release"]
    assert await stand.live_gpus(job) == 0
    lease = await stand.pool.fetchrow("SELECT * FROM leases WHERE job_id = $1", job)
    assert lease["state"] == "released" and lease["release_reason"] == "succeeded"


SLEEP = [PY, "-c", "import time; time.sleep(60)"]


async def test_gang_rank_failure_stops_all_ranks_releases_gpus_and_requeues_in_front(stand):
    cmd = [
        PY,
        "-c",
        "import os, sys, time; r = int(os.environ['RANK']); time.sleep(0.8); sys.exit(3) if r == 2 else time.sleep(60)",
    ]
    job = await stand.submit("j-gang", command=cmd, replicas=4, gpus_per_replica=8)
    await stand.allocate(job, *[(n, tuple(range(8))) for n in stand.nodes[:4]])
    row = await stand.wait_state(job, "QUEUED", attempt=2)
    assert row["front_of_class"] is True and row["failed_attempts"] == 1
    assert await stand.pool.fetchval("SELECT count(*) FROM allocations") == 0
    leases = await stand.pool.fetch("SELECT * FROM leases WHERE job_id = $1 AND attempt = 1", job)
    assert len(leases) == 4 and all(lz["state"] == "released" for lz in leases)
    # the three healthy ranks were stopped, the failed one had exited by itself
    stopped = {s.lease_id for s in stand.agent.stops}
    assert {f"{job}.a1.r{r}" for r in (0, 1, 3)} <= stopped
    assert all(t.done.is_set() for t in stand.agent.tasks.values())
    failed = [e for e in await stand.events(job) if e["event"] == "attempt_failed"]
    assert len(failed) == 1 and failed[0]["detail"]["job_fault"] is True and "rank 2" in failed[0]["reason"]
    assert await stand.transitions(job) == [
        (1, None, "QUEUED"),
        (1, "QUEUED", "STARTING"),
        (1, "STARTING", "RUNNING"),
        (2, "RUNNING", "QUEUED"),
    ]

    # the workflow continued as new for attempt 2 and waits for its allocation
    async def waiting_for_attempt_2():
        status = await workflow_status(stand.client, job)
        return status.get("attempt") == 2 and status.get("state") == "QUEUED"

    await eventually(waiting_for_attempt_2, what="the attempt-2 run")


async def test_preempted_job_checkpoints_requeues_and_resumes_to_the_same_result(stand):
    from tests.e2e.train import expected

    steps = 40
    job = await stand.submit("j-train", command=[PY, TRAIN, str(steps), "0.05", "5"], grace_s=5.0)
    await stand.allocate(job, (stand.nodes[0], (0,)))
    await stand.wait_state(job, "RUNNING")
    lease_dir = stand.agent.root / stand.nodes[0] / f"{job}.a1.r0"

    async def progressed():
        try:
            return read_json(lease_dir / "progress.json")["step"] >= 10
        except (OSError, ValueError):
            return False

    await eventually(progressed, timeout=10, what="training progress")
    await stand.preempt(job, by_job="j-prod")
    row = await stand.wait_state(job, "QUEUED", attempt=2)
    assert stand.agent.signals_seen[f"{job}.a1.r0"] == ["SIGTERM"]  # it exited within its grace
    ck = row["last_checkpoint"]
    assert ck and ck.startswith("file://")
    ck_step = read_json(ck + "/rank-0.json")["step"]
    assert 10 <= ck_step < steps
    assert row["preemptions"] == 1 and row["front_of_class"] is False
    assert row["submitted_at"] < row["queued_at"]  # original submit time kept
    assert await stand.live_gpus(job) == 0

    await stand.allocate(job, (stand.nodes[1], (3,)))
    res = await stand.result(job)
    assert res.state == "SUCCEEDED" and res.attempt == 2, (res, [dict(e) for e in await stand.events(job)])
    start2 = [s for s in stand.agent.starts if s.attempt == 2]
    assert start2 and start2[0].resume_from == ck
    # both attempts run as the job's numbered user, so attempt 2 may read attempt 1's checkpoint
    alpha = await stand.pool.fetchval("SELECT rank_id FROM teams WHERE name = 'alpha'")
    numbered = await stand.pool.fetchval("SELECT rank_id FROM jobs WHERE job_id = $1", job)
    assert {(s.team_rank_id, s.job_rank_id) for s in stand.agent.starts if s.job_id == job} == {(alpha, numbered)}
    # each attempt writes its own dir: attempt 2 resumed from attempt 1's checkpoint
    ck_root = stand.settings.state_dir.resolve() / "checkpoints" / job
    assert ck.startswith(f"file://{ck_root}/attempt-1/") or ck.startswith(f"{ck_root}/attempt-1/"), ck
    assert start2[0].checkpoint_dir.endswith("/attempt-2")
    out = read_json(ck_root / "attempt-2" / "result-0.json")
    assert out["value"] == expected(steps) and out["resumed_from"] == ck and out["attempt"] == "2"
    assert await stand.transitions(job) == [
        (1, None, "QUEUED"),
        (1, "QUEUED", "STARTING"),
        (1, "STARTING", "RUNNING"),
        (1, "RUNNING", "PREEMPTING"),
        (2, "PREEMPTING", "QUEUED"),
        (2, "QUEUED", "STARTING"),
        (2, "STARTING", "RUNNING"),
        (2, "RUNNING", "SUCCEEDED"),
    ]
    actions = [a["action"] for a in await stand.audit(job)]
    assert actions == ["allocate", "preempt", "release", "allocate", "release"]


async def test_cancel_while_queued(stand):
    job = await stand.submit("j-cq")
    await stand.client.get_workflow_handle(job).signal("cancel", {"actor": "alice", "reason": "not needed"})
    res = await stand.result(job)
    assert res.state == "CANCELLED"
    assert await stand.transitions(job) == [(1, None, "QUEUED"), (1, "QUEUED", "CANCELLED")]
    audit = await stand.audit(job)
    assert [(a["action"], a["actor"]) for a in audit] == [("cancel", "alice")]


async def test_cancel_while_starting_releases_the_gang(stand):
    job = await stand.submit("j-cs", image="fake/hang", replicas=2, gpus_per_replica=8)
    await stand.allocate(job, (stand.nodes[0], tuple(range(8))), (stand.nodes[1], tuple(range(8))))
    await eventually(lambda: _started(stand, job, 2), what="start tasks sent")
    await stand.client.get_workflow_handle(job).signal("cancel", {"actor": "alice"})
    res = await stand.result(job)
    assert res.state == "CANCELLED"
    assert await stand.live_gpus(job) == 0
    assert await stand.transitions(job) == [
        (1, None, "QUEUED"),
        (1, "QUEUED", "STARTING"),
        (1, "STARTING", "CANCELLING"),
        (1, "CANCELLING", "CANCELLED"),
    ]
    assert [a["action"] for a in await stand.audit(job)] == ["allocate", "cancel", "release"]


async def _started(stand, job, n):
    return len([s for s in stand.agent.starts if s.job_id == job]) >= n


async def test_cancel_while_running_stops_the_ranks(stand):
    job = await stand.submit("j-cr", command=SLEEP, grace_s=1.0)
    await stand.allocate(job, (stand.nodes[0], (0, 1)))
    await stand.wait_state(job, "RUNNING")
    await stand.client.get_workflow_handle(job).signal("cancel", {"actor": "alice", "reason": "done with it"})
    res = await stand.result(job)
    assert res.state == "CANCELLED"
    assert stand.agent.signals_seen[f"{job}.a1.r0"] == ["SIGTERM"]
    assert await stand.live_gpus(job) == 0
    assert await stand.transitions(job) == [
        (1, None, "QUEUED"),
        (1, "QUEUED", "STARTING"),
        (1, "STARTING", "RUNNING"),
        (1, "RUNNING", "CANCELLING"),
        (1, "CANCELLING", "CANCELLED"),
    ]


async def test_max_runtime_expiry_times_out(stand):
    job = await stand.submit("j-to", command=SLEEP, max_runtime_s=1.5, grace_s=1.0)
    await stand.allocate(job, (stand.nodes[0], (0,)))
    res = await stand.result(job)
    assert res.state == "TIMED_OUT"
    row = await stand.job(job)
    assert (row["finished_at"] - row["started_at"]).total_seconds() >= 1.5
    assert [a["action"] for a in await stand.audit(job)] == ["allocate", "timeout", "release"]
    assert stand.agent.signals_seen[f"{job}.a1.r0"] == ["SIGTERM"]


async def test_extensions_granted_and_refused(stand):
    job = await stand.submit("j-ext", command=SLEEP, max_runtime_s=40.0, grace_s=1.0)
    await stand.allocate(job, (stand.nodes[0], (0,)))
    await stand.wait_state(job, "RUNNING")
    h = stand.client.get_workflow_handle(job)

    async def extend(seconds):
        from workflows.messages import ExtendRequest, ExtendResult

        return await h.execute_update("extend", ExtendRequest("alice", seconds, "need more"), result_type=ExtendResult)

    too_long = await extend(11.0)  # > 25% of 40 s
    assert (too_long.granted, too_long.code) == (False, "too_long")
    first = await extend(10.0)
    assert first.granted and first.code == "granted" and first.extensions_used == 1
    # a reservation on this node that expects to start before the new end refuses the next one
    await stand.submit("j-big", start=False)
    await stand.pool.execute(
        "INSERT INTO reservations (job_id, epoch, expected_start, nodes, blocks)"
        " VALUES ('j-big', 1, now() + interval '45 seconds', ARRAY[$1], '{}')",
        stand.nodes[0],
    )
    blocked = await extend(10.0)
    assert (blocked.granted, blocked.code) == (False, "delays_reservation")
    await stand.pool.execute("DELETE FROM reservations")
    second = await extend(10.0)
    assert second.granted and second.extensions_used == 2
    third = await extend(1.0)
    assert (third.granted, third.code) == (False, "too_many")
    row = await stand.job(job)
    assert row["max_runtime_s"] == 60.0 and row["extensions"] == 2 and row["extended_s"] == 20.0
    status = await h.query("status")
    assert status["deadline"] is not None
    actions = [a["action"] for a in await stand.audit(job)]
    assert actions == ["allocate", "extend_refused", "extend", "extend_refused", "extend", "extend_refused"]
    await h.signal("cancel", {"actor": "alice"})
    assert (await stand.result(job)).state == "CANCELLED"


async def test_three_failures_caused_by_the_job_fail_it(stand):
    job = await stand.submit("j-bad", command=[PY, "-c", "import sys; sys.exit(1)"])
    for attempt in (1, 2, 3):
        await stand.wait_state(job, "QUEUED", attempt=attempt)
        await stand.allocate(job, (stand.nodes[attempt], (0,)), attempt=attempt)
    res = await stand.result(job)
    assert res.state == "FAILED"
    row = await stand.job(job)
    assert row["failed_attempts"] == 3 and row["attempt"] == 3
    assert await stand.live_gpus(job) == 0


async def test_duplicate_allocation_signal_is_a_noop(stand):
    job = await stand.submit("j-dup", command=[PY, "-c", "import time; time.sleep(0.5)"])
    alloc = await stand.allocate(job, (stand.nodes[0], (0,)))
    from control.leader import signals

    await signals.signal_allocation(stand.client, stand.settings, alloc)
    await signals.signal_allocation(stand.client, stand.settings, alloc)
    assert (await stand.result(job)).state == "SUCCEEDED"
    assert len([s for s in stand.agent.starts if s.job_id == job]) == 1
    # a re-signal after the job finished does not start anything
    assert await signals.signal_allocation(stand.client, stand.settings, alloc) is False


async def test_refused_start_fails_the_attempt_without_counting_against_the_job(stand):
    job = await stand.submit("j-ref", image="fake/refuse")
    await stand.allocate(job, (stand.nodes[0], (0,)))
    row = await stand.wait_state(job, "QUEUED", attempt=2)
    assert row["failed_attempts"] == 0 and row["front_of_class"] is True
    ev = next(e for e in await stand.events(job) if e["event"] == "attempt_failed")
    assert ev["detail"]["job_fault"] is False and "never started" in ev["reason"]


@pytest.mark.parametrize("settings_overrides", [{"gang_start_timeout_s": 1.5}])
async def test_gang_not_started_in_time_is_released_and_requeued(stand):
    job = await stand.submit("j-hang", image="fake/hang", replicas=2, gpus_per_replica=8)
    await stand.allocate(job, (stand.nodes[0], tuple(range(8))), (stand.nodes[1], tuple(range(8))))
    row = await stand.wait_state(job, "QUEUED", attempt=2, timeout=20)
    assert row["failed_attempts"] == 0 and row["front_of_class"] is True
    assert await stand.live_gpus(job) == 0
    ev = next(e for e in await stand.events(job) if e["event"] == "attempt_failed")
    assert ev["detail"]["job_fault"] is False and "started" in ev["reason"]


async def test_failed_serving_replica_restarts_alone(stand):
    cmd = [
        PY,
        "-c",
        "import os, sys, time, pathlib;"
        " m = pathlib.Path(os.environ['GPUFLEET_CHECKPOINT_DIR']) / ('crashed-' + os.environ['RANK']);"
        " m.parent.mkdir(parents=True, exist_ok=True);"
        " first = not m.exists(); m.touch();"
        " sys.exit(1) if (os.environ['RANK'] == '1' and first) else time.sleep(60)",
    ]
    job = await stand.submit("j-serve", command=cmd, replicas=2, priority_class="prod-serving", grace_s=1.0)
    await stand.allocate(job, (stand.nodes[0], (0,)), (stand.nodes[1], (0,)))
    await stand.wait_state(job, "RUNNING")
    await eventually(lambda: _started(stand, job, 3), what="rank 1 restarted")
    starts = [s.rank for s in stand.agent.starts if s.job_id == job]
    assert sorted(starts) == [0, 1, 1]
    assert stand.agent.stops == []  # rank 0 kept serving
    row = await stand.job(job)
    assert row["state"] == "RUNNING" and row["attempt"] == 1
    leases = await stand.pool.fetch("SELECT lease_id, state FROM leases WHERE job_id = $1 ORDER BY lease_id", job)
    assert [(lz["lease_id"], lz["state"]) for lz in leases] == [
        (f"{job}.a1.r0", "live"),
        (f"{job}.a1.r1", "released"),
        (f"{job}.a1.r1.g1", "live"),
    ]
    assert await stand.live_gpus(job) == 2
    assert "restart_replica" in [a["action"] for a in await stand.audit(job)]
    h = stand.client.get_workflow_handle(job)
    await h.signal("cancel", {"actor": "ops"})
    assert (await stand.result(job)).state == "CANCELLED"


async def test_long_running_attempt_continues_as_new_and_keeps_running(stand, monkeypatch):
    import workflows.job as wj
    from common.contracts import TaskState, TaskStatus
    from workflows.messages import TaskStatusBatch

    monkeypatch.setattr(wj, "HISTORY_LIMIT", 30)
    job = await stand.submit("j-long", command=[PY, "-c", "import time; time.sleep(4)"])
    alloc = await stand.allocate(job, (stand.nodes[0], (0,)))
    await stand.wait_state(job, "RUNNING")
    h = stand.client.get_workflow_handle(job)
    first_run = (await h.describe()).run_id
    from datetime import datetime

    noise = TaskStatus(
        stand.nodes[0], alloc.ranks[0].lease_id, job, 1, alloc.epoch, 0, TaskState.STARTED, datetime.now(UTC)
    )
    for _ in range(20):
        await h.signal("task_status", TaskStatusBatch([noise]))

    async def new_run():
        return (await h.describe()).run_id != first_run

    await eventually(new_run, what="continue-as-new")
    status = await h.query("status")
    assert status["state"] == "RUNNING" and status["ranks_started"] == 1
    assert (await stand.result(job)).state == "SUCCEEDED"
    assert len([s for s in stand.agent.starts if s.job_id == job]) == 1
