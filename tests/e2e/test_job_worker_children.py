"""Job workflows served by a child process of the control process (``control_job_workers``).

The control process keeps placement, leadership and heartbeats; its child runs the job
workflows. A child that dies is restarted, and jobs keep flowing; stopping the control
process stops its children.
"""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from tests.e2e.conftest import PY
from tests.support import eventually


@pytest.fixture
def stack_overrides() -> dict:
    return {"control_job_workers": 1}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_job_workflows_run_in_a_restarted_child_and_stop_with_control(stack):
    control = stack.controls[0]
    children = control.job_workers
    assert children is not None and len(children.pids) == 1
    first = children.pids[0]
    assert psutil.Process(first).ppid() == os.getpid()  # a child of the control process

    job = await stack.submit(command=[PY, "-c", "print('from a child worker')"])
    await stack.wait_state(job, "SUCCEEDED", timeout=60)

    os.kill(first, signal.SIGKILL)

    async def replaced():
        pids = children.pids
        return pids if pids and pids[0] != first else None

    second = (await eventually(replaced, timeout=20, interval=0.2, what="a new job worker"))[0]
    assert children.restarts == 1
    job2 = await stack.submit(command=[PY, "-c", "print('after a restart')"])
    await stack.wait_state(job2, "SUCCEEDED", timeout=60)

    await children.stop()
    assert not _alive(second)


def test_children_get_settings_from_a_private_file_with_only_their_secrets(tmp_path, monkeypatch):
    """The job workers' settings come in a 0600 file, with the database login and none of the
    secrets they do not use (API tokens, the agents' credentials and their derivation secret)."""
    from common.settings import Principal, Settings
    from control.job_workers import SETTINGS_FILE_ENV, JobWorkerChildren, settings_for_child

    settings = Settings(
        state_dir=tmp_path,
        database_url="postgresql://gpufleet:pw@db/gpufleet",
        api_tokens={"t0ken": Principal(name="alice", team="a")},
        agent_credentials={f"node-{i:05d}": "c" * 40 for i in range(50)},
    )
    path = JobWorkerChildren(settings, 1)._settings_file()
    assert path.stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv(SETTINGS_FILE_ENV, str(path))
    child = settings_for_child()
    assert child is not None and child.database_url == settings.database_url
    assert child.api_tokens == {} and child.agent_credentials == {} and child.agent_shared_secret == ""
    assert "t0ken" not in path.read_text() and "c" * 40 not in path.read_text()
    assert child.control_task_queue == settings.control_task_queue
