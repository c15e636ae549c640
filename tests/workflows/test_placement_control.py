"""The leader's placement cycles and the control process, with a fake agent.

Each test runs one or two in-process ``ControlProcess``es against the real Temporal
dev server and Postgres; jobs are placed by the real engine.
"""

from __future__ import annotations

import asyncio

import pytest
from temporalio.service import RPCError, RPCStatusCode

from common.temporal import connect, make_worker
from control.leader import signals
from control.leader.state import LeaderState
from control.process import ControlProcess
from store import allocations, errors
from tests.support import eventually, workflow_status
from tests.workflows.fake_agent import FakeAgent
from tests.workflows.harness import PY, TRAIN, Stand, read_json, scaled_settings, seed


class _Fwd:
    """The fake agent reports to whichever control process leads (as agents follow redirects)."""

    def __init__(self) -> None:
        self.procs: list[ControlProcess] = []

    def submit(self, status) -> None:
        for p in self.procs:
            if p.is_leader and p.reports is not None:
                p.reports.submit(status)
                return
        self.procs[0].reports.submit(status)


@pytest.fixture
async def cluster(pool, temporal_env, tmp_path):
    settings = scaled_settings(tmp_path, preemption_protect_s=0.0, placement_cycle_s=0.3)
    client = temporal_env.client
    nodes, _ = await seed(pool, settings)
    # the test's seed took the leader row; hand it back so a control process can lead
    await pool.execute("DELETE FROM leader")
    fwd = _Fwd()
    agent = FakeAgent(fwd, tmp_path / "agent")
    procs: list[ControlProcess] = []

    async def start(holder: str) -> ControlProcess:
        # a client per process: one client may not run two workers on one task queue
        own = await connect(settings, address=client.service_client.config.target_host)
        p = ControlProcess(settings, holder=holder, pool=pool, client=own, grpc=False)
        await p.start()
        procs.append(p)
        fwd.procs.append(p)
        return p

    node_worker = make_worker(client, settings.agent_shared_task_queue, activities=agent.activities())
    async with node_worker:
        stand = Stand(pool=pool, client=client, settings=settings, agent=agent, epoch=0, nodes=nodes)
        yield stand, start
        for p in procs:
            if not p._stopping.is_set():
                await p.stop()
        await agent.kill_all()


async def leading(proc: ControlProcess, timeout: float = 10.0) -> int:
    await eventually(lambda: _true(proc.is_leader), timeout=timeout, what=f"{proc.holder} leading")
    return proc.epoch


async def _true(v):
    return v


async def test_placement_places_and_the_job_succeeds(cluster):
    stand, start = cluster
    c1 = await start("c1")
    await leading(c1)
    job = await stand.submit("p-ok", command=[PY, "-c", "import time; time.sleep(0.2)"])
    res = await stand.result(job)
    assert res.state == "SUCCEEDED"
    assert await stand.transitions(job) == [
        (1, None, "QUEUED"),
        (1, "QUEUED", "STARTING"),
        (1, "STARTING", "RUNNING"),
        (1, "RUNNING", "SUCCEEDED"),
    ]
    allocate = next(a for a in await stand.audit(job) if a["action"] == "allocate")
    assert allocate["actor"] == "placement:c1" and allocate["detail"]["epoch"] == c1.epoch


async def test_unplaceable_job_gets_a_position_and_a_reason(cluster):
    stand, start = cluster
    c1 = await start("c1")
    await leading(c1)
    job = await stand.submit("p-big", replicas=5, gpus_per_replica=8)  # the cluster has 4 nodes

    async def published():
        row = await stand.job(job)
        return row if row["pending_reason"] else None

    row = await eventually(published, what="a pending reason")
    assert row["state"] == "QUEUED" and row["queue_position"] == 1
    assert row["pending_reason"] in ("capacity", "topology", "invalid", "quota")


async def test_a_job_without_a_workflow_is_started_by_its_allocation(cluster):
    stand, start = cluster
    c1 = await start("c1")
    await leading(c1)
    job = await stand.submit("p-nowf", command=[PY, "-c", "pass"], start=False)
    await stand.wait_state(job, "SUCCEEDED")
    assert (await stand.result(job)).state == "SUCCEEDED"


async def test_a_lost_allocation_signal_is_resent(cluster, monkeypatch):
    stand, start = cluster
    real = signals.signal_allocation
    dropped: list[str] = []

    async def lossy(client, settings, alloc, labels=None):
        if alloc.job_id == "p-lost" and not dropped:
            dropped.append(alloc.job_id)
            # the RPC failed (Temporal unreachable): a signal Temporal accepted is in the
            # workflow's history and cannot be lost, so only a failed send needs a resend
            raise RPCError("connection reset", RPCStatusCode.UNAVAILABLE, b"")
        return await real(client, settings, alloc, labels)

    monkeypatch.setattr(signals, "signal_allocation", lossy)
    c1 = await start("c1")
    await leading(c1)
    job = await stand.submit("p-lost", command=[PY, "-c", "pass"])
    assert (await stand.result(job, timeout=30)).state == "SUCCEEDED"
    assert dropped == ["p-lost"]


