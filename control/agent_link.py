"""Control-side pieces of the agent link: the heartbeat table and auth failures.

* ``HeartbeatTable`` — the leader's in-memory view of every node's latest heartbeat
  (docs/design.md, Health: never in Postgres). ``NodeHeartbeat`` keeps the wire message
  and decodes it lazily (``.report()`` -> ``common.contracts.HeartbeatReport``), so
  ingesting thousands of heartbeats a second stays cheap.
* ``AuthFailure`` — what the server hands to its ``on_auth_failure`` callback for the
  audit row (docs/design.md, Security).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from common.contracts import HeartbeatReport
from proto import agent_pb2 as pb
from proto.convert import heartbeat_report_from_pb


class ReportRefused(Exception):
    """A node's report about something that is not its own: refused for good (the agent is
    told not to retry) and audited as a security event."""


@dataclass(frozen=True)
class AuthFailure:
    """A rejected stream or message: audit it (who claimed to be which node, from where, why)."""

    node_id: str | None  # the node id the peer claimed
    peer: str
    reason: str
    message_node_id: str | None = None  # for a message naming another node than the stream's


class NodeHeartbeat:
    """The latest heartbeat of one node, as received."""

    __slots__ = ("_report", "boot_id", "message", "node_id", "peer", "received_at", "received_wall", "seq")

    def __init__(self, node_id: str, message: pb.Heartbeat, peer: str, now: float, wall: float) -> None:
        self.node_id = node_id
        self.boot_id = message.boot_id
        self.seq = message.seq
        self.message = message
        self.peer = peer
        self.received_at = now  # time.monotonic()
        self.received_wall = wall  # time.time()
        self._report: HeartbeatReport | None = None

    def report(self) -> HeartbeatReport:
        if self._report is None:
            self._report = heartbeat_report_from_pb(self.message)
        return self._report

    def age(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.received_at

    @property
    def lease_ids(self) -> list[str]:
        return [r.lease_id for r in self.message.running]

    @property
    def agent_addr(self) -> str:
        return self.message.agent_addr

    def failed_gpus(self) -> list[int]:
        return [g.index for g in self.message.gpus if g.health == pb.GPU_HEALTH_FAILED]


class HeartbeatTable:
    """node_id -> NodeHeartbeat. Stale or duplicate heartbeats (same boot, seq not newer) are dropped."""

    RETIRED_BOOTS = 8

    def __init__(self) -> None:
        self._nodes: dict[str, NodeHeartbeat] = {}
        self._retired: dict[str, list[str]] = {}  # boots replaced by a newer one: their messages are stale

    def offer(self, node_id: str, message: pb.Heartbeat, peer: str = "") -> NodeHeartbeat | None:
        """Record ``message``; None when it is stale (then nothing changes): not newer than the
        latest of the same boot, or from a boot that a newer boot already replaced."""
        old = self._nodes.get(node_id)
        if old is not None:
            if old.boot_id == message.boot_id:
                if message.seq <= old.seq:
                    return None
            elif message.boot_id in self._retired.get(node_id, ()):
                return None
            else:
                retired = self._retired.setdefault(node_id, [])
                retired.append(old.boot_id)
                del retired[: -self.RETIRED_BOOTS]
        entry = NodeHeartbeat(node_id, message, peer, time.monotonic(), time.time())
        self._nodes[node_id] = entry
        return entry

    def get(self, node_id: str) -> NodeHeartbeat | None:
        return self._nodes.get(node_id)

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[NodeHeartbeat]:
        return iter(list(self._nodes.values()))

    def silent(self, older_than_s: float, now: float | None = None) -> list[str]:
        """Nodes whose last heartbeat is older than ``older_than_s`` (suspect/down checks)."""
        now = time.monotonic() if now is None else now
        return [n for n, e in self._nodes.items() if now - e.received_at > older_than_s]

    def forget(self, node_id: str) -> None:
        self._nodes.pop(node_id, None)
        self._retired.pop(node_id, None)
