"""Keep ranks off the control plane's own endpoints: nftables rules on the ranks' users.

Ranks share the host's network (NCCL needs it), so a rank could open a connection to
whatever the agent reaches: Temporal's frontend (with no client certificates required, it
could signal or terminate any job's workflow, or poll a node's task queue and take its
StartTasks), control's gRPC port, and anything an operator lists (Postgres, Temporal's UI).
The agent, as root, puts one table in the host's ruleset that rejects TCP connections from
the ranks' uids (the shared rank user, every numbered team's, every listed team's) to those
addresses, as resolved at start. Other users and every other destination are untouched:
a rank may still reach the API, its storage and its peers.

The table is the state dir's own (``table_for``: the setting's name and a hash of the state
dir), so two stacks on one host (the tests beside a developer's `make up`) never replace or
remove each other's. It is replaced whole in one nft transaction, so a restarted agent never
leaves a gap; it stays after the agent stops while any rank of the state dir runs (ranks
outlive their agent) and goes with the last one (``release_if_unused``).

``ruleset`` and ``table_for`` are pure (tested as text); ``apply`` runs ``nft -f -``.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from worker_agent.live_ranks import live_ranks, nodes_served
from worker_agent.rank_users import UID_MAX


class FirewallError(RuntimeError):
    pass


@dataclass(frozen=True, order=True)
class Endpoint:
    ip: str  # a literal address, v4 or v6
    port: int
    what: str  # whose endpoint it is, as the rule's comment

    @property
    def family(self) -> str:
        return "ip6" if ipaddress.ip_address(self.ip).version == 6 else "ip"


def table_for(name: str, state_dir: Path | str) -> str:
    """The state dir's own table: ``<name>_<crc32 of the state dir's real path>``."""
    return f"{name}_{zlib.crc32(os.path.realpath(state_dir).encode()):08x}"


def split_host_port(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``; a ValueError names the bad address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"an address is host:port, not {address!r}")
    return host.strip("[]"), int(port)


def resolve(addresses: Iterable[tuple[str, str]]) -> tuple[list[Endpoint], list[str]]:
    """(address, what) pairs -> each IP the addresses resolve to now, with its port, and a
    line for each address that could not be read or resolved (it is then not covered)."""
    out: set[Endpoint] = set()
    problems: list[str] = []
    for address, what in addresses:
        try:
            host, port = split_host_port(address)
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (ValueError, OSError) as e:  # socket.gaierror is an OSError
            problems.append(f"cannot resolve {what} address {address!r}: {e}")
            continue
        for _family, _type, _proto, _name, sockaddr in infos:
            out.add(Endpoint(str(sockaddr[0]).split("%")[0], port, what))
    return sorted(out), problems


def uid_set(uids: Iterable[int], numbered_from: int | None) -> str:
    """The nft set of the ranks' uids: single ids, and the numbered jobs' range."""
    parts = [str(u) for u in sorted(set(uids)) if numbered_from is None or not numbered_from <= u <= UID_MAX]
    if numbered_from is not None:
        parts.append(f"{numbered_from}-{UID_MAX}")
    return "{ " + ", ".join(parts) + " }"


def _comment(text: str) -> str:
    return "".join(c for c in text if c.isalnum() or c in " -_.:/")[:120]


def ruleset(table: str, uids: str, endpoints: Iterable[Endpoint]) -> str:
    """The whole table, replacing any earlier one in the same transaction."""
    rules = [
        f"\t\tmeta skuid {uids} {e.family} daddr {e.ip} tcp dport {e.port} counter reject with tcp reset"
        f' comment "{_comment(e.what)}"'
        for e in endpoints
    ]
    return "\n".join(
        [
            f"table inet {table}",  # so that the delete below finds one on a first start
            f"delete table inet {table}",
            f"table inet {table} {{",
            "\tchain output {",
            "\t\ttype filter hook output priority 0; policy accept;",
            *rules,
            "\t}",
            "}",
            "",
        ]
    )


def _nft() -> str:
    nft = shutil.which("nft")
    if nft is None:
        raise FirewallError("nft (nftables) is not installed")
    return nft


def apply(text: str, timeout_s: float = 10.0) -> None:
    r = subprocess.run([_nft(), "-f", "-"], input=text, capture_output=True, text=True, timeout=timeout_s, check=False)
    if r.returncode != 0:
        raise FirewallError(f"nft refused the ranks' rules: {r.stderr.strip() or r.stdout.strip()}")


def remove(table: str, timeout_s: float = 10.0) -> None:
    nft = shutil.which("nft")
    if nft is not None:
        subprocess.run([nft, "delete", "table", "inet", table], capture_output=True, timeout=timeout_s, check=False)


def present(table: str, timeout_s: float = 10.0) -> bool:
    """Whether the host's ruleset has the table (a firewall service's reload flushes the
    whole ruleset, ours with it)."""
    r = subprocess.run([_nft(), "list", "table", "inet", table], capture_output=True, timeout=timeout_s, check=False)
    return r.returncode == 0


def release_if_unused(state_dir: Path | str, table: str, settle_s: float = 5.0, poll_s: float = 0.05) -> bool:
    """Remove the state dir's table once no rank of it runs and no agent serves any of its
    nodes (an agent that starts meanwhile puts it back within its refresh); True if it went.
    A supervisor whose rank has ended is given ``settle_s`` to finish its exit record; one
    still there after it keeps the rules (it may be about to start its rank)."""
    deadline = time.monotonic() + settle_s
    while True:
        ranks = live_ranks(Path(state_dir))
        if any(r.pgid for r in ranks) or nodes_served(Path(state_dir)):
            return False
        if not ranks:
            break
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    remove(table)
    return True
