"""A team's job sees only its own lease (docs/design.md, Security): with the agent running as
root (as on a GPU node, and as CI runs here), a rank runs as an unprivileged user in its own
work dir with a scrubbed environment, and reads nothing of the agent's or the control
plane's environment, the agent's state, or another lease's log.

The ranks here are /bin/sh scripts: the unprivileged user may not reach this venv's
interpreter (CI keeps it under /root)."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from common.contracts import StopTask
from tests.agent.conftest import close_node, make_settings, start_task, wait_for
from tests.security.conftest import run_sh_rank
from worker_agent import rank_users
from worker_agent import statefiles as sf
from worker_agent.node import NodeAgent
from worker_agent.nvml import make_backend
from worker_agent.rank_access import RankAccessError

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="the agent must run as root to run ranks as another user (it does on a GPU node)"
)

SECRET = "tok-secret-6b1f0e"  # in the agent's and the control plane's environments


@pytest.fixture
async def node(tmp_path, work_root, monkeypatch):
    monkeypatch.setenv("GPUFLEET_API_TOKENS", f'{{"{SECRET}": {{"name": "root", "admin": true}}}}')
    monkeypatch.setenv("GPUFLEET_DATABASE_URL", f"postgresql://postgres:{SECRET}@127.0.0.1/gpufleet")
    settings = make_settings(tmp_path, agent_rank_isolation=True, agent_work_dir=work_root)
    (tmp_path / "state").mkdir(parents=True, exist_ok=True)
    tokens = tmp_path / "state" / "tokens.json"
    tokens.write_text(SECRET)
    tokens.chmod(0o600)
    n = NodeAgent(settings, "node-i", backend=make_backend(settings, "node-i", "simulated"))
    await n.start()
    yield n
    await close_node(n)


@pytest.fixture
def control_plane():
    """A root process holding the control plane's secrets in its environment."""
    env = {"PATH": "/usr/bin:/bin", "GPUFLEET_DATABASE_URL": f"postgresql://postgres:{SECRET}@db/gpufleet"}
    proc = subprocess.Popen(["sleep", "60"], env=env)
    yield proc
    proc.kill()
    proc.wait()


async def run_rank(node: NodeAgent, lease_id: str, body: str, **kw) -> tuple[str, str]:
    st = await run_sh_rank(node, lease_id, body, **kw)
    return (st.dir / sf.STDOUT).read_text(), (st.dir / sf.STDERR).read_text()


async def test_a_rank_reads_nothing_of_the_agent_control_plane_or_another_lease(node, tmp_path, control_plane):
    # another team's lease, with something in its log
    other = await node.start_task(
        start_task(node.node_id, "lease-other", ["/bin/sh", "-c", f"echo other-team-{SECRET}; sleep 30"], gpus=(1,))
    )
    assert other.accepted
    other_log = node.leases["lease-other"].dir / sf.STDOUT
    await wait_for(lambda: other_log.exists() and SECRET in other_log.read_text(), what="the other lease's output")
    state = tmp_path / "state"
    probes = {
        "agent environ": f"/proc/{os.getpid()}/environ",
        "control environ": f"/proc/{control_plane.pid}/environ",
        "tokens file": str(state / "tokens.json"),
        "other lease's log": str(other_log),
        "other lease's spec": str(node.leases["lease-other"].dir / sf.SPEC),
        "agent state dir": str(node.dir),
    }
    body = "id -u; id -g; pwd; echo HOME=$HOME; env | grep -c GPUFLEET_ || true\n" + "".join(
        f'echo "== {name}"; cat "{path}" 2>&1 || ls "{path}" 2>&1\n' for name, path in probes.items()
    )
    out, _ = await run_rank(node, "lease-probe", body, gpus=(0,))
    lines = out.splitlines()
    assert lines[0] == "65534" and lines[1] == "65534", out  # the unprivileged user, not root
    work = str(node.work_dir / "lease-probe")
    assert lines[2] == work and lines[3] == f"HOME={work}", out  # its own work dir
    assert SECRET not in out, out
    for name in probes:
        section = out.split(f"== {name}\n", 1)[1].split("\n== ", 1)[0]
        # another user's process is refused, or not there at all where the rank has its own
        # /proc; so is a file under /tmp (pytest's) where the rank has its own /tmp
        out_of_sight = name.endswith("environ") if node.private_proc else False
        out_of_sight = out_of_sight or (node.private_tmp and probes[name].startswith("/tmp/"))
        hidden = out_of_sight and "No such file" in section
        assert "Permission denied" in section or hidden, (name, section)
    # the rank's env is the lease's: only the job variables the platform sets, and its share of the node
    env_out = out.split("HOME=", 1)[1].splitlines()[1]
    job_vars = (
        "JOB_ID",
        "ATTEMPT",
        "LEASE_ID",
        "CHECKPOINT_DIR",
        "PROGRESS_FILE",
        "CPUS",
        "MEMORY_BYTES",
        "DISK_BYTES",
    )
    assert env_out == str(len(job_vars)), out
    # the work dir is the rank's alone, and the agent's state is root's alone
    assert os.stat(work).st_uid == 65534 and os.stat(work).st_mode & 0o777 == 0o700
    assert os.stat(node.dir.parent).st_mode & 0o777 == 0o700
    await node.stop_task(StopTask("lease-other", 1, node.node_id, 0.5, "done"))