async def test_research_job_is_preempted_by_prod_batch_and_resumes_to_the_same_result(cluster):
    from tests.e2e.train import expected

    stand, start = cluster
    c1 = await start("c1")
    await leading(c1)
    steps = 60
    research = await stand.submit(
        "p-research",
        command=[PY, TRAIN, str(steps), "0.05", "5"],
        replicas=4,
        gpus_per_replica=8,
        priority_class="research",
        team="beta",
        grace_s=5.0,
    )
    await stand.wait_state(research, "RUNNING")
    lease_dir = (
        stand.agent.root
        / (await stand.pool.fetchval("SELECT node_id FROM leases WHERE job_id = $1 AND rank = 0", research))
        / f"{research}.a1.r0"
    )

    async def progressed():
        try:
            return read_json(lease_dir / "progress.json")["step"] >= 10
        except (OSError, ValueError):
            return False

    await eventually(progressed, timeout=15, what="training progress")

    async def gang_checkpoint():
        return (await workflow_status(stand.client, research)).get("checkpoint")

    await eventually(gang_checkpoint, timeout=15, what="a checkpoint every rank reported")
    prod = await stand.submit(
        "p-prod",
        command=[PY, "-c", "import time; time.sleep(0.5)"],
        replicas=1,
        gpus_per_replica=8,
        priority_class="prod-batch",
        team="alpha",
    )
    assert (await stand.result(prod, timeout=40)).state == "SUCCEEDED"
    res = await stand.result(research, timeout=60)
    assert res.state == "SUCCEEDED" and res.attempt == 2
    row = await stand.job(research)
    assert row["preemptions"] == 1
    out = read_json(stand.settings.state_dir.resolve() / "checkpoints" / research / "attempt-2" / "result-0.json")
    assert out["value"] == expected(steps) and out["resumed_from"] and out["attempt"] == "2"
    assert all(sigs == ["SIGTERM"] for lid, sigs in stand.agent.signals_seen.items() if lid.startswith(research))
    preempt = next(a for a in await stand.audit(research) if a["action"] == "preempt")
    assert preempt["detail"]["by_job"] == prod


async def test_leader_failover_higher_epoch_fences_the_old_leader(cluster):
    stand, start = cluster
    c1 = await start("c1")
    e1 = await leading(c1)
    c2 = await start("c2")
    long = await stand.submit(
        "f-long", command=[PY, "-c", "import time; time.sleep(3)"], replicas=2, gpus_per_replica=8
    )
    await stand.wait_state(long, "RUNNING", timeout=15)
    t0 = asyncio.get_running_loop().time()
    await c1.kill()  # no resignation: c2 must wait for the lease to expire
    e2 = await leading(c2, timeout=30)
    took = asyncio.get_running_loop().time() - t0
    assert e2 > e1 and took < 30
    # a write under the old epoch is refused
    await stand.submit("f-stale", start=False)
    with pytest.raises(errors.StaleEpoch):
        await allocations.commit_gang(
            stand.pool,
            scope=stand.settings.leader_scope,
            epoch=e1,
            job_id="f-stale",
            attempt=1,
            placements=[allocations.GangPlacement(0, stand.nodes[3], (7,), False)],
        )
    # the new leader keeps placing, and the running job finishes
    after = await stand.submit("f-after", command=[PY, "-c", "pass"])
    assert (await stand.result(after, timeout=30)).state == "SUCCEEDED"
    assert (await stand.result(long, timeout=30)).state == "SUCCEEDED"
    allocs = [a for a in await stand.audit(after) if a["action"] == "allocate"]
    assert allocs[0]["detail"]["epoch"] == e2
    await assert_no_gpu_had_two_live_leases(stand.pool)


async def assert_no_gpu_had_two_live_leases(pool) -> None:
    """Over the whole lease history: no two leases holding one GPU were live at once."""
    overlaps = await pool.fetch(
        "WITH g AS (SELECT lease_id, node_id, unnest(gpu_indices) AS gpu, created_at,"
        "  coalesce(released_at, 'infinity') AS released_at FROM leases)"
        " SELECT a.lease_id AS a, b.lease_id AS b, a.node_id, a.gpu FROM g a JOIN g b"
        "  ON a.node_id = b.node_id AND a.gpu = b.gpu AND a.lease_id < b.lease_id"
        "  AND a.created_at < b.released_at AND b.created_at < a.released_at"
    )
    assert not overlaps, [dict(r) for r in overlaps]


