"""Hand-checked scenarios: reservations with backfill, failures, reclaims, accounting."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from placement import PRESETS, NodeHealth, PreemptReason
from sim.failures import Fault
from sim.metrics import STARVED_AFTER_S

from .helpers import HOUR, ended_at, job, placement_of, preemptions, simulate, workload


def test_gang_waits_for_its_reservation_while_backfill_runs() -> None:
    # 2 blocks x 4 nodes. A holds 6 nodes for 2 h; gang B needs all 8 nodes (64 GPUs: it
    # reserves both blocks, expected start = A's max_runtime end). C (30 min) fits before
    # that start and backfills; D (10 h max_runtime) may not use the reserved nodes.
    # Everything is within its team's guarantee and of one class: nothing may be preempted.
    wl = workload(
        [
            job("a", "x", 0.0, 2 * HOUR, gpus=48),
            job("b", "y", 10.0, 1 * HOUR, gpus=64, pack="block"),
            job("c", "z", 20.0, 20 * 60, gpus=8, max_runtime_s=30 * 60),
            job("d", "z", 30.0, 20 * 60, gpus=8, max_runtime_s=10 * HOUR),
        ],
        {"x": (48, 0), "y": (64, 0), "z": (16, 0)},
    )
    sim, res = simulate(wl)
    recs = sim.recs
    assert recs["a"].first_start == 0.0
    # B is not placed but holds a head-of-line reservation on both blocks from its first cycle
    first_b = next(p for p in sim.plans if p.now >= 10.0)
    (resv,) = [r for r in first_b.reservations if r.job_id == "b"]
    assert resv.kind.value == "head_of_line"
    assert set(resv.blocks) == {"b000", "b001"}
    assert resv.expected_start == pytest.approx(2 * HOUR)
    assert first_b.reason("b").value == "reserved"
    # C backfills onto a reserved node right away
    t_c, pl_c = placement_of(sim, "c")
    assert t_c == 20.0 and pl_c.backfill
    # D would end after B's expected start: it waits (reason reservation) and runs after B
    d_reasons = {p.reason("d").value for p in sim.plans if 30.0 <= p.now < 2 * HOUR}
    assert d_reasons == {"reservation"}
    assert recs["b"].first_start == pytest.approx(2 * HOUR)  # at A's end, on every node
    _, pl_b = placement_of(sim, "b")
    assert len(pl_b.nodes) == 8
    assert recs["d"].first_start == pytest.approx(3 * HOUR)  # once B ends
    assert res["jobs"]["backfill_placements"] >= 1
    assert res["preemptions"]["total"] == 0
    hol = res["head_of_line_reservations"]
    assert (hol["made"], hol["owner_started"], hol["dropped_while_owner_waits"]) == (1, 1, 0)
    assert hol["held_until_start_s"]["max"] == pytest.approx(2 * HOUR - 10.0)


def test_failure_requeues_the_whole_gang_from_its_last_checkpoint() -> None:
    # gang G (4 nodes) checkpoints every 10 min; a GPU on one of its nodes fails at 25 min.
    wl = workload(
        [job("g", "x", 0.0, 1 * HOUR, gpus=32, pack="block", checkpoint_s=600.0, max_runtime_s=2 * HOUR)],
        {"x": (64, 0)},
    )
    sim0, _ = simulate(wl, faults=())
    _, pl0 = placement_of(sim0, "g")
    failed_node = pl0.nodes[0].node_id
    index = sim0.node_ids.index(failed_node)
    fault = Fault(time=1500.0, node_index=index, kind="gpu", repair_s=2 * HOUR, burn_in_s=HOUR)
    sim, res = simulate(wl, faults=(fault,))
    t0, _first = placement_of(sim, "g", 0)
    t1, second = placement_of(sim, "g", 1)
    assert t0 == 0.0 and t1 == 1500.0  # re-placed in the same instant, whole gang
    assert len(second.nodes) == 4 and failed_node not in {n.node_id for n in second.nodes}
    rec = sim.recs["g"]
    assert rec.spec.attempt == 1 and rec.spec.front  # attempt + 1, ahead of its class
    assert rec.failures == 1
    # saved 20 min (checkpoints at 10 and 20 min): 40 min left -> ends at 1500 + 2400
    assert rec.end_kind == "succeeded"
    assert ended_at(sim, "g") == pytest.approx(3900.0)
    # lost: 32 GPUs x 5 min since the 20-min checkpoint
    assert res["lost_gpu_hours"]["failures"] == pytest.approx(32 * 300 / 3600, abs=0.01)
    a = res["allocation"]
    net = 100.0 * (a["allocated_gpu_hours"] - 32 * 300 / 3600) / a["healthy_gpu_hours"]
    assert a["healthy_gpu_pct_net_of_lost_work"] == pytest.approx(net, abs=0.02)
    assert a["healthy_gpu_pct_net_of_lost_work"] < a["healthy_gpu_pct"]
    assert res["failures"] == {
        "faults": 1,
        "faults_on_unready_nodes_dropped": 0,
        "gangs_failed": 1,
        "serving_jobs_degraded": 0,
    }
    # the node was cordoned, then burn-in after repair, then ready again
    health = [line.split()[-1] for line in sim.log if f"node {failed_node}" in line]
    assert health == ["burn_in", "ready"]
    assert sim.state.node_health(failed_node) is NodeHealth.READY


def test_reclaim_preempts_only_borrowed_work() -> None:
    # one block of 4 nodes (32 GPUs). Team A (guarantee 16) runs 4 x 8 GPUs: 2 guaranteed,
    # 2 borrowed. An hour later team B (guarantee 16) asks for its 16 GPUs.
    a_jobs = [job(f"a{i}", "A", float(i), 10 * HOUR, checkpoint_s=600.0, grace_s=30.0) for i in range(4)]
    b_jobs = [job(f"b{i}", "B", HOUR + i, 1 * HOUR, grace_s=30.0) for i in range(2)]
    wl = workload(a_jobs + b_jobs, {"A": (16, 32), "B": (16, 32)}, blocks=1, end=3 * HOUR)
    sim, res = simulate(wl)
    borrowed = {pl.job_id for p in sim.plans for pl in p.placements if pl.borrowed}
    assert borrowed == {"a2", "a3"}
    pre = preemptions(sim)
    assert len(pre) == 2
    assert {pr.victim for _, pr in pre} == {"a2", "a3"}
    assert all(pr.victim_borrowed and pr.reason is PreemptReason.RECLAIM for _, pr in pre)
    assert {pr.beneficiary for _, pr in pre} == {"b0", "b1"}
    # guaranteed work untouched
    assert sim.recs["a0"].preemptions == 0 and sim.recs["a1"].preemptions == 0
    # B starts after the victims' grace, within grace + 2 cycles of the reclaim
    for b in ("b0", "b1"):
        assert HOUR + 30.0 <= sim.recs[b].first_start <= HOUR + 1 + 30.0 + 2.0
    assert res["reclaim"]["count"] == 2
    assert res["reclaim"]["over_grace_plus_2_cycles"] == 0
    assert res["reclaim"]["max_s"] <= 32.0
    # lost work: each victim loses the time since its last checkpoint (10-min cadence) + grace
    assert res["lost_gpu_hours"]["preemption"] > 0
    assert res["lost_gpu_hours"]["preemption"] <= 2 * 8 * (600 + 30) / 3600 + 1e-6
    # the victims are re-queued (attempt 1) and wait for B's jobs to end (the cluster is full)
    for a in ("a2", "a3"):
        assert sim.recs[a].spec.attempt == 1
        t, _ = placement_of(sim, a, 1)
        assert 2 * HOUR + 30.0 <= t <= 2 * HOUR + 33.0
    assert res["starved_teams"] == []


def test_reclaim_bound_counts_every_victim_the_job_waits_for() -> None:
    # one block of 2 nodes. Team A (preemptible, guarantee 8) runs a0 guaranteed (grace 60 s)
    # and a1 borrowed (grace 30 s). B (prod-batch, 16 GPUs) preempts both: it starts when a0
    # is gone, 60 s later; the bound is that grace + 2 cycles, not the borrowed victim's 30 s
    wl = workload(
        [
            job("a0", "A", 0.0, 10 * HOUR, cls="preemptible", grace_s=60.0),
            job("a1", "A", 1.0, 10 * HOUR, cls="preemptible", grace_s=30.0),
            job("b", "B", HOUR, HOUR, gpus=16, cls="prod-batch", pack="block"),
        ],
        {"A": (8, 8), "B": (16, 0)},
        blocks=1,
        nodes_per_block=2,
        end=3 * HOUR,
    )
    sim, res = simulate(wl)
    assert {pr.victim for _, pr in preemptions(sim)} == {"a0", "a1"}
    assert sim.recs["b"].first_start == pytest.approx(HOUR + 60.0)
    assert res["reclaim"]["count"] == 1
    assert res["reclaim"]["max_s"] == pytest.approx(60.0)
    assert res["reclaim"]["over_grace_plus_2_cycles"] == 0


def _one_node_preemptible_then_prod_batch():
    """One 8-GPU node: team A's preemptible p (2 h, no checkpoints) from 0, team B's
    prod-batch q (10 min) at 1 h, within B's guarantee: q preempts p."""
    return workload(
        [
            job("p", "A", 0.0, 2 * HOUR, cls="preemptible", max_runtime_s=3 * HOUR),
            job("q", "B", HOUR, 10 * 60, cls="prod-batch"),
        ],
        {"A": (0, 8), "B": (8, 0)},
        blocks=1,
        nodes_per_block=1,
        end=6 * HOUR,
    )