async def test_a_rank_writes_its_progress_and_its_checkpoint_dir_as_its_user(node, work_root):
    ckpt = work_root / "checkpoints" / "job-lease-ck" / "attempt-1"
    out, err = await run_rank(
        node,
        "lease-ck",
        'echo \'{"step": 7}\' > "$GPUFLEET_PROGRESS_FILE" && touch "${GPUFLEET_CHECKPOINT_DIR#file://}/step-7" && echo ok'
        f'; ls "{work_root / "checkpoints"}" "{ckpt.parent}" 2>&1',
        checkpoint_dir=f"file://{ckpt}",
    )
    lines = out.splitlines()
    assert lines[0] == "ok", (out, err)
    assert (ckpt / "step-7").stat().st_uid == 65534
    # the dirs the agent made above it may be passed through, not listed (every team's job ids)
    assert len(lines) == 3 and all("Permission denied" in line for line in lines[1:]), out
    node._read_progress(node.leases["lease-ck"])
    assert node.leases["lease-ck"].step == 7


def team_task(
    node: NodeAgent, lease_id: str, body: str, team: str, team_rank_id: int | None, job_rank_id: int | None = None,
    **kw,
):  # fmt: skip
    task = start_task(node.node_id, lease_id, ["/bin/sh", "-c", body], **kw)
    return dataclasses.replace(task, team=team, team_rank_id=team_rank_id, job_rank_id=job_rank_id)


@pytest.mark.parametrize("teams", [("alpha", 1, "beta", 2), ("alpha", 1, "alpha", 1)], ids=["two teams", "one team"])
async def test_two_jobs_ranks_on_one_node_cannot_read_or_signal_each_other(node, work_root, teams):
    """Each job's ranks run as its own numbered user, so a rank cannot read another job's
    work dir, checkpoints or environment (its job's env), nor signal it: another team's
    job, or its own team's."""
    mine_team, mine_number, their_team, their_number = teams
    beta_secret = "beta-weights-5f2c9a"
    beta = team_task(
        node, "lease-beta", f'echo {beta_secret} > "$HOME/weights"; touch "$HOME/ready"; sleep 30', their_team,
        their_number, 1_000_002, gpus=(1,), env={"BETA_KEY": beta_secret},
        checkpoint_dir=f"file://{work_root / 'ckpt-beta'}",
    )  # fmt: skip
    assert (await node.start_task(beta)).accepted
    theirs = node.leases["lease-beta"]
    ready = node.work_dir / "lease-beta" / "ready"
    await wait_for(ready.exists, timeout=15, what="beta's rank to write its weights")
    probes = {
        "work dir": f'cat "{node.work_dir / "lease-beta" / "weights"}"',
        "checkpoint dir": f'ls "{work_root / "ckpt-beta"}"',
        "environ": f"cat /proc/{theirs.pid}/environ",
        "signal": f"kill -TERM {theirs.pid}",
    }
    body = "id -u\nid -g\n" + "".join(f'echo "== {name}"; {cmd} 2>&1\n' for name, cmd in probes.items())
    alpha = team_task(node, "lease-alpha", body, mine_team, mine_number, 1_000_001, gpus=(0,))
    assert (await node.start_task(alpha)).accepted
    mine = node.leases["lease-alpha"]
    await wait_for(lambda: mine.exit is not None and not mine.live, timeout=20, what="alpha's probe to end")
    out = (mine.dir / sf.STDOUT).read_text()
    assert out.splitlines()[:2] == ["2001000001", f"{2_000_000_000 + mine_number}"], out  # base + the job's, the team's
    assert beta_secret not in out, out
    for name in probes:
        section = out.split(f"== {name}\n", 1)[1].split("\n== ", 1)[0]
        # refused, or not there at all: the rank's own /proc hides other users' processes
        assert any(w in section for w in ("denied", "not permitted", "No such file")), (name, section)
    assert theirs.live and theirs.exit is None  # the signal did not reach it
    assert os.stat(node.work_dir / "lease-beta").st_uid == 2_001_000_002
    await node.stop_task(StopTask("lease-beta", 1, node.node_id, 0.5, "done"))


