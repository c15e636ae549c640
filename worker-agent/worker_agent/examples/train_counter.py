"""A deterministic "training" script for gpufleet tests and demos.

Each step updates a running value with a fixed recurrence; the state (step +
value) is checkpointed as JSON through ``worker_agent.jobhelper``. Preempted
(SIGTERM) it checkpoints at the next step boundary and exits 143; started with
``GPUFLEET_RESUME_FROM`` it continues from that checkpoint. An interrupted and
resumed run prints the same final line as an uninterrupted one:

    RESULT steps=<N> value=<V>

Each step may also compute for ``--compute-time`` seconds (small matrix products in pure
Python, standing in for the forward and backward pass) before it waits ``--step-time``: a
rank that computes is what the simulated GPU backend shows as busy (worker_agent.nvml). The
products never change the value, so the result line is the same with or without them.

Usage: python train_counter.py [--steps N] [--step-time S] [--checkpoint-every K] [--compute-time C]
(defaults from TRAIN_STEPS, TRAIN_STEP_TIME, TRAIN_CHECKPOINT_EVERY, TRAIN_COMPUTE_TIME,
else 200 / 0.02 / 20 / 0)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from worker_agent.jobhelper import Job

MOD = (1 << 61) - 1


def advance(value: int, step: int) -> int:
    return (value * 6364136223846793005 + 1442695040888963407 + step) % MOD


def compute(seconds: float, n: int = 24) -> float:
    """Multiply small matrices for ``seconds`` of CPU work; returns a checksum (kept out of the value)."""
    a = [[(i * n + j) % 7 / 7.0 for j in range(n)] for i in range(n)]
    cols = list(zip(*a, strict=True))
    total = 0.0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        c = [[sum(x * y for x, y in zip(row, col, strict=True)) for col in cols] for row in a]
        total += c[0][0]
    return total


def expected(steps: int) -> int:
    """What an uninterrupted run ends with (for tests)."""
    value = 1
    for step in range(steps):
        value = advance(value, step)
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=int(os.environ.get("TRAIN_STEPS", "200")))
    p.add_argument("--step-time", type=float, default=float(os.environ.get("TRAIN_STEP_TIME", "0.02")))
    p.add_argument("--checkpoint-every", type=int, default=int(os.environ.get("TRAIN_CHECKPOINT_EVERY", "20")))
    p.add_argument("--compute-time", type=float, default=float(os.environ.get("TRAIN_COMPUTE_TIME", "0")))
    a = p.parse_args(argv)

    job = Job(checkpoint_every_steps=a.checkpoint_every if os.environ.get("GPUFLEET_CHECKPOINT_DIR") else None)
    step, value = 0, 1
    resumed = job.resume()
    if resumed is not None:
        step, state = resumed
        value = int(state["value"])
        print(f"resumed from step {step} ({job.resume_from})", flush=True)
    print(
        f"rank {job.rank}/{job.world_size} job {job.job_id} attempt {job.attempt} starting at step {step}", flush=True
    )
    while step < a.steps:
        value = advance(value, step)
        step += 1
        if a.compute_time > 0:
            compute(a.compute_time)
        time.sleep(a.step_time)
        job.report_step(step)
        if job.stop_requested:
            if job.checkpoint_dir:
                print(f"SIGTERM: checkpointing step {step}", flush=True)
                job.exit_for_preemption(step, {"value": value})
            print("SIGTERM: no checkpoint dir, exiting", flush=True)
            return 143
        if job.checkpoint_dir:
            job.maybe_checkpoint(step, {"value": value})
    if job.checkpoint_dir:
        if job.maybe_checkpoint(step, {"value": value}) is None and step != job._last_ckpt_step:
            job.checkpoint(step, {"value": value})
        job.wait_for_checkpoints()
    job.report_step(step, force=True)
    print(f"RESULT steps={step} value={value}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
