"""cgroup v2's GPU fence on the real kernel (worker_agent.device_bpf; docs/security.md,
"GPUs, process runtime"): a process in a cgroup holding the program cannot open the GPU
nodes it denies, while its own GPU's and CUDA's shared nodes reach the driver.

A cgroup2 hierarchy is mounted for the test (as root; a host whose controllers are bound
to v1 still has one, and the kernel runs its device programs). The GPU nodes are made with
mknod under NVIDIA's major number: with no driver loaded, a node the fence lets through
opens with "No such device or address", one it denies with "Operation not permitted"."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.security.conftest import sections
from worker_agent import device_bpf, gpu_devices, rank_cgroup

RANK_UID = 65534


def _mount_cgroup2(where: Path) -> str:
    """Mount a cgroup2 hierarchy there; why not, or ''."""
    if os.geteuid() != 0:
        return "mounting cgroup2 and attaching BPF programs needs root"
    r = subprocess.run(["mount", "-t", "cgroup2", "none", str(where)], capture_output=True, text=True)
    return "" if r.returncode == 0 else f"cannot mount cgroup2 here: {r.stderr.strip()}"


@pytest.fixture
def cgroup2():
    """A cgroup of the test's own in a cgroup2 hierarchy mounted for it. Every mount of
    cgroup2 shows the host's one v2 hierarchy, so nothing is made at its root, and the
    test's cgroup is removed, children first, before the mount goes."""
    where = Path(tempfile.mkdtemp(prefix="gpufleet-cg2-"))
    why = _mount_cgroup2(where)
    if why:
        where.rmdir()
        pytest.skip(why)
    try:
        mine = Path(tempfile.mkdtemp(prefix="gpufleet-test-", dir=where))
        try:
            yield mine
        finally:
            for d in sorted((p for p in mine.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                d.rmdir()
            mine.rmdir()
    finally:
        subprocess.run(["umount", str(where)], check=True)
        where.rmdir()


def opened_as_rank(cgroup: Path, dev: Path, names: list[str]) -> dict[str, str]:
    """Each node's `cat` error, from a process that joins the cgroup and drops to the rank
    user first (as the supervisor starts a rank)."""

    def enter() -> None:
        (cgroup / "cgroup.procs").write_text("0")
        os.setgroups([])
        os.setgid(RANK_UID)
        os.setuid(RANK_UID)

    body = "".join(f'echo "== {n}"; cat "{dev / n}" 2>&1\n' for n in names) + 'echo "== null"; cat /dev/null && echo ok'
    out = subprocess.run(["/bin/sh", "-c", body], preexec_fn=enter, capture_output=True, text=True, timeout=20)
    return sections(out.stdout)


def test_a_process_in_the_cgroup_cannot_open_the_gpus_beside_its_own(cgroup2, gpu_dev):
    rank = cgroup2 / "lease-gpu"
    rank.mkdir()
    denied = gpu_devices.denied_devices(gpu_devices.gpu_device_numbers(gpu_dev), [1])
    assert denied == [(195, 0), (195, 2), (195, 3)]
    device_bpf.deny(rank, denied)
    assert device_bpf.attached(rank) == 1  # held by the cgroup after the loader closed it
    opened = opened_as_rank(rank, gpu_dev, ["nvidia0", "nvidia1", "nvidia2", "nvidia3", "nvidiactl"])
    assert "No such device or address" in opened["nvidia1"], opened  # its own GPU: through to the driver
    assert "No such device or address" in opened["nvidiactl"], opened  # CUDA's control node stays open
    for other in ("nvidia0", "nvidia2", "nvidia3"):
        assert "Operation not permitted" in opened[other], opened
    assert opened["null"].strip() == "ok"
    # beside it, a cgroup without the program: every node reaches the driver
    other = cgroup2 / "lease-other"
    other.mkdir()
    assert device_bpf.attached(other) == 0
    beside = opened_as_rank(other, gpu_dev, ["nvidia0", "nvidia2"])
    assert all("No such device or address" in v for k, v in beside.items() if k != "null"), beside


def test_the_program_cannot_be_loosened_from_below(cgroup2, gpu_dev):
    """A program attached below (with the same flag) runs beside the rank's, not instead of it:
    a cgroup made inside the rank's is denied the same GPUs."""
    rank = cgroup2 / "lease-nest"
    rank.mkdir()
    device_bpf.deny(rank, [(195, 0)])
    inner = rank / "inner"
    inner.mkdir()
    device_bpf.deny(inner, [])  # allows everything by itself
    opened = opened_as_rank(inner, gpu_dev, ["nvidia0", "nvidia1"])
    assert "Operation not permitted" in opened["nvidia0"], opened
    assert "No such device or address" in opened["nvidia1"], opened


def test_a_dir_that_is_not_a_cgroup_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("loading BPF programs needs root")
    with pytest.raises(device_bpf.DeviceFenceError, match="cannot attach the device program"):
        device_bpf.deny(tmp_path, [(195, 0)])


def test_a_cgroup_holding_the_program_is_removed_like_any_other(cgroup2):
    rank = cgroup2 / "lease-gone"
    rank.mkdir()
    device_bpf.deny(rank, [(195, 0)])
    cg = rank_cgroup.RankCgroup(2, [rank])
    assert cg.remove(timeout_s=5)
    assert not rank.exists()
