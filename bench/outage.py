"""`gpufleet bench outage --json`: Postgres or Temporal goes away under a loaded cluster at
scale; no running job restarts, no node is judged, and work submitted around it runs.

    run(service="postgres", down_s=30.0, hard=True, blocks=94, nodes_per_block=32, jobs=300,
        gang_gpus=1024, burst=50) -> dict

Runs a simulated fleet on its own embedded stack (``bench.fleet``): ``blocks x nodes_per_block``
nodes of 8 GPUs, two real ``gpufleet control`` processes (c1 leads, c2 stands by) and
``agent_procs`` agent processes, each hosting every ``agent_procs``-th node, with simulated
ranks. It submits a ``gang_gpus`` gang and ``jobs`` more, waits until all run, then stops
``service`` for ``down_s`` (``hard``: SIGKILL for Temporal, ``pg_ctl -m immediate`` for
Postgres, as a crash; else a clean stop) and starts it again on the same data. ``burst`` jobs
of 1 GPU are submitted meanwhile: during the outage when the API can take them (Temporal
down: admission is Postgres only), else once Postgres is back (each retried until accepted,
as a client would on the 503). The control processes keep running throughout.

With Postgres gone no one can renew the leader lease: c1 loses it after ``leader_ttl_s``,
and when Postgres is back c1 or c2 takes it, waits ``takeover_quiet_s`` before judging
silence, and the agents relink to it. With Temporal gone leadership and health go on; the
placements' signals wait and are re-sent. What it reports:

* ``outage_s`` (stopped -> started again), the leader epochs seen since the stop (holder,
  when taken, relative to the stop) and ``back_to_leader_s`` (started again -> a leader
  holds a valid lease; 0 when one held it throughout) and, when the leader changed,
  ``relinked``: started again -> each node's first heartbeat acknowledged by the newest
  leader (median, max) and the nodes it never acknowledged;
* ``jobs_restarted`` (jobs running before that are not running in the same attempt at the
  end), ``leases_ended`` (live leases before that are not live at the end), nodes audited
  ``suspect`` or ``down`` since the stop: each must be 0;
* ``back_to_burst_running_s``: started again -> each burst job's ``started_at`` (first,
  median, max), and ``burst_not_running``;
* ``most_gpus_with_two_live_leases``, sampled whenever Postgres answers (must be 0);
* ``observed_after_back_s``: how long it looked on after the service was back: ``observe_s``
  (60 s) at least, and ``takeover_quiet_s + suspect_after_s`` + 10 s past the newest leader's
  takeover, so a node the new leader could not hear would be suspect by then.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.fleet import Fleet, TwoLeaseWatch, check_gang, median, quantile, run_bench, spread, until

SERVICES = ("postgres", "temporal")
# what the report quotes from the settings the stack ran with
REPORTED_SETTINGS = (
    "heartbeat_interval_s",
    "leader_renew_s",
    "leader_ttl_s",
    "takeover_quiet_s",
    "suspect_after_s",
    "down_after_s",
    "allocation_resignal_s",
    "workflow_reconcile_s",
    "unconfirmed_kill_s",
)
QUIET_ERRORS = (OSError, TimeoutError, ConnectionError)


async def _or_none(coro: Any) -> Any:
    """The query's answer, or None while Postgres does not answer."""
    import asyncpg

    try:
        return await asyncio.wait_for(coro, 5.0)
    except (*QUIET_ERRORS, asyncpg.PostgresError, asyncpg.InterfaceError):
        return None


