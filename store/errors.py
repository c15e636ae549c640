"""The typed errors the store raises instead of leaking a database exception."""

from __future__ import annotations


class StoreError(Exception):
    """Base of the typed errors the store raises."""

    code = "store_error"


class AllocationConflict(StoreError):
    """A GPU in the gang already belongs to a live lease."""

    code = "allocation_conflict"


class StaleEpoch(StoreError):
    """The caller's fencing epoch is not the current leader's."""

    code = "stale_epoch"


class QuotaExceeded(StoreError):
    """Guaranteed usage would exceed the guarantee, or borrowing its limit."""

    code = "quota_exceeded"


class JobStateConflict(StoreError):
    """The job is not in the state (or attempt) the write expects."""

    code = "job_state_conflict"


class EarlierAttemptSucceeded(JobStateConflict):
    """An earlier attempt of the job had exited 0 on every rank: its work is not started again."""

    code = "earlier_attempt_succeeded"


class InvalidJobTransition(StoreError):
    """A job state change that placement.lifecycle's table has no edge for."""

    code = "invalid_job_transition"


class UnknownSubject(StoreError):
    code = "unknown_subject"
