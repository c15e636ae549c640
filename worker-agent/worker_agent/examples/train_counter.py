"""A deterministic "training" script for gpufleet tests and demos.

Each step updates a running value with a fixed recurrence; the state (step +
value) is checkpointed as JSON through ``worker_agent.jobhelper``. Preempted
(SIGTERM) it checkpoints at the next step boundary and exits 143; started with
``GPUFLEET_RESUME_FROM`` it continues from that checkpoint. An interrupted and
resumed run prints the same final line as an uninterrupted one:

    RESULT steps=<N> value=<V>

Usage: python train_counter.py [--steps N] [--step-time S] [--checkpoint-every K]
(defaults from TRAIN_STEPS, TRAIN_STEP_TIME, TRAIN_CHECKPOINT_EVERY, else 200 / 0.02 / 20)
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