async def test_a_queued_job_costs_temporal_nothing_until_it_is_placed(cluster):
    """A QUEUED job has no workflow (its allocation starts one); the leader's ownership check
    leaves it alone, and a cancel reaches it by signal-with-start."""
    from temporalio.service import RPCError

    stand, start = cluster
    c1 = await start("c1")
    await leading(c1)
    job = await stand.submit("p-orphan", replicas=5, gpus_per_replica=8, start=False)  # never placeable here
    await stand.pool.execute("UPDATE jobs SET updated_at = now() - interval '1 hour' WHERE job_id = $1", job)
    stats = await c1.ownership.reconcile_once()
    assert (stats.checked, stats.started) == (0, 0)
    with pytest.raises(RPCError) as e:
        await stand.client.get_workflow_handle(job).describe()
    assert e.value.status == RPCStatusCode.NOT_FOUND
    from workflows import messages as m

    await signals.start_with_signal(stand.client, stand.settings, job, m.SIGNAL_CANCEL, m.CancelRequest(actor="test"))
    assert (await stand.result(job)).state == "CANCELLED"


async def test_a_gang_committed_without_a_signal_is_signalled_by_the_leader(cluster):
    """E.g. committed by a previous leader that died before signalling."""
    from store.teams import TeamQuota, set_quota

    stand, start = cluster
    c1 = await start("c1")
    epoch = await leading(c1)
    async with stand.pool.acquire() as conn:  # a type the cluster has no node of: placement leaves it alone
        await set_quota(conn, TeamQuota("alpha", "a100", 8, 0), actor="test", reason="fixture")
    job = await stand.submit("p-adopt", command=[PY, "-c", "pass"], gpu_type="a100")
    await allocations.commit_gang(
        stand.pool,
        scope=stand.settings.leader_scope,
        epoch=epoch,
        job_id=job,
        attempt=1,
        placements=[allocations.GangPlacement(0, stand.nodes[0], (5,), False)],
    )
    assert (await stand.result(job, timeout=30)).state == "SUCCEEDED"


async def test_a_placement_workflow_left_by_an_older_version_is_terminated(cluster):
    """Before the leader ran its cycles itself, a singleton workflow scheduled them; a run
    left in Temporal by that version is retired by the first leader (nothing polls it)."""
    from control.process import RETIRED_PLACEMENT_WORKFLOW_ID

    stand, start = cluster
    await stand.client.start_workflow(
        "PlacementWorkflow",
        id=RETIRED_PLACEMENT_WORKFLOW_ID,
        task_queue=stand.settings.control_task_queue + "-placement",
    )
    c1 = await start("c1")
    await leading(c1)
    h = stand.client.get_workflow_handle(RETIRED_PLACEMENT_WORKFLOW_ID)

    async def terminated():
        return (await h.describe()).status.name == "TERMINATED"

    await eventually(terminated, timeout=10, what="the retired placement workflow terminated")
    job = await stand.submit("p-after-retire", command=[PY, "-c", "pass"])
    assert (await stand.result(job)).state == "SUCCEEDED"


async def test_a_change_wakes_the_leader_at_once(cluster):
    stand, start = cluster
    # the periodic cycle is far away: only a wake-up (Postgres NOTIFY) can place the job in time
    stand.settings.placement_cycle_s = 60.0
    c1 = await start("c1")
    await leading(c1)
    assert c1.cycles is not None
    await eventually(lambda: _now(c1.cycles.cycles >= 1), timeout=10, what="the first cycle")
    job = await stand.submit("p-woken", command=[PY, "-c", "pass"])

    async def allocated():
        return await stand.pool.fetchval("SELECT 1 FROM job_events WHERE job_id = $1 AND event = 'allocated'", job)

    await eventually(allocated, timeout=5, what="the job allocated by a woken cycle")
    assert (await stand.result(job)).state == "SUCCEEDED"


async def _now(value):
    return value


async def test_a_stop_during_the_takeover_leaves_no_leader_and_no_cycle_behind(cluster, monkeypatch):
    """Stop 61's CI failure, in process: the stop came after the leader row was won but
    while the takeover ran. Before, the stop found no epoch and returned; the takeover then
    finished and the process led on, its placement cycles outliving the stop, the row
    unresigned. Now the stop waits for the takeover, resigns, and awaits the cycle task."""
    stand, start = cluster
    entered, release = asyncio.Event(), asyncio.Event()
    real = LeaderState.take_over

    async def slow(self, epoch: int) -> None:
        await real(self, epoch)
        entered.set()
        await release.wait()

    monkeypatch.setattr(LeaderState, "take_over", slow)
    c1 = await start("c1")
    await asyncio.wait_for(entered.wait(), 10)
    stopping = asyncio.create_task(c1.stop())
    await asyncio.sleep(0)  # one turn of the loop: the stop has begun
    release.set()
    await asyncio.wait_for(stopping, 30)
    assert not c1.is_leader
    assert c1._cycle_task is None and all(t.done() for t in c1._tasks)
    free = await stand.pool.fetchval(
        "SELECT expires_at < now() FROM leader WHERE scope = $1", stand.settings.leader_scope
    )
    assert free, "the row was left to expire: a successor would wait out the lease"
