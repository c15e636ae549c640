"""`gpufleet bench node-loss --json`: whole blocks of nodes die at cluster scale; their jobs,
and only theirs, restart elsewhere.

    run(blocks=94, nodes_per_block=32, jobs=300, gang_gpus=1024, agent_procs=8, fail_procs=1,
        fault="kill", back="never") -> dict

Runs a simulated fleet on its own embedded stack (``bench.fleet``): ``blocks x nodes_per_block``
nodes of 8 GPUs, one real ``gpufleet control`` process, and ``agent_procs`` agent processes each
hosting a run of consecutive nodes, block after block (``bench.fleet.by_blocks``; whole blocks
when the processes divide the blocks). It submits a ``gang_gpus`` gang and ``jobs`` more (1 GPU,
one node of 8, gangs of 2 nodes), waits until all run, then SIGKILLs ``fail_procs`` agent
processes (those hosting part of the gang first, then those with the most running GPUs): their
nodes fall silent at once, as when a row loses power. ``fault="freeze"`` SIGSTOPs them instead,
as when a row loses its switches: their ranks live on in memory. With the defaults one
process of 8 holds 376 nodes (11.75 blocks, 12.5% of the fleet): below the mass-silence guard's
share (``health_mass_silence_fraction``, 0.2), so the leader must mark them down and restart
their jobs. What it reports:

* ``nodes_failed`` / ``gpus_failed``, ``jobs_hit`` (jobs with a live lease on a failed node at the
  kill) and whether the gang was one;
* ``kill_to_down_s``: per failed node, the kill -> its audited ``down`` (median, p90, max;
  bounded below by ``down_after_s``); ``nodes_marked_down`` and ``other_nodes_marked_down``
  (nodes that did not fail, must be 0);
* ``kill_to_restart_s``: per hit job, the kill -> its next attempt running (median, p95,
  max); ``jobs_not_restarted`` (hit jobs not running again within ``settle_s``);
* ``jobs_restarted_not_hit``: jobs that were not on a failed node and are not running in the
  same attempt at the end (must be 0); ``jobs_restarted_more_than_once`` (hit jobs past their
  next attempt, must be 0); ``live_leases_on_failed_nodes`` after (must be 0);
  ``gpus_with_two_live_leases`` at the end and ``most_gpus_with_two_live_leases`` sampled
  through the restarts and the return (read from the leases, not from the allocations' key:
  must be 0);
* ``returned`` (with ``back="down"``: the processes come back once every failed node is down,
  while the jobs restart; ``"restarted"``: once every hit job runs again): thawed, or started
  again empty. ``back_to_clear_s`` per node (its audited ``down -> burn_in``: no live lease, no
  rank left; median, p90, max), ``nodes_not_cleared`` (must be none), ``late_reports`` (the
  returned nodes' reports by state, e.g. the replaced attempts' ranks STOPPED), how many are
  undelivered (must be 0) and ``jobs_changed`` (jobs not as the restarts leave them: a hit
  job running in its next attempt, any other in the same; must be none). Burn-in itself never
  passes on a simulated node (``_returned``);
* the mass-silence guard's audited changes, and the settings used.
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.fleet import Fleet, TwoLeaseWatch, by_blocks, check_gang, median, quantile, run_bench, until

# kill: SIGKILL (the nodes lose power); freeze: SIGSTOP (cut off: the ranks stay in the agent's memory)
FAULTS = ("kill", "freeze")
# when the failed processes come back: never; once every failed node is down (while their jobs
# restart); once every hit job runs again
BACK = ("never", "down", "restarted")

# what the report quotes from the settings the stack ran with
REPORTED_SETTINGS = (
    "heartbeat_interval_s",
    "takeover_quiet_s",
    "start_task_timeout_s",
    "suspect_after_s",
    "down_after_s",
    "health_sweep_s",
    "health_mass_silence_fraction",
    "health_mass_silence_min_nodes",
    "recovery_resignal_s",
    "agent_poll_s",
)


async def _bench(
    root: Path,
    log_dir: Path,
    *,
    blocks: int,
    nodes_per_block: int,
    jobs: int,
    gang_gpus: int,
    agent_procs: int,
    fail_procs: int,
    settle_s: float,
    overrides: dict[str, Any],
    links: str,
    fault: str,
    back: str,
) -> dict[str, Any]:
    t_setup = time.monotonic()
    fleet = Fleet(root, log_dir)
    await fleet.start(
        blocks=blocks, nodes_per_block=nodes_per_block, agent_procs=agent_procs, group=by_blocks,
        overrides=overrides, links=links, standby=False, max_queued=max(5000, 2 * jobs),
    )  # fmt: skip
    try:
        pool, settings = fleet.pool, fleet.settings
        gang_id, job_ids = await fleet.submit_workload(jobs, gang_gpus)
        await fleet.all_running(job_ids, settle_s)
        setup_s = time.monotonic() - t_setup

        # the processes to kill: those hosting part of the gang first, then the most live GPUs
        # (ties: the lower index)
        live = await pool.fetch(
            "SELECT job_id, attempt, node_id, cardinality(gpu_indices) AS n FROM leases WHERE state = 'live'"
        )
        proc_of = {node: k for k, nodes in enumerate(fleet.groups) for node in nodes}
        gpus_by_proc = [0] * len(fleet.groups)
        gang_procs = set()
        for r in live:
            gpus_by_proc[proc_of[r["node_id"]]] += r["n"]
            if r["job_id"] == gang_id:
                gang_procs.add(proc_of[r["node_id"]])
        order = sorted(range(len(fleet.groups)), key=lambda k: (k not in gang_procs, -gpus_by_proc[k], k))
        doomed = sorted(order[:fail_procs])
        failed = {node for k in doomed for node in fleet.groups[k]}
        before = await fleet.attempts(job_ids)
        hit = sorted({r["job_id"] for r in live if r["node_id"] in failed})

        # a leader judges no silence within takeover_quiet_s of taking over (docs/design.md,
        # Leadership): a small fleet is up sooner than that, and would measure the window
        await fleet.past_takeover_quiet()

        # ---------------------------------------------------------------- the failure
        killed_at = time.time()
        for k in doomed:
            if fault == "freeze":
                fleet.agents.freeze(k)
            else:
                await fleet.agents.kill(k)
        since = datetime.fromtimestamp(killed_at).astimezone()

        async def restarted() -> bool:
            rows = await pool.fetch(
                "SELECT job_id, state, attempt FROM jobs WHERE job_id = ANY($1)", hit
            )  # a hit job runs again in a later attempt
            return all(r["state"] == "RUNNING" and r["attempt"] > before[r["job_id"]] for r in rows)

        async def all_down() -> bool:
            n = await pool.fetchval("SELECT count(*) FROM nodes WHERE state = 'down' AND node_id = ANY($1)", failed)
            return n == len(failed)

        doubles = TwoLeaseWatch(pool)  # sampled all through the restarts and the return

        async def running_again() -> bool:
            await doubles.sample()
            return await restarted()

        back_at: float | None = None
        deadline = time.monotonic() + settings.down_after_s + settle_s
        for probe, what, then in (
            (all_down, "every failed node down", "down"),
            (running_again, "every hit job running again", "restarted"),
        ):
            try:
                await until(probe, max(1.0, deadline - time.monotonic()), what, interval=0.5)
            except RuntimeError:
                pass  # reported below
            if back == then:
                back_at = await _bring_back(fleet, doomed, fault)
        done_at = time.time()
        # at the end: each hit job running in its next attempt, every other in the same one
        expected = {j: ("RUNNING", before[j] + (j in hit)) for j in job_ids}
        returned = None
        if back_at is not None:
            returned = await _returned(fleet, sorted(failed), expected, back_at, fault, settle_s, doubles)

        # ---------------------------------------------------------------- the figures
        downs = await pool.fetch(
            "SELECT subject, min(at) AS at FROM audit WHERE action = 'node_state' AND detail->>'to' = 'down'"
            " AND at >= $1 GROUP BY subject",
            since,
        )
        to_down = [r["at"].timestamp() - killed_at for r in downs if r["subject"] in failed]
        after = {
            r["job_id"]: (r["state"], r["attempt"], r["started_at"])
            for r in await pool.fetch(
                "SELECT job_id, state, attempt, started_at FROM jobs WHERE job_id = ANY($1)", job_ids
            )
        }
        back = {
            j: after[j][2].timestamp() - killed_at
            for j in hit
            if after[j][0] == "RUNNING" and after[j][1] > before[j] and after[j][2] is not None
        }
        not_hit_moved = sorted(j for j in job_ids if j not in hit and after[j][:2] != ("RUNNING", before[j]))
        live_on_failed = await pool.fetchval(
            "SELECT count(*) FROM leases WHERE state = 'live' AND node_id = ANY($1)", sorted(failed)
        )
        doubled = await doubles.sample()
        guard = [
            {
                "at_s": round(r["at"].timestamp() - killed_at, 2),
                "reason": r["reason"],
                "detail": json.loads(r["detail"]),
            }
            for r in await pool.fetch(
                "SELECT at, reason, detail::text AS detail FROM audit WHERE action = 'health_guard' AND at >= $1"
                " ORDER BY id",
                since,
            )
        ]
        return {
            "nodes": len(fleet.nodes),
            "blocks": blocks,
            "nodes_per_block": nodes_per_block,
            "gpus": fleet.gpus,
            "agent_processes": len(fleet.groups),
            "agent_links": links,
            "running_jobs_before": len(before),
            "gang_gpus": gang_gpus if gang_id else 0,
            "gang_hit": bool(gang_id and gang_id in hit),
            "processes_killed": doomed,
            "nodes_failed": len(failed),
            "failed_share": round(len(failed) / len(fleet.nodes), 4),
            "gpus_failed": 8 * len(failed),
            "gpus_in_use_on_failed_nodes": sum(gpus_by_proc[k] for k in doomed),
            "jobs_hit": len(hit),
            "nodes_marked_down": len(to_down),
            "other_nodes_marked_down": sorted(r["subject"] for r in downs if r["subject"] not in failed),
            "kill_to_down_s": {"median": median(to_down), "p90": quantile(to_down, 0.9), "max": quantile(to_down, 1.0)},
            "jobs_restarted": len(back),
            "jobs_not_restarted": sorted(set(hit) - set(back)),
            "kill_to_restart_s": {
                "median": median(list(back.values())),
                "p95": quantile(list(back.values()), 0.95),
                "max": quantile(list(back.values()), 1.0),
            },
            "gang_kill_to_restart_s": round(back[gang_id], 2) if gang_id in back else None,
            "jobs_restarted_not_hit": not_hit_moved,
            "live_leases_on_failed_nodes": live_on_failed,
            "jobs_restarted_more_than_once": sorted(j for j in hit if after[j][1] > before[j] + 1),
            "gpus_with_two_live_leases": doubled,
            "most_gpus_with_two_live_leases": doubles.most,
            "health_guard_changes": guard,
            "fault": fault,
            "returned": returned,
            "observed_s": round(done_at - killed_at, 1),
            "setup_s": round(setup_s, 1),
            "settings": {k: getattr(settings, k, None) for k in REPORTED_SETTINGS},
            "stack": "embedded Postgres + Temporal dev server, one control process, "
            f"{len(fleet.groups)} agent processes hosting runs of consecutive nodes with simulated ranks, API in-process",
            "measured": f"from the {'SIGSTOP' if fault == 'freeze' else 'SIGKILL'} of the agent processes:"
            " each failed node's audited down, each hit"
            " job's next attempt's started_at; restarts of other jobs, leases and GPUs at the end",
        }
    finally:
        await fleet.stop()


async def _bring_back(fleet: Fleet, doomed: list[int], fault: str) -> float:
    """The failed processes come back: thawed (``freeze``: they resume with the ranks they held,
    as a row cut off by its switches comes back) or started again (``kill``: empty, as after a
    reboot). Returns when (wall time)."""
    back_at = time.time()
    for k in doomed:
        if fault == "freeze":
            fleet.agents.thaw(k)
        else:
            await fleet.agents.restart(k)
    return back_at


async def _returned(
    fleet: Fleet,
    failed: list[str],
    expected: dict[str, tuple[str, int]],
    back_at: float,
    fault: str,
    settle_s: float,
    doubles: TwoLeaseWatch,
) -> dict[str, Any]:
    """After ``_bring_back``: each returned node must have the ranks of replaced attempts stopped
    and be cleared for burn-in (``down -> burn_in``: no live lease, its agent reports no rank
    left); their late reports must be delivered and leave every job as ``expected`` (state,
    attempt).

    A simulated rank reads idle and runs until stopped, so a simulated node's burn-in never
    passes: the return is measured to the burn-in's start, not to ``ready``."""
    pool = fleet.pool
    since = datetime.fromtimestamp(back_at).astimezone()
    job_ids = sorted(expected)

    async def cleared() -> dict[str, float]:
        rows = await pool.fetch(
            "SELECT subject, min(at) AS at FROM audit WHERE action = 'node_state' AND detail->>'to' = 'burn_in'"
            " AND at >= $1 AND subject = ANY($2) GROUP BY subject",
            since,
            failed,
        )
        return {r["subject"]: r["at"].timestamp() - back_at for r in rows}

    async def all_cleared() -> bool:
        await doubles.sample()
        return len(await cleared()) == len(failed)

    async def reports_delivered() -> bool:
        return not await pool.fetchval(
            "SELECT count(*) FROM task_reports WHERE node_id = ANY($1) AND received_at >= $2 AND delivered_at IS NULL",
            failed,
            since,
        )

    deadline = time.monotonic() + settle_s
    for probe, what in ((all_cleared, "every returned node cleared"), (reports_delivered, "their reports delivered")):
        try:
            await until(probe, max(1.0, deadline - time.monotonic()), what, interval=0.5)
        except RuntimeError:
            pass  # reported below
    after = {
        r["job_id"]: (r["state"], r["attempt"])
        for r in await pool.fetch("SELECT job_id, state, attempt FROM jobs WHERE job_id = ANY($1)", job_ids)
    }
    to_clear = await cleared()
    reports = await pool.fetch(
        "SELECT state, count(*) AS n, count(*) FILTER (WHERE delivered_at IS NULL) AS pending FROM task_reports"
        " WHERE node_id = ANY($1) AND received_at >= $2 GROUP BY state ORDER BY state",
        failed,
        since,
    )
    return {
        "how": "thawed (SIGCONT)" if fault == "freeze" else "started again",
        "back_to_clear_s": {
            "median": median(list(to_clear.values())),
            "p90": quantile(list(to_clear.values()), 0.9),
            "max": quantile(list(to_clear.values()), 1.0),
        },
        "nodes_not_cleared": sorted(set(failed) - set(to_clear)),
        "late_reports": {r["state"]: r["n"] for r in reports},
        "late_reports_undelivered": sum(r["pending"] for r in reports),
        "jobs_changed": sorted(j for j in job_ids if after.get(j) != expected[j]),
        "observed_s": round(time.time() - back_at, 1),
    }


