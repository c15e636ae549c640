"""Which users a node's ranks run as, and that the numbered users are nobody else's.

As root, the agent runs a rank as an unprivileged user (docs/security.md, "Ranks on one
node"): its team's listed ids, else its job's numbered user (uid ``agent_rank_id_base`` +
the job's number in the store, gid the base + the team's), else the shared
``agent_rank_uid``. ``rank_users`` is the set the agent's start-up checks look at (dirs the
ranks must reach, the firewall's uids).

A host account, or a range of subordinate ids (``/etc/subuid``, ``/etc/subgid``) inside
``agent_rank_id_base`` .. ``UID_MAX`` would let a job's ranks read that account's files,
or a container's. ``clashes`` is pure (given the accounts and the subordinate-id files'
text); the agent refuses to start while there is one."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

UID_MAX = 2_147_483_646  # the numbered range ends here (worker_agent.rank_firewall matches up to it)


def ranks_isolated(settings) -> bool:
    """Whether ranks run as another user than the agent's: asked for, and the agent is root."""
    return bool(settings.agent_rank_isolation) and os.geteuid() == 0


def rank_user(settings, team: str, team_rank_id: int | None, job_rank_id: int | None) -> tuple[int, int]:
    """The (uid, gid) a job's ranks run as: its team's listed ids; else uid base + the job's
    number and gid base + the team's; a StartTask without the job's number (sent by a
    control older than the jobs' numbering) runs as its team's user, uid and gid base + the
    team's number; without a team number (burn-in) or with numbering off, the shared one.
    ValueError for a number past ``UID_MAX`` (the range is spent: a lower base widens it)."""
    ids = settings.agent_team_rank_ids.get(team)
    if ids:
        return int(ids[0]), int(ids[1])
    teams = team_user(settings, team_rank_id)
    if teams is None:
        return int(settings.agent_rank_uid), int(settings.agent_rank_gid)
    base = int(settings.agent_rank_id_base)
    gid = teams[1]
    uid = teams[0] if job_rank_id is None else base + int(job_rank_id)
    if max(uid, gid) > UID_MAX:
        raise ValueError(
            f"the job's user {uid} (group {gid}) is past {UID_MAX}: agent_rank_id_base {base} leaves no id for"
            f" job number {job_rank_id} of team number {team_rank_id}"
        )
    return uid, gid


def team_user(settings, team_rank_id: int | None) -> tuple[int, int] | None:
    """The team's numbered user, base + the team's number: its jobs' group, the user of a
    StartTask without a job number, and the one its ranks ran as before jobs were numbered
    (whose checkpoint dirs are handed to the job's own user); None where there is none."""
    base = int(settings.agent_rank_id_base)
    if not base or team_rank_id is None:
        return None
    return base + int(team_rank_id), base + int(team_rank_id)


def rank_users(settings) -> set[tuple[int, int]]:
    """The (uid, gid) ranks run as: the shared one, each listed team's, and one standing for
    every numbered job's (nothing is numbered 0, and every numbered user is the same
    stranger to the agent's dirs)."""
    ids = {(int(settings.agent_rank_uid), int(settings.agent_rank_gid))}
    base = int(settings.agent_rank_id_base)
    if base:
        ids.add((base, base))
    return ids | {(int(u), int(g)) for u, g in settings.agent_team_rank_ids.values()}


def clashes(
    base: int, accounts: Iterable[tuple[str, int, int]], subordinate: dict[str, str], listed: Iterable[int] = ()
) -> list[str]:
    """What already holds an id in [base, UID_MAX]: accounts (name, uid, gid) and
    subordinate-id ranges (file name -> its text, lines ``owner:first:count``). Ids an
    operator listed for a team (``agent_team_rank_ids``) are that team's, not a clash."""
    if not base:
        return []
    mine = set(listed)
    found = [
        f"account {name} (uid {uid}, gid {gid})"
        for name, uid, gid in accounts
        if (base <= uid <= UID_MAX and uid not in mine) or (base <= gid <= UID_MAX and gid not in mine)
    ]
    for file, text in subordinate.items():
        for line in text.splitlines():
            parts = line.strip().split(":")
            if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
                continue
            first, count = int(parts[1]), int(parts[2])
            if first <= UID_MAX and first + count - 1 >= base:
                found.append(f"{file} range {first}-{first + count - 1} of {parts[0]}")
    return found


def host_clashes(base: int, listed: Iterable[int] = ()) -> list[str]:
    """``clashes`` on this host's account database and subordinate-id files."""
    import pwd

    accounts = [(p.pw_name, p.pw_uid, p.pw_gid) for p in pwd.getpwall()]
    subordinate = {}
    for name in ("/etc/subuid", "/etc/subgid"):
        try:
            subordinate[name] = Path(name).read_text()
        except OSError:
            continue
    return clashes(base, accounts, subordinate, listed)