# what a restart loses, without the wait of Policy.borrowed_restart_backoff_s (tested below)
NO_BACKOFF = replace(PRESETS["gpufleet"], borrowed_restart_backoff_s=None)


def test_preempted_job_without_checkpoints_restarts_from_scratch() -> None:
    # a preemptible-class job that cannot checkpoint is preempted by a prod-batch job
    wl = _one_node_preemptible_then_prod_batch()
    sim, res = simulate(wl, NO_BACKOFF)
    ((_, pr),) = preemptions(sim)
    assert pr.victim == "p" and pr.reason is PreemptReason.PRIORITY
    rec = sim.recs["p"]
    # stopped at 1 h + 30 s grace; q runs 10 min; p restarts from zero and needs its full 2 h
    assert sim.recs["q"].first_start == pytest.approx(HOUR + 30.0)
    t1, _ = placement_of(sim, "p", 1)
    assert t1 == pytest.approx(HOUR + 30.0 + 600.0)
    assert rec.end_kind == "succeeded"
    assert res["lost_gpu_hours"]["preemption"] == pytest.approx(8 * (HOUR + 30.0) / 3600, abs=1e-3)


def test_start_latency_holds_gpus_without_work_and_a_restart_pays_it_again() -> None:
    # the scenario above with 2 min from placement to running ranks (image pull, checkpoint load)
    wl = _one_node_preemptible_then_prod_batch()
    sim, res = simulate(wl, NO_BACKOFF, start_latency_s=120.0)
    assert sim.recs["q"].first_start == pytest.approx(HOUR + 30.0)
    t1, _ = placement_of(sim, "p", 1)
    assert t1 == pytest.approx(HOUR + 30.0 + 120.0 + 600.0)  # q: latency, then its 10 min of work
    assert ended_at(sim, "p") == pytest.approx(t1 + 120.0 + 2 * HOUR)
    # the first attempt's GPU time, latency included, is lost
    assert res["lost_gpu_hours"]["preemption"] == pytest.approx(8 * (HOUR + 30.0) / 3600, abs=1e-3)


