from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GpuHealth(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GPU_HEALTH_UNKNOWN: _ClassVar[GpuHealth]
    GPU_HEALTH_OK: _ClassVar[GpuHealth]
    GPU_HEALTH_DEGRADED: _ClassVar[GpuHealth]
    GPU_HEALTH_FAILED: _ClassVar[GpuHealth]

class TaskState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_STATE_UNSPECIFIED: _ClassVar[TaskState]
    STARTED: _ClassVar[TaskState]
    EXITED: _ClassVar[TaskState]
    STOPPED: _ClassVar[TaskState]
    FENCED: _ClassVar[TaskState]
    LOST: _ClassVar[TaskState]
    REJECTED: _ClassVar[TaskState]
GPU_HEALTH_UNKNOWN: GpuHealth
GPU_HEALTH_OK: GpuHealth
GPU_HEALTH_DEGRADED: GpuHealth
GPU_HEALTH_FAILED: GpuHealth
TASK_STATE_UNSPECIFIED: TaskState
STARTED: TaskState
EXITED: TaskState
STOPPED: TaskState
FENCED: TaskState
LOST: TaskState
REJECTED: TaskState

class AgentMessage(_message.Message):
    __slots__ = ("heartbeat", "task_status")
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    TASK_STATUS_FIELD_NUMBER: _ClassVar[int]
    heartbeat: Heartbeat
    task_status: TaskStatus
    def __init__(self, heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., task_status: _Optional[_Union[TaskStatus, _Mapping]] = ...) -> None: ...

class ControlMessage(_message.Message):
    __slots__ = ("heartbeat_ack", "task_status_ack", "redirect")
    HEARTBEAT_ACK_FIELD_NUMBER: _ClassVar[int]
    TASK_STATUS_ACK_FIELD_NUMBER: _ClassVar[int]
    REDIRECT_FIELD_NUMBER: _ClassVar[int]
    heartbeat_ack: HeartbeatAck
    task_status_ack: TaskStatusAck
    redirect: Redirect
    def __init__(self, heartbeat_ack: _Optional[_Union[HeartbeatAck, _Mapping]] = ..., task_status_ack: _Optional[_Union[TaskStatusAck, _Mapping]] = ..., redirect: _Optional[_Union[Redirect, _Mapping]] = ...) -> None: ...

class GpuStatus(_message.Message):
    __slots__ = ("index", "health", "sm_util", "mem_util", "mem_used", "mem_total", "temperature_c", "ecc_sbe", "ecc_dbe", "xids", "faults", "uuid")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    SM_UTIL_FIELD_NUMBER: _ClassVar[int]
    MEM_UTIL_FIELD_NUMBER: _ClassVar[int]
    MEM_USED_FIELD_NUMBER: _ClassVar[int]
    MEM_TOTAL_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    ECC_SBE_FIELD_NUMBER: _ClassVar[int]
    ECC_DBE_FIELD_NUMBER: _ClassVar[int]
    XIDS_FIELD_NUMBER: _ClassVar[int]
    FAULTS_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    index: int
    health: GpuHealth
    sm_util: float
    mem_util: float
    mem_used: int
    mem_total: int
    temperature_c: float
    ecc_sbe: int
    ecc_dbe: int
    xids: _containers.RepeatedScalarFieldContainer[int]
    faults: _containers.RepeatedScalarFieldContainer[str]
    uuid: str
    def __init__(self, index: _Optional[int] = ..., health: _Optional[_Union[GpuHealth, str]] = ..., sm_util: _Optional[float] = ..., mem_util: _Optional[float] = ..., mem_used: _Optional[int] = ..., mem_total: _Optional[int] = ..., temperature_c: _Optional[float] = ..., ecc_sbe: _Optional[int] = ..., ecc_dbe: _Optional[int] = ..., xids: _Optional[_Iterable[int]] = ..., faults: _Optional[_Iterable[str]] = ..., uuid: _Optional[str] = ...) -> None: ...

class RunningLease(_message.Message):
    __slots__ = ("lease_id", "job_id", "epoch", "step", "attempt", "rank", "pid", "checkpoint_uri", "checkpoint_step", "step_age_s", "gpu_indices", "unconfirmed_s", "gpu_util")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_URI_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_AGE_S_FIELD_NUMBER: _ClassVar[int]
    GPU_INDICES_FIELD_NUMBER: _ClassVar[int]
    UNCONFIRMED_S_FIELD_NUMBER: _ClassVar[int]
    GPU_UTIL_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    job_id: str
    epoch: int
    step: int
    attempt: int
    rank: int
    pid: int
    checkpoint_uri: str
    checkpoint_step: int
    step_age_s: float
    gpu_indices: _containers.RepeatedScalarFieldContainer[int]
    unconfirmed_s: float
    gpu_util: float
    def __init__(self, lease_id: _Optional[str] = ..., job_id: _Optional[str] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., attempt: _Optional[int] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., checkpoint_uri: _Optional[str] = ..., checkpoint_step: _Optional[int] = ..., step_age_s: _Optional[float] = ..., gpu_indices: _Optional[_Iterable[int]] = ..., unconfirmed_s: _Optional[float] = ..., gpu_util: _Optional[float] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("node_id", "boot_id", "seq", "sent_at", "gpus", "running", "free_disk_bytes", "cached_images", "agent_addr", "agent_version", "node_faults")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    FREE_DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_IMAGES_FIELD_NUMBER: _ClassVar[int]
    AGENT_ADDR_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NODE_FAULTS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    boot_id: str
    seq: int
    sent_at: float
    gpus: _containers.RepeatedCompositeFieldContainer[GpuStatus]
    running: _containers.RepeatedCompositeFieldContainer[RunningLease]
    free_disk_bytes: int
    cached_images: _containers.RepeatedScalarFieldContainer[str]
    agent_addr: str
    agent_version: str
    node_faults: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., boot_id: _Optional[str] = ..., seq: _Optional[int] = ..., sent_at: _Optional[float] = ..., gpus: _Optional[_Iterable[_Union[GpuStatus, _Mapping]]] = ..., running: _Optional[_Iterable[_Union[RunningLease, _Mapping]]] = ..., free_disk_bytes: _Optional[int] = ..., cached_images: _Optional[_Iterable[str]] = ..., agent_addr: _Optional[str] = ..., agent_version: _Optional[str] = ..., node_faults: _Optional[_Iterable[str]] = ...) -> None: ...

class LeaseRef(_message.Message):
    __slots__ = ("lease_id", "epoch", "reason")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    epoch: int
    reason: str
    def __init__(self, lease_id: _Optional[str] = ..., epoch: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class HeartbeatAck(_message.Message):
    __slots__ = ("seq", "confirmed_lease_ids", "stop", "server_time")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CONFIRMED_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    SERVER_TIME_FIELD_NUMBER: _ClassVar[int]
    seq: int
    confirmed_lease_ids: _containers.RepeatedScalarFieldContainer[str]
    stop: _containers.RepeatedCompositeFieldContainer[LeaseRef]
    server_time: float
    def __init__(self, seq: _Optional[int] = ..., confirmed_lease_ids: _Optional[_Iterable[str]] = ..., stop: _Optional[_Iterable[_Union[LeaseRef, _Mapping]]] = ..., server_time: _Optional[float] = ...) -> None: ...

class TaskStatus(_message.Message):
    __slots__ = ("node_id", "lease_id", "job_id", "attempt", "epoch", "rank", "state", "at", "exit_code", "checkpoint_uri", "step", "boot_id", "seq", "signal", "stderr_tail", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_URI_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    STDERR_TAIL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    lease_id: str
    job_id: str
    attempt: int
    epoch: int
    rank: int
    state: TaskState
    at: float
    exit_code: int
    checkpoint_uri: str
    step: int
    boot_id: str
    seq: int
    signal: int
    stderr_tail: str
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., epoch: _Optional[int] = ..., rank: _Optional[int] = ..., state: _Optional[_Union[TaskState, str]] = ..., at: _Optional[float] = ..., exit_code: _Optional[int] = ..., checkpoint_uri: _Optional[str] = ..., step: _Optional[int] = ..., boot_id: _Optional[str] = ..., seq: _Optional[int] = ..., signal: _Optional[int] = ..., stderr_tail: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class TaskStatusAck(_message.Message):
    __slots__ = ("lease_id", "epoch", "seq", "ok", "error", "refused")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    epoch: int
    seq: int
    ok: bool
    error: str
    refused: bool
    def __init__(self, lease_id: _Optional[str] = ..., epoch: _Optional[int] = ..., seq: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., refused: _Optional[bool] = ...) -> None: ...

class Redirect(_message.Message):
    __slots__ = ("leader_addr", "reason")
    LEADER_ADDR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    leader_addr: str
    reason: str
    def __init__(self, leader_addr: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