async def _bench(
    root: Path,
    log_dir: Path,
    *,
    service: str,
    down_s: float,
    hard: bool,
    blocks: int,
    nodes_per_block: int,
    jobs: int,
    gang_gpus: int,
    burst: int,
    agent_procs: int,
    observe_s: float,
    settle_s: float,
    overrides: dict[str, Any],
    links: str,
) -> dict[str, Any]:
    t_setup = time.monotonic()
    fleet = Fleet(root, log_dir)
    await fleet.start(
        blocks=blocks, nodes_per_block=nodes_per_block, agent_procs=agent_procs, group=spread,
        overrides=overrides, links=links, standby=True, max_queued=max(5000, 2 * (jobs + burst)),
    )  # fmt: skip
    try:
        pool, settings = fleet.pool, fleet.settings
        gang_id, job_ids = await fleet.submit_workload(jobs, gang_gpus)
        await fleet.all_running(job_ids, settle_s)
        before = await fleet.attempts(job_ids)
        live_before = {r["lease_id"] for r in await pool.fetch("SELECT lease_id FROM leases WHERE state = 'live'")}
        took = await fleet.past_takeover_quiet()
        setup_s = time.monotonic() - t_setup

        epochs: dict[int, dict[str, Any]] = {}
        doubles = TwoLeaseWatch(pool)

        async def sample() -> None:
            row = await _or_none(fleet.leader())
            if row is not None:
                epochs.setdefault(row["epoch"], {"holder": row["holder"], "acquired_at": row["acquired_at"]})
            await _or_none(doubles.sample())

        async def watch() -> None:
            while True:
                await sample()
                await asyncio.sleep(0.5)

        async def submit(i: int) -> str:
            """Submit burst job ``i`` as a client would: retried with the same key while the API
            answers 503 (or 5xx, 429) or cannot be reached, for at most ``settle_s``."""
            import httpx

            key = f"burst-{i}-{down_at}"
            give_up = time.monotonic() + settle_s
            while True:
                try:
                    return await fleet.submit(f"burst-{i}", 1, 1, key=key)
                except (RuntimeError, httpx.TransportError) as e:
                    retry = isinstance(e, httpx.TransportError) or any(
                        f"HTTP {c}" in str(e) for c in ("429", "500", "502", "503", "504")
                    )
                    if not retry or time.monotonic() > give_up:
                        raise
                    await asyncio.sleep(1.0)

        # ---------------------------------------------------------------- the outage
        watcher = asyncio.create_task(watch())
        down_at = time.time()
        await fleet.service_down(service, hard=hard)
        submitting = None
        if service == "temporal":  # admission is Postgres only: the burst goes in now
            submitting = asyncio.gather(*(submit(i) for i in range(burst)))
        await asyncio.sleep(max(0.0, down_at + down_s - time.time()))
        await fleet.service_up(service)
        back_at = time.time()
        if submitting is None:
            submitting = asyncio.gather(*(submit(i) for i in range(burst)))
        burst_ids = list(await submitting)

        async def burst_running() -> bool:
            n = await _or_none(
                pool.fetchval("SELECT count(*) FROM jobs WHERE state = 'RUNNING' AND job_id = ANY($1)", burst_ids)
            )
            return n == len(burst_ids)

        try:
            await until(burst_running, settle_s, "every burst job running", interval=0.5)
        except RuntimeError:
            pass  # reported below
        newest = await until(lambda: _or_none(fleet.leader()), settle_s, "a leader")
        look_until = max(
            newest["acquired_at"].timestamp() + settings.takeover_quiet_s + settings.suspect_after_s + 10.0,
            back_at + observe_s,
        )
        await asyncio.sleep(max(0.0, look_until - time.time()))
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        await sample()

        # ---------------------------------------------------------------- the figures
        since = datetime.fromtimestamp(down_at).astimezone()
        after = {
            r["job_id"]: (r["state"], r["attempt"])
            for r in await pool.fetch("SELECT job_id, state, attempt FROM jobs WHERE job_id = ANY($1)", job_ids)
        }
        restarted = sorted(j for j, a in before.items() if after.get(j) != ("RUNNING", a))
        live_after = {r["lease_id"] for r in await pool.fetch("SELECT lease_id FROM leases WHERE state = 'live'")}

        started = {
            r["job_id"]: r["started_at"]
            for r in await pool.fetch(
                "SELECT job_id, started_at FROM jobs WHERE job_id = ANY($1) AND state = 'RUNNING'", burst_ids
            )
        }
        to_running = [t.timestamp() - back_at for t in started.values() if t is not None]
        valid_at = min(
            (
                max(e["acquired_at"].timestamp(), back_at)
                for e in epochs.values()
                if e["acquired_at"].timestamp() >= down_at
            ),
            default=None,
        )
        new_epochs = [
            {"epoch": k, "holder": e["holder"], "acquired_s": round(e["acquired_at"].timestamp() - down_at, 2)}
            for k, e in sorted(epochs.items())
            if e["acquired_at"].timestamp() >= down_at
        ]
        # after a change of leader: when each node's stream was first acknowledged by the newest one
        relinked: dict[str, Any] | None = None
        if new_epochs:
            addr = next(c.addr for c in fleet.controls if c.holder == newest["holder"])
            at = fleet.agents.linked_to(addr, since=down_at)
            waits = [t - back_at for t in at.values()]
            relinked = {
                "leader": newest["holder"],
                "back_to_relinked_s": {"median": median(waits), "max": quantile(waits, 1.0)},
                "nodes_not_relinked": sorted(set(fleet.nodes) - set(at)),
            }
        return {
            "service": service,
            "hard": hard,
            "nodes": len(fleet.nodes),
            "gpus": fleet.gpus,
            "agent_processes": len(fleet.groups),
            "agent_links": links,
            "running_jobs_before": len(before),
            "gang_gpus": gang_gpus if gang_id else 0,
            "outage_s": round(back_at - down_at, 2),
            "leader_before": {"holder": took["holder"], "epoch": took["epoch"]},
            "leader_epochs_since": new_epochs,
            "back_to_leader_s": round(valid_at - back_at, 2) if valid_at is not None else 0.0,
            "relinked": relinked,
            "jobs_restarted": restarted,
            "leases_ended": len(live_before - live_after),
            "nodes_marked_suspect": await fleet.nodes_audited_into("suspect", since),
            "nodes_marked_down": await fleet.nodes_audited_into("down", since),
            "burst_jobs": len(burst_ids),
            "burst_submitted": "during the outage" if service == "temporal" else "once Postgres was back",
            "back_to_burst_running_s": {
                "first": quantile(to_running, 0.0),
                "median": median(to_running),
                "max": quantile(to_running, 1.0),
            },
            "burst_not_running": len(burst_ids) - len(to_running),
            "most_gpus_with_two_live_leases": doubles.most,
            "observed_after_back_s": round(time.time() - back_at, 1),
            "setup_s": round(setup_s, 1),
            "settings": {k: getattr(settings, k, None) for k in REPORTED_SETTINGS},
            "stack": "embedded Postgres + Temporal dev server, two control processes (c1 leads, c2 stands by), "
            f"{len(fleet.groups)} agent processes hosting the nodes with simulated ranks, API in-process",
            "measured": "from the service's stop and its start again: leader epochs and GPUs under two live"
            " leases sampled every 0.5 s while Postgres answers; restarts, leases and node marks at the end",
        }
    finally:
        await fleet.stop()