def test_a_reclaimed_job_backs_off_while_its_owners_demand_is_expected_back() -> None:
    """The scenario above under gpufleet's defaults: B asked for its 8 GPUs within the last
    30 minutes when q ends, so p (borrowed, preempted once) waits out the 1,800 s backoff
    from its preemption (SIGTERM at 1 h) instead of restarting when q ends."""
    wl = _one_node_preemptible_then_prod_batch()
    sim, _ = simulate(wl)
    assert sim.recs["q"].first_start == pytest.approx(HOUR + 30.0)
    t1, _ = placement_of(sim, "p", 1)
    assert t1 == pytest.approx(HOUR + 1800.0, abs=1.0)
    assert sim.recs["p"].end_kind == "succeeded"


def test_allocation_and_idle_accounting() -> None:
    # one 8-GPU job on a 64-GPU cluster for the first half of a 2-hour window
    wl = workload([job("a", "x", 0.0, HOUR)], {"x": (64, 0)}, end=2 * HOUR)
    _, res = simulate(wl)
    assert res["allocation"]["healthy_gpu_pct"] == pytest.approx(100 * 8 * 1 / (64 * 2))
    assert res["allocation"]["healthy_gpu_pct_while_demand_exceeds_capacity"] is None
    assert res["idle"]["gpu_hours"] == pytest.approx(64 * 2 - 8)
    assert res["idle"]["cost_usd"] == pytest.approx((64 * 2 - 8) * 2.0)
    assert res["jobs"]["outcomes"] == {"succeeded": 1}


