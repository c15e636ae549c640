"""The numbered teams' users must be nobody else's: a host account, or a range of
subordinate ids (``/etc/subuid``, ``/etc/subgid``) inside ``agent_team_uid_base`` ..
``UID_MAX`` would let a team's ranks read that account's files, or a container's.

``clashes`` is pure (given the accounts and the subordinate-id files' text); the agent
refuses to start while there is one (docs/security.md, "Ranks on one node")."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

UID_MAX = 2_147_483_646  # the numbered range ends here (worker_agent.rank_firewall matches up to it)


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
