"""Why a job's attempt ended, for `status`, `explain` and GET /v1/jobs/{id} (docs/design.md, Reports).

    ends = await task_reports.rank_ends(pool, job_id, attempt)
    view = failure_view(row, ends, last_end_event, faults_in_window, settings)   # None: nothing failed

Pure: the caller reads the job row, the ranks' ends (``store.task_reports``), the event that
ended the attempt and how many failures the job caused within ``failure_window_s``.
"""

from __future__ import annotations

import signal as _signal
from typing import Any

from common.settings import Settings
from placement.lifecycle import JobState
from store.task_reports import RankEnd, failing

ACTIVE = (JobState.QUEUED, JobState.STARTING, JobState.RUNNING, JobState.PREEMPTING, JobState.CANCELLING)
ENDED_BADLY = (JobState.FAILED, JobState.CANCELLED, JobState.TIMED_OUT)


def signal_name(sig: int | None) -> str | None:
    if sig is None:
        return None
    try:
        return _signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def rank_result(e: RankEnd) -> dict[str, Any]:
    return {
        "rank": e.rank,
        "attempt": e.attempt,
        "node_id": e.node_id,
        "lease_id": e.lease_id,
        "state": e.state,
        "exit_code": e.exit_code,
        "signal": e.signal,
        "signal_name": signal_name(e.signal),
        "reason": e.reason or None,
        "stderr_tail": e.stderr_tail,
        "finished_at": e.at,
    }


def how_it_ended(e: RankEnd) -> str:
    """``rank 0 on n-3 exited with code 137 (killed by SIGKILL)``."""
    who = f"rank {e.rank} on {e.node_id}"
    if e.state == "EXITED":
        if e.signal is not None:
            return f"{who} was killed by {signal_name(e.signal)} (exit code {e.exit_code})"
        what = f"{who} exited with code {e.exit_code}"
        if e.exit_code is not None and 128 < e.exit_code < 160:
            what += f" (128 + {signal_name(e.exit_code - 128)}: a process was killed by that signal?)"
        return what
    verbs = {"STOPPED": "was stopped", "FENCED": "was fenced", "LOST": "was lost", "REJECTED": "was refused"}
    text = f"{who} {verbs.get(e.state, e.state.lower())}"
    if e.reason:
        text += f" ({e.reason})"
    if e.state == "STOPPED" and e.exit_code is not None:
        text += f", exit code {e.exit_code}"
    return text


def failure_view(
    job: Any, ends: list[RankEnd], last_end: Any, faults: int, settings: Settings
) -> dict[str, Any] | None:
    """What ended the job's latest ended attempt and whether it runs again; None when the job
    never had an attempt end other than by success."""
    state = job["state"]
    if state == JobState.SUCCEEDED or (not ends and last_end is None):
        return None  # succeeded, or nothing on record says how it ended
    event = last_end["event"] if last_end is not None else None
    detail = last_end["detail"] if last_end is not None and isinstance(last_end["detail"], dict) else {}
    if state in ACTIVE and event not in ("requeued", "attempt_failed"):
        return None  # the current attempt is the first, or the last one ended well
    if state in ENDED_BADLY:
        attempt = job["attempt"]
    else:
        attempt = int(detail.get("previous_attempt") or (last_end["attempt"] if last_end else job["attempt"] - 1))
    ends = [e for e in ends if e.attempt == attempt]
    culprit = failing(ends)
    limit = settings.max_failed_attempts
    left = max(0, limit - faults)
    reason = (last_end["reason"] if last_end is not None else None) or ""
    if state == JobState.FAILED:
        kind, will_retry = "failed", False
        retry = f"no: {reason}" if event == "failed" and reason else "no: the job failed"
    elif state == JobState.CANCELLED:
        kind, will_retry = "cancelled", False
        retry = f"no: cancelled by {last_end['actor']}" + (f" ({reason})" if reason else "") if last_end else "no"
    elif state == JobState.TIMED_OUT:
        kind, will_retry = "timed_out", False
        retry = "no: its max_runtime ran out"
    elif detail.get("cause") == "preempted":
        kind, will_retry = "preempted", True
        retry = f"yes: preempted ({reason}); attempt {job['attempt']} resumes from its last checkpoint"
    elif detail.get("job_fault"):
        kind, will_retry = "failed", True
        retry = f"yes (attempt {job['attempt']} of {job['attempt'] + max(0, left - 1)})"
    else:
        kind, will_retry = "infrastructure", True
        retry = (
            f"yes (attempt {job['attempt']}): an infrastructure failure does not count against the job"
            f" ({left} of {limit} failures of its own left)"
        )
    if kind in ("failed", "infrastructure") and will_retry and culprit is not None and culprit.state != "STOPPED":
        retry += f"; not on {culprit.node_id} again while another node is free"  # jobs.avoid_nodes
    exit_code = job["exit_code"]
    if exit_code is None and culprit is not None and state == JobState.FAILED:
        exit_code = culprit.exit_code
    parts = [f"attempt {attempt} {_KIND[kind]}"]
    if culprit is not None:
        parts.append(how_it_ended(culprit))
    elif reason:
        parts.append(reason)
    text = ": ".join(parts)
    if culprit is not None and culprit.stderr_tail:
        last = culprit.stderr_tail.rstrip("\n").splitlines()[-1]
        text += f"; its stderr ends: {last}"
    text += f". Will retry: {retry}."
    return {
        "kind": kind,
        "attempt": attempt,
        "rank": culprit.rank if culprit else None,
        "node_id": culprit.node_id if culprit else None,
        "state": culprit.state if culprit else None,
        "exit_code": culprit.exit_code if culprit else exit_code,
        "signal": culprit.signal if culprit else None,
        "signal_name": signal_name(culprit.signal) if culprit else None,
        "stderr_tail": culprit.stderr_tail if culprit else "",
        "reason": reason or None,
        "will_retry": will_retry,
        "retry": retry,
        "attempts_left": left if will_retry and kind == "failed" else (None if will_retry else 0),
        "summary": text,
    }


_KIND = {
    "failed": "failed",
    "cancelled": "was cancelled",
    "timed_out": "ran out of time",
    "preempted": "was preempted",
    "infrastructure": "failed for an infrastructure reason",
}
