"""The control plane's /metrics against Postgres, after a scripted day on the embedded stack:
placements (guaranteed and borrowed), a reclaim, a priority preemption, a node failure. Each
exported value must equal what the store says (docs/design.md, Observability)."""

from __future__ import annotations

import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import PY
from tests.support import eventually
from worker_agent.nvml import write_fault

pytestmark = pytest.mark.e2e

SLEEP = [PY, "-c", "import time; time.sleep(600)"]


async def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """name -> {sorted label pairs: value}, samples of every family."""
    async with httpx.AsyncClient(timeout=5) as http:
        return samples((await http.get(url)).text)


def samples(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """An exposition's samples: name -> {sorted label pairs: value}."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def by(samples: dict, *keys: str, drop_zero: bool = True) -> dict[tuple[str, ...], float]:
    got: dict[tuple[str, ...], float] = {}
    for labels, v in samples.items():
        d = dict(labels)
        k = tuple(d[x] for x in keys)
        got[k] = got.get(k, 0.0) + v
    return {k: v for k, v in got.items() if v or not drop_zero}


async def store_view(pool) -> dict:
    alloc = await pool.fetch("SELECT gpu_type, team, borrowed, count(*) AS n FROM allocations GROUP BY 1, 2, 3")
    queued = await pool.fetch("SELECT priority_class, count(*) AS n FROM jobs WHERE state = 'QUEUED' GROUP BY 1")
    preempts = await pool.fetch(
        "SELECT split_part(reason, ':', 1) AS why, count(*) AS n FROM audit WHERE action = 'preempt' GROUP BY 1"
    )
    nodes = await pool.fetch("SELECT state, count(*) AS n FROM nodes GROUP BY 1")
    idle = await pool.fetch(
        "SELECT j.team, sum(cardinality(l.gpu_indices)) AS n FROM leases l JOIN jobs j USING (job_id)"
        " WHERE l.state = 'live' AND l.idle_since IS NOT NULL GROUP BY 1"
    )
    return {
        "allocated": {(r["gpu_type"], r["team"], str(r["borrowed"]).lower()): float(r["n"]) for r in alloc},
        "queued": {(r["priority_class"],): float(r["n"]) for r in queued},
        "preemptions": {(r["why"],): float(r["n"]) for r in preempts},
        "nodes": {(r["state"],): float(r["n"]) for r in nodes},
        "allocated_idle": {(r["team"],): float(r["n"]) for r in idle},
    }


async def exported(url: str) -> dict:
    m = await scrape(url)
    return {
        "allocated": by(m.get("gpufleet_gpus_allocated", {}), "gpu_type", "team", "borrowed"),
        "queued": by(m.get("gpufleet_queued_jobs", {}), "priority_class"),
        "preemptions": by(m.get("gpufleet_preemptions_total", {}), "reason"),
        "nodes": by(m.get("gpufleet_nodes", {}), "state"),
        "allocated_idle": by(m.get("gpufleet_allocated_idle_gpus", {}), "team"),
        "raw": m,
    }


async def agree(stack, *, what: str, timeout: float = 30.0) -> dict:
    """Poll until every exported value equals the store's; returns the last scrape."""
    url = stack.controls[0].metrics_url
    last: dict = {}

    async def probe():
        nonlocal last
        want = await store_view(stack.pool)
        got = await exported(url)
        last = {"want": want, "got": {k: v for k, v in got.items() if k != "raw"}}
        return got if all(got[k] == want[k] for k in want) else None

    try:
        return await eventually(probe, timeout=timeout, interval=0.2, what=what)
    except AssertionError as e:
        raise AssertionError(f"{e}: {last}") from None


@pytest.fixture
def stack_overrides():
    # sleeping ranks read idle after two seconds; the leader writes readings twice a second
    return {"idle_gpu_after_s": 2.0, "gpu_use_flush_s": 0.5, "health_sweep_s": 0.5}


async def test_exported_values_equal_the_store_through_placements_preemptions_and_a_failure(stack):
    url = stack.controls[0].metrics_url
    assert url.startswith("http://127.0.0.1:")
    first = await exported(url)
    assert first["raw"]["gpufleet_control_is_leader"] == {(("holder", "c1"),): 1.0}

    # placements: alpha fills its guarantee (16) and borrows 8; beta takes 8 of its own
    alpha = [await stack.submit(command=SLEEP, gpus_per_replica=8) for _ in range(3)]
    for j in alpha:
        await stack.wait_state(j, "RUNNING")
    beta1 = await stack.submit(token="tok-beta", team="beta", command=SLEEP, gpus_per_replica=8)
    await stack.wait_state(beta1, "RUNNING")
    got = await agree(stack, what="allocation after placements")
    assert got["allocated"] == {("h100", "alpha", "false"): 16.0, ("h100", "alpha", "true"): 8.0,
                                ("h100", "beta", "false"): 8.0}  # fmt: skip
    assert got["raw"]["gpufleet_placements_total"]
    # sleeping ranks: every lease is allocated-but-idle for its team, in the store and in /metrics
    got = await eventually(
        lambda: _idle_everywhere(stack, url), timeout=30, interval=0.3, what="allocated-but-idle leases"
    )
    auth = {"Authorization": "Bearer tok-alpha"}
    use = (await stack.http.get(f"/v1/jobs/{alpha[0]}", headers=auth)).json()["gpu_use"]
    assert use["idle"] and use["idle_gpus"] == use["gpus"] == 8 and use["gpu_util"] < 5
    explain = (await stack.http.get(f"/v1/jobs/{alpha[0]}/explain", headers=auth)).json()
    assert "allocated but idle" in explain["message"] and explain["gpu_use"]["idle"]

    # a reclaim: beta, within its guarantee, takes back the 8 GPUs alpha borrowed
    beta2 = await stack.submit(token="tok-beta", team="beta", command=SLEEP, gpus_per_replica=8)
    await stack.wait_state(beta2, "RUNNING", timeout=60)
    got = await agree(stack, what="after the reclaim")
    assert got["preemptions"].get(("reclaim",)) == 1.0
    reclaim = got["raw"]["gpufleet_reclaim_seconds_count"]
    assert sum(reclaim.values()) == 1.0

    # a priority preemption: a new team's prod-batch job, within its guarantee, evicts research work
    r = await stack.http.put(
        "/v1/teams/gamma/quota",
        json={"gpu_type": "h100", "guaranteed": 8, "borrow_limit": 0, "reason": "test"},
        headers={"Authorization": "Bearer tok-admin", "Idempotency-Key": uuid.uuid4().hex},
    )
    assert r.status_code == 200, r.text
    prod = await stack.submit(
        token="tok-admin", team="gamma", priority_class="prod-batch", command=SLEEP, gpus_per_replica=8
    )
    await stack.wait_state(prod, "RUNNING", timeout=60)
    got = await agree(stack, what="after the priority preemption")
    assert got["preemptions"].get(("priority",)) == 1.0
    lost = got["raw"]["gpufleet_preemption_lost_gpu_hours_total"]
    assert all(v >= 0 for v in lost.values())

    # a node failure: a fatal Xid on a node that runs beta's first job
    node = await stack.pool.fetchval("SELECT node_id FROM leases WHERE job_id = $1 AND state = 'live'", beta1)
    write_fault(stack.settings.state_dir, node, gpu=0, xid=79)
    await stack.wait_state(beta1, "QUEUED", "STARTING", "RUNNING", attempt=2, timeout=60)
    got = await agree(stack, what="after the node failure")
    assert got["nodes"].get(("ready",), 0) == 3.0
    failure_lost = got["raw"]["gpufleet_failure_lost_gpu_hours_total"]
    assert sum(failure_lost.values()) > 0
    # the cluster's gauges add up: allocated + idle = healthy GPUs of every type
    raw = got["raw"]
    healthy = sum(raw["gpufleet_gpus_healthy"].values())
    idle = sum(raw["gpufleet_gpus_idle"].values())
    allocated = sum(got["allocated"].values())
    on_ready = await stack.pool.fetchval(
        "SELECT count(*) FROM allocations a JOIN nodes n USING (node_id) WHERE n.state = 'ready'"
    )
    assert idle == healthy - on_ready and allocated >= on_ready
    cost = raw["gpufleet_idle_gpu_cost_usd_per_hour"][()]
    assert cost == pytest.approx(idle * stack.settings.gpu_hour_usd)


async def _idle_everywhere(stack, url):
    got = await exported(url)
    want = await store_view(stack.pool)
    live = await stack.pool.fetch(
        "SELECT j.team, sum(cardinality(l.gpu_indices)) AS n FROM leases l JOIN jobs j USING (job_id)"
        " WHERE l.state = 'live' GROUP BY 1"
    )
    every = {(r["team"],): float(r["n"]) for r in live}
    if want["allocated_idle"] == every and got["allocated_idle"] == every:
        return got
    return None


async def test_a_follower_says_so_and_exports_no_cluster(stack):
    """A second control process (not the leader) serves /metrics too, saying it follows."""
    from common.temporal import connect
    from control.process import ControlProcess

    client = await connect(stack.settings)  # one worker per task queue per client
    follower = ControlProcess(stack.settings, holder="c2", pool=stack.pool, client=client, grpc=False)
    await follower.start()
    try:
        m = await scrape(follower.metrics_url)
        assert m["gpufleet_control_is_leader"] == {(("holder", "c2"),): 0.0}
        assert m["gpufleet_leader_epoch"] == {(): 0.0}
        assert "gpufleet_gpus_allocated" not in m
        leader = await scrape(stack.controls[0].metrics_url)
        assert leader["gpufleet_leader_epoch"][()] >= 1
        assert leader["gpufleet_leader_takeovers_total"][()] == 1.0
    finally:
        await follower.stop()


async def test_a_rank_that_trains_shows_use_and_is_never_idle_while_a_sleeping_one_is(stack):
    """Simulated GPUs follow what the ranks really do: the example training loop reads busy in
    the job's status and on the agent's /metrics; a sleeping rank reads idle."""
    from tests.e2e.conftest import TRAIN_COUNTER

    train = [PY, TRAIN_COUNTER, "--steps", "100000", "--step-time", "0", "--compute-time", "0.05"]
    busy = await stack.submit(command=train, gpus_per_replica=2)
    asleep = await stack.submit(command=SLEEP, gpus_per_replica=2)
    for j in (busy, asleep):
        await stack.wait_state(j, "RUNNING")
    auth = {"Authorization": "Bearer tok-alpha"}

    async def readings():
        b = (await stack.http.get(f"/v1/jobs/{busy}", headers=auth)).json()["gpu_use"]
        s = (await stack.http.get(f"/v1/jobs/{asleep}", headers=auth)).json()["gpu_use"]
        if b and s and b["gpu_util"] is not None and s["idle"] and b["gpu_util"] > 50:
            return b, s
        return None

    b, s = await eventually(readings, timeout=30, interval=0.3, what="a busy and an idle job")
    assert not b["idle"] and b["idle_gpus"] == 0 and s["gpu_util"] < 5
    lease = await stack.pool.fetchrow("SELECT node_id, gpu_indices FROM leases WHERE job_id = $1", busy)
    addr = await stack.pool.fetchval("SELECT agent_addr FROM nodes WHERE node_id = $1", lease["node_id"])
    m = await scrape(f"http://{addr}/metrics")  # where the node's heartbeats say its agent serves
    util = m["gpufleet_gpu_utilization_percent"]
    on_busy = [util[(("gpu", str(g)), ("node", lease["node_id"]))] for g in lease["gpu_indices"]]
    assert all(u > 50 for u in on_busy), on_busy
