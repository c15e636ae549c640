"""One rank's cgroup under the process runtime: its share's limits, and every process it starts.

The supervisor (running as root, like the agent) creates it before the rank starts, the
rank joins it between fork and exec (before it drops to its own user), and the supervisor
kills what is left in it and removes it when the rank ends. Two things follow:

* the rank cannot take more than its share of CPUs, memory or processes
  (worker_agent.rank_limits); past its memory the kernel's OOM killer ends it, and
  ``oom_kills()`` says so;
* a process that leaves the rank's process group (``setsid``, a daemon) is still in the
  cgroup, so it is killed with the rank instead of holding the GPUs after it.

The rank is also denied the device nodes of the node's other GPUs (``deny_devices``,
worker_agent.gpu_devices): ``CUDA_VISIBLE_DEVICES`` alone is advisory. v1 writes them to
the devices controller's ``devices.deny``; v2 has no devices file, so there a BPF device
program is attached to the rank's cgroup (worker_agent.device_bpf). ``device_fence_problem``
says at the agent's start whether either works here.

Both hierarchies: cgroup v2 (one tree, ``cgroup.controllers`` at the root) and v1 (one
tree per controller: ``cpu``, ``memory``, ``pids``, and ``devices`` where mounted).
``parent`` is a path under the root (v2: a subtree delegated to the agent, with cpu,
memory and pids enabled down to it).

Standard library only (the supervisor imports it).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from worker_agent import device_bpf

CFS_PERIOD_US = 100_000
V1_CONTROLLERS = ("cpu", "memory", "pids")
V2_CONTROLLERS = ("cpu", "memory", "pids")


class CgroupError(OSError):
    pass


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as e:
        raise CgroupError(f"cannot write {value!r} to {path}: {e.strerror or e}") from e


def hierarchy(root: Path) -> int:
    """2 for a unified hierarchy with the controllers we need, 1 for v1's, else CgroupError."""
    controllers = root / "cgroup.controllers"
    if controllers.exists():
        have = set(controllers.read_text().split())
        missing = [c for c in V2_CONTROLLERS if c not in have]
        if missing:
            raise CgroupError(f"cgroup v2 at {root} lacks the {', '.join(missing)} controller(s)")
        return 2
    missing = [c for c in V1_CONTROLLERS if not (root / c / "cgroup.procs").exists()]
    if missing:
        raise CgroupError(f"no cgroup v2 at {root}, and no v1 {', '.join(missing)} hierarchy under it")
    return 1


def has_v1_devices(root: Path) -> bool:
    """Whether v1's devices controller is mounted under ``root`` (v1's GPU fence needs it)."""
    return (root / "devices" / "devices.deny").exists()


PROBE = "gpu-fence-probe"  # not a lease id's shape (worker_agent.statefiles), so never a rank's


def device_fence_problem(root: Path | str, parent: str) -> str | None:
    """Why ranks' cgroups under ``parent`` cannot be denied device nodes here, or None.

    v1: whether the devices controller is mounted. v2: a program is attached to a probe
    cgroup under ``parent`` and the probe removed, the very steps a rank's cgroup takes."""
    root = Path(root)
    if hierarchy(root) == 1:
        return None if has_v1_devices(root) else "no cgroup v1 devices controller"
    probe = root / parent.strip("/") / PROBE
    try:
        probe.mkdir(parents=True, exist_ok=True)
        device_bpf.deny(probe, [])
    except OSError as e:
        return f"cgroup v2 at {root} takes no BPF device program ({e.strerror or e})"
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass
    return None


