"""Whether ranks can read other users' process command lines (worker_agent.proc_visibility),
and the agent saying so at start."""

from __future__ import annotations

import logging
import os

import pytest

from tests.agent.conftest import make_settings
from worker_agent import proc_visibility, rank_mounts
from worker_agent.agent import AgentProcess
from worker_agent.proc_visibility import proc_hides_pids

PROC = "22 27 0:21 / /proc rw,nosuid,nodev,noexec,relatime - proc proc {options}"


@pytest.mark.parametrize(
    "options, hides",
    [
        ("rw", False),
        ("rw,hidepid=0", False),
        ("rw,hidepid=off", False),
        ("rw,hidepid=1", True),
        ("rw,hidepid=2,gid=27", True),
        ("rw,hidepid=invisible,gid=27", True),
        ("rw,hidepid=noaccess", True),
    ],
)
def test_proc_hides_other_users_processes_only_with_hidepid(options, hides):
    other = "30 27 0:25 / /sys rw - sysfs sysfs rw\n"
    assert proc_hides_pids(other + PROC.format(options=options) + "\n") is hides


def test_of_mounts_stacked_on_proc_the_last_is_the_one_seen():
    own = "40 22 0:60 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw,hidepid=invisible\n"
    assert proc_hides_pids(PROC.format(options="rw") + "\n" + own) is True
    assert proc_hides_pids(own + PROC.format(options="rw") + "\n") is False
    assert proc_hides_pids(PROC.format(options="rw") + "\n41 22 0:61 / /proc rw - tmpfs tmpfs rw\n") is None


def test_no_proc_mount_is_unknown():
    assert proc_hides_pids("30 27 0:25 / /sys rw - sysfs sysfs rw\n") is None
    assert proc_hides_pids("31 27 0:26 / /proc rw - tmpfs tmpfs rw\n") is None  # not proc


@pytest.mark.skipif(os.geteuid() != 0, reason="the agent isolates ranks (and checks) only as root")
@pytest.mark.parametrize(
    "own_proc, hides, warned",
    [
        ("off", False, True),
        ("off", True, False),
        ("cannot", False, True),
        ("cannot", True, False),
        ("on", False, False),
    ],
)
async def test_the_agent_says_when_ranks_can_read_every_command_line(
    tmp_path, work_root, monkeypatch, caplog, own_proc, hides, warned
):
    """Ranks read every command line only when they get no /proc of their own (the setting
    is off, or the host cannot) and the host's shows every process."""
    monkeypatch.setattr(proc_visibility, "this_host_hides_pids", lambda: hides)
    monkeypatch.setattr(
        rank_mounts, "problem", lambda: "Linux 5.4 shares procfs options" if own_proc == "cannot" else None
    )
    caplog.set_level(logging.INFO, "gpufleet.agent")
    settings = make_settings(
        tmp_path, agent_rank_isolation=True, agent_work_dir=work_root, agent_rank_firewall="off",
        agent_rank_private_proc=own_proc != "off",
    )  # fmt: skip
    agent = AgentProcess(settings, ["node-p"], backend="simulated", temporal=False)
    await agent.start()
    await agent.stop()
    assert ("the host's is mounted without hidepid" in caplog.text) is warned
    if own_proc == "cannot" and warned:
        assert "they cannot have their own /proc (Linux 5.4 shares procfs options)" in caplog.text
    assert ("ranks see only their own processes" in caplog.text) is (own_proc == "on")
