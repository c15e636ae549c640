"""The numbered teams' users must be nobody else's (worker_agent.rank_users)."""

from __future__ import annotations

from worker_agent.rank_users import UID_MAX, clashes

BASE = 2_000_000_000
ACCOUNTS = [("root", 0, 0), ("nobody", 65534, 65534), ("alice", 1000, 1000)]


def test_a_host_without_ids_in_the_range_is_free():
    subordinate = {"/etc/subuid": "alice:100000:65536\n", "/etc/subgid": "alice:100000:65536\n"}
    assert clashes(BASE, ACCOUNTS, subordinate) == []


def test_an_account_or_a_subordinate_range_in_the_range_is_named():
    accounts = [*ACCOUNTS, ("ldap-bob", BASE + 5, 100), ("grp", 2000, BASE + 9), ("nfsnobody", 4294967294, 1)]
    subordinate = {
        "/etc/subuid": "alice:100000:65536\ncarol:1999999000:2000\nbad line\n",
        "/etc/subgid": f"dave:{UID_MAX}:10\n",
    }
    assert clashes(BASE, accounts, subordinate) == [
        f"account ldap-bob (uid {BASE + 5}, gid 100)",
        f"account grp (uid 2000, gid {BASE + 9})",  # a group in the range clashes too
        "/etc/subuid range 1999999000-2000000999 of carol",  # overlaps the base
        f"/etc/subgid range {UID_MAX}-{UID_MAX + 9} of dave",
    ]  # nfsnobody (above the range's end) is not in it


def test_a_listed_teams_own_ids_and_numbering_off_are_not_clashes():
    accounts = [*ACCOUNTS, ("team-alpha", BASE + 7, BASE + 7)]
    assert clashes(BASE, accounts, {}, listed=[BASE + 7]) == []
    assert clashes(0, accounts, {"/etc/subuid": f"x:{BASE}:10\n"}) == []
