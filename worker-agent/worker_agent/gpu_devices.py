"""Which GPU device nodes a rank may not open: every ``nvidiaN`` of the node but its own.

``CUDA_VISIBLE_DEVICES`` only tells CUDA which GPUs to show; a process that opens another
GPU's device node uses that GPU anyway. Under the process runtime with cgroups, the rank's
supervisor denies the rank the other GPUs' nodes through its cgroup (worker_agent.rank_cgroup:
v1's devices controller, or v2's BPF device program, worker_agent.device_bpf). The shared
control nodes (``nvidiactl``, ``nvidia-uvm``, ``nvidia-modeset``) stay open: CUDA needs them
and they reach no GPU by themselves.

A GPU's node is found by its minor number (NVML's, which need not equal its index), and
matched by the device numbers of the node file, not by its name.

Standard library only.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

GPU_NODE = re.compile(r"nvidia(\d+)")


def _gpu_nodes(dev_dir: Path | str) -> dict[int, tuple[str, tuple[int, int]]]:
    """minor -> (path, (major, minor)) of each GPU device node in ``dev_dir`` (a character
    device named ``nvidiaN``; links and other files are not GPUs)."""
    try:
        names = os.listdir(dev_dir)
    except FileNotFoundError:
        return {}
    out: dict[int, tuple[str, tuple[int, int]]] = {}
    for name in names:
        if not GPU_NODE.fullmatch(name):
            continue
        path = os.path.join(dev_dir, name)
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            out[os.minor(st.st_rdev)] = (path, (os.major(st.st_rdev), os.minor(st.st_rdev)))
    return out


def gpu_device_numbers(dev_dir: Path | str) -> dict[int, tuple[int, int]]:
    """minor -> (major, minor) of each GPU device node in ``dev_dir``."""
    return {minor: number for minor, (_, number) in _gpu_nodes(dev_dir).items()}


def denied_paths(dev_dir: Path | str, granted_minors: Iterable[int]) -> list[str]:
    """The paths of every GPU node in ``dev_dir`` the rank was not granted, in order (what a
    rank's own mount namespace masks where no cgroup denies them: worker_agent.rank_mounts)."""
    keep = set(granted_minors)
    return sorted(path for minor, (path, _) in _gpu_nodes(dev_dir).items() if minor not in keep)


def denied_devices(nodes: dict[int, tuple[int, int]], granted_minors: Iterable[int]) -> list[tuple[int, int]]:
    """The (major, minor) of every GPU node the rank was not granted, in order."""
    keep = set(granted_minors)
    return sorted(number for minor, number in nodes.items() if minor not in keep)