async def test_another_users_checkpoint_dir_is_not_handed_over(node, work_root):
    """The agent makes the job's checkpoint dir and hands it to the rank's user. A StartTask
    naming a dir that another rank's user already holds and left open (here 0755, as its
    rank may chmod it) must not give it away: chowned to the new rank's user, its files
    could be deleted or replaced. (The API lets no job choose the path; this is the agent's
    own check, for a spec that reached the store another way.)"""
    ckpt = work_root / "ckpt-shared-name"
    first = await run_sh_rank(node, "lease-a1", f"chmod 755 {ckpt}", checkpoint_dir=f"file://{ckpt}")
    assert first.exit["exit_code"] == 0 and ckpt.stat().st_uid == 65534
    res = await node.start_task(team_task(node, "lease-b1", "true", "beta", 2, checkpoint_dir=f"file://{ckpt}"))
    assert not res.accepted and "belongs to uid 65534, not to this rank's user 2000000002" in res.reason, res
    assert ckpt.stat().st_uid == 65534  # untouched
    # the same user's next rank (the job's next rank on this node) takes it
    res = await node.start_task(team_task(node, "lease-a2", "true", "", None, checkpoint_dir=f"file://{ckpt}"))
    assert res.accepted, res


async def test_which_user_a_teams_ranks_run_as(tmp_path, work_root):
    settings = make_settings(
        tmp_path, agent_rank_isolation=True, agent_work_dir=work_root, agent_team_rank_ids={"alpha": (61000, 61000)}
    )
    n = NodeAgent(settings, "node-u", backend=make_backend(settings, "node-u", "simulated"))
    shared = NodeAgent(
        settings.model_copy(update={"agent_rank_id_base": 0}), "node-v",
        backend=make_backend(settings, "node-v", "simulated"),
    )  # fmt: skip
    assert n.rank_user("alpha", 1, 1_000_007) == (61000, 61000)  # listed ids come first
    assert n.rank_user("beta", 2, 1_000_007) == (2_001_000_007, 2_000_000_002)  # the job's user, the team's group
    assert n.rank_user("beta", 2) == (2_000_000_002, 2_000_000_002)  # no job number (older control): the team's
    assert n.rank_user("", None) == (65534, 65534)  # no team number (burn-in, an old StartTask): the shared one
    assert shared.rank_user("beta", 2, 1_000_007) == (65534, 65534)  # numbering off
    with pytest.raises(ValueError, match="past 2147483646"):
        n.rank_user("beta", 2, 147_483_647)  # the range is spent
    assert (2_000_000_000, 2_000_000_000) in n.rank_users()  # numbered users must reach the work root


async def test_a_team_with_its_own_ids_runs_as_them(tmp_path, work_root):
    settings = make_settings(
        tmp_path, agent_rank_isolation=True, agent_work_dir=work_root, agent_team_rank_ids={"alpha": (61000, 61000)}
    )
    n = NodeAgent(settings, "node-j", backend=make_backend(settings, "node-j", "simulated"))
    await n.start()
    try:
        assert n.rank_user("alpha") == (61000, 61000) and n.rank_user("beta") == (65534, 65534)
        task = dataclasses.replace(start_task("node-j", "lease-a", ["/bin/sh", "-c", "id -u"]), team="alpha")
        assert (await n.start_task(task)).accepted
        st = n.leases["lease-a"]
        await wait_for(lambda: st.exit is not None, timeout=15, what="the rank to exit")
        assert (st.dir / sf.STDOUT).read_text().strip() == "61000"
    finally:
        await n.close()


async def test_an_agent_whose_teams_users_are_taken_refuses_to_start(tmp_path, work_root, monkeypatch):
    """A host account in the numbered range would let a team's ranks read its files."""
    taken = "account ldap-bob (uid 2000000005, gid 100)"
    monkeypatch.setattr(rank_users, "host_clashes", lambda base, listed: [taken] if base == 2_000_000_000 else [])
    settings = make_settings(tmp_path, agent_rank_isolation=True, agent_work_dir=work_root)
    n = NodeAgent(settings, "node-c", backend=make_backend(settings, "node-c", "simulated"))
    with pytest.raises(
        RankAccessError, match=f"not free on this host: {re.escape(taken)}.*GPUFLEET_AGENT_RANK_ID_BASE"
    ):
        await n.start()
    moved = settings.model_copy(update={"agent_rank_id_base": 2_050_000_000})
    n = NodeAgent(moved, "node-c", backend=make_backend(moved, "node-c", "simulated"))
    await n.start()  # a base above it
    await close_node(n)