def test_timeout_at_max_runtime() -> None:
    wl = workload([job("a", "x", 0.0, 2 * HOUR, max_runtime_s=HOUR)], {"x": (64, 0)}, end=3 * HOUR)
    sim, res = simulate(wl)
    assert sim.recs["a"].end_kind == "timed_out"
    assert res["jobs"]["outcomes"] == {"timed_out": 1}


def test_max_runtime_counts_from_running_after_the_start_latency() -> None:
    wl = workload([job("a", "x", 0.0, 2 * HOUR, max_runtime_s=HOUR)], {"x": (64, 0)}, end=3 * HOUR)
    sim, _ = simulate(wl, start_latency_s=120.0)
    assert ended_at(sim, "a", "timed_out") == pytest.approx(120.0 + HOUR)


def test_cycles_only_on_change_and_at_most_once_per_second() -> None:
    # a burst of 50 jobs at 50/s, then nothing: cycles are few and 1 s apart at least
    jobs = [job(f"s{i:02d}", "x", i / 50.0, 600.0, gpus=1) for i in range(50)]
    wl = workload(jobs, {"x": (64, 0)}, end=HOUR)
    sim, res = simulate(wl)
    times = [p.now for p in sim.plans]
    assert all(b - a >= 1.0 for a, b in itertools.pairwise(times))
    assert times[0] == 0.0
    # arrivals over 1 s -> cycles at 0 and 1; completions at 600 and 601 -> two more
    assert len(times) == 4
    assert res["cycles"] == 4
    waits = [sim.recs[j.job_id].first_start - j.submit for j in jobs]
    assert max(waits) <= 1.0


def test_the_report_names_the_work_queued_beside_idle_gpus_while_demand_exceeds_capacity() -> None:
    # 8 nodes of 8 GPUs, each holding one 7-GPU job (2 h): 8 GPUs free, one per node. Two
    # 8-GPU jobs arrive at 60 s: demand (72) exceeds the 64 GPUs, yet 8 sit free, because
    # neither job fits a node. Everything is team x's, within its guarantee, one class.
    smalls = [job(f"s{i}", "x", 0.0, 2 * HOUR, gpus=7) for i in range(8)]
    wholes = [job(f"w{i}", "x", 60.0, HOUR, gpus=8) for i in range(2)]
    sim, res = simulate(workload(smalls + wholes, {"x": (64, 0)}, end=HOUR))
    at_60 = next(p for p in sim.plans if p.now >= 60.0)
    assert {at_60.reason(w.job_id).value for w in wholes} == {"topology"}
    q = res["idle"]["queued_while_demand_exceeds_capacity"]
    assert q["snapshots"] == 11  # every 300 s from 300 s to 3,300 s
    assert q["idle_gpus_mean"] == 8.0
    assert q["queued_gpus_mean"] == 16.0
    assert q["by_kind_gpus_mean"] == {"research/guaranteed/<=8/topology: needs N whole free node(s), N free": 16.0}
    assert q["other_kinds_gpus_mean"] == 0.0
    assert res["allocation"]["healthy_gpu_pct_while_demand_exceeds_capacity"] == pytest.approx(87.5)


def test_nothing_is_listed_beside_idle_gpus_when_demand_never_exceeds_capacity() -> None:
    _, res = simulate(workload([job("a", "x", 0.0, HOUR, gpus=8)], {"x": (64, 0)}, end=HOUR))
    assert res["idle"]["queued_while_demand_exceeds_capacity"] is None


def _borrow_then_ask(b_class: str) -> object:
    # team A (guarantee 16) runs 4 x 8 GPUs on a 32-GPU block: 16 borrowed; an hour in, team B
    # (guarantee 16) asks for 8 GPUs. A's jobs run 3 h.
    a_jobs = [job(f"a{i}", "A", float(i), 3 * HOUR, checkpoint_s=600.0) for i in range(4)]
    return workload(
        a_jobs + [job("b", "B", HOUR, HOUR, cls=b_class)], {"A": (16, 32), "B": (16, 32)}, blocks=1, end=5 * HOUR
    )


