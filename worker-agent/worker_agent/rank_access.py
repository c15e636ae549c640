"""Whether a rank's user can reach a path: every directory on the way must let that user
through (its execute bit for the owner, group or others, whichever applies to the user).

An isolated rank runs as another uid than the agent, so a work dir or a checkpoint dir under
a private directory (``/root``, a 0700 home, pytest's tmp) cannot be reached by it at all;
the agent says so before a job fails on it. ``hand_over_tree`` gives a dir's files from one
of the ranks' users to another.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class RankAccessError(Exception):
    """A rank's user cannot reach a directory it needs; the message says which and why."""


def private_ancestor(path: Path, uid: int, gid: int) -> Path | None:
    """The first existing directory on the way to ``path`` (itself included) that ``uid`` in
    group ``gid`` (and no other group) cannot pass through; None when every one lets it."""
    target = Path(os.path.abspath(path))
    for d in [*reversed(target.parents), target]:
        try:
            st = d.stat()
        except FileNotFoundError:
            return None  # the rest is created by the agent, with modes that let the rank in
        if not stat.S_ISDIR(st.st_mode):
            return None
        if uid == 0:
            continue
        if st.st_uid == uid:
            bit = stat.S_IXUSR
        elif st.st_gid == gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return d
    return None


def require_reachable(path: Path, uid: int, gid: int, what: str, fix: str) -> None:
    blocked = private_ancestor(path, uid, gid)
    if blocked is not None:
        mode = stat.S_IMODE(blocked.stat().st_mode)
        raise RankAccessError(
            f"{what} {path} is out of reach of the ranks' user {uid}:{gid}: {blocked} is private"
            f" (mode {mode:04o}, owner {blocked.stat().st_uid}); {fix}"
        )


def hand_over_tree(root: Path, from_uid: int, user: tuple[int, int]) -> None:
    """Give ``user`` every entry under ``root`` (not ``root`` itself) that ``from_uid`` owns,
    following no link (a link is given, never what it points to)."""
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in (*dirnames, *filenames):
            path = os.path.join(dirpath, name)
            if os.lstat(path).st_uid == from_uid:
                os.chown(path, *user, follow_symlinks=False)
