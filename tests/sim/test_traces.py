"""Trace adapters parse their fixtures (hand-written rows in each format) and replay."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from sim.run import run_policies
from sim.traces import TraceError, TraceOptions, load_topology_csv, load_trace, read_rows
from sim.workload import ClusterSpec

FIX = Path(__file__).parent / "fixtures"
SMALL = ClusterSpec.uniform(64, 8)  # 512 GPUs in 8 blocks


def test_generic_csv() -> None:
    wl = load_trace(FIX / "generic.csv", SMALL, TraceOptions(format="generic"))
    assert len(wl.jobs) == 30
    by_key = {j.kind: j for j in wl.jobs}
    g03 = by_key["g03"]
    assert (g03.submit, g03.work_s, g03.gpus, g03.team, g03.priority) == (10.0, 300.0, 8, "nlp", "prod-batch")
    assert g03.max_runtime_s == 1800.0  # given by the trace
    assert by_key["g02"].max_runtime_s >= 1200.0  # not given: a user-style estimate
    g24 = by_key["g24"]
    assert (g24.replicas, g24.gpus_per_replica, g24.pack) == (32, 8, "block")
    g30 = by_key["g30"]  # 24 GPUs: three whole nodes
    assert (g30.replicas, g30.gpus_per_replica) == (3, 8)
    assert {j.priority for j in wl.jobs} == {"prod-serving", "prod-batch", "research", "preemptible"}
    # the trace's team column names the teams; guarantees split the cluster evenly
    assert sorted(t.name for t in wl.teams) == ["nlp", "rl", "serving", "speech", "vision"]
    assert sum(t.guaranteed("h100") for t in wl.teams) == 512
    assert wl.end == pytest.approx(3001.0)  # up to the last submission
    assert [j.job_id for j in wl.jobs] == sorted(j.job_id for j in wl.jobs)


def test_philly_style_csv() -> None:
    wl = load_trace(FIX / "philly.csv", SMALL, TraceOptions(format="philly"))
    assert len(wl.jobs) == 25
    first = wl.jobs[0]
    assert first.submit == 0.0 and first.kind == "app_01"
    by_key = {j.kind: j for j in wl.jobs}
    assert by_key["app_02"].submit == pytest.approx(73.0)  # 02:55:21 - 02:54:08
    assert by_key["app_25"].submit == pytest.approx(7 * 3600 + 35 * 60 + 52)
    assert (by_key["app_19"].replicas, by_key["app_19"].gpus_per_replica) == (2, 6)  # 12 GPUs
    assert by_key["app_10"].work_s == 72000.0
    # the vc column names the teams (5 virtual clusters)
    assert sorted(t.name for t in wl.teams) == ["vc1qz", "vc7Bz", "vcHyQ", "vcJsw", "vcWoR"]
    assert {j.priority for j in wl.jobs} == {"research"}
    # fold into 2 teams by a stable hash
    wl2 = load_trace(FIX / "philly.csv", SMALL, TraceOptions(format="philly", teams=2))
    assert sorted(t.name for t in wl2.teams) == ["team00", "team01"]
    assert {j.team for j in wl2.jobs} <= {"team00", "team01"}


def test_alibaba_2023_pods_csv() -> None:
    rows, stats = read_rows(FIX / "alibaba_pods.csv", TraceOptions(format="alibaba"))
    assert stats["rows"] == 30
    assert stats["skipped_no_gpu"] == 2  # CPU-only pods
    assert stats["skipped_pending"] == 2  # never scheduled
    assert stats["fractional_gpu"] == 6  # gpu_milli < 1000: one whole GPU here
    assert len(rows) == 26
    wl = load_trace(FIX / "alibaba_pods.csv", SMALL, TraceOptions(format="alibaba", teams=4))
    by_key = {j.kind: j for j in wl.jobs}
    a08 = by_key["pod-a08"]
    assert (a08.gpus, a08.priority, a08.work_s) == (4, "prod-batch", 60000.0 - 1260.0)  # deletion - scheduled
    assert by_key["pod-a00"].priority == "prod-serving"  # LS
    assert by_key["pod-a04"].priority == "preemptible"  # BE
    assert by_key["pod-a03"].priority == "research"  # Burstable
    assert by_key["pod-a01"].gpus == 1  # shares a GPU (460 milli)
    assert len({j.team for j in wl.jobs}) <= 4
    with_pending = load_trace(FIX / "alibaba_pods.csv", SMALL, TraceOptions(format="alibaba", alibaba_pending=True))
    assert len(with_pending.jobs) == 28


def test_scaling_and_window() -> None:
    base = load_trace(FIX / "generic.csv", SMALL, TraceOptions())
    fast = load_trace(FIX / "generic.csv", SMALL, TraceOptions(arrival_scale=2.0, size_scale=2.0))
    b = {j.kind: j for j in base.jobs}
    f = {j.kind: j for j in fast.jobs}
    assert f["g09"].submit == pytest.approx(b["g09"].submit / 2)
    assert f["g01"].gpus == 2 and f["g03"].gpus == 16 and (f["g03"].replicas, f["g03"].gpus_per_replica) == (2, 8)
    assert f["g10"].gpus == 64
    win = load_trace(FIX / "generic.csv", SMALL, TraceOptions(start=100.0, days=600 / 86400))
    assert [j.kind for j in win.jobs] == [f"g{i}" for i in range(11, 23)]  # submitted in [100, 700)
    assert win.jobs[0].submit == pytest.approx(20.0)
    rr = load_trace(FIX / "generic.csv", SMALL, TraceOptions(team_assign="round-robin", teams=3))
    assert [j.team for j in rr.jobs[:4]] == ["team00", "team01", "team02", "team00"]


def test_bad_files_say_what_is_wrong(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("submit_time,num_gpu\n0,1\n")
    with pytest.raises(TraceError, match="duration"):
        load_trace(bad, SMALL, TraceOptions())
    bad.write_text("submit_time,duration,num_gpu\n0,abc,1\n")
    with pytest.raises(TraceError, match="line 2"):
        load_trace(bad, SMALL, TraceOptions())
    bad.write_text("submit_time,duration,num_gpu,priority_class\n0,10,1,urgent\n")
    with pytest.raises(TraceError, match="urgent"):
        load_trace(bad, SMALL, TraceOptions())


@pytest.mark.parametrize(
    "fmt,name", [("generic", "generic.csv"), ("philly", "philly.csv"), ("alibaba", "alibaba_pods.csv")]
)
def test_every_fixture_replays_under_every_policy(fmt: str, name: str) -> None:
    wl = load_trace(FIX / name, SMALL, TraceOptions(format=fmt, arrival_scale=10.0))
    rep = run_policies(wl, failures=None)
    for p in rep["policies"].values():
        assert p["jobs"]["submitted"] == len(wl.jobs)
        assert p["jobs"]["started"] >= 1


def test_topology_csv_gives_uneven_blocks(tmp_path: Path) -> None:
    topo = tmp_path / "topo.csv"
    topo.write_text(
        "ip,DSW,PSW,ASW\n"
        + "".join(f"h{i},G1,P1,S1\n" for i in range(5))
        + "".join(f"h{i + 5},G1,P2,S1\n" for i in range(3))
        + "h9,G2,P1,S2\n"
    )
    cl = load_topology_csv(topo)
    assert [(b.block_id, b.nodes) for b in cl.blocks] == [("P1-S1", 5), ("P1-S2", 1), ("P2-S1", 3)]
    assert cl.min_blocks("h100", 6) == 2 and cl.min_blocks("h100", 9) == 3


def test_an_alibaba_pod_list_without_times_takes_them_from_another() -> None:
    """``openb_pod_list_multigpu50.csv`` has only names and resources: its pods take the
    times and qos of their namesakes in a pod list with times, and pods found nowhere
    those of a scheduled GPU pod drawn by the seed (the same draw every run)."""
    no_times = FIX / "alibaba_pods_no_times.csv"
    with pytest.raises(TraceError, match="--times-from"):
        read_rows(no_times, TraceOptions(format="alibaba"))
    opts = TraceOptions(format="alibaba", times_from=str(FIX / "alibaba_pods.csv"), seed=3)
    rows, stats = read_rows(no_times, opts)
    assert (stats["rows"], stats["times_joined"], stats["times_drawn"]) == (7, 4, 3)
    assert stats["skipped_no_gpu"] == 1 and stats["skipped_pending"] == 1  # a02 (no GPU), a11 (never scheduled)
    by_key = {r.key: r for r in rows}
    a08 = by_key["pod-a08"]  # its own times and qos, its own GPUs
    assert (a08.submit, a08.duration, a08.gpus, a08.priority) == (1200.0, 60000.0 - 1260.0, 4, "prod-batch")
    timed, _ = read_rows(FIX / "alibaba_pods.csv", TraceOptions(format="alibaba"))
    donors = {(r.submit, r.duration, r.priority) for r in timed}
    for k, gpus in (("pod-x00", 8), ("pod-x01", 2), ("pod-x02", 4)):
        assert by_key[k].gpus == gpus
        assert (by_key[k].submit, by_key[k].duration, by_key[k].priority) in donors, k
    again, _ = read_rows(no_times, opts)
    assert again == rows
    with pytest.raises(TraceError, match="missing column"):
        read_rows(no_times, replace(opts, times_from=str(FIX / "generic.csv")))
