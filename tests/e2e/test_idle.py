"""Idle GPUs, measured where they cost: scheduler-caused idle per freed node against the
requirements' SLO (under 2 minutes), and GPUs idle while demand waits, with their cost, in
the control plane's /metrics, the API's /metrics and /v1/cluster (docs/design.md, Observability)."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import PY
from tests.e2e.test_metrics import samples, scrape
from tests.support import eventually

pytestmark = pytest.mark.e2e

SLO_S = 120.0  # the requirements: a freed node is re-allocated within 2 minutes while work is queued


def _sleep(s: float) -> list[str]:
    return [PY, "-c", f"import time; time.sleep({s})"]


async def test_a_node_freed_with_work_queued_is_reallocated_within_seconds(stack):
    url = stack.controls[0].metrics_url
    # fill all four nodes; two jobs end soon, three more wait for their nodes
    short = [await stack.submit(command=_sleep(2), gpus_per_replica=8) for _ in range(2)]
    long = [await stack.submit(token="tok-beta", team="beta", command=_sleep(600), gpus_per_replica=8)
            for _ in range(2)]  # fmt: skip
    for j in short + long:
        await stack.wait_state(j, "RUNNING", "SUCCEEDED")
    waiting = [await stack.submit(command=_sleep(600), gpus_per_replica=8) for _ in range(3)]
    for j in short:
        await stack.wait_state(j, "SUCCEEDED")
    for j in waiting[:2]:
        await stack.wait_state(j, "RUNNING", timeout=30)

    async def measured():
        m = await scrape(url)
        n = m.get("gpufleet_scheduler_idle_seconds_count", {}).get((), 0.0)
        return m if n >= 2 else None

    m = await eventually(measured, timeout=10, interval=0.2, what="two freed nodes measured")
    count = m["gpufleet_scheduler_idle_seconds_count"][()]
    total = m["gpufleet_scheduler_idle_seconds_sum"][()]
    buckets = {float(dict(k)["le"]): v for k, v in m["gpufleet_scheduler_idle_seconds_bucket"].items()}
    worst_bound = min(le for le, v in buckets.items() if v == count)  # every spell is at most this
    print(json.dumps({"scheduler_idle_per_freed_node": {"count": count, "mean_s": round(total / count, 3),
                                                        "max_at_most_s": worst_bound, "slo_s": SLO_S}}))  # fmt: skip
    assert worst_bound <= SLO_S
    assert total / count < 5.0, "with a half-second cycle a freed node waits a cycle or two"
    # the third waiting job still has no node: nothing fits it, so nothing is scheduler-idle
    assert m["gpufleet_scheduler_idle_nodes"][()] == 0


@pytest.fixture
def stack_overrides():
    return {"_nodes": 5}


async def test_ten_percent_idle_with_demand_queued_shows_its_cost(stack):
    """40 GPUs: 36 allocated, 4 free on one node, an 8-GPU job waits (it fits nowhere)."""
    price = stack.settings.gpu_hour_usd
    jobs = [await stack.submit(command=_sleep(600), gpus_per_replica=8) for _ in range(2)]
    jobs += [await stack.submit(token="tok-beta", team="beta", command=_sleep(600), gpus_per_replica=8)
             for _ in range(2)]  # fmt: skip
    jobs.append(await stack.submit(command=_sleep(600), gpus_per_replica=4))
    for j in jobs:
        await stack.wait_state(j, "RUNNING")
    blocked = await stack.submit(token="tok-beta", team="beta", command=_sleep(600), gpus_per_replica=8)

    async def control_says():
        m = await scrape(stack.controls[0].metrics_url)
        idle = sum(m.get("gpufleet_gpus_idle", {}).values())
        queued = sum(m.get("gpufleet_queued_jobs", {}).values())
        return m if idle == 4 and queued == 1 else None

    m = await eventually(control_says, timeout=20, interval=0.2, what="4 idle GPUs with a job queued")
    assert sum(m["gpufleet_gpus_healthy"].values()) == 40
    assert m["gpufleet_idle_gpu_cost_usd_per_hour"][()] == pytest.approx(4 * price)
    # the 4 free GPUs cannot take the 8-GPU job: idle, but not the scheduler's doing
    assert sum(m.get("gpufleet_gpus_idle_with_demand", {}).values()) == 0
    assert (await stack.job(blocked))["state"] == "QUEUED"

    api = samples((await stack.http.get("/metrics")).text)
    assert sum(api["gpufleet_cluster_idle_gpus"].values()) == 4
    assert api["gpufleet_cluster_idle_gpu_cost_usd_per_hour"][()] == pytest.approx(4 * price)

    view = (await stack.http.get("/v1/cluster", headers={"Authorization": "Bearer tok-admin"})).json()
    totals = view["totals"]
    assert totals["idle_gpu_total"] == 4
    assert totals["idle_cost_usd_per_hour"] == pytest.approx(4 * price)
    print(
        json.dumps({"idle_gpus": totals["idle_gpu_total"], "idle_cost_usd_per_hour": totals["idle_cost_usd_per_hour"]})
    )