async def test_a_work_dir_out_of_the_ranks_reach_is_refused_at_start(tmp_path):
    private = Path(tempfile.mkdtemp(prefix="gpufleet-private-"))  # 0700, root's
    try:
        settings = make_settings(tmp_path, agent_rank_isolation=True, agent_work_dir=private / "work")
        n = NodeAgent(settings, "node-p", backend=make_backend(settings, "node-p", "simulated"))
        with pytest.raises(RankAccessError, match=f"{private} is private.*GPUFLEET_AGENT_WORK_DIR"):
            await n.start()
    finally:
        shutil.rmtree(private, ignore_errors=True)


async def test_a_checkpoint_dir_of_another_user_is_not_handed_to_a_rank(node, work_root):
    theirs = work_root / "someone-elses"
    theirs.mkdir()
    os.chown(theirs, 4242, 4242)
    res = await node.start_task(
        start_task(node.node_id, "lease-steal", ["/bin/sh", "-c", "true"], checkpoint_dir=f"file://{theirs}")
    )
    assert not res.accepted and "belongs to uid 4242" in res.reason, res
    assert theirs.stat().st_uid == 4242  # untouched


async def test_a_job_past_the_numbered_range_is_refused_not_run_as_someone(node):
    res = await node.start_task(team_task(node, "lease-far", "true", "beta", 2, 147_483_647))
    assert not res.accepted and "past 2147483646" in res.reason, res
    assert "lease-far" not in node.leases


async def test_a_checkpoint_dir_its_team_user_wrote_is_handed_to_the_jobs_user(node, work_root):
    """Before jobs were numbered a job's ranks ran as its team's user; its next attempt runs
    as the job's own and takes over what the team's user wrote (a link is given, not what
    it points to). Another team's former dir is not taken."""
    ckpt = work_root / "ckpt-upgraded"
    outside = work_root / "outside"
    outside.write_text("the host's")
    first = await run_as(
        node, "lease-old", f'mkdir -p "{ckpt}/step-3" && echo w > "{ckpt}/step-3/w" && ln -s "{outside}" "{ckpt}/l"',
        "beta", 2, None, checkpoint_dir=f"file://{ckpt}",
    )  # fmt: skip
    assert first.exit["exit_code"] == 0 and (ckpt / "step-3" / "w").stat().st_uid == 2_000_000_002
    body = f'cat "{ckpt}/step-3/w" && echo more > "{ckpt}/step-3/w2" && id -u'
    res = await node.start_task(
        team_task(node, "lease-new", body, "beta", 2, 1_000_009, checkpoint_dir=f"file://{ckpt}")
    )
    assert res.accepted, res
    st = node.leases["lease-new"]
    await wait_for(lambda: st.exit is not None and not st.live, timeout=20, what="the new attempt to end")
    assert (st.dir / sf.STDOUT).read_text().split() == ["w", "2001000009"], (st.dir / sf.STDERR).read_text()
    for path in (ckpt, ckpt / "step-3", ckpt / "step-3" / "w", ckpt / "l"):
        assert os.lstat(path).st_uid == 2_001_000_009, path
    assert outside.stat().st_uid == 0  # the link's target stays the host's
    # a dir another team's user wrote is still refused
    theirs = work_root / "ckpt-theirs"
    await run_as(node, "lease-t", "true", "gamma", 3, None, checkpoint_dir=f"file://{theirs}")
    res = await node.start_task(
        team_task(node, "lease-x", "true", "beta", 2, 1_000_010, checkpoint_dir=f"file://{theirs}")
    )
    assert not res.accepted and "belongs to uid 2000000003" in res.reason, res


async def run_as(
    node: NodeAgent, lease_id: str, body: str, team: str, team_rank_id: int | None, job_rank_id: int | None, **kw
):  # fmt: skip
    """``run_sh_rank`` for a rank of this team and job."""
    assert (await node.start_task(team_task(node, lease_id, body, team, team_rank_id, job_rank_id, **kw))).accepted
    st = node.leases[lease_id]
    await wait_for(lambda: st.exit is not None and not st.live, timeout=20, what=f"{lease_id} to exit")
    return st
