"""Whether ranks can read other users' process command lines (worker_agent.proc_visibility),
and the agent saying so at start."""

from __future__ import annotations

import logging
import os

import pytest

from tests.agent.conftest import make_settings
from worker_agent import proc_visibility
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


def test_no_proc_mount_is_unknown():
    assert proc_hides_pids("30 27 0:25 / /sys rw - sysfs sysfs rw\n") is None
    assert proc_hides_pids("31 27 0:26 / /proc rw - tmpfs tmpfs rw\n") is None  # not proc


@pytest.mark.skipif(os.geteuid() != 0, reason="the agent isolates ranks (and checks) only as root")
@pytest.mark.parametrize("hides, warned", [(False, True), (True, False)])
async def test_the_agent_says_when_ranks_can_read_every_command_line(
    tmp_path, work_root, monkeypatch, caplog, hides, warned
):
    monkeypatch.setattr(proc_visibility, "this_host_hides_pids", lambda: hides)
    caplog.set_level(logging.WARNING, "gpufleet.agent")
    settings = make_settings(tmp_path, agent_rank_isolation=True, agent_work_dir=work_root, agent_rank_firewall="off")
    agent = AgentProcess(settings, ["node-p"], backend="simulated", temporal=False)
    await agent.start()
    await agent.stop()
    assert ("/proc is mounted without hidepid" in caplog.text) is warned
