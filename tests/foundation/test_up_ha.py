"""`gpufleet up --ha` (issue 24): Postgres as a primary and a synchronous standby under the
failover supervisor, two APIs on one port, two controls. The primary is SIGKILLed and an
API process is SIGKILLed while a user submits through the CLI's client; every submission
is accepted once, the old primary comes back as the standby, the dead API is started
again, and Ctrl-C stops every process, both Postgres servers included.
"""

from __future__ import annotations

import json
import signal
import subprocess
import uuid
from pathlib import Path

import psutil
import pytest
import yaml

from cli.user_cmd import ApiClient
from common.embedded import any_free_port
from common.postgres_pair import PostgresNode
from tests.foundation.test_up import ROOT, assert_stopped, read_until, start, stop
from tests.support import eventually_sync

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

JOB = {**yaml.safe_load((ROOT / "examples" / "one-gpu.yaml").read_text()), "command": ["true"]}


def start_ha(state: Path, ports: dict[str, int]) -> subprocess.Popen:
    # two controls: the second's metrics and the agent's HTTP on free ports
    free = {"GPUFLEET_CONTROL_METRICS_LISTEN": "127.0.0.1:0", "GPUFLEET_AGENT_HTTP_LISTEN": "127.0.0.1:0"}
    return start(state, ports, "--ha", env=free)


def _children(proc: subprocess.Popen, role: str) -> list[psutil.Process]:
    """Live children of ``up`` in ``role``; a killed one not yet reaped (a zombie) is not one."""
    out = []
    for c in psutil.Process(proc.pid).children():
        try:
            if f"cli.main {role}" in " ".join(c.cmdline()):
                out.append(c)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            pass
    return out


def _postmaster(pgdata: Path) -> int | None:
    return PostgresNode("probe", pgdata).pid()


def test_up_ha_survives_a_dead_primary_and_a_dead_api(state_root: Path) -> None:
    state = state_root / "state"
    ports = {"api": any_free_port(), "temporal": any_free_port(), "ui": any_free_port(), "grpc": any_free_port()}
    proc = start_ha(state, ports)
    tail = ""
    try:
        out = read_until(proc, "Ctrl-C stops everything", 240)
        assert "synchronous standby" in out, out
        assert len(_children(proc, "api")) == 2 and len(_children(proc, "control")) == 2
        token = next(
            t for t, p in json.loads((state / "tokens.json").read_text()).items() if p.get("team") == JOB["team"]
        )
        client = ApiClient(f"http://127.0.0.1:{ports['api']}", token, timeout=15, retry_s=60)
        names: list[str] = []

        def submit() -> None:
            name = f"ha-{uuid.uuid4().hex[:8]}"
            client.request("POST", "/v1/jobs", json_body={**JOB, "name": name}, write=True)
            names.append(name)

        submit()
        # the primary dies (and every backend with it): the standby is promoted
        primary = _postmaster(state / "pgdata")
        assert primary is not None
        for p in [psutil.Process(primary), *psutil.Process(primary).children()]:
            p.send_signal(signal.SIGKILL)
        for _ in range(3):
            submit()
        eventually_sync(
            lambda: "promoted" in (state / "logs" / "postgres-failover.log").read_text(), timeout=30, what="promoted"
        )
        # the old primary is seeded as the new standby, and commits wait for it again
        eventually_sync(
            lambda: (state / "logs" / "postgres-failover.log").read_text().count("synchronous primary") >= 2,
            timeout=120, what="a new standby streaming",
        )  # fmt: skip
        assert (state / "pgdata" / "standby.signal").exists()
        # an API process dies: the other serves, and `up` starts it again
        victim = _children(proc, "api")[0]
        victim.kill()
        for _ in range(3):
            submit()
        eventually_sync(lambda: len(_children(proc, "api")) == 2, timeout=30, what="the API started again")
        jobs = client.request("GET", "/v1/jobs", params={"limit": 100})
        listed = [j["name"] for j in (jobs["jobs"] if isinstance(jobs, dict) else jobs)]
        assert sorted(n for n in listed if n.startswith("ha-")) == sorted(names), (listed, names)
    finally:
        tail = stop(proc)
    assert_stopped(proc, tail, ports)
    assert _postmaster(state / "pgdata") is None and _postmaster(state / "pgdata-standby") is None
