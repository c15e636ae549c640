"""Whether a node can host new ranks (worker_agent.node_fitness): the dirs a rank's start
writes are checked for room and for a write that reaches the disk, and the container engine
for an answer; what is found goes out in the node's heartbeat. Real filesystems where root
may mount them; no container engine runs here, so a script on PATH answers as a daemon
that is down or up does."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

import pytest

from tests.agent.conftest import close_node, make_settings
from tests.support import fill_disk
from worker_agent.node import NodeAgent
from worker_agent.node_fitness import NodeFitness, check
from worker_agent.nvml import make_backend
from worker_agent.runtime import ContainerRuntime, ProcessRuntime

DAEMON_DOWN = "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?"
SLEEP = shutil.which("sleep")  # found before a test narrows PATH
MOUNTS = os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.fixture
def small_fs(tmp_path):
    """A 1 MiB tmpfs of its own (root only)."""
    if not MOUNTS:
        pytest.skip("mounting a small tmpfs needs root")
    d = tmp_path / "small"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], check=True)
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_dir_with_room_that_takes_a_write_is_fit_and_a_missing_one_is_not(tmp_path):
    assert check([tmp_path, tmp_path], 0) == []
    assert not list(tmp_path.iterdir())  # the probe file is gone again
    gone = tmp_path / "gone"
    (faults,) = [check([gone], 0)]
    assert len(faults) == 1 and faults[0].startswith(f"disk {gone}: ") and "No such file" in faults[0]
    (below,) = check([tmp_path], 1 << 62)
    assert below.startswith(f"disk {tmp_path}: ") and "free, below" in below and "agent_min_free_disk_bytes" in below


def test_a_full_disk_and_a_read_only_one_are_named(small_fs):
    assert check([small_fs], 256 * 1024) == []
    fill_disk(small_fs / "filler")
    (full,) = check([small_fs], 256 * 1024)
    assert "0.0 MiB free, below 0.2 MiB" in full, full
    (full,) = check([small_fs], 0)  # no floor: the write itself fails
    assert "cannot write: No space left on device" in full, full
    (small_fs / "filler").unlink()
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)  # as ext4 does after an I/O error
    (ro,) = check([small_fs], 0)
    assert "cannot write: Read-only file system" in ro, ro


async def test_the_heartbeat_says_what_keeps_the_node_from_new_ranks(small_fs, tmp_path):
    settings = make_settings(
        tmp_path, agent_work_dir=small_fs, agent_min_free_disk_bytes=512 * 1024, agent_node_fitness_check_s=3600
    )
    node = NodeAgent(settings, "node-f", backend=make_backend(settings, "node-f", "simulated"))
    await node.start()
    try:
        assert list((await node.heartbeat()).node_faults) == []
        (small_fs / "node-f" / "big").write_bytes(bytes(768 * 1024))
        # checked again only every hour: the heartbeat still carries the latest check ...
        assert list((await node.heartbeat()).node_faults) == []
        node.fitness.recheck()  # ... until a start could not prepare its dirs
        (fault,) = (await node.heartbeat()).node_faults
        assert fault.startswith(f"disk {small_fs / 'node-f'}: ") and "free, below 0.5 MiB" in fault
    finally:
        await close_node(node)


async def test_a_change_is_logged_once(tmp_path, caplog):
    caplog.set_level(logging.INFO, "gpufleet.agent")
    free = iter(range(100, 0, -1))  # a disk filling up: each check finds another figure
    fitness = NodeFitness("node-l", [tmp_path / "gone"], 0, every_s=0, probes=[lambda: f"disk /d: {next(free)} B free"])
    assert len(await fitness.faults()) == 2 and len(await fitness.faults()) == 2
    assert "/d: 99 B free" in fitness.latest[1]
    assert caplog.text.count("node-l: cannot host new ranks: disk") == 1
    (tmp_path / "gone").mkdir()
    fitness.probes = []
    assert await fitness.faults() == []
    assert "node-l: can host new ranks again" in caplog.text


def engine(tmp_path, monkeypatch, body: str) -> None:
    """``docker`` on PATH as a shell script with this body (only it: no real engine here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "docker").write_text(f"#!/bin/sh\n{body}\n")
    (bin_dir / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))


def test_a_container_engine_that_does_not_answer_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert ContainerRuntime("docker").problem() == "container engine docker: not installed"
    engine(tmp_path, monkeypatch, f'echo "{DAEMON_DOWN}" >&2; exit 1')
    assert ContainerRuntime("docker").problem() == f"container engine docker: {DAEMON_DOWN}"
    engine(tmp_path, monkeypatch, f"exec {SLEEP} 5")  # a hung daemon
    assert "no answer to `docker info` within 0.2s" in (ContainerRuntime("docker").problem(timeout_s=0.2) or "")
    engine(tmp_path, monkeypatch, 'echo "28.0.1"')
    assert ContainerRuntime("docker").problem() is None
    assert ProcessRuntime().problem() is None


async def test_a_node_whose_container_daemon_is_down_says_so_in_its_heartbeat(tmp_path, monkeypatch):
    engine(tmp_path, monkeypatch, f'echo "{DAEMON_DOWN}" >&2; exit 1')
    settings = make_settings(tmp_path, agent_node_fitness_check_s=3600)
    node = NodeAgent(
        settings, "node-d", backend=make_backend(settings, "node-d", "simulated"), runtime=ContainerRuntime("docker")
    )
    await node.start()
    try:
        assert list((await node.heartbeat()).node_faults) == [f"container engine docker: {DAEMON_DOWN}"]
    finally:
        await close_node(node)