def test_starvation_is_detected_when_borrowed_capacity_is_not_reclaimed() -> None:
    # FIFO + first fit never preempts: B waits below its guarantee while A borrows
    sim, res = simulate(_borrow_then_ask("research"), "fifo_first_fit")
    assert sim.recs["b"].first_start == pytest.approx(3 * HOUR + 1.0, abs=1.0)
    assert res["starved_teams"] == ["B"]
    b = res["teams"]["B"]
    assert b["longest_starving_s"] == pytest.approx(2 * HOUR, abs=2.0)
    assert b["max_wait_s"] == pytest.approx(2 * HOUR, abs=2.0)
    assert set(res["starving_work_reasons"]) == {"research/capacity"}
    # A's 16 borrowed research GPUs could hold B's 8: the stricter figure counts it too
    assert res["starved_teams_while_capacity_suffices"] == ["B"]
    assert res["teams"]["B"]["longest_starving_while_capacity_suffices_s"] == pytest.approx(2 * HOUR, abs=2.0)
    # and on nodes: any of A's jobs' nodes would hold it
    assert res["starved_teams_while_nodes_suffice"] == ["B"]
    assert res["teams"]["B"]["longest_starving_while_nodes_suffice_s"] == pytest.approx(2 * HOUR, abs=2.0)
    # and it was one job's wait
    assert res["starved_teams_by_one_job"] == ["B"]
    assert res["teams"]["B"]["longest_job_starving_s"] == pytest.approx(2 * HOUR, abs=2.0)
    # our policy reclaims within the grace period: no starvation
    _, ours = simulate(_borrow_then_ask("research"))
    assert ours["starved_teams"] == []
    assert ours["starved_teams_while_capacity_suffices"] == []


def test_a_stream_of_short_waits_starves_the_team_but_no_one_job() -> None:
    # A (guarantee 8) borrows 56 of 64 GPUs; B (guarantee 40) asks for 8 GPUs five times,
    # 4 minutes apart. Each reclaim takes its victim's 5-minute grace, so each job waits about
    # that long, but B always has one waiting while A still borrows: its span passes the
    # 10-minute line, no job's wait does. a1 saves often (the cheapest victim, B's first) and
    # takes 8 minutes to stop: the first job's wait is the longest
    a_jobs = [job(f"a{i}", "A", float(i), 3 * HOUR, checkpoint_s=600.0, grace_s=300.0) for i in range(8)]
    a_jobs[1] = job("a1", "A", 1.0, 3 * HOUR, checkpoint_s=60.0, grace_s=480.0)
    b_jobs = [job(f"b{i}", "B", HOUR + 240.0 * i, HOUR) for i in range(5)]
    wl = workload(a_jobs + b_jobs, {"A": (8, 64), "B": (40, 64)}, end=5 * HOUR)
    sim, res = simulate(wl)
    waits = [sim.recs[j.job_id].first_start - j.submit for j in b_jobs]
    assert all(240.0 < w < STARVED_AFTER_S for w in waits), waits
    assert waits[0] == pytest.approx(480.0, abs=2.0)
    b = res["teams"]["B"]
    assert res["starved_teams"] == ["B"]
    assert b["longest_starving_s"] > 3 * STARVED_AFTER_S / 2
    assert res["starved_teams_by_one_job"] == []
    assert b["longest_job_starving_s"] == pytest.approx(max(waits), abs=2.0)


def test_preemption_losses_are_split_by_cause_victim_size_and_age() -> None:
    # B takes back one of A's borrowed 8-GPU jobs an hour (+300 s) in: all the loss is a
    # reclaim of borrowed work, of a <= 8-GPU job, 30 min-2 h into its run
    _, res = simulate(_borrow_then_ask("research"))
    lost = res["lost_gpu_hours"]
    by = lost["preemption_by"]
    assert lost["preemption"] > 0
    for split in ("cause", "victim_size", "victim_age_at_sigterm"):
        assert sum(by[split].values()) == pytest.approx(lost["preemption"], abs=1e-3), split
    assert by["cause"]["reclaim_of_borrowed"] == pytest.approx(lost["preemption"], abs=1e-3)
    assert by["victim_size"]["<=8"] == pytest.approx(lost["preemption"], abs=1e-3)
    assert by["victim_age_at_sigterm"]["30m-2h"] == pytest.approx(lost["preemption"], abs=1e-3)


