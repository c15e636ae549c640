"""`gpufleet up` started, used and stopped as a user does (issue 23): a normal start and a
Ctrl-C log no traceback in any process's log; stopping says how many ranks of how many jobs
keep running and how to stop them; `up --stop-jobs` (and `gpufleet stop-ranks`) stop them
through their supervisors, SIGKILL after the grace."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.up import stop_ranks
from common.embedded import any_free_port
from worker_agent import statefiles as sf
from worker_agent.live_ranks import live_ranks

ROOT = Path(__file__).resolve().parents[2]
JOB = """\
team: pretrain
priority_class: research
image: registry/demo:1
command: ["python3", "-c", "import time; print('up', flush=True); time.sleep(600)"]
gpu_type: h100
replicas: 1
gpus_per_replica: 8
max_runtime: 1h
"""


def _env(state: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    env.update(
        GPUFLEET_STATE_DIR=str(state),
        GPUFLEET_API_PORT=str(any_free_port()),
        GPUFLEET_CONTROL_GRPC_PORT=str(any_free_port()),
        GPUFLEET_CONTROL_METRICS_LISTEN=f"127.0.0.1:{any_free_port()}",
        GPUFLEET_TEMPORAL_PORT=str(any_free_port()),
        GPUFLEET_TEMPORAL_UI_PORT=str(any_free_port()),
        GPUFLEET_AGENT_SIMULATE="2",
        GPUFLEET_AGENT_RANK_ISOLATION="false",
    )
    return env


class Up:
    """`gpufleet up` in its own process group, as a terminal runs it (Ctrl-C reaches the group)."""

    def __init__(self, tmp: Path, state: Path, *args: str) -> None:
        self.env = _env(state)
        self.out = tmp / f"up-{time.monotonic_ns()}.out"
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cli.main", "up", *args], env=self.env, stdout=out, stderr=subprocess.STDOUT,
                cwd=ROOT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 180
        while "Ctrl-C" not in self.text:
            assert self.proc.poll() is None, f"gpufleet up exited {self.proc.returncode}: {self.text[-3000:]}"
            assert time.monotonic() < deadline, f"no banner in 180 s: {self.text[-3000:]}"
            time.sleep(0.5)
        self.api = re.search(r"^\s+api\s+(http://\S+)$", self.text, re.M).group(1)  # type: ignore[union-attr]
        self.token = re.search(r"team pretrain\s+(\S+)$", self.text, re.M).group(1)  # type: ignore[union-attr]

    @property
    def text(self) -> str:
        return self.out.read_text()

    def cli(self, *args: str) -> str:
        env = {**self.env, "GPUFLEET_API_URL": self.api, "GPUFLEET_TOKEN": self.token}
        r = subprocess.run([sys.executable, "-m", "cli.main", *args], env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    def ctrl_c(self, timeout_s: float = 120) -> str:
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise
        assert self.proc.returncode == 0, self.text[-3000:]
        return self.text


def no_traceback(logs: Path) -> None:
    for name in ("control.log", "api.log", "agent.log"):
        text = (logs / name).read_text()
        assert "Traceback" not in text, f"{name}:\n{text[-6000:]}"
        assert "loses leadership" not in text, f"{name}: a clean stop logged as a loss:\n{text[-3000:]}"
        assert "Temporal unavailable" not in text, f"{name}: a clean stop logged as an outage:\n{text[-3000:]}"


def wait_running(up: Up, job_id: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while json.loads(up.cli("status", job_id, "--json"))["state"] != "RUNNING":
        assert time.monotonic() < deadline, up.cli("status", job_id, "--json")
        time.sleep(1)


@pytest.fixture
def state_root() -> Iterator[Path]:
    """Outside pytest's tmp_path: as root the embedded Postgres runs as another user, and pytest
    resets `/tmp/pytest-of-root` to 0700 whenever another session starts (tests/foundation/conftest.py)."""
    root = Path(tempfile.mkdtemp(prefix="gpufleet-stop-"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.e2e
def test_start_run_a_job_and_ctrl_c_log_no_traceback_and_say_what_keeps_running(tmp_path: Path, state_root: Path):
    state = state_root / "state"
    up = Up(tmp_path, state)
    try:
        spec = tmp_path / "job.yaml"
        spec.write_text(JOB)
        job_id = json.loads(up.cli("submit", "-f", str(spec), "--json"))["job_id"]
        wait_running(up, job_id)
        text = up.ctrl_c()
    finally:
        if up.proc.poll() is None:
            os.killpg(up.proc.pid, signal.SIGKILL)
    try:
        assert "1 rank of 1 job keep running" in text, text[-2000:]
        assert f"gpufleet stop-ranks --state-dir {state}" in text and "--stop-jobs" in text
        assert [r.job_id for r in live_ranks(state)] == [job_id]
        no_traceback(state / "logs")

        # a restart adopts the rank; `up --stop-jobs` stops it on Ctrl-C, through its supervisor
        for log in (state / "logs").glob("*.log"):
            log.rename(log.with_suffix(".log.1"))
        up = Up(tmp_path, state, "--stop-jobs", "--grace", "20")
        text = up.ctrl_c()
        assert "stopped 1 rank of 1 job (all exited)" in text, text[-2000:]
        assert live_ranks(state) == []
        [exit_file] = state.glob(f"agent/*/leases/{job_id}.a1.r0/{sf.EXIT}")
        assert (sf.read_json(exit_file) or {}).get("state") == "STOPPED"
        no_traceback(state / "logs")
    finally:
        stop_ranks(state, grace_s=1)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "600"], start_new_session=True)


def test_stop_ranks_terms_supervisors_and_kills_what_outlives_the_grace(tmp_path: Path):
    """A supervisor that dies on SIGTERM and leaves its rank behind: the rank's group is
    SIGKILLed after the grace; a finished lease (no live pid) is left alone."""
    supervisor, rank = _sleeper(), _sleeper()
    lease = tmp_path / "agent" / "n1" / "leases" / "j-1.a1.r0"
    lease.mkdir(parents=True)
    sf.write_json_atomic(lease / sf.TASK, {"job_id": "j-1"})
    sf.write_json_atomic(
        lease / sf.SUPERVISOR,
        {"supervisor_pid": supervisor.pid, "supervisor_start": sf.process_start_ticks(supervisor.pid),
         "rank_pid": rank.pid, "rank_start": sf.process_start_ticks(rank.pid), "pgid": rank.pid},
    )  # fmt: skip
    done = tmp_path / "agent" / "n1" / "leases" / "j-0.a1.r0"
    done.mkdir(parents=True)
    sf.write_json_atomic(done / sf.SUPERVISOR, {"supervisor_pid": 1, "supervisor_start": 0, "rank_pid": 1,
                                                 "rank_start": 0, "pgid": 1})  # fmt: skip
    try:
        assert [r.lease_id for r in live_ranks(tmp_path)] == ["j-1.a1.r0"]
        found, killed = stop_ranks(tmp_path, grace_s=1.0, poll_s=0.05)
        assert [r.lease_id for r in found] == ["j-1.a1.r0"]
        assert [r.lease_id for r in killed] == ["j-1.a1.r0"]  # the rank outlived its supervisor
        assert supervisor.wait(5) == -signal.SIGTERM and rank.wait(5) == -signal.SIGKILL
        assert live_ranks(tmp_path) == []
    finally:
        for p in (supervisor, rank):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_gpufleet_stop_ranks_says_there_is_nothing_to_stop(tmp_path: Path):
    r = subprocess.run(
        [sys.executable, "-m", "cli.main", "stop-ranks", "--state-dir", str(tmp_path)], cwd=ROOT, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0 and f"no rank runs under {tmp_path}" in r.stdout, r.stdout + r.stderr
