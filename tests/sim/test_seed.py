"""The seed workload has the shape the issue asks for; the fault schedule its rate."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from sim.failures import FailureModel, fault_schedule
from sim.seed import SeedConfig, seed_workload
from sim.workload import ClusterSpec


@pytest.fixture(scope="module")
def day():
    return seed_workload(SeedConfig(days=1.0, seed=1, warmup_h=0.0))


def test_cluster_and_teams(day) -> None:
    cl = day.cluster
    assert cl.total_nodes == 3000 and cl.total_gpus() == 24_000
    assert all(b.nodes == 32 for b in cl.blocks[:-1]) and len(cl.blocks) == 94
    assert sum(t.guaranteed("h100") for t in day.teams) == 24_000  # guarantees sum to the cluster
    classes_by_team: dict[str, set] = {}
    for j in day.jobs:
        classes_by_team.setdefault(j.team, set()).add(j.priority)
    assert set().union(*classes_by_team.values()) == {"prod-serving", "prod-batch", "research", "preemptible"}
    assert set(classes_by_team) == {t.name for t in day.teams}


def test_submission_mix(day) -> None:
    jobs = [j for j in day.jobs if j.submit >= 0]
    n = len(jobs)
    assert 36_000 <= n <= 44_000
    small = sum(1 for j in jobs if j.gpus <= 8)
    assert 0.88 <= small / n <= 0.92
    large = [j for j in jobs if j.gpus >= 1024]
    assert 15 <= len(large) <= 60
    assert max(j.gpus for j in large) == 8192 and min(j.gpus for j in large) == 1024
    gh = lambda js: sum(j.gpus * min(j.work_s, j.max_runtime_s, 86400 - j.submit) for j in js)  # noqa: E731
    assert gh(large) / gh(jobs) > 0.5  # a few dozen gangs hold most GPU-hours
    # daily shape: the afternoon is busier than the night
    by_hour = Counter(int(j.submit // 3600) for j in jobs)
    assert sum(by_hour[h] for h in range(12, 17)) > 2 * sum(by_hour[h] for h in range(0, 5))
    # sweep bursts at 50/s
    per_second = Counter(int(j.submit) for j in jobs if j.kind == "sweep")
    assert max(per_second.values()) >= 50
    # users over-estimate max_runtime; a few under-estimate (they time out)
    over = sum(1 for j in jobs if j.max_runtime_s >= j.work_s) / n
    assert 0.93 <= over < 1.0
    assert sum(1 for j in jobs if j.max_runtime_s >= 2 * j.work_s) / n > 0.5
    # checkpoints: big jobs every 15-30 min
    assert all(900 <= j.checkpoint_s <= 1800 for j in large)
    assert all(j.pack == "block" and j.max_blocks >= -(-j.replicas // 32) for j in large)


def test_deterministic_per_seed() -> None:
    a = seed_workload(SeedConfig(days=0.05, seed=7))
    b = seed_workload(SeedConfig(days=0.05, seed=7))
    c = seed_workload(SeedConfig(days=0.05, seed=8))
    assert a.jobs == b.jobs
    assert a.jobs != c.jobs


def test_fault_rate_matches_the_model() -> None:
    cl = ClusterSpec.uniform(3000, 32)
    faults = fault_schedule(cl, FailureModel(), 0.0, 30 * 86400.0, random.Random(1))
    expected = 2e-5 * 24_000 * 24 * 30
    assert abs(len(faults) - expected) < 4 * expected**0.5
    assert all(0 <= f.node_index < 3000 for f in faults)
    assert {f.kind for f in faults} == {"gpu", "node"}
    assert fault_schedule(cl, FailureModel(rate_per_gpu_hour=0), 0, 86400.0, random.Random(1)) == ()


def test_one_block_requests_wait_a_bounded_time_and_large_gangs_hold_their_limit(day) -> None:
    one_block = [j for j in day.jobs if j.max_blocks == 1]
    assert len(one_block) > 100 and {j.max_blocks_wait_s for j in one_block} == {300.0}
    assert all(j.max_blocks_wait_s is None for j in day.jobs if j.gpus >= 1024)
    hard = seed_workload(SeedConfig(days=0.05, seed=1, warmup_h=0.0, one_block_wait_s=None))
    assert all(j.max_blocks_wait_s is None for j in hard.jobs)