def test_starvation_bound_by_the_victim_rules_is_told_apart() -> None:
    # one 32-GPU block: A (research) borrows 8 GPUs, C (prod-batch) borrows 8; an hour in,
    # B (research, guarantee 16) asks for 16. B may take back only A's 8 (same class), and
    # nothing is free: starvation by the yardstick, but not while free + reclaimable capacity
    # (8 GPUs) could hold the job
    a_jobs = [job(f"a{i}", "A", float(i), 3 * HOUR) for i in range(2)]
    c_jobs = [job(f"c{i}", "C", float(i), 3 * HOUR, cls="prod-batch") for i in range(2)]
    wl = workload(
        a_jobs + c_jobs + [job("b", "B", HOUR, HOUR, gpus=16)],
        {"A": (8, 32), "C": (8, 32), "B": (16, 32)},
        blocks=1,
        end=5 * HOUR,
    )
    sim, res = simulate(wl, "fifo_first_fit")
    assert sim.recs["b"].first_start == pytest.approx(3 * HOUR + 1.0, abs=2.0)
    assert res["starved_teams"] == ["B"]
    assert res["teams"]["B"]["longest_starving_s"] == pytest.approx(2 * HOUR, abs=2.0)
    assert res["starved_teams_while_capacity_suffices"] == []
    assert res["teams"]["B"]["longest_starving_while_capacity_suffices_s"] == 0.0
    assert res["starved_teams_while_nodes_suffice"] == []


def test_starvation_bound_by_topology_is_told_apart() -> None:
    # 8 nodes of 8 GPUs. X runs a 5-GPU job on every node within its guarantee (one per node:
    # two do not fit one); A borrows the 3 GPUs left on each. An hour in, B (research,
    # guarantee 16) asks for 16 GPUs, two whole nodes. A's 24 borrowed research GPUs could hold
    # them by count, but every node also holds X's guaranteed research work, which B may not
    # take: no two nodes can be cleared. Starved by the yardstick and by the GPU count, not on
    # nodes
    x_jobs = [job(f"x{i}", "X", float(i), 3 * HOUR, gpus=5) for i in range(8)]
    a_jobs = [job(f"a{i}", "A", 10.0 + i, 3 * HOUR, gpus=3) for i in range(8)]
    wl = workload(
        x_jobs + a_jobs + [job("b", "B", HOUR, HOUR, gpus=16)],
        {"X": (40, 0), "A": (0, 64), "B": (16, 0)},
        end=5 * HOUR,
    )
    sim, res = simulate(wl, "fifo_first_fit")
    assert [sim.recs[j.job_id].first_start for j in a_jobs] == pytest.approx([j.submit for j in a_jobs], abs=2.0)
    assert sim.recs["b"].first_start == pytest.approx(3 * HOUR, abs=20.0)
    assert res["starved_teams"] == ["B"]
    assert res["starved_teams_while_capacity_suffices"] == ["B"]
    assert res["starved_teams_while_nodes_suffice"] == []
    assert res["teams"]["B"]["longest_starving_while_nodes_suffice_s"] == 0.0


def test_borrowed_work_of_a_higher_class_is_not_counted_as_starving_a_lower_class() -> None:
    # B's job is preemptible: by docs/design.md's victims it may not take back A's research
    # capacity, so this is not starvation; the looser figure still shows the wait
    design_only = replace(PRESETS["gpufleet"], reclaim_small_borrowed_after_s=None)
    _, res = simulate(_borrow_then_ask("preemptible"), design_only)
    assert res["starved_teams"] == []
    assert res["teams"]["B"]["longest_below_guarantee_while_any_team_borrows_s"] >= HOUR
    # ours: after reclaim_small_borrowed_after_s (300 s) B takes back one of A's small
    # borrowed research jobs, which stops within its 30 s grace
    sim, res = simulate(_borrow_then_ask("preemptible"))
    assert sim.recs["b"].first_start == pytest.approx(HOUR + 300.0 + 30.0, abs=2.0)
    assert res["starved_teams"] == []
    assert [(pr.victim, pr.reason.value) for _, pr in preemptions(sim) if pr.beneficiary == "b"] == [("a3", "reclaim")]


