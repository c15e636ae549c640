"""Ranks are kept off the control plane's endpoints (docs/security.md, "Tenant vs platform"):
a rank shares the host's network, and Temporal without client certificates would let it
signal, terminate or impersonate any job's workflow. The agent process rejects TCP
connections from the ranks' users to Temporal, control and the listed addresses.

The real test runs nftables as root (CI installs it) and ranks that try to connect with
bash's /dev/tcp; the rules are built as text and checked without root too."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from common.settings import Settings
from tests.agent.conftest import make_settings, start_task, wait_for
from tests.security.conftest import run_sh_rank, sections
from worker_agent import rank_firewall
from worker_agent import statefiles as sf
from worker_agent.agent import AgentProcess
from worker_agent.node_lock import NodeLock
from worker_agent.rank_firewall import Endpoint

ROOT = Path(__file__).resolve().parents[2]


def test_the_rules_reject_the_ranks_users_and_nobody_else():
    uids = rank_firewall.uid_set({65534, 61000, 2_000_000_005}, 2_000_000_000)
    assert uids == "{ 61000, 65534, 2000000000-2147483646 }"  # a numbered id is in the range already
    assert rank_firewall.uid_set({65534}, None) == "{ 65534 }"
    text = rank_firewall.ruleset(
        "gpufleet_ranks", uids, [Endpoint("127.0.0.1", 7233, "temporal"), Endpoint("::1", 50051, 'control"; drop')]
    )
    lines = text.splitlines()
    # replaced whole in one transaction (the first line makes the delete safe on a first start)
    assert lines[:3] == ["table inet gpufleet_ranks", "delete table inet gpufleet_ranks", "table inet gpufleet_ranks {"]
    assert "type filter hook output priority 0; policy accept;" in text
    assert (
        "meta skuid { 61000, 65534, 2000000000-2147483646 } ip daddr 127.0.0.1 tcp dport 7233"
        ' counter reject with tcp reset comment "temporal"' in text
    )
    assert 'ip6 daddr ::1 tcp dport 50051 counter reject with tcp reset comment "control drop"' in text


def test_each_state_dir_has_its_own_table(tmp_path):
    """Two stacks on one host (the tests beside a developer's `make up`) never replace or
    remove each other's rules: the table is named by the state dir too."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").symlink_to(tmp_path / "a")
    a = rank_firewall.table_for("gpufleet_ranks", tmp_path / "a")
    assert a.startswith("gpufleet_ranks_") and len(a) == len("gpufleet_ranks_") + 8
    assert rank_firewall.table_for("gpufleet_ranks", tmp_path / "b") == a  # the same dir by another path
    assert rank_firewall.table_for("gpufleet_ranks", tmp_path / "c") != a


def test_the_rules_go_only_once_no_rank_runs_and_no_agent_serves(tmp_path, monkeypatch):
    """What ``release_if_unused`` reads in the state dir: a live rank, or a node an agent
    serves, keeps the rules; a supervisor whose rank has ended is waited for a moment."""
    removed: list[str] = []
    monkeypatch.setattr(rank_firewall, "remove", removed.append)
    lease = tmp_path / "agent" / "n0" / "leases" / "j-1.a1.r0"
    lease.mkdir(parents=True)
    me = {"supervisor_pid": os.getpid(), "supervisor_start": sf.process_start_ticks(os.getpid())}
    sf.write_json_atomic(lease / sf.SUPERVISOR, {**me, "rank_pid": os.getpid(), "rank_start": me["supervisor_start"],
                                                 "pgid": os.getpgid(0)})  # fmt: skip
    assert not rank_firewall.release_if_unused(tmp_path, "t", settle_s=60)  # a rank runs: at once, kept
    sf.write_json_atomic(lease / sf.SUPERVISOR, me)  # its supervisor outlives it ...
    assert not rank_firewall.release_if_unused(tmp_path, "t", settle_s=0.2)  # ... past the settle: kept
    (lease / sf.SUPERVISOR).unlink()
    lock = NodeLock(tmp_path / "agent" / "n0")
    lock.acquire("n0")
    assert not rank_firewall.release_if_unused(tmp_path, "t")  # an agent serves the node
    lock.release()
    assert removed == []
    assert rank_firewall.release_if_unused(tmp_path, "t") and removed == ["t"]


def test_addresses_resolve_and_bad_ones_are_refused():
    got, problems = rank_firewall.resolve(
        [("localhost:7233", "temporal"), ("[::1]:80", "listed"), ("no-such-host.invalid:5432", "listed"),
         ("dns:///control", "control")]
    )  # fmt: skip
    assert Endpoint("127.0.0.1", 7233, "temporal") in got and Endpoint("::1", 80, "listed") in got
    # one that cannot be resolved or read is named, and the others are still covered
    assert len(problems) == 2 and "'no-such-host.invalid:5432'" in problems[0] and "host:port" in problems[1]
    for bad in ("temporal", "host:", ":80", "host:99999", "host:http"):
        with pytest.raises(ValueError, match="host:port"):
            rank_firewall.split_host_port(bad)
    with pytest.raises(ValueError, match="host:port"):
        Settings(agent_rank_blocked_addresses=["db.internal"])


def _firewall_here() -> str:
    if os.geteuid() != 0:
        return "nftables rules need root (the agent has it on a GPU node)"
    if shutil.which("nft") is None:
        return "nft is not installed (CI installs nftables)"
    r = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=False)
    return "" if r.returncode == 0 else f"nft cannot run here: {r.stderr.strip()}"


