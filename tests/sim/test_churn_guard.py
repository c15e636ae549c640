"""``Policy.unsaved_borrow_guard`` in the simulator: the sim feeds each team's recent demand
to the engine, and a borrowed job that cannot checkpoint waits instead of starting on
capacity its owner takes back minutes later (and pays for it with idle GPUs)."""

from __future__ import annotations

from dataclasses import replace

from placement import PRESETS

from .helpers import HOUR, job, simulate, workload


def _wl():
    # one block of 4 nodes (32 GPUs). "lender" (guarantee 32) runs 32 GPUs for 20 min, goes
    # quiet, and asks for them again at 40 min; "b" (no guarantee, may borrow) submits an
    # 8-GPU job that cannot checkpoint at 30 min.
    return workload(
        [
            job("l1", "lender", 0.0, 20 * 60, gpus=32),
            job("u", "b", 30 * 60, 2 * HOUR),
            job("l2", "lender", 40 * 60, 1 * HOUR, gpus=32),
        ],
        {"lender": (32, 0), "b": (0, 32)},
        blocks=1,
    )


def test_unsaved_borrowed_job_waits_for_the_owner_instead_of_being_reclaimed() -> None:
    sim_off, res_off = simulate(_wl())
    assert sim_off.recs["u"].first_start == 30 * 60
    assert res_off["lost_gpu_hours"]["preemption"] > 0  # u is reclaimed by l2 at 40 min

    on = replace(PRESETS["gpufleet"], unsaved_borrow_guard=1.0)
    sim_on, res_on = simulate(_wl(), on)
    assert sim_on.recs["l2"].first_start == 40 * 60
    # u starts after l2, and only once the lender's 32-GPU peak has left the 30-min window
    # (5-min buckets): the trade, GPUs left idle for a while after the owner's work ends
    assert sim_on.recs["u"].first_start == 40 * 60 + HOUR + 35 * 60
    assert res_on["lost_gpu_hours"]["preemption"] == 0
    assert sim_on.recs["u"].preemptions == 0


def _wl_gang():
    # two blocks of 4 nodes (64 GPUs). "lender" (guarantee 64) runs 64 GPUs for 20 min, goes
    # quiet, and asks for them again at 40 min; "b" (no guarantee, may borrow) submits a
    # 64-GPU gang that checkpoints every 15 min at 30 min.
    return workload(
        [
            job("l1", "lender", 0.0, 20 * 60, gpus=64),
            job("g", "b", 30 * 60, 2 * HOUR, gpus=64, checkpoint_s=15 * 60),
            job("l2", "lender", 40 * 60, 1 * HOUR, gpus=64),
        ],
        {"lender": (64, 0), "b": (0, 64)},
    )


def test_borrowed_gang_waits_for_the_owner_instead_of_being_reclaimed() -> None:
    """``Policy.borrowed_gang_guard``: the same trade for a gang of >= reserve_min_gpus."""
    off = replace(PRESETS["gpufleet"], borrowed_gang_guard=None)
    sim_off, res_off = simulate(_wl_gang(), off)
    assert sim_off.recs["g"].first_start == 30 * 60
    assert sim_off.recs["g"].preemptions == 1  # reclaimed by l2 at 40 min, before its first checkpoint
    assert res_off["lost_gpu_hours"]["preemption"] > 64 * 10 / 60

    on = replace(PRESETS["gpufleet"], borrowed_gang_guard=1.0)
    sim_on, res_on = simulate(_wl_gang(), on)
    assert sim_on.recs["l2"].first_start == 40 * 60
    assert sim_on.recs["g"].first_start == 40 * 60 + HOUR + 35 * 60
    assert res_on["lost_gpu_hours"]["preemption"] == 0
    assert sim_on.recs["g"].preemptions == 0
