"""The node's state dir, shared by the agent and the per-rank supervisors.

Standard library only: the supervisor imports this and must start fast.

Layout (``<state_dir>/agent/<node_id>/``)::

    faults.jsonl              simulated faults appended by `gpufleet agent inject-fault`
    leases/<lease_id>/
        epoch.json            newest epoch seen for the lease (fsynced: survives reboots)
        task.json             the StartTask as received
        spec.json             what the supervisor runs (argv, env, log paths, timeouts)
        supervisor.json       supervisor pid, rank pid/pgid, their start times, boot id
        confirmed.json        last lease confirmation (CLOCK_BOOTTIME), written by the agent
        stop.json             a stop request (epoch, grace), written by the agent
        exit.json             written once by the supervisor (or the agent for LOST)
        reported.json         the terminal TaskStatus was acknowledged by the leader
        stdout.log stderr.log the rank's output; supervisor.log the supervisor's
        rank/progress.json    written by the rank (worker_agent.jobhelper): step, checkpoint

Times that cross processes use CLOCK_BOOTTIME, which all processes of one boot
share and which does not jump with the wall clock.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Any

EPOCH = "epoch.json"
TASK = "task.json"
SPEC = "spec.json"
SUPERVISOR = "supervisor.json"
CONFIRMED = "confirmed.json"
STOP = "stop.json"
EXIT = "exit.json"
REPORTED = "reported.json"
STDOUT = "stdout.log"
STDERR = "stderr.log"
SUPERVISOR_LOG = "supervisor.log"
RANK_DIR = "rank"
PROGRESS = "rank/progress.json"
FAULTS = "faults.jsonl"

_LEASE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def valid_lease_id(lease_id: str) -> bool:
    """Lease ids become directory names: no separators, no '..'."""
    return bool(_LEASE_ID.match(lease_id)) and ".." not in lease_id


def node_dir(state_dir: Path | str, node_id: str) -> Path:
    if not valid_lease_id(node_id):  # same alphabet
        raise ValueError(f"invalid node id {node_id!r}")
    return Path(state_dir) / "agent" / node_id


def leases_dir(state_dir: Path | str, node_id: str) -> Path:
    return node_dir(state_dir, node_id) / "leases"


def progress_path(lease_dir: Path) -> Path:
    """Where the lease's rank writes its progress: as its spec says (in the rank's work dir),
    else where ranks started before work dirs existed wrote it (``rank/progress.json``)."""
    spec = read_json(lease_dir / SPEC) or {}
    return Path(spec["progress"]) if spec.get("progress") else lease_dir / PROGRESS


def boot_clock() -> float:
    """Seconds since boot, shared by every process of this boot."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def host_boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:  # not Linux: one id per process lifetime is the best we can do
        return f"unknown-{os.getpid()}"


def write_json_atomic(path: Path, obj: Any, *, fsync: bool = False) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = json.dumps(obj, separators=(",", ":"), default=str).encode()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def read_json(path: Path) -> dict | None:
    """The object in ``path``, or None when it is missing or not (yet) valid JSON."""
    try:
        with open(path, "rb") as f:
            value = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


RANK_FILE_MAX_BYTES = 64 * 1024


def read_rank_json(path: Path) -> dict | None:
    """Like ``read_json``, for a file a rank writes (its progress): the agent is root and the
    rank is not, so a symlink (to the agent's state), a FIFO (to hang the agent) or a huge file
    is not followed, waited on or read whole."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, RANK_FILE_MAX_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > RANK_FILE_MAX_BYTES:
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (pid-reuse-proof identity), None if gone/zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    # comm may contain spaces and parentheses: split after the last ')'
    rest = raw[raw.rfind(")") + 2 :].split()
    if not rest or rest[0] in ("Z", "X"):
        return None
    try:
        return int(rest[19])  # field 22 overall
    except (IndexError, ValueError):
        return None


def process_alive(pid: int | None, start_ticks: int | None) -> bool:
    if not pid:
        return False
    ticks = process_start_ticks(pid)
    if ticks is None:
        return False
    return start_ticks is None or ticks == start_ticks


def group_alive(pgid: int | None) -> bool:
    if not pgid:
        return False
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