def ok(result: dict[str, Any]) -> bool:
    """Every failed node down, every hit job running again, nothing else touched, no GPU twice."""
    return (
        result["nodes_marked_down"] == result["nodes_failed"]
        and not result["other_nodes_marked_down"]
        and not result["jobs_not_restarted"]
        and not result["jobs_restarted_not_hit"]
        and result["live_leases_on_failed_nodes"] == 0
        and not result["jobs_restarted_more_than_once"]
        and result["most_gpus_with_two_live_leases"] == 0
        and (result["returned"] is None or returned_ok(result["returned"]))
    )


def returned_ok(returned: dict[str, Any]) -> bool:
    """Every returned node cleared, every late report delivered, no job changed by them."""
    return (
        not returned["nodes_not_cleared"] and returned["late_reports_undelivered"] == 0 and not returned["jobs_changed"]
    )


def run(
    blocks: int = 94,
    nodes_per_block: int = 32,
    jobs: int = 300,
    gang_gpus: int = 1024,
    agent_procs: int = 8,
    fail_procs: int = 1,
    settle_s: float = 600.0,
    overrides: dict[str, Any] | None = None,
    keep: bool = False,
    shared_connections: bool = False,
    fault: str = "kill",
    back: str = "never",
) -> dict[str, Any]:
    """Run the benchmark once on a fresh stack (see the module docstring); ``overrides`` are
    settings (tests scale the timings down); ``keep`` keeps the logs and state dir."""
    check_gang(gang_gpus, blocks, nodes_per_block)
    if fault not in FAULTS:
        raise ValueError(f"fault={fault!r}: one of {', '.join(FAULTS)}")
    if back not in BACK:
        raise ValueError(f"back={back!r}: one of {', '.join(BACK)}")
    procs = max(1, min(agent_procs, blocks * nodes_per_block))
    if not 1 <= fail_procs < procs:
        raise ValueError(f"fail_procs={fail_procs}: at least one agent process, and fewer than all {procs}")
    result = run_bench(
        "gpufleet-bench-node-loss-", keep,
        lambda root, log_dir: _bench(
            root, log_dir, blocks=blocks, nodes_per_block=nodes_per_block, jobs=jobs, gang_gpus=gang_gpus,
            agent_procs=procs, fail_procs=fail_procs, settle_s=settle_s, overrides=dict(overrides or {}),
            links="shared" if shared_connections else "own", fault=fault, back=back,
        ),
    )  # fmt: skip
    result["ok"] = ok(result)
    return result