def ok(result: dict[str, Any]) -> bool:
    """Nothing restarted, no lease ended, no node judged, every burst job running, no GPU twice."""
    return (
        not result["jobs_restarted"]
        and result["leases_ended"] == 0
        and not result["nodes_marked_suspect"]
        and not result["nodes_marked_down"]
        and result["burst_not_running"] == 0
        and result["most_gpus_with_two_live_leases"] == 0
    )


def run(
    service: str = "postgres",
    down_s: float = 30.0,
    hard: bool = True,
    blocks: int = 94,
    nodes_per_block: int = 32,
    jobs: int = 300,
    gang_gpus: int = 1024,
    burst: int = 50,
    agent_procs: int = 4,
    observe_s: float = 60.0,
    settle_s: float = 600.0,
    overrides: dict[str, Any] | None = None,
    keep: bool = False,
    shared_connections: bool = False,
) -> dict[str, Any]:
    """Run the benchmark once on a fresh stack (see the module docstring); ``overrides`` are
    settings (tests scale the timings down); ``keep`` keeps the logs and state dir."""
    if service not in SERVICES:
        raise ValueError(f"service={service!r}: one of {', '.join(SERVICES)}")
    check_gang(gang_gpus, blocks, nodes_per_block)
    result = run_bench(
        "gpufleet-bench-outage-", keep,
        lambda root, log_dir: _bench(
            root, log_dir, service=service, down_s=down_s, hard=hard, blocks=blocks,
            nodes_per_block=nodes_per_block, jobs=jobs, gang_gpus=gang_gpus, burst=burst,
            agent_procs=max(1, min(agent_procs, blocks * nodes_per_block)), observe_s=observe_s, settle_s=settle_s,
            overrides=dict(overrides or {}), links="shared" if shared_connections else "own",
        ),
    )  # fmt: skip
    result["ok"] = ok(result)
    return result
