"""Replay committed workflow histories with the worker's own sandbox and data converter.

A change to workflow code that would break running workflows (non-determinism)
fails here; such changes go through ``workflow.patched``. The histories under
``histories/`` were recorded from real runs with

    GPUFLEET_RECORD_HISTORIES=1 .venv/bin/python -m pytest tests/replay -k record

(success, preemption and resume, cancel while running, gang failure; from v6, a gang whose two
nodes fail one after the other). Re-record only for an
intended, patched change. ``job_requeue_lost_from_history-v5-1.json`` was not recorded so: it
is the history `gpufleet chaos` caught ending with its job left QUEUED (docs/design.md,
Failure paths), exported with ``temporal workflow show --output json``; it must keep
replaying on the path it took.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory

from common.temporal import make_replayer
from workflows.job import JobWorkflow

HISTORIES = Path(__file__).parent / "histories"
RECORD = os.environ.get("GPUFLEET_RECORD_HISTORIES") == "1"
# histories are kept per workflow-code version (<name>-<version>-<run>.json): older versions
# stay committed so patched branches keep replaying; recording writes this version only
VERSION = "v6"


def _histories() -> list[Path]:
    return sorted(HISTORIES.glob("*.json"))


@pytest.mark.skipif(RECORD, reason="recording")
@pytest.mark.parametrize("path", _histories(), ids=lambda p: p.stem)
async def test_history_replays(path: Path):
    data = json.loads(path.read_text())
    history = WorkflowHistory.from_json(data["workflow_id"], data["history"])
    replayer = make_replayer([JobWorkflow])
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, f"{path.name}: {result.replay_failure}"


def test_the_representative_histories_are_committed():
    names = {p.stem.split("-", 1)[0] for p in _histories()}
    assert {"job_success", "job_preempt_resume", "job_cancel", "job_gang_failure"} <= names


# ---------------------------------------------------------------------------- recording


async def _save(client, workflow_id: str, name: str, max_runs: int | None = None) -> list[Path]:
    """Every run of ``workflow_id`` (continue-as-new chains), or the first ``max_runs``, as
    name-<n>.json."""
    out: list[Path] = []
    runs = []
    async for wf in client.list_workflows(f"WorkflowId = '{workflow_id}'"):
        runs.append(wf)
    runs.sort(key=lambda w: w.start_time)
    runs = runs[:max_runs]
    HISTORIES.mkdir(exist_ok=True)
    for i, wf in enumerate(runs):
        history = await client.get_workflow_handle(workflow_id, run_id=wf.run_id).fetch_history()
        path = HISTORIES / f"{name}-{VERSION}-{i + 1}.json"
        path.write_text(json.dumps({"workflow_id": workflow_id, "history": history.to_json_dict()}, indent=1))
        out.append(path)
    return out


@pytest.mark.skipif(not RECORD, reason="set GPUFLEET_RECORD_HISTORIES=1 to re-record")
async def test_record_histories(stand):
    from tests.support import eventually
    from tests.workflows.harness import PY, TRAIN, read_json
    from workflows import messages as m

    for old in HISTORIES.glob(f"job_*-{VERSION}-*.json"):
        old.unlink()
    c = stand.client
    # success
    # each workflow starts as in production: with its allocation (signal-with-start, labels)
    ok = await stand.submit("rec-ok", command=[PY, "-c", "import time; time.sleep(0.3)"], start=False)
    await stand.allocate(ok, (stand.nodes[0], (0,)))
    assert (await stand.result(ok)).state == "SUCCEEDED"
    # preemption and resume
    tr = await stand.submit("rec-train", command=[PY, TRAIN, "40", "0.05", "5"], grace_s=5.0, start=False)
    await stand.allocate(tr, (stand.nodes[0], (0,)))
    await stand.wait_state(tr, "RUNNING")
    lease_dir = stand.agent.root / stand.nodes[0] / f"{tr}.a1.r0"

    async def progressed():
        try:
            return read_json(lease_dir / "progress.json")["step"] >= 10
        except (OSError, ValueError):
            return False

    await eventually(progressed, timeout=10)
    await stand.preempt(tr, by_job="rec-prod")
    await stand.wait_state(tr, "QUEUED", attempt=2)
    await stand.allocate(tr, (stand.nodes[1], (0,)))
    assert (await stand.result(tr)).state == "SUCCEEDED"
    # cancel while running
    cx = await stand.submit("rec-cancel", command=[PY, "-c", "import time; time.sleep(60)"], grace_s=1.0, start=False)
    await stand.allocate(cx, (stand.nodes[2], (0,)))
    await stand.wait_state(cx, "RUNNING")
    await c.get_workflow_handle(cx).signal("cancel", {"actor": "alice", "reason": "recorded"})
    assert (await stand.result(cx)).state == "CANCELLED"
    # gang failure, then the re-run succeeds
    cmd = [
        PY,
        "-c",
        "import os, sys, time; time.sleep(0.5);"
        " sys.exit(3) if (os.environ['RANK'] == '2' and os.environ['GPUFLEET_ATTEMPT'] == '1') else None",
    ]
    g = await stand.submit("rec-gang", command=cmd, replicas=4, gpus_per_replica=8, grace_s=1.0, start=False)
    await stand.allocate(g, *[(n, tuple(range(8))) for n in stand.nodes[:4]])
    await stand.wait_state(g, "QUEUED", attempt=2)
    await stand.allocate(g, *[(n, tuple(range(8))) for n in stand.nodes[:4]])
    assert (await stand.result(g)).state == "SUCCEEDED"
    # a gang on two nodes that fail one after the other (the agent's worker shut down: no stop
    # is picked up); told of the second while its stop waits, the workflow cancels that stop
    nf = await stand.submit("rec-nodes-failed", command=[PY, "-c", "import time; time.sleep(60)"], replicas=2,
                            gpus_per_replica=8, grace_s=1.0, start=False)  # fmt: skip
    await stand.allocate(nf, *[(n, tuple(range(8))) for n in stand.nodes[:2]])
    await stand.wait_state(nf, "RUNNING")
    await stand.node_worker.shutdown()
    handle = c.get_workflow_handle(nf)
    await handle.signal(m.SIGNAL_NODE_FAILED, m.NodeFailed(nf, 1, stand.nodes[0], "recorded"))
    await eventually(lambda: stand.scheduled(nf, "stop_task"), timeout=10, what="the stop of rank 1 scheduled")
    await handle.signal(m.SIGNAL_NODE_FAILED, m.NodeFailed(nf, 1, stand.nodes[1], "recorded"))
    await stand.wait_state(nf, "QUEUED", attempt=2)
    for wid, name in [(ok, "job_success"), (tr, "job_preempt_resume"), (cx, "job_cancel"), (g, "job_gang_failure")]:
        assert await _save(c, wid, name)
    # its next run has only just begun (waiting for an allocation): the failed attempt's run only
    assert await _save(c, nf, "job_gang_nodes_failed", max_runs=1)