def test_a_backfill_jobs_preemption_keeps_the_gangs_reservation() -> None:
    # 7 prod-batch jobs (guaranteed, 2 h) and a preemptible job (24 h) fill 8 nodes. Gang L
    # (prod-batch, 8 nodes, within its guarantee) cannot preempt same-class guaranteed work:
    # it reserves both blocks. A short research job R may backfill there and preempts the
    # preemptible job; L's reservation survives that (found by this simulator; fixed in
    # placement 6e92d44, "preemption reservations are layered").
    q = [job(f"q{i}", "Q", 0.0, 2 * HOUR, cls="prod-batch") for i in range(7)]
    e = job("e", "E", 0.0, 10 * HOUR, cls="preemptible", max_runtime_s=24 * HOUR, checkpoint_s=600.0)
    gang = job("L", "P", 3500.0, HOUR, gpus=64, cls="prod-batch", pack="block", max_runtime_s=2 * HOUR)
    r = job("R", "W", 3650.0, 300.0, max_runtime_s=600.0)
    wl = workload(q + [e, gang, r], {"Q": (56, 0), "E": (0, 64), "P": (64, 0), "W": (8, 0)}, end=4 * HOUR)
    sim, res = simulate(wl)
    assert any(pr.victim == "e" and pr.beneficiary == "R" for _, pr in preemptions(sim))
    assert res["head_of_line_reservations"]["dropped_while_owner_waits"] == 0


def _gang_on_scattered_free_nodes(**gang) -> object:
    # 2 blocks x 4 nodes filled by eight 1-node jobs; four end at 1 h, leaving free nodes in
    # both blocks. Gang G (4 nodes, max_blocks=1) arrives at 30 min: a policy without
    # topology places it on those free nodes at 1 h, across both blocks.
    fill = [job(f"f{i}", "x", 0.0, HOUR if i in (0, 5, 6, 7) else 8 * HOUR) for i in range(8)]
    g = job("g", "y", 1800.0, HOUR, gpus=32, pack="block", max_blocks=1, max_runtime_s=3 * HOUR, **gang)
    return workload([*fill, g], {"x": (64, 0), "y": (32, 0)})


def test_spread_gang_runs_slower_and_its_extra_time_counts_as_lost() -> None:
    wl = _gang_on_scattered_free_nodes()
    sim, res = simulate(wl, "no_topology_no_reservation", spread_slowdown=0.25)
    t, pl = placement_of(sim, "g")
    assert t == HOUR and len(pl.blocks) == 2  # beyond its max_blocks of 1
    assert ended_at(sim, "g") == pytest.approx(HOUR + 1.25 * HOUR)
    # 32 GPUs x the extra quarter hour
    assert res["lost_gpu_hours"]["spread_placement"] == pytest.approx(32 * 0.25, abs=1e-3)
    alloc = res["allocation"]
    assert alloc["healthy_gpu_pct_net_of_lost_work"] == pytest.approx(
        100 * (alloc["allocated_gpu_hours"] - 8.0) / alloc["healthy_gpu_hours"], abs=0.01
    )
    # off by default: the same placement runs at full speed and nothing is lost
    sim0, res0 = simulate(wl, "no_topology_no_reservation")
    assert len(placement_of(sim0, "g")[1].blocks) == 2
    assert ended_at(sim0, "g") == pytest.approx(2 * HOUR)
    assert res0["lost_gpu_hours"]["spread_placement"] == 0


def test_spread_gang_saves_less_work_per_checkpoint_and_is_charged_only_for_kept_work() -> None:
    # G checkpoints every 10 min of wall time; at pace 1.5 each one saves 400 s of work.
    # A fault at 25 min into the run loses the 5 min since the 20-min checkpoint.
    wl = _gang_on_scattered_free_nodes(checkpoint_s=600.0)
    sim0, _ = simulate(wl, "no_topology_no_reservation", spread_slowdown=0.5)
    _, pl0 = placement_of(sim0, "g")
    index = sim0.node_ids.index(pl0.nodes[0].node_id)
    fault = Fault(time=HOUR + 1500.0, node_index=index, kind="gpu", repair_s=20 * HOUR, burn_in_s=HOUR)
    sim, res = simulate(wl, "no_topology_no_reservation", faults=(fault,), spread_slowdown=0.5)
    rec = sim.recs["g"]
    assert rec.failures == 1 and rec.saved == pytest.approx(800.0)
    assert res["lost_gpu_hours"]["failures"] == pytest.approx(32 * 300 / 3600, abs=1e-3)
    t1, pl1 = placement_of(sim, "g", 1)
    pace1 = 1.5 if len(pl1.blocks) > 1 else 1.0
    assert ended_at(sim, "g") == pytest.approx(t1 + (HOUR - 800.0) * pace1)
    # the first attempt is charged for its 20 kept minutes only (a third of them is slowness)
    first = 32 * 1200 * (1 - 1 / 1.5) / 3600
    second = 32 * (HOUR - 800.0) * (pace1 - 1) / 3600
    assert res["lost_gpu_hours"]["spread_placement"] == pytest.approx(first + second, abs=1e-3)


