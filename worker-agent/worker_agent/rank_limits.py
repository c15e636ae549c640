"""A rank's share of its node: CPUs, memory, processes and work-dir disk in proportion to its GPUs.

A 1-GPU job beside another team's 7-GPU job on one 8-GPU node must not be able to take
the node's memory or CPUs from it (docs/security.md, "Fencing a rank to its share"). The
share is the one Slurm's per-GPU defaults and a Kubernetes GPU node's requests give:
what the node keeps for itself (the agent, supervisors, the OS) is set aside, and the rest
is split by GPUs. The container runtime passes it as the engine's flags; under the process
runtime the supervisor puts the rank in cgroups with it (worker_agent.rank_cgroup). Disk,
under either runtime, the supervisor measures in the rank's work dir (worker_agent.rank_disk).

    limits = rank_limits(gpus=1, node_gpus=8, node_cpus=96, node_memory_bytes=1 << 40,
                         reserved_cpus=2, reserved_memory_bytes=8 << 30, pids_max=16384)

Standard library only.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

MIB = 1 << 20


@dataclass(frozen=True)
class RankLimits:
    cpus: float  # CPU-seconds per second (a CFS quota), not pinned cores
    memory_bytes: int  # resident memory, page cache and shared memory together; no swap
    pids: int  # processes and threads
    disk_bytes: int | None = None  # in its work dir; None: not measured (no work dir's filesystem known)

    def as_json(self) -> dict:
        return asdict(self)


def rank_limits(
    *,
    gpus: int,
    node_gpus: int,
    node_cpus: float,
    node_memory_bytes: int,
    reserved_cpus: float,
    reserved_memory_bytes: int,
    pids_max: int,
    node_disk_bytes: int | None = None,
    reserved_disk_bytes: int = 0,
) -> RankLimits:
    """The rank's share. The reserve never takes more than half the node (a small host still
    gives its ranks something); a rank granted every GPU gets all of what is left. Disk is
    the work dirs' filesystem, when given."""
    if node_cpus <= 0 or node_memory_bytes <= 0 or pids_max < 1:
        raise ValueError(
            f"a node needs CPUs, memory and a process limit ({node_cpus}, {node_memory_bytes}, {pids_max})"
        )
    share = min(1.0, max(1, gpus) / max(1, node_gpus))
    usable_cpus = max(node_cpus - max(0.0, reserved_cpus), node_cpus / 2)
    cpus = max(0.01, round(usable_cpus * share, 2))
    memory = _bytes_share(node_memory_bytes, reserved_memory_bytes, share)
    disk = None if node_disk_bytes is None else _bytes_share(node_disk_bytes, reserved_disk_bytes, share)
    return RankLimits(cpus=cpus, memory_bytes=memory, pids=int(pids_max), disk_bytes=disk)


def _bytes_share(total: int, reserved: int, share: float) -> int:
    """``share`` of ``total`` less the reserve (at most half), in whole MiB: the engines' unit."""
    usable = max(total - max(0, reserved), total // 2)
    return max(MIB, int(usable * share) // MIB * MIB)


def host_cpus() -> int:
    """The CPUs this process may run on (a container's or cpuset's, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def host_memory_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def filesystem_bytes(path: Path | str) -> int:
    st = os.statvfs(path)
    return int(st.f_blocks) * int(st.f_frsize)


def node_rank_limits(settings, *, gpus: int, node_gpus: int, work_dir: Path | str | None = None) -> RankLimits | None:
    """The share from the agent's settings; None when ``agent_rank_limits`` is off. Disk: the
    filesystem of ``work_dir`` (the ranks' work dirs), unless ``agent_node_disk_gib`` says."""
    if not settings.agent_rank_limits:
        return None
    cpus = settings.agent_node_cpus or host_cpus()
    memory = int(settings.agent_node_memory_gib * (1 << 30)) if settings.agent_node_memory_gib else host_memory_bytes()
    disk = None
    if settings.agent_node_disk_gib:
        disk = int(settings.agent_node_disk_gib * (1 << 30))
    elif work_dir is not None:
        disk = filesystem_bytes(work_dir)
    return rank_limits(
        gpus=gpus,
        node_gpus=node_gpus,
        node_cpus=float(cpus),
        node_memory_bytes=memory,
        reserved_cpus=float(settings.agent_node_reserved_cpus),
        reserved_memory_bytes=int(settings.agent_node_reserved_memory_gib * (1 << 30)),
        pids_max=int(settings.agent_rank_pids_max),
        node_disk_bytes=disk,
        reserved_disk_bytes=int(settings.agent_node_reserved_disk_gib * (1 << 30)),
    )
