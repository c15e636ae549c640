"""Ranks as real processes under their supervisors: environment, stop, epochs, idempotency, fencing.

Scaled durations (conftest.FAST): grace 1-2 s, unconfirmed kill 3 s (15 min in production).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest

from common.contracts import StopTask, TaskState
from tests.agent.conftest import PY, TRAIN_COUNTER, kill_group_quietly, pid_alive, script, start_task, wait_for
from tests.support import holds
from worker_agent import statefiles as sf
from worker_agent.examples.train_counter import expected
from worker_agent.node import NodeAgent
from worker_agent.nvml import make_backend

SLEEPER = """
    import os, sys, time
    open(sys.argv[1], "a").write(f"{os.getpid()}\\n") if len(sys.argv) > 1 else None
    while True:
        time.sleep(0.05)
"""


def terminal(node: NodeAgent, lease_id: str):
    st = node.leases.get(lease_id)
    return st is not None and not st.live and st.exit


async def test_rank_sees_its_environment_and_no_agent_credentials(node, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLEET_AGENT_SHARED_SECRET", "agent-secret-never-leaks")
    monkeypatch.setenv("GPUFLEET_DATABASE_URL", "postgresql://admin:pw@db/gpufleet")
    monkeypatch.setenv("SOME_API_TOKEN", "tok-never-leaks")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    out = tmp_path / "env.json"
    cmd = script(tmp_path, "dump_env.py", "import json, os, sys\njson.dump(dict(os.environ), open(sys.argv[1], 'w'))\n")
    task = start_task(
        "node-t", "lease-env", [*cmd, str(out)], gpus=(2, 5), rank=3, world_size=4, attempt=2,
        checkpoint_dir="file:///ckpt/job", resume_from="file:///ckpt/job/step-00000040", env={"USER_VAR": "x", "RANK": "99"},
    )  # fmt: skip
    res = await node.start_task(task)
    assert res.accepted and res.pid
    await wait_for(lambda: terminal(node, "lease-env"), what="rank exit")
    env = json.loads(out.read_text())
    assert env["CUDA_VISIBLE_DEVICES"] == "2,5"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "0")  # the job cannot override RANK
    assert env["MASTER_ADDR"] == "10.0.0.1" and 29500 <= int(env["MASTER_PORT"]) < 49500  # assigned per lease
    assert env["GPUFLEET_JOB_ID"] == "job-lease-env" and env["GPUFLEET_ATTEMPT"] == "2"
    assert env["GPUFLEET_CHECKPOINT_DIR"] == "file:///ckpt/job"
    assert env["GPUFLEET_RESUME_FROM"] == "file:///ckpt/job/step-00000040"
    assert env["USER_VAR"] == "x" and env["NCCL_SOCKET_IFNAME"] == "eth0"
    leaked = [k for k, v in env.items() if "never-leaks" in v or "admin:pw" in v]
    assert not leaked, leaked
    assert not [k for k in env if k.startswith("GPUFLEET_") and k not in (
        "GPUFLEET_JOB_ID", "GPUFLEET_ATTEMPT", "GPUFLEET_LEASE_ID", "GPUFLEET_CHECKPOINT_DIR",
        "GPUFLEET_RESUME_FROM", "GPUFLEET_PROGRESS_FILE", "GPUFLEET_CPUS", "GPUFLEET_MEMORY_BYTES",
        "GPUFLEET_DISK_BYTES")]  # fmt: skip
    assert float(env["GPUFLEET_CPUS"]) > 0 and int(env["GPUFLEET_MEMORY_BYTES"]) > 0  # its share of the node
    assert node.leases["lease-env"].exit["exit_code"] == 0


async def test_stop_gives_sigterm_and_the_script_checkpoints_inside_the_grace(node, tmp_path):
    ckpt = f"file://{tmp_path}/ckpt"
    task = start_task("node-t", "lease-stop", [PY, TRAIN_COUNTER, "--steps", "100000", "--step-time", "0.01"],
                      epoch=4, checkpoint_dir=ckpt)  # fmt: skip
    res = await node.start_task(task)
    assert res.accepted
    await wait_for(lambda: (node.leases["lease-stop"].step or 0) >= 20, what="some steps")
    t0 = time.monotonic()
    stop = await node.stop_task(StopTask("lease-stop", 4, "node-t", grace_seconds=2.0, reason="preempted"))
    took = time.monotonic() - t0
    assert stop.accepted and stop.exit_code == 143  # 128 + SIGTERM: the helper's preemption exit
    assert took < 2.0, took
    assert stop.checkpoint_uri and stop.checkpoint_uri.startswith(ckpt + "/step-")
    rec = node.leases["lease-stop"].exit
    assert rec["state"] == "STOPPED" and not rec["killed"]
    saved = json.loads(
        (tmp_path / "ckpt" / stop.checkpoint_uri.rsplit("/", 1)[1] / "rank-0" / "state.json").read_text()
    )
    assert saved["step"] == rec["checkpoint_step"] > 0
    assert not pid_alive(res.pid)
    states = [m.state for m in node.outbox.values()]
    assert states[0] == 1 and states[-1] == 3  # STARTED ... STOPPED on the way to the leader


async def test_a_script_ignoring_sigterm_is_killed_at_the_end_of_the_grace(node, tmp_path):
    cmd = script(tmp_path, "stubborn.py", """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring SIGTERM", flush=True)
        while True:
            time.sleep(0.05)
    """)  # fmt: skip
    res = await node.start_task(start_task("node-t", "lease-stubborn", cmd))
    await wait_for(lambda: b"ignoring" in (node.leases["lease-stubborn"].dir / sf.STDOUT).read_bytes(), what="ready")
    t0 = time.monotonic()
    stop = await node.stop_task(StopTask("lease-stubborn", 1, "node-t", grace_seconds=1.5, reason="preempted"))
    took = time.monotonic() - t0
    assert stop.accepted and stop.exit_code == 128 + signal.SIGKILL
    assert 1.4 <= took < 3.0, took
    rec = node.leases["lease-stubborn"].exit
    assert rec["state"] == "STOPPED" and rec["killed"] and rec["signal"] == signal.SIGKILL
    assert not pid_alive(res.pid)


async def test_stale_epoch_stop_is_ignored_and_the_rank_keeps_running(node, tmp_path):
    cmd = script(tmp_path, "sleeper.py", SLEEPER)
    res = await node.start_task(start_task("node-t", "lease-epoch", cmd, epoch=7))
    stale = await node.stop_task(StopTask("lease-epoch", 6, "node-t", grace_seconds=0.5, reason="old leader"))
    assert not stale.accepted and "stale epoch" in stale.reason
    assert not (node.leases["lease-epoch"].dir / sf.STOP).exists()
    await holds(lambda: pid_alive(res.pid) and node.leases["lease-epoch"].live, for_s=0.3, what="the rank running")
    # a StartTask of an older epoch is refused too, and a newer StopTask works
    old = await node.start_task(start_task("node-t", "lease-epoch", cmd, epoch=6))
    assert not old.accepted and "stale epoch" in old.reason
    newer = await node.stop_task(StopTask("lease-epoch", 8, "node-t", grace_seconds=0.5, reason="new leader"))
    assert newer.accepted and not pid_alive(res.pid)
    # the newest epoch is on disk (fsynced), so a restarted agent refuses epoch 7 too
    assert sf.read_json(node.leases["lease-epoch"].dir / sf.EPOCH)["epoch"] == 8


async def test_duplicate_start_task_starts_one_process(node, tmp_path):
    launches = tmp_path / "launches.txt"
    cmd = [*script(tmp_path, "sleeper.py", SLEEPER), str(launches)]
    task = start_task("node-t", "lease-dup", cmd, epoch=2)
    results = await asyncio.gather(*(node.start_task(task) for _ in range(5)))
    again = await node.start_task(task)
    assert all(r.accepted for r in results + [again])
    pids = {r.pid for r in results + [again]}
    assert len(pids) == 1
    assert sum(r.already_running for r in results + [again]) == 5
    await wait_for(lambda: launches.exists() and launches.read_text().strip(), what="launch record")
    pid = pids.pop()
    await holds(lambda: launches.read_text().split() == [str(pid)], for_s=0.3, what="a single launch")
    await node.stop_task(StopTask("lease-dup", 2, "node-t", grace_seconds=0.5, reason="done"))
    # and after it ended, a redelivered StartTask re-reports instead of starting again
    late = await node.start_task(task)
    assert late.accepted and not late.already_running and "already finished" in late.reason
    assert len(launches.read_text().split()) == 1


async def test_stop_before_start_leaves_a_tombstone(node, tmp_path):
    cmd = script(tmp_path, "sleeper.py", SLEEPER)
    stop = await node.stop_task(StopTask("lease-early", 3, "node-t", grace_seconds=0.5, reason="cancelled"))
    assert stop.accepted and "nothing to stop" in stop.reason
    late = await node.start_task(start_task("node-t", "lease-early", cmd, epoch=3))
    assert not late.accepted and "stopped" in late.reason
    assert "lease-early" not in node.leases


async def test_start_rejects_bad_gpus_busy_gpus_other_nodes_and_bad_commands(node, tmp_path):
    cmd = script(tmp_path, "sleeper.py", SLEEPER)
    assert not (await node.start_task(start_task("node-t", "l-bad", cmd, gpus=(8,)))).accepted
    assert not (await node.start_task(start_task("node-t", "l-dupgpu", cmd, gpus=(1, 1)))).accepted
    assert not (await node.start_task(start_task("node-x", "l-other", cmd))).accepted
    assert not (await node.start_task(start_task("node-t", "../escape", cmd))).accepted
    assert (await node.start_task(start_task("node-t", "l-a", cmd, gpus=(0, 1)))).accepted
    busy = await node.start_task(start_task("node-t", "l-b", cmd, gpus=(1, 2)))
    assert not busy.accepted and "busy" in busy.reason
    missing = await node.start_task(start_task("node-t", "l-missing", ["/nonexistent/binary"], gpus=(4,)))
    assert missing.accepted  # started, and the exit comes as a report:
    await wait_for(lambda: terminal(node, "l-missing"), what="exec failure recorded")
    assert node.leases["l-missing"].exit["exit_code"] == 127


async def test_unconfirmed_lease_is_killed_by_its_supervisor_even_with_the_agent_gone(settings, tmp_path):
    """unconfirmed_kill_s = 3 s here (15 min in production); nobody confirms; the agent is closed."""
    cmd = script(tmp_path, "sleeper.py", SLEEPER)
    node = NodeAgent(settings, "node-f", backend=make_backend(settings, "node-f", "simulated"))
    await node.start()
    res = await node.start_task(start_task("node-f", "lease-fence", cmd))
    d = node.leases["lease-fence"].dir
    await node.close()  # the agent is gone: only the supervisor is left
    try:
        t0 = time.monotonic()
        await wait_for(lambda: not pid_alive(res.pid), timeout=10, what="self-fence")
        took = time.monotonic() - t0
        assert 2.0 < took < 6.0, took
        await wait_for(lambda: sf.read_json(d / sf.EXIT), what="exit record")
        assert sf.read_json(d / sf.EXIT)["state"] == "FENCED"
        # a restarted agent reads the exit it missed and reports it
        node2 = NodeAgent(settings, "node-f", backend=make_backend(settings, "node-f", "simulated"))
        await node2.start()
        try:
            assert node2.leases["lease-fence"].state == TaskState.FENCED
            assert [m.state for m in node2.outbox.values()] == [4]  # FENCED
        finally:
            await node2.close()
    finally:
        kill_group_quietly(res.pid)


async def test_confirmations_keep_a_rank_alive_past_the_unconfirmed_window(node, tmp_path):
    cmd = script(tmp_path, "sleeper.py", SLEEPER)
    res = await node.start_task(start_task("node-t", "lease-conf", cmd))

    def confirmed_and_alive() -> bool:
        node.confirm(["lease-conf"])  # the leader's confirmation, every 0.5 s
        return pid_alive(res.pid) and node.leases["lease-conf"].live

    # 4.5 s > unconfirmed_kill_s = 3 s
    await holds(confirmed_and_alive, for_s=4.5, interval=0.5, what="a confirmed rank alive")
    await wait_for(lambda: not pid_alive(res.pid), timeout=8, what="fenced once confirmations stop")
    await wait_for(lambda: terminal(node, "lease-conf"), what="FENCED report")
    assert node.leases["lease-conf"].state == TaskState.FENCED


async def test_restarted_agent_readopts_and_after_a_reboot_reports_lost(settings, tmp_path):
    cmd = script(tmp_path, "sleeper.py", SLEEPER)
    a = NodeAgent(settings, "node-r", backend=make_backend(settings, "node-r", "simulated"), boot_id="boot-1")
    await a.start()
    res = await a.start_task(start_task("node-r", "lease-r", cmd, epoch=5))
    await a.close()
    try:
        b = NodeAgent(settings, "node-r", backend=make_backend(settings, "node-r", "simulated"), boot_id="boot-1")
        await b.start()
        assert b.leases["lease-r"].live and b.leases["lease-r"].pid == res.pid
        dup = await b.start_task(start_task("node-r", "lease-r", cmd, epoch=5))
        assert dup.already_running and dup.pid == res.pid
        stale = await b.stop_task(StopTask("lease-r", 4, "node-r", 0.5, "stale"))
        assert not stale.accepted  # the epoch survived the restart
        await b.close()
        # "reboot": same state dir, new boot id. (The old processes are still around
        # here, so kill them as a reboot would: supervisor first, then the rank.)
        sup = sf.read_json(b.leases["lease-r"].dir / sf.SUPERVISOR)
        os.kill(sup["supervisor_pid"], signal.SIGKILL)
        kill_group_quietly(res.pid)
        c = NodeAgent(settings, "node-r", backend=make_backend(settings, "node-r", "simulated"), boot_id="boot-2")
        await c.start()
        assert c.leases["lease-r"].state == TaskState.LOST
        assert "rebooted" in c.leases["lease-r"].exit["reason"]
        assert [m.state for m in c.outbox.values()] == [5]  # LOST
        await c.close()
    finally:
        kill_group_quietly(res.pid)


async def test_a_dead_supervisor_is_replaced_by_an_adopting_one(node, tmp_path):
    cmd = script(tmp_path, "sleeper.py", SLEEPER)
    res = await node.start_task(start_task("node-t", "lease-adopt", cmd))
    st = node.leases["lease-adopt"]
    os.kill(st.sup_pid, signal.SIGKILL)
    await wait_for(lambda: (sf.read_json(st.dir / sf.SUPERVISOR) or {}).get("adopted"), what="adopting supervisor")
    assert pid_alive(res.pid) and st.live
    stop = await node.stop_task(StopTask("lease-adopt", 1, "node-t", grace_seconds=1.0, reason="done"))
    assert stop.accepted and not pid_alive(res.pid)
    assert st.exit["state"] == "STOPPED"


async def test_a_rank_and_supervisor_killed_together_leave_no_worker_on_the_gpus(node, tmp_path):
    """The OOM killer or an operator's kill -9 takes the rank (a launcher, like torchrun) and its
    supervisor at once: the lease is LOST and its GPUs go to the next job, so the workers the
    rank started in its process group must not live on."""
    child = tmp_path / "worker.pid"
    res = await node.start_task(
        start_task("node-t", "lease-both", ["/bin/sh", "-c", f"sleep 300 & echo $! > {child}; wait"])
    )
    assert res.accepted
    st = node.leases["lease-both"]
    await wait_for(lambda: child.exists() and child.read_text().strip(), what="the rank's worker")
    worker = int(child.read_text())
    assert os.getpgid(worker) == st.pgid  # in the rank's group
    # both at once, with no await between: the agent has no chance to adopt the rank
    os.kill(st.sup_pid, signal.SIGKILL)
    os.kill(res.pid, signal.SIGKILL)
    await wait_for(lambda: terminal(node, "lease-both"), what="the lease to end")
    assert st.exit["state"] == "LOST" and "vanished" in st.exit["reason"]
    await wait_for(lambda: not pid_alive(worker), timeout=5, what="the rank's worker to be killed")


async def test_train_counter_preempted_and_resumed_gives_the_uninterrupted_result(node, tmp_path):
    ckpt = f"file://{tmp_path}/ck"
    argv = [PY, TRAIN_COUNTER, "--steps", "120", "--step-time", "0.01", "--checkpoint-every", "25"]
    await node.start_task(start_task("node-t", "lease-a1", argv, checkpoint_dir=ckpt))
    await wait_for(lambda: (node.leases["lease-a1"].step or 0) >= 30, what="progress")
    stop = await node.stop_task(StopTask("lease-a1", 1, "node-t", grace_seconds=3.0, reason="preempted"))
    assert stop.exit_code == 143 and stop.checkpoint_uri
    await node.start_task(start_task("node-t", "lease-a2", argv, attempt=2, checkpoint_dir=ckpt,
                                     resume_from=stop.checkpoint_uri))  # fmt: skip
    await wait_for(lambda: terminal(node, "lease-a2"), timeout=20, what="second attempt to finish")
    out = (node.leases["lease-a2"].dir / sf.STDOUT).read_text()
    assert "resumed from step" in out
    assert f"RESULT steps=120 value={expected(120)}" in out
    assert node.leases["lease-a2"].exit["exit_code"] == 0


@pytest.mark.parametrize("grace", [0.0])
async def test_zero_grace_kills_at_once(node, tmp_path, grace):
    cmd = script(tmp_path, "sleeper.py", SLEEPER)
    res = await node.start_task(start_task("node-t", "lease-zero", cmd))
    t0 = time.monotonic()
    stop = await node.stop_task(StopTask("lease-zero", 1, "node-t", grace_seconds=grace, reason="now"))
    assert stop.accepted and time.monotonic() - t0 < 1.5 and not pid_alive(res.pid)
