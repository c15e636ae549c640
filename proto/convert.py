"""Conversions between the wire messages (agent_pb2) and common.contracts dataclasses."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from common.contracts import GpuReport, HeartbeatReport, RunningLeaseReport, TaskState, TaskStatus
from proto import agent_pb2 as pb

_STATE_TO_PB: dict[TaskState, Any] = {s: pb.TaskState.Value(s.value) for s in TaskState}
_PB_TO_STATE = {v: k for k, v in _STATE_TO_PB.items()}


def task_status_to_pb(s: TaskStatus) -> pb.TaskStatus:
    m = pb.TaskStatus(
        node_id=s.node_id,
        lease_id=s.lease_id,
        job_id=s.job_id,
        attempt=s.attempt,
        epoch=s.epoch,
        rank=s.rank,
        state=_STATE_TO_PB[TaskState(s.state)],
        at=s.at.timestamp(),
        boot_id=s.boot_id,
        seq=s.seq,
        stderr_tail=s.stderr_tail,
        reason=s.reason,
    )
    if s.signal is not None:
        m.signal = s.signal
    if s.exit_code is not None:
        m.exit_code = s.exit_code
    if s.checkpoint_uri is not None:
        m.checkpoint_uri = s.checkpoint_uri
    if s.step is not None:
        m.step = s.step
    return m


def task_status_from_pb(m: pb.TaskStatus) -> TaskStatus:
    if m.state not in _PB_TO_STATE:
        raise ValueError(f"unknown task state {m.state}")
    return TaskStatus(
        node_id=m.node_id,
        lease_id=m.lease_id,
        job_id=m.job_id,
        attempt=m.attempt,
        epoch=m.epoch,
        rank=m.rank,
        state=_PB_TO_STATE[m.state],
        at=datetime.fromtimestamp(m.at, tz=UTC),
        exit_code=m.exit_code if m.HasField("exit_code") else None,
        checkpoint_uri=m.checkpoint_uri if m.HasField("checkpoint_uri") else None,
        step=m.step if m.HasField("step") else None,
        boot_id=m.boot_id,
        seq=m.seq,
        signal=m.signal if m.HasField("signal") else None,
        stderr_tail=m.stderr_tail,
        reason=m.reason,
    )


_HEALTH = {
    pb.GPU_HEALTH_UNKNOWN: "unknown",
    pb.GPU_HEALTH_OK: "ok",
    pb.GPU_HEALTH_DEGRADED: "degraded",
    pb.GPU_HEALTH_FAILED: "failed",
}
HEALTH_TO_PB = {v: k for k, v in _HEALTH.items()}


def _opt(m, name: str):
    return getattr(m, name) if m.HasField(name) else None


def gpu_report_from_pb(g: pb.GpuStatus) -> GpuReport:
    return GpuReport(
        index=g.index,
        health=_HEALTH.get(g.health, "unknown"),
        sm_util=_opt(g, "sm_util"),
        mem_util=_opt(g, "mem_util"),
        mem_used=_opt(g, "mem_used"),
        mem_total=_opt(g, "mem_total"),
        temperature_c=_opt(g, "temperature_c"),
        ecc_sbe=_opt(g, "ecc_sbe"),
        ecc_dbe=_opt(g, "ecc_dbe"),
        xids=tuple(g.xids),
        faults=tuple(g.faults),
        uuid=g.uuid,
    )


def running_lease_from_pb(r: pb.RunningLease) -> RunningLeaseReport:
    return RunningLeaseReport(
        lease_id=r.lease_id,
        job_id=r.job_id,
        epoch=r.epoch,
        attempt=r.attempt,
        rank=r.rank,
        pid=r.pid or None,
        step=r.step if r.step >= 0 else None,
        step_age_s=r.step_age_s,
        checkpoint_uri=r.checkpoint_uri or None,
        checkpoint_step=r.checkpoint_step if r.checkpoint_uri else None,
        gpu_indices=tuple(r.gpu_indices),
        unconfirmed_s=r.unconfirmed_s,
    )


def heartbeat_report_from_pb(h: pb.Heartbeat) -> HeartbeatReport:
    return HeartbeatReport(
        node_id=h.node_id,
        boot_id=h.boot_id,
        seq=h.seq,
        sent_at=datetime.fromtimestamp(h.sent_at, tz=UTC),
        gpus=tuple(gpu_report_from_pb(g) for g in h.gpus),
        running=tuple(running_lease_from_pb(r) for r in h.running),
        free_disk_bytes=h.free_disk_bytes,
        cached_images=tuple(h.cached_images),
        agent_addr=h.agent_addr,
        node_faults=tuple(h.node_faults),
    )
