"""What a preemption costs: the second cost model, reported beside today's accounting.

Today's accounting (the default, and the one ``lost_gpu_hours`` and "net of lost work"
report): a preempted job loses the work since its last periodic checkpoint (since its
start if it cannot checkpoint), up to the end of its grace period; a restart costs nothing
(unless the run sets ``SimOptions.start_latency_s``).

The SIGTERM model (``lost_gpu_hours_sigterm_model``), as the requirements describe a
preemption: a job that checkpoints on SIGTERM within its grace period loses the grace
period plus its restart time; one that cannot loses its work since its last checkpoint,
as today. Fixed parameters:

* ``SIGTERM_SAVE_SHARE`` (70%) of the jobs that checkpoint at all save on SIGTERM. Which
  ones is a pure function of the job id and the run's seed (``saves_on_sigterm``), so no
  other draw shifts and every policy in a run sees the same jobs save;
* restart time by job size (``restart_s``): 2 min for <= 8 GPUs, 5 min for 9-1,023,
  10 min for >= 1,024.

The model re-prices the same run: the simulated jobs still resume from their periodic
checkpoint and no restart time is simulated, so the schedule (and every other figure) is
that of today's accounting. A job stopped by a fault during its grace period is counted
as one that could not save (the fault comes before the save at the grace's end); faults
and spread placement cost the same under both models.
"""

from __future__ import annotations

import hashlib

SIGTERM_SAVE_SHARE = 0.7
RESTART_S = ((8, 120.0), (1023, 300.0))  # (up to this many GPUs, restart seconds)
RESTART_LARGE_S = 600.0  # >= 1,024 GPUs


def restart_s(gpus: int) -> float:
    """Restart time of a job of ``gpus`` GPUs under the SIGTERM model."""
    for upto, s in RESTART_S:
        if gpus <= upto:
            return s
    return RESTART_LARGE_S


def saves_on_sigterm(job_id: str, seed: int, checkpoints: bool) -> bool:
    """Whether the job saves a checkpoint on SIGTERM (only jobs that checkpoint at all may).

    A hash of (seed, job id) mapped to [0, 1): below ``SIGTERM_SAVE_SHARE`` saves. Stable
    across interpreters (no ``hash()``) and independent of every random draw of the run.
    """
    if not checkpoints:
        return False
    h = hashlib.sha256(f"gpufleet-sigterm:{seed}:{job_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64 < SIGTERM_SAVE_SHARE


def describe() -> dict:
    """Both models' parameters, for the report."""
    return {
        "default": "work since the last periodic checkpoint (since start without checkpoints) up to the end"
        " of the grace period is lost; no restart charge",
        "sigterm_model": {
            "rule": "a job that saves on SIGTERM loses its grace period plus its restart time; one that"
            " cannot loses its work since its last checkpoint; faults and spread placement as by default",
            "save_on_sigterm_share_of_checkpointing_jobs": SIGTERM_SAVE_SHARE,
            "restart_s": {"<=8": RESTART_S[0][1], "9-1023": RESTART_S[1][1], ">=1024": RESTART_LARGE_S},
        },
    }