def list_table(table: str) -> subprocess.CompletedProcess:
    """``nft list`` of an agent's table."""
    return subprocess.run(["nft", "list", "table", "inet", table], capture_output=True, text=True, check=False)


def connect_probe(**ports: int) -> str:
    """A rank's shell: for each name, whether a TCP connection to 127.0.0.1:port opens."""
    return "".join(
        f'echo "== {name}"; bash -c "exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected" 2>&1\n'
        for name, port in ports.items()
    )


class Listener:
    """A TCP server on 127.0.0.1 that accepts and closes, standing in for an endpoint."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def listeners():
    made = [Listener() for _ in range(3)]
    yield made
    for lst in made:
        lst.close()


@pytest.mark.skipif(bool(_firewall_here()), reason=_firewall_here() or "-")
async def test_a_rank_cannot_connect_to_control_or_a_listed_address_and_others_can(
    tmp_path, work_root, listeners, caplog
):
    caplog.set_level(logging.INFO, "gpufleet.agent")
    control, database, storage = listeners
    settings = make_settings(
        tmp_path, agent_rank_isolation=True, agent_work_dir=work_root, agent_rank_firewall="required",
        agent_rank_firewall_table=f"gpufleet_test_{os.getpid()}",
        agent_rank_blocked_addresses=[f"localhost:{database.port}"],
    )  # fmt: skip
    table = rank_firewall.table_for(settings.agent_rank_firewall_table, settings.state_dir)
    agent = AgentProcess(
        settings, ["node-w"], backend="simulated", temporal=False, control_addresses=[f"127.0.0.1:{control.port}"]
    )
    await agent.start()
    try:
        assert f"nftables table inet {table}" in caplog.text
        probe = connect_probe(control=control.port, database=database.port, storage=storage.port)
        st = await run_sh_rank(agent.nodes["node-w"], "lease-net", probe)
        out = (st.dir / sf.STDOUT).read_text()
        got = sections(out)
        assert "Connection refused" in got["control"], out
        assert "Connection refused" in got["database"], out  # resolved from localhost
        assert got["storage"].strip() == "connected", out  # everything else is the rank's to reach
        # the agent's own user (and every user but the ranks') still reaches control
        socket.create_connection(("127.0.0.1", control.port), timeout=5).close()
        listed = await asyncio.to_thread(list_table, table)
        assert listed.returncode == 0 and f"dport {control.port}" in listed.stdout, listed
    finally:
        await agent.stop()
    # no rank of the state dir is left: the rules go with the agent
    assert not await asyncio.to_thread(rank_firewall.present, table)


@pytest.mark.skipif(bool(_firewall_here()), reason=_firewall_here() or "-")
async def test_an_address_that_does_not_resolve_is_named_and_the_others_are_still_closed(
    tmp_path, work_root, listeners, caplog
):
    control = listeners[0]
    settings = make_settings(
        tmp_path, agent_rank_isolation=True, agent_work_dir=work_root,
        agent_rank_firewall_table=f"gpufleet_test_{os.getpid()}_b", agent_rank_blocked_addresses=["no-such-host.invalid:5432"],
    )  # fmt: skip
    table = rank_firewall.table_for(settings.agent_rank_firewall_table, settings.state_dir)
    agent = AgentProcess(
        settings, ["node-z"], backend="simulated", temporal=False, control_addresses=[f"127.0.0.1:{control.port}"]
    )
    await agent.start()
    listed = await asyncio.to_thread(list_table, table)
    await agent.stop()
    assert f"dport {control.port}" in listed.stdout, listed
    assert "cannot resolve listed address 'no-such-host.invalid:5432'" in caplog.text
    with pytest.raises(RuntimeError, match="required but ranks cannot be kept off: cannot resolve"):
        await AgentProcess(
            settings.model_copy(update={"agent_rank_firewall": "required"}), ["node-z2"], backend="simulated",
            temporal=False, control_addresses=[f"127.0.0.1:{control.port}"],
        ).start()  # fmt: skip


@pytest.mark.skipif(bool(_firewall_here()), reason=_firewall_here() or "-")
async def test_a_name_that_resolves_only_after_the_start_is_closed_to_ranks_then(
    tmp_path, work_root, listeners, monkeypatch, caplog
):
    """DNS was down when the agent started (or a name behind a load balancer moved): the
    address is closed to ranks once it resolves, and what was closed before stays closed."""
    caplog.set_level(logging.INFO, "gpufleet.agent")
    control, database = listeners[0], listeners[1]
    resolves = threading.Event()
    real = socket.getaddrinfo

    def getaddrinfo(host, *args, **kw):
        if host == "db.moving.test":
            if not resolves.is_set():
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            host = "127.0.0.1"
        return real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    settings = make_settings(
        tmp_path, agent_rank_isolation=True, agent_work_dir=work_root,
        agent_rank_firewall_table=f"gpufleet_test_{os.getpid()}_r",
        agent_rank_blocked_addresses=[f"db.moving.test:{database.port}"], agent_rank_firewall_refresh_s=0.1,
    )  # fmt: skip
    table = rank_firewall.table_for(settings.agent_rank_firewall_table, settings.state_dir)
    agent = AgentProcess(
        settings, ["node-r"], backend="simulated", temporal=False, control_addresses=[f"127.0.0.1:{control.port}"]
    )
    probe = connect_probe(control=control.port, database=database.port)
    await agent.start()
    try:
        assert "cannot resolve listed address 'db.moving.test" in caplog.text
        before = (await run_sh_rank(agent.nodes["node-r"], "lease-before", probe)).dir / sf.STDOUT
        assert "Connection refused" in before.read_text().split("== database")[0], before.read_text()
        assert "connected" in before.read_text().split("== database")[1]  # the hole, while it does not resolve
        resolves.set()
        await wait_for(lambda: "may no longer connect to 127.0.0.1:" in caplog.text, timeout=20, what="a renewal")
        after = (await run_sh_rank(agent.nodes["node-r"], "lease-after", probe)).dir / sf.STDOUT
        control_out, database_out = after.read_text().split("== database")
        assert "Connection refused" in control_out and "Connection refused" in database_out, after.read_text()
        listed = await asyncio.to_thread(list_table, table)
        assert f"dport {control.port}" in listed.stdout and f"dport {database.port}" in listed.stdout, listed
    finally:
        await agent.stop()


async def test_an_agent_that_must_keep_ranks_off_and_cannot_refuses_to_start(tmp_path, work_root, monkeypatch, caplog):
    if os.geteuid() != 0:
        pytest.skip("the rules are only for ranks of another user (the agent must be root)")
    monkeypatch.setenv("PATH", str(tmp_path / "no-nft"))  # no nft to be found
    settings = make_settings(
        tmp_path, agent_rank_isolation=True, agent_work_dir=work_root, agent_rank_firewall="required"
    )
    agent = AgentProcess(settings, ["node-x"], backend="simulated", temporal=False)
    with pytest.raises(RuntimeError, match=r"agent_rank_firewall is required .* nft .*not installed"):
        await agent.start()
    assert not agent.nodes  # refused before any rank could start
    # auto: it says what ranks can reach, and runs
    auto = AgentProcess(settings.model_copy(update={"agent_rank_firewall": "auto"}), ["node-y"], backend="simulated",
                        temporal=False)  # fmt: skip
    await auto.start()
    await auto.stop()
    assert "ranks can connect to 127.0.0.1:1: nft (nftables) is not installed" in caplog.text


@pytest.mark.skipif(bool(_firewall_here()), reason=_firewall_here() or "-")
async def test_two_stacks_on_one_host_keep_each_others_rules(tmp_path, work_root, listeners):
    """A second stack's agent (another state dir, other endpoints) starts and stops beside the
    first: the first's ranks stay kept off the first's control plane throughout. With one
    table for the host, the second's start replaced the first's rules with its own."""
    control_a, control_b = listeners[0], listeners[1]
    agents = {}
    for name, control in (("a", control_a), ("b", control_b)):
        settings = make_settings(
            tmp_path / name, agent_rank_isolation=True, agent_work_dir=work_root / name,
            agent_rank_firewall="required",
        )  # fmt: skip
        agents[name] = AgentProcess(
            settings, [f"node-{name}"], backend="simulated", temporal=False,
            control_addresses=[f"127.0.0.1:{control.port}"],
        )  # fmt: skip
    probe = connect_probe(a=control_a.port, b=control_b.port)
    await agents["a"].start()
    try:
        await agents["b"].start()
        try:
            for name in ("a", "b"):
                st = await run_sh_rank(agents[name].nodes[f"node-{name}"], f"lease-{name}", probe)
                out = sections((st.dir / sf.STDOUT).read_text())
                # its own stack's control is closed to it (and the other's: the ranks' users are the same)
                assert "Connection refused" in out["a"] and "Connection refused" in out["b"], out
        finally:
            await agents["b"].stop()
        tables = {n: rank_firewall.table_for(a.settings.agent_rank_firewall_table, a.settings.state_dir)
                  for n, a in agents.items()}  # fmt: skip
        assert not rank_firewall.present(tables["b"]) and rank_firewall.present(tables["a"])
        st = await run_sh_rank(agents["a"].nodes["node-a"], "lease-a2", probe)
        out = sections((st.dir / sf.STDOUT).read_text())
        assert "Connection refused" in out["a"], out  # the second stack's stop took only its own rules
    finally:
        await agents["a"].stop()
    assert not rank_firewall.present(tables["a"])


@pytest.mark.skipif(bool(_firewall_here()), reason=_firewall_here() or "-")
async def test_rules_flushed_from_the_host_are_put_back(tmp_path, work_root, listeners, caplog):
    """A firewall service's reload (`nft flush ruleset`, firewalld's reload) takes the ranks'
    table with the rest: the agent puts it back within its refresh, and says so."""
    caplog.set_level(logging.INFO, "gpufleet.agent")
    control = listeners[0]
    settings = make_settings(
        tmp_path, agent_rank_isolation=True, agent_work_dir=work_root, agent_rank_firewall_refresh_s=0.1
    )
    table = rank_firewall.table_for(settings.agent_rank_firewall_table, settings.state_dir)
    agent = AgentProcess(
        settings, ["node-f"], backend="simulated", temporal=False, control_addresses=[f"127.0.0.1:{control.port}"]
    )
    await agent.start()
    try:
        assert await asyncio.to_thread(rank_firewall.present, table)
        await asyncio.to_thread(rank_firewall.remove, table)
        await wait_for(lambda: "were gone from the host" in caplog.text, timeout=20, what="the rules put back")
        assert f"dport {control.port}" in (await asyncio.to_thread(list_table, table)).stdout
        st = await run_sh_rank(agent.nodes["node-f"], "lease-f", connect_probe(control=control.port))
        assert "Connection refused" in (st.dir / sf.STDOUT).read_text()
    finally:
        await agent.stop()


@pytest.mark.skipif(bool(_firewall_here()), reason=_firewall_here() or "-")
async def test_the_rules_stay_while_a_rank_runs_on_and_go_with_it(tmp_path, work_root, listeners):
    """An agent stopped while its rank runs on leaves the rules for that rank; once
    `gpufleet stop-ranks` has stopped it, they go."""
    control = listeners[0]
    prefix = f"gpufleet_test_{os.getpid()}_s"
    settings = make_settings(
        tmp_path, agent_rank_isolation=True, agent_work_dir=work_root, agent_rank_firewall_table=prefix
    )
    table = rank_firewall.table_for(prefix, settings.state_dir)
    agent = AgentProcess(
        settings, ["node-s"], backend="simulated", temporal=False, control_addresses=[f"127.0.0.1:{control.port}"]
    )
    await agent.start()
    try:
        res = await agent.nodes["node-s"].start_task(start_task("node-s", "lease-s", ["/bin/sh", "-c", "sleep 60"]))
        assert res.accepted, res
    finally:
        await agent.stop()
    try:
        assert await asyncio.to_thread(rank_firewall.present, table)  # the rank runs on: its rules stay
        r = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "cli.main", "stop-ranks", "--state-dir", str(settings.state_dir), "--grace", "5"],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
            env={**os.environ, "GPUFLEET_AGENT_RANK_FIREWALL_TABLE": prefix},
        )  # fmt: skip
        assert r.returncode == 0 and "stopped 1 rank of 1 job" in r.stdout, r.stdout + r.stderr
        assert not await asyncio.to_thread(rank_firewall.present, table)
    finally:
        await asyncio.to_thread(rank_firewall.remove, table)
