"""A job as the simulator sees it across attempts (the engine's and the metrics' shared record)."""

from __future__ import annotations

from placement import JobSpec
from sim.workload import SimJob


class JobRecord:
    """A job as the simulator sees it across attempts."""

    __slots__ = (
        "attempt_start",
        "charge",
        "end_kind",
        "failures",
        "first_start",
        "job",
        "last_ckpt",
        "pace",
        "phase",
        "preemptions",
        "reclaim_at",
        "reclaim_grace",
        "saved",
        "saves_on_sigterm",
        "sigterm_at",
        "spec",
        "token",
        "work_start",
    )

    def __init__(self, job: SimJob, spec: JobSpec, charge: int) -> None:
        self.job = job
        self.spec = spec
        self.charge = charge
        self.phase = "future"  # future, queued, running, stopping, done
        self.saved = 0.0  # work (s) saved in the last checkpoint, kept across attempts
        self.attempt_start = 0.0
        self.work_start = 0.0  # when the work of this attempt began (after start latency)
        self.last_ckpt: float | None = None  # time of the last checkpoint in this attempt
        self.token = 0
        self.first_start: float | None = None
        self.preemptions = 0
        self.failures = 0
        self.sigterm_at: float | None = None
        self.reclaim_at: float | None = None
        self.reclaim_grace = 0.0
        self.end_kind = ""
        self.pace = 1.0  # wall seconds per second of work in this attempt (> 1: spread placement)
        self.saves_on_sigterm = False  # the SIGTERM cost model's draw (sim.costs), set by the simulation

    def saved_at(self) -> float:
        """When the newest checkpoint of the running attempt was taken (its start if none)."""
        return self.last_ckpt if self.last_ckpt is not None else self.attempt_start
