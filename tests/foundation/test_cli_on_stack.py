"""The user CLI on the whole `make up` stack (`gpufleet up`: embedded Postgres and Temporal,
control, API and a simulated agent fleet), with the dev token it prints for team pretrain:
submit a 1-GPU job, follow its logs until a known line, cancel it, watch it reach
CANCELLED; and the seed's example request is refused with a clear admission error."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.embedded import any_free_port
from tests.foundation.test_up import ROOT, read_until, start, stop
from tests.support import OutputReader, eventually_sync

pytestmark = pytest.mark.e2e

# a shell rank: as root, `gpufleet up` runs ranks as an unprivileged user, which may not reach
# this venv's interpreter (CI keeps it under /root)
RANK = "echo uid $(id -u); i=0; while [ $i -lt 40 ]; do echo tick $i; i=$((i+1)); sleep 0.5; done"

JOB = """\
team: pretrain
name: cli-on-stack
priority_class: research
image: registry/llm:1
command: {command}
gpu_type: h100
replicas: 1
gpus_per_replica: 1
topology: {{pack: any}}
max_runtime: 1h
"""

# the seed's example request: more than the demo cluster's 128 GPUs
EXAMPLE = """\
team: pretrain
name: llm-pretrain
priority_class: prod-batch
image: registry/llm:2024-05
command: [python, train.py]
gpu_type: h100
replicas: 128
gpus_per_replica: 8
topology: {pack: block, max_blocks: 4}
max_runtime: 72h
checkpoint: {preemptible: true, grace_seconds: 120}
"""


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}


class Cli:
    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "cli.main", *args, "--url", self.url, "--token", self.token]

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*args), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)

    def state(self, job_id: str) -> str:
        r = self.run("status", job_id, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["state"]

    def wait_state(self, job_id: str, *want: str, timeout: float) -> str:
        seen: list[str] = []

        def reached() -> str | None:
            seen.append(self.state(job_id))
            return seen[-1] if seen[-1] in want else None

        try:
            return eventually_sync(reached, timeout=timeout, interval=0.5, what=f"{job_id} in {want}")
        except AssertionError as e:
            raise AssertionError(f"{e} (last state {seen[-1] if seen else None})") from None

    def follow_until(self, job_id: str, marker: str, timeout: float) -> str:
        """Run `logs -f` until ``marker`` is printed; terminate the follower; return its output.
        A follower that exits early (the rank's node not yet known to the API) is restarted."""
        deadline = time.monotonic() + timeout
        out: list[str] = []

        def follow() -> str | None:
            proc = subprocess.Popen(
                self.argv("logs", job_id, "-f"), cwd=ROOT, env=_env(),
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            try:
                found, got = OutputReader(proc.stdout).until(marker, deadline)
                out.extend(got)
                return "".join(out) if found else None
            finally:
                if proc.poll() is None:
                    proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

        try:
            return eventually_sync(follow, timeout=timeout, interval=0.5, what=f"{marker!r} in the logs of {job_id}")
        except AssertionError as e:
            raise AssertionError(f"{e}:\n{''.join(out)}") from None


def test_cli_on_the_running_stack(state_root, tmp_path):
    ports = {"api": any_free_port(), "temporal": any_free_port(), "ui": any_free_port(), "grpc": any_free_port()}
    proc = start(state_root / "state", ports)
    try:
        _run_cli_checks(proc, ports, tmp_path)
    except BaseException as e:
        tail = stop(proc)  # what `gpufleet up` said (a child that exited) belongs with the failure
        raise AssertionError(f"{e}\n--- gpufleet up:\n{tail}") from e
    tail = stop(proc)
    assert proc.returncode == 0, tail


def _run_cli_checks(proc: subprocess.Popen, ports: dict[str, int], tmp_path: Path) -> None:
    out = read_until(proc, "Ctrl-C stops everything", 180)
    token = next(line.split()[-1] for line in out.splitlines() if line.strip().startswith("team pretrain"))
    cli = Cli(f"http://127.0.0.1:{ports['api']}", token)

    job = tmp_path / "job.yaml"
    job.write_text(JOB.format(command=json.dumps(["/bin/sh", "-c", RANK])))
    r = cli.run("submit", "-f", str(job), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    job_id = json.loads(r.stdout)["job_id"]

    cli.wait_state(job_id, "RUNNING", timeout=60)
    logs = cli.follow_until(job_id, "tick 2", timeout=30)
    assert "tick 0" in logs and "tick 1" in logs
    # as root the dev box isolates ranks, each job as its own numbered user, and says so
    ranks = next(line for line in out.splitlines() if line.strip().startswith("ranks"))
    if os.geteuid() == 0 and "NOT isolated" not in ranks:
        uid = int(re.search(r"uid (\d+)", logs).group(1))  # type: ignore[union-attr]
        assert "run as their job's own uid, 2000000000 + the job's number" in ranks, ranks
        assert 2_001_000_000 <= uid < 2_001_001_000, logs  # jobs are numbered from 1,000,000
        # another team's rank on the same node runs as another user
        research = next(line.split()[-1] for line in out.splitlines() if line.strip().startswith("team research"))
        other = tmp_path / "other-team.yaml"
        other.write_text(JOB.replace("team: pretrain", "team: research").format(command='["/bin/sh", "-c", "id -u"]'))
        theirs = Cli(cli.url, research)
        r = theirs.run("submit", "-f", str(other), "--wait", "--json")
        assert r.returncode == 0, r.stdout + r.stderr
        r = theirs.run("logs", json.loads(r.stdout)["job_id"])
        assert r.returncode == 0, r.stdout + r.stderr
        their_uid = int(r.stdout.split()[-1])
        assert 2_001_000_000 <= their_uid < 2_001_001_000 and their_uid != uid, (uid, r.stdout)
    else:
        assert f"uid {os.geteuid()}" in logs, (ranks, logs)

    r = cli.run("cancel", job_id)
    assert r.returncode == 0, r.stdout + r.stderr
    assert cli.wait_state(job_id, "CANCELLED", timeout=60) == "CANCELLED"

    example = tmp_path / "example.yaml"
    example.write_text(EXAMPLE)
    r = cli.run("submit", "-f", str(example))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "exceeds_cluster" in r.stderr and "1024 h100 GPUs" in r.stderr and "HTTP 422" in r.stderr, r.stderr
