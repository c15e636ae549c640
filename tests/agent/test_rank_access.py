"""Whether a rank's user can reach a path (worker_agent.rank_access), judged from the modes
and owners on the way, and the agent's word when it cannot isolate ranks at all."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.agent.conftest import make_settings
from worker_agent import node as node_module
from worker_agent.node import NodeAgent
from worker_agent.nvml import make_backend
from worker_agent.rank_access import RankAccessError, private_ancestor, require_reachable

ME = os.geteuid(), os.getegid()
OTHER = 65534, 65534


@pytest.fixture
def tree():
    """/tmp/x (0711) / open (0755) / shut (0700) / inner (0755), and open/group (0710): under
    the system temp dir, which every user may pass through."""
    top = Path(tempfile.mkdtemp(prefix="gpufleet-access-"))
    (top / "open" / "shut" / "inner").mkdir(parents=True)
    (top / "open" / "group").mkdir()
    top.chmod(0o711)
    (top / "open").chmod(0o755)
    (top / "open" / "shut").chmod(0o700)
    (top / "open" / "group").chmod(0o710)
    yield top
    shutil.rmtree(top, ignore_errors=True)


def test_modes_and_owners_decide(tree):
    inner = tree / "open" / "shut" / "inner"
    assert private_ancestor(inner, *OTHER) == tree / "open" / "shut"
    assert private_ancestor(inner, *ME) is None  # the owner passes its own 0700 dir
    assert private_ancestor(tree / "open" / "not-yet" / "deeper", *OTHER) is None  # the agent creates the rest
    assert private_ancestor(inner, 0, 0) is None  # root passes everything
    group = tree / "open" / "group"
    gid = os.stat(group).st_gid
    assert private_ancestor(group / "x", 5000, gid) is None  # group execute lets the group through
    assert private_ancestor(group / "x", 5000, gid + 1) == group  # others may not


def test_require_reachable_names_the_dir_and_the_fix(tree):
    with pytest.raises(RankAccessError, match=r"shut is private \(mode 0700.*set X"):
        require_reachable(tree / "open" / "shut" / "inner", *OTHER, "the work dir", "set X")
    require_reachable(tree / "open" / "work", *OTHER, "the work dir", "set X")  # open all the way


async def test_an_agent_that_is_not_root_says_ranks_are_not_isolated(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(node_module.os, "geteuid", lambda: 1000)
    settings = make_settings(tmp_path, agent_rank_isolation=True)
    n = NodeAgent(settings, "node-k", backend=make_backend(settings, "node-k", "simulated"))
    with caplog.at_level(logging.WARNING, logger="gpufleet.agent"):
        await n.start()
    try:
        assert not n.isolated and n.rank_user("any-team") is None
        assert any("not root" in r.getMessage() and "no isolation" in r.getMessage() for r in caplog.records)
    finally:
        await n.close()