def test_ours_keeps_the_gang_in_one_block_at_full_speed_unless_it_lets_it_spread() -> None:
    # ours waits for a whole block (f1-f3 end at 8 h): full speed, nothing lost
    sim, res = simulate(_gang_on_scattered_free_nodes(), spread_slowdown=0.25)
    t, pl = placement_of(sim, "g")
    assert t == 8 * HOUR and len(pl.blocks) == 1
    assert ended_at(sim, "g") == pytest.approx(9 * HOUR)
    assert res["lost_gpu_hours"]["spread_placement"] == 0
    # with max_blocks_wait_s the gang accepts any blocks after 10 min: placed across both
    # at 1 h, it pays the same slowdown as under a policy without topology
    sim, res = simulate(_gang_on_scattered_free_nodes(max_blocks_wait_s=600.0), spread_slowdown=0.25)
    t, pl = placement_of(sim, "g")
    assert t == HOUR and len(pl.blocks) == 2
    assert ended_at(sim, "g") == pytest.approx(HOUR + 1.25 * HOUR)
    assert res["lost_gpu_hours"]["spread_placement"] == pytest.approx(32 * 0.25, abs=1e-3)


def _gang_queued_past_the_window():
    # A holds 6 of 8 nodes from 0 to 5 h (within its team's guarantee, same class: no
    # victim); gang B (all 8 nodes) arrives at 1 h. The window ends at 2 h.
    return workload(
        [job("a", "x", 0.0, 5 * HOUR, gpus=48), job("b", "y", HOUR, HOUR, gpus=64, pack="block")],
        {"x": (48, 0), "y": (64, 0)},
        end=2 * HOUR,
    )


def test_drain_follows_a_job_the_window_cut_off_until_it_starts() -> None:
    wl = _gang_queued_past_the_window()
    cut, cut_res = simulate(wl, drain_s=0.0)
    sim, res = simulate(wl)  # the default drain (48 h)
    # without a drain, B's wait stops at the window's end: 1 h, censored
    assert cut.recs["b"].first_start is None
    cut_big = cut_res["wait_s"]["by_size"]["9-1023"]  # A (no wait) and B
    assert (cut_big["n"], cut_big["max"], cut_big["censored"]) == (2, HOUR, 1)
    assert cut_res["teams"]["y"]["max_wait_s"] == HOUR
    assert (cut_res["jobs"]["never_started"], cut_res["jobs"]["drain_h"]) == (1, 0.0)
    # the drain runs on until B starts at A's end: its wait is 4 h, and the run stops there
    assert sim.recs["b"].first_start == pytest.approx(5 * HOUR)
    big = res["wait_s"]["by_size"]["9-1023"]
    assert (big["max"], big["censored"]) == (pytest.approx(4 * HOUR), 0)
    assert res["teams"]["y"]["max_wait_s"] == pytest.approx(4 * HOUR)
    jobs = res["jobs"]
    assert (jobs["still_queued_at_window_end"], jobs["running_at_window_end"]) == (1, 1)
    assert (jobs["never_started"], jobs["drain_h"]) == (0, pytest.approx(3.0))
    assert ended_at(sim, "b") is None  # the drain stops once every window job has started
    # everything else is measured over the window, drain or not
    for key in ("allocation", "idle", "lost_gpu_hours", "preemptions", "starved_teams", "failures"):
        assert res[key] == cut_res[key], key
    assert res["jobs"]["outcomes"] == cut_res["jobs"]["outcomes"] == {}


def test_a_drain_too_short_leaves_the_job_censored_at_the_drains_end() -> None:
    sim, res = simulate(_gang_queued_past_the_window(), drain_s=HOUR)
    assert sim.recs["b"].first_start is None
    big = res["wait_s"]["by_size"]["9-1023"]
    assert (big["max"], big["censored"]) == (pytest.approx(2 * HOUR), 1)  # 1 h -> 3 h
    assert (res["jobs"]["never_started"], res["jobs"]["drain_h"]) == (1, pytest.approx(1.0))
