"""`gpufleet bench takeover --json`: a frozen leader at cluster scale restarts nothing.

    run(blocks=94, nodes_per_block=32, jobs=300, gang_gpus=1024, freeze_s=30.0) -> dict

Runs a simulated fleet on its own embedded stack (``bench.fleet``): ``blocks x
nodes_per_block`` nodes of 8 GPUs, two real ``gpufleet control`` processes (c1 leads, c2 stands
by) and ``agent_procs`` agent processes (4 by default, each hosting every ``agent_procs``-th
node) with simulated ranks, each node streaming heartbeats to the leader over its own gRPC
connection as separate hosts would. The REST API runs in this process.

It submits a 1,024-GPU gang (``gang_gpus``) and ``jobs`` more (1 GPU, one node of 8, gangs
of 2 nodes), waits until all run, then freezes the leader's process tree (SIGSTOP) for
``freeze_s`` and kills it (SIGKILL). A few probe jobs are submitted during the freeze, so the
new leader has something to place. What it reports:

* ``takeover_s``: the freeze -> c2's lease (``leader.acquired_at``);
* ``takeover_to_first_placement_s``: c2's lease -> its first allocation (audit, its epoch);
* ``takeover_to_all_relinked_s`` (and the median): c2's lease -> every node's first
  acknowledged heartbeat from c2 (the agents report it);
* ``jobs_restarted``: jobs running before the freeze that are not running in the same
  attempt at the end; ``nodes_marked_down`` / ``nodes_marked_suspect``: nodes audited into
  those states after the freeze (both must stay 0);
* the mass-silence guard's audited changes, the gang's blocks, and the settings used.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.fleet import Fleet, check_gang, median, quantile, run_bench, spread, until

# what the report quotes from the settings the stack ran with
REPORTED_SETTINGS = (
    "heartbeat_interval_s",
    "agent_ack_timeout_s",
    "agent_connect_timeout_s",
    "leader_renew_s",
    "leader_ttl_s",
    "takeover_quiet_s",
    "suspect_after_s",
    "down_after_s",
    "health_mass_silence_fraction",
    "health_mass_silence_min_nodes",
    "unconfirmed_kill_s",
    "agent_poll_s",
)
PROBE_JOBS = 4  # submitted during the freeze: what the new leader places first


async def _bench(
    root: Path,
    log_dir: Path,
    *,
    blocks: int,
    nodes_per_block: int,
    jobs: int,
    gang_gpus: int,
    freeze_s: float,
    observe_s: float,
    settle_s: float,
    agent_procs: int,
    overrides: dict[str, Any],
    links: str = "own",
) -> dict[str, Any]:
    t_setup = time.monotonic()
    fleet = Fleet(root, log_dir)
    await fleet.start(
        blocks=blocks, nodes_per_block=nodes_per_block, agent_procs=agent_procs, group=spread,
        overrides=overrides, links=links, standby=True, max_queued=max(5000, 2 * jobs),
    )  # fmt: skip
    try:
        settings, pool, agents, nodes, total = fleet.settings, fleet.pool, fleet.agents, fleet.nodes, fleet.gpus
        c1, c2 = fleet.controls
        leader, submit = fleet.leader, fleet.submit
        gang_id, job_ids = await fleet.submit_workload(jobs, gang_gpus)
        await fleet.all_running(job_ids, settle_s)
        before = await fleet.attempts(job_ids)
        first = await leader()
        assert first is not None and first["holder"] == "c1", first
        setup_s = time.monotonic() - t_setup

        # ---------------------------------------------------------------- the freeze
        c1.signal(signal.SIGSTOP)
        frozen_at = time.time()
        t_frozen = time.monotonic()
        await asyncio.sleep(min(2.0, freeze_s / 4))
        probes = [await submit(f"probe-{i}", 1, 1) for i in range(PROBE_JOBS)]
        took: Any = None
        while time.monotonic() - t_frozen < freeze_s:
            if took is None:
                row = await leader()
                if row is not None and row["holder"] == "c2":
                    took = row
            await asyncio.sleep(0.2)
        c1.signal(signal.SIGKILL)
        killed_at = time.time()
        if took is None:
            took = await until(
                lambda: _holder_is(leader, "c2"), settings.leader_ttl_s * 3, "c2 takes over after the kill"
            )
        took_at = took["acquired_at"].timestamp()

        async def relinked() -> bool:
            return len(agents.linked_to(c2.addr, since=frozen_at)) == len(nodes)

        try:
            await until(relinked, max(observe_s, 30.0), "every node relinked to c2")
        except RuntimeError:
            pass  # reported below as nodes_not_relinked
        # look on for a while: any node the new leader judged silent would be suspect by now
        await asyncio.sleep(max(0.0, took_at + observe_s - time.time()))

        # ---------------------------------------------------------------- the figures
        at_c2 = agents.linked_to(c2.addr, since=frozen_at)
        relink = [t - took_at for t in at_c2.values()]
        after = {
            r["job_id"]: (r["state"], r["attempt"])
            for r in await pool.fetch("SELECT job_id, state, attempt FROM jobs WHERE job_id = ANY($1)", job_ids)
        }
        restarted = sorted(j for j, a in before.items() if after.get(j) != ("RUNNING", a))
        since = datetime.fromtimestamp(frozen_at).astimezone()

        down = await fleet.nodes_audited_into("down", since)
        suspect = await fleet.nodes_audited_into("suspect", since)
        first_alloc = await pool.fetchval(
            "SELECT min(at) FROM audit WHERE action = 'allocate' AND (detail->>'epoch')::bigint = $1", took["epoch"]
        )
        probe_states = {
            r["state"]: r["n"]
            for r in await pool.fetch("SELECT state, count(*) AS n FROM jobs WHERE job_id = ANY($1) GROUP BY 1", probes)
        }
        guard = [
            {
                "at_s": round(r["at"].timestamp() - frozen_at, 2),
                "reason": r["reason"],
                "detail": json.loads(r["detail"]),
            }
            for r in await pool.fetch(
                "SELECT at, reason, detail::text AS detail FROM audit WHERE action = 'health_guard' AND at >= $1"
                " ORDER BY id",
                since,
            )
        ]
        gang_blocks = None
        if gang_id is not None:
            gang_blocks = await pool.fetchval(
                "SELECT count(DISTINCT n.block_id) FROM leases l JOIN nodes n USING (node_id)"
                " WHERE l.job_id = $1 AND l.state = 'live'",
                gang_id,
            )
        node_states = {
            r["state"]: r["n"] for r in await pool.fetch("SELECT state, count(*) AS n FROM nodes GROUP BY 1")
        }
        return {
            "nodes": len(nodes),
            "blocks": blocks,
            "nodes_per_block": nodes_per_block,
            "gpus": total,
            "agent_processes": agent_procs,
            # own: one connection per node, as real agents; shared: one per agent process and address
            "agent_links": links,
            "running_jobs_before": len(before),
            "gang_gpus": gang_gpus if gang_id else 0,
            "gang_blocks_after": gang_blocks,
            "gang_restarted": bool(gang_id and gang_id in restarted),
            "freeze_s": freeze_s,
            "killed_after_s": round(killed_at - frozen_at, 2),
            "takeover_s": round(took_at - frozen_at, 2),
            "takeover_epoch": took["epoch"],
            "takeover_to_first_placement_s": (
                round(first_alloc.timestamp() - took_at, 2) if first_alloc is not None else None
            ),
            "probe_jobs": len(probes),
            "probe_job_states": probe_states,
            "takeover_to_all_relinked_s": round(max(relink), 2) if len(at_c2) == len(nodes) else None,
            "takeover_to_relinked_median_s": median(relink),
            "takeover_to_relinked_p90_s": quantile(relink, 0.9),
            "nodes_relinked": len(at_c2),
            "nodes_not_relinked": len(nodes) - len(at_c2),
            "jobs_restarted": len(restarted),
            "jobs_restarted_sample": restarted[:10],
            "nodes_marked_down": len(down),
            "nodes_marked_suspect": len(suspect),
            "node_states_after": node_states,
            "health_guard_changes": guard,
            "observed_after_takeover_s": observe_s,
            "setup_s": round(setup_s, 1),
            "settings": {k: getattr(settings, k, None) for k in REPORTED_SETTINGS},
            "stack": "embedded Postgres + Temporal dev server, two control processes (c1 frozen then killed,"
            f" c2 takes over), {agent_procs} agent processes hosting the nodes with simulated ranks, API in-process",
            "measured": "takeover_s from SIGSTOP to c2's lease; relinks from c2's lease to each node's first"
            " acknowledged heartbeat from c2; restarts and down/suspect marks since the freeze",
        }
    finally:
        await fleet.stop()


async def _holder_is(leader: Any, holder: str) -> Any:
    row = await leader()
    return row if row is not None and row["holder"] == holder else None


def run(
    blocks: int = 94,
    nodes_per_block: int = 32,
    jobs: int = 300,
    gang_gpus: int = 1024,
    freeze_s: float = 30.0,
    observe_s: float = 60.0,
    settle_s: float = 600.0,
    agent_procs: int = 4,
    overrides: dict[str, Any] | None = None,
    keep: bool = False,
    shared_connections: bool = False,
) -> dict[str, Any]:
    """Run the benchmark once on a fresh stack (see the module docstring); ``overrides`` are
    settings (tests scale the timings down); ``keep`` keeps the logs and state dir."""
    check_gang(gang_gpus, blocks, nodes_per_block)
    return run_bench(
        "gpufleet-bench-takeover-", keep,
        lambda root, log_dir: _bench(
            root, log_dir, blocks=blocks, nodes_per_block=nodes_per_block, jobs=jobs, gang_gpus=gang_gpus,
            freeze_s=freeze_s, observe_s=observe_s, settle_s=settle_s,
            agent_procs=max(1, min(agent_procs, blocks * nodes_per_block)), overrides=dict(overrides or {}),
            links="shared" if shared_connections else "own",
        ),
    )  # fmt: skip
