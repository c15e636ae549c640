"""What a rank writes and the agent (root, on a GPU node) reads back: its progress file and
the checkpoint it reports. A rank must not make the agent follow a symlink into the agent's
state, hang on a FIFO, read a huge file whole, or point the next attempt's resume (which the
agent mounts and hands over) outside the job's checkpoint dir."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.agent.conftest import script, start_task, wait_for
from worker_agent import statefiles as sf
from worker_agent.checkpoints import checkpoint_within


@pytest.mark.parametrize(
    ("uri", "root", "ok"),
    [
        ("file:///ckpt/job/step-10", "file:///ckpt/job", True),
        ("/ckpt/job/step-10", "file:///ckpt/job/", True),
        ("file:///ckpt/job", "file:///ckpt/job", True),
        ("file:///ckpt/job/../other/step-1", "file:///ckpt/job", False),
        ("file:///ckpt/job-2/step-1", "file:///ckpt/job", False),  # a text prefix is not a parent
        ("file:///etc", "file:///ckpt/job", False),
        ("/var/lib/gpufleet/agent", "file:///ckpt/job", False),
        ("file:///ckpt/job/x", "s3://bucket/job", False),
        ("file:///ckpt/job/x", "", False),
        ("s3://bucket/job/step-1", "file:///ckpt/job", True),
        ("step-1", "file:///ckpt/job", False),  # neither a path nor a URI
    ],
)
def test_checkpoint_within(uri, root, ok):
    assert checkpoint_within(uri, root) is ok


def test_rank_files_are_read_without_following_or_waiting(tmp_path):
    good = tmp_path / "progress.json"
    good.write_text('{"step": 3}')
    assert sf.read_rank_json(good) == {"step": 3}
    secret = tmp_path / "agent-state.json"
    secret.write_text('{"step": 99, "checkpoint_uri": "file:///etc"}')
    link = tmp_path / "link.json"
    link.symlink_to(secret)
    assert sf.read_json(link) is not None and sf.read_rank_json(link) is None
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    assert sf.read_rank_json(fifo) is None and time.monotonic() - t0 < 1.0
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps({"step": 1, "pad": "x" * (sf.RANK_FILE_MAX_BYTES + 1)}))
    assert sf.read_rank_json(huge) is None
    assert sf.read_rank_json(tmp_path / "missing.json") is None
    (tmp_path / "list.json").write_text("[1, 2]")
    assert sf.read_rank_json(tmp_path / "list.json") is None


async def test_a_checkpoint_reported_outside_the_jobs_dir_is_ignored(node, tmp_path):
    ckpt = tmp_path / "ckpt" / "job"
    body = f"""
        import json, os, time
        p = os.environ["GPUFLEET_PROGRESS_FILE"]
        json.dump({{"step": 5, "checkpoint_uri": "file://{ckpt}/step-5"}}, open(p + ".tmp", "w"))
        os.replace(p + ".tmp", p)
        time.sleep(0.5)
        json.dump({{"step": 6, "checkpoint_uri": "file:///etc"}}, open(p + ".tmp", "w"))
        os.replace(p + ".tmp", p)
        time.sleep(0.5)
    """
    task = start_task("node-t", "lease-ck-out", script(tmp_path, "ck.py", body), checkpoint_dir=f"file://{ckpt}")
    assert (await node.start_task(task)).accepted
    st = node.leases["lease-ck-out"]
    await wait_for(lambda: st.checkpoint_uri is not None, what="the first checkpoint")
    assert st.checkpoint_uri == f"file://{ckpt}/step-5"
    await wait_for(lambda: not st.live and st.exit, what="the rank's exit")
    node._read_progress(st)
    assert st.step == 6 and st.checkpoint_uri == f"file://{ckpt}/step-5"  # the step counts, the path does not
    assert st.exit["checkpoint_uri"] is None  # the supervisor's exit record holds the same rule
