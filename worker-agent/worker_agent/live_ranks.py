"""What still runs under a state dir's agents, read from the dir alone (no agent need run):
the ranks whose supervisor or rank process is alive, and the nodes an agent serves now (it
holds the node's lock, worker_agent.node_lock). Whoever lets go of what ranks need once
they are gone (their jobs' spaces, the ranks' firewall) asks here first: `gpufleet up` and
`gpufleet stop-ranks` after the agents have stopped, and a stopping agent itself."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from worker_agent import statefiles as sf
from worker_agent.node_lock import NodeLock, NodeLockHeld


@dataclass(frozen=True)
class LiveRank:
    """A rank (or its supervisor) still alive, as the agent's state dir records it."""

    node_id: str
    lease_id: str
    job_id: str
    supervisor_pid: int | None
    pgid: int | None


def live_ranks(state_dir: Path) -> list[LiveRank]:
    """The ranks whose supervisor or rank process still runs, from
    ``<state_dir>/agent/<node>/leases/<lease>/supervisor.json`` (pids checked by start time)."""
    out: list[LiveRank] = []
    for sup_file in sorted(Path(state_dir).glob(f"agent/*/leases/*/{sf.SUPERVISOR}")):
        lease_dir = sup_file.parent
        sup = sf.read_json(sup_file) or {}
        spid = sup.get("supervisor_pid")
        sup_alive = sf.process_alive(spid, sup.get("supervisor_start"))
        pgid = sup.get("pgid")
        # by pid and start time: a pid (or group id) reused since is never signalled
        rank_alive = sf.process_alive(sup.get("rank_pid"), sup.get("rank_start"))
        if not (sup_alive or rank_alive):
            continue
        task = sf.read_json(lease_dir / sf.TASK) or {}
        job_id = str(task.get("job_id") or lease_dir.name.split(".")[0])
        out.append(
            LiveRank(lease_dir.parents[1].name, lease_dir.name, job_id, spid if sup_alive else None,
                     pgid if rank_alive else None)
        )  # fmt: skip
    return out


def nodes_served(state_dir: Path) -> list[str]:
    """The nodes of the state dir an agent serves now: another process (or another open of
    the lock file in this one) holds the node's lock."""
    served = []
    for node_dir in sorted(Path(state_dir).glob("agent/*/")):
        lock = NodeLock(node_dir)
        try:
            lock.acquire(node_dir.name)
        except NodeLockHeld:
            served.append(node_dir.name)
        else:
            lock.release()
    return served