class RankCgroup:
    """The rank's cgroup dirs (one for v2, one per controller for v1)."""

    def __init__(self, version: int, dirs: list[Path]) -> None:
        self.version = version
        self.dirs = dirs

    # --------------------------------------------------------------- make
    @classmethod
    def create(
        cls, root: Path | str, parent: str, name: str, *, cpus: float, memory_bytes: int, pids: int,
        deny_devices: list[tuple[int, int]] | None = None,
    ) -> RankCgroup:  # fmt: skip
        """``deny_devices``: (major, minor) of the character devices the rank may not open (a
        list given where it cannot be enforced is a CgroupError, not ignored)."""
        root = Path(root)
        version = hierarchy(root)
        rel = Path(parent.strip("/")) / name
        if deny_devices and version == 1 and not has_v1_devices(root):
            raise CgroupError(f"cannot deny devices {deny_devices}: no cgroup v1 devices controller at {root}")
        if version == 2:
            _enable_v2(root, Path(parent.strip("/")))
            d = root / rel
            d.mkdir(parents=True, exist_ok=True)
            cg = cls(2, [d])
            _write(d / "cpu.max", f"{max(1000, int(cpus * CFS_PERIOD_US))} {CFS_PERIOD_US}")
            _write(d / "memory.max", str(int(memory_bytes)))
            if (d / "memory.swap.max").exists():
                _write(d / "memory.swap.max", "0")
            _write(d / "pids.max", str(int(pids)))
            if deny_devices:
                try:
                    device_bpf.deny(d, deny_devices)
                except OSError as e:
                    raise CgroupError(f"cannot deny devices {deny_devices}: {e.strerror or e}") from e
            return cg
        dirs = {c: root / c / rel for c in V1_CONTROLLERS}
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        cg = cls(1, list(dirs.values()))
        _write(dirs["cpu"] / "cpu.cfs_period_us", str(CFS_PERIOD_US))
        _write(dirs["cpu"] / "cpu.cfs_quota_us", str(max(1000, int(cpus * CFS_PERIOD_US))))
        _write(dirs["memory"] / "memory.limit_in_bytes", str(int(memory_bytes)))
        if (dirs["memory"] / "memory.memsw.limit_in_bytes").exists():  # swap accounting on: no swap either
            _write(dirs["memory"] / "memory.memsw.limit_in_bytes", str(int(memory_bytes)))
        _write(dirs["pids"] / "pids.max", str(int(pids)))
        if deny_devices:
            devices = root / "devices" / rel
            devices.mkdir(parents=True, exist_ok=True)
            cg.dirs.append(devices)
            for major, minor in deny_devices:
                _write(devices / "devices.deny", f"c {int(major)}:{int(minor)} rwm")
        return cg

    def as_json(self) -> dict:
        return {"version": self.version, "dirs": [str(d) for d in self.dirs]}

    @classmethod
    def from_json(cls, data: dict) -> RankCgroup:
        return cls(int(data["version"]), [Path(d) for d in data["dirs"]])

    # --------------------------------------------------------------- use
    def enter(self) -> None:
        """Move the calling process in (the rank, between fork and exec, while still root)."""
        for d in self.dirs:
            _write(d / "cgroup.procs", "0")

    def pids(self) -> set[int]:
        out: set[int] = set()
        for d in self.dirs:
            try:
                out |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
            except (OSError, ValueError):
                pass
        return out

    def kill_all(self) -> None:
        """SIGKILL every process in it, wherever its process group or session went."""
        kill_file = self.dirs[0] / "cgroup.kill"  # v2, Linux 5.14+
        if self.version == 2 and kill_file.exists():
            try:
                kill_file.write_text("1")
                return
            except OSError:
                pass
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def oom_kills(self) -> int:
        """How many of its processes the kernel's OOM killer ended (0 when it cannot tell)."""
        memory_dir = self.dirs[0] if self.version == 2 else self.dirs[V1_CONTROLLERS.index("memory")]
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in (memory_dir / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def remove(self, timeout_s: float = 5.0) -> bool:
        """Kill what is left and remove the dirs; False if one could not be removed in time."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.kill_all()
            left = []
            for d in self.dirs:
                try:
                    d.rmdir()
                except FileNotFoundError:
                    pass
                except OSError:
                    left.append(d)
            if not left:
                return True
            self.dirs = left
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def _enable_v2(root: Path, parent: Path) -> None:
    """Enable cpu, memory and pids for children from the root down to ``parent``."""
    d = root
    for part in (*parent.parts, None):
        ctl = d / "cgroup.subtree_control"
        have = set(ctl.read_text().split()) if ctl.exists() else set()
        want = [c for c in V2_CONTROLLERS if c not in have]
        if want:
            _write(ctl, " ".join("+" + c for c in want))
        if part is None:
            break
        d = d / part
        d.mkdir(exist_ok=True)
