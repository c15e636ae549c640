"""One chaos run: its own stack up, the workload and the seeded faults for ``minutes``, a
bounded settle, the independent checker, the teardown (nothing left behind), the report.

    report = await run_chaos(ChaosOptions(minutes=3, seed=7))
    report["invariants"]        # name -> bool; report["counterexamples"] for the false ones

The report (JSON): ``faults`` (count by kind), ``jobs`` (count by final state),
``invariants`` and ``counterexamples`` (``chaos.checker``), ``measurements`` (takeover
times, failure-to-restart times, the largest attempt overlap, kills no fault explains),
``submissions``, ``fault_timeline``, ``crashes`` (children that exited by themselves and
were started again), ``leftover_processes`` (what the teardown still found),
``unfinished_at_end`` (each job not finished when the settle ended, with the reason
placement last gave for its wait), ``durations_s``,
``settings`` (the scaled durations) and ``notes``.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos import schedule
from chaos.checker import CheckParams, Verdict, check
from chaos.faults import FaultInjector
from chaos.history import TERMINAL_STATES, load
from chaos.stack import SCALED, ChaosStack, Layout
from chaos.timeline import ALL_FAULT_KINDS, FAULT_KINDS, HA_FAULT_KINDS, LeaderSample, RunRecord
from chaos.workload import Workload
from common.embedded import PlatformError
from common.settings import Settings


@dataclass(frozen=True)
class ChaosOptions:
    minutes: float = 3.0
    seed: int = 1
    settle_s: float = 90.0
    layout: Layout = field(default_factory=Layout)
    kinds: tuple[str, ...] | None = None  # None: every kind the stack supports (the HA kinds with layout.ha)
    keep: bool = False  # keep the state dir and logs (its path is in the report)
    mean_interval_s: float = 2.0
    max_active: int = 10
    min_gap_s: float = 20.0  # between planned faults (schedule.plan); smaller packs more into a short run
    workdir: Path | None = None  # where the run's temporary dir goes (default: the system's)


# a Temporal dev server stopped and started again takes this long (at most, on a busy 2-core
# box) to answer again; a workflow cannot be started meanwhile
TEMPORAL_RESTART_S = 30.0


def check_params(s: Settings) -> CheckParams:
    """The checker's bounds for a stack with these settings, each derived from the design:

    * a lease without a running workflow: the job is checked once unchanged for
      ``workflow_reconcile_s`` and the check runs every ``workflow_reconcile_s`` (2x); a
      leader change restarts that clock after the lease runs out and the new leader's
      quiet period (``leader_ttl_s + takeover_quiet_s``); Temporal restarting adds its
      own downtime (``TEMPORAL_RESTART_S``);
    * two attempts of one job at once: the old attempt's ranks run on until their
      supervisor fences them: ``unconfirmed_kill_s`` without a word from the agent, then
      ``agent_fence_grace_s`` for the rank to go, plus 10 s for the new attempt's start;
    * a fault explains an attempt's end within the time the platform takes to act on a
      node fault: ``down_after_s``, a stop's grace and margin, and three start-task tries;
    * a job in flight moves on within that, plus a lease's bound without a workflow (one
      reconcile after a takeover and a Temporal restart): past both it is stuck.
    """
    leak_bound_s = 2 * s.workflow_reconcile_s + s.leader_ttl_s + s.takeover_quiet_s + TEMPORAL_RESTART_S
    explain_window_s = max(45.0, s.down_after_s + s.default_grace_s + s.stop_margin_s + 3 * s.start_task_timeout_s)
    return CheckParams(
        leak_bound_s=leak_bound_s,
        overlap_bound_s=s.unconfirmed_kill_s + s.agent_fence_grace_s + 10.0,
        explain_window_s=explain_window_s,
        epoch_slack_s=0.5,
        leader_ttl_s=s.leader_ttl_s,
        stuck_bound_s=leak_bound_s + explain_window_s,
    )


def _stderr_log(msg: str) -> None:
    sys.stderr.write(f"{time.strftime('%H:%M:%S')} chaos: {msg}\n")
    sys.stderr.flush()


async def _active(stack: ChaosStack, job_ids: list[str]) -> int:
    assert stack.pool is not None
    if not job_ids:
        return 0
    return int(
        await stack.pool.fetchval(
            "SELECT count(*) FROM jobs WHERE job_id = ANY($1::text[]) AND NOT state = ANY($2::text[])",
            job_ids,
            list(TERMINAL_STATES),
        )
    )


async def _watchdog(stack: ChaosStack) -> None:
    while True:
        await asyncio.sleep(1.0)
        stack.restart_crashed()


async def _settle(stack: ChaosStack, settle_s: float) -> float:
    """Until every job is finished, or ``settle_s``; returns how long it took."""
    t0 = time.monotonic()
    assert stack.pool is not None
    while time.monotonic() - t0 < settle_s:
        stack.restart_crashed()
        try:
            left = await stack.pool.fetchval(
                "SELECT count(*) FROM jobs WHERE NOT state = ANY($1::text[])", list(TERMINAL_STATES)
            )
        except Exception:
            left = None
        if left == 0:
            break
        await asyncio.sleep(1.0)
    return time.monotonic() - t0


async def run_chaos(opts: ChaosOptions, log: Callable[[str], None] = _stderr_log) -> dict[str, Any]:
    if opts.layout.test_faults and "test_faults" not in Settings.model_fields:
        raise PlatformError("this build has no test_faults hooks (settings.test_faults)")
    kinds = opts.kinds or (ALL_FAULT_KINDS if opts.layout.ha else FAULT_KINDS)
    unknown = set(kinds) - set(ALL_FAULT_KINDS)
    if unknown:
        raise PlatformError(f"unknown fault kinds {sorted(unknown)} (known: {', '.join(ALL_FAULT_KINDS)})")
    if not opts.layout.ha and set(kinds) & set(HA_FAULT_KINDS):
        raise PlatformError(f"fault kinds {', '.join(sorted(set(kinds) & set(HA_FAULT_KINDS)))} need --ha")
    began = time.time()
    root = Path(tempfile.mkdtemp(prefix="gpufleet-chaos-", dir=opts.workdir))
    stack = ChaosStack(root, opts.layout, log=log)
    leaders: dict[int, dict[str, Any]] = {}
    background: list[asyncio.Task] = []
    workload: Workload | None = None
    injector: FaultInjector | None = None
    verdict: Verdict | None = None
    history = None
    durations: dict[str, float] = {}
    left: list[dict[str, Any]] = []
    record = RunRecord()
    try:
        await stack.start()
        s = stack.settings
        assert s is not None
        durations["startup"] = round(time.time() - began, 1)
        background.append(asyncio.create_task(stack.watch_leader(leaders)))
        background.append(asyncio.create_task(_watchdog(stack)))
        seconds = opts.minutes * 60.0
        workload = Workload(
            stack.api_url,
            {t.name: (t.principal, t.token) for t in stack.teams.values()},
            opts.seed,
            python=sys.executable,
            mean_interval_s=opts.mean_interval_s,
            max_active=opts.max_active,
            active=lambda ids: _active(stack, ids),
            log=log,
        )
        injector = FaultInjector(stack, burst=workload.burst, log=log)
        timings = schedule.Timings(
            leader_ttl_s=s.leader_ttl_s, hang_after_s=s.hang_after_s, down_after_s=s.down_after_s
        )
        planned = schedule.plan(opts.seed, seconds, kinds=kinds, timings=timings, min_gap_s=opts.min_gap_s)
        log(f"{seconds:.0f}s of workload and {len(planned)} faults: {', '.join(p.kind for p in planned)}")
        t0 = time.time()
        submitting = asyncio.create_task(workload.run(until=t0 + seconds))
        await injector.run(planned, t0)
        await submitting
        await workload.drain()
        faults_ended = time.time()
        durations["faults"] = round(faults_ended - t0, 1)
        log(f"settling (at most {opts.settle_s:.0f}s)")
        durations["settle"] = round(await _settle(stack, opts.settle_s), 1)
        for t in background:
            t.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        background.clear()
        record = RunRecord(
            submissions=workload.records(),
            faults=tuple(injector.faults),
            leaders=tuple(LeaderSample(**x) for x in sorted(leaders.values(), key=lambda x: x["epoch"])),
            started_at=t0,
            faults_ended_at=faults_ended,
        )
        log("checking")
        t_check = time.time()
        from common.temporal import connect

        client = await connect(s)
        history = await load(stack.dsn, stack.state, temporal_client=client, scope=s.leader_scope)
        verdict = check(history, record, check_params(s))
        durations["check"] = round(time.time() - t_check, 1)
    finally:
        for t in background:
            t.cancel()
        await asyncio.gather(*background, return_exceptions=True)
        if workload is not None:
            await workload.close()
        log("tearing the stack down")
        left = await stack.stop(keep=opts.keep)
    durations["total"] = round(time.time() - began, 1)
    assert verdict is not None and history is not None
    return report(opts, stack, record, verdict, history, left, durations)


def report(
    opts: ChaosOptions,
    stack: ChaosStack,
    record: RunRecord,
    verdict: Verdict,
    history: Any,
    left: list[dict[str, Any]],
    durations: dict[str, float],
) -> dict[str, Any]:
    s = stack.settings
    assert s is not None
    subs = record.submissions
    t0 = record.started_at

    def rel(t: float) -> float:
        return round(t - t0, 1)

    counts = Counter(f.kind for f in record.faults)
    return {
        "ok": verdict.ok and not left,
        "seed": opts.seed,
        "minutes": opts.minutes,
        "faults": {k: counts.get(k, 0) for k in ALL_FAULT_KINDS if k in FAULT_KINDS or opts.layout.ha},
        "jobs": dict(sorted(Counter(j.state for j in history.jobs.values()).items())),
        "invariants": dict(verdict.invariants),
        "counterexamples": dict(verdict.counterexamples),
        "measurements": dict(verdict.measurements),
        "submissions": {
            "logical": len(subs),
            "accepted": sum(1 for x in subs if x.accepted),
            "refused": sum(1 for x in subs if not x.accepted),
            "requests": sum(x.sends for x in subs),
            "sent_again_with_same_key": sum(1 for x in subs if x.sends > 1),
            "cancel_requests": sum(1 for x in subs if x.cancel_requested_at is not None),
            "by_class": dict(sorted(Counter(x.priority_class for x in subs).items())),
            "by_kind": dict(sorted(Counter(x.kind for x in subs).items())),
            "statuses": dict(sorted(Counter(str(c) for x in subs for c in x.statuses).items())),
        },
        "fault_timeline": [
            {
                "kind": f.kind,
                "at": rel(f.started_at),
                "until": rel(f.ended_at),
                "target": f.target,
                "nodes": list(f.nodes),
                **dict(f.detail),
            }
            for f in record.faults
        ],
        "leaders": [{"epoch": x.epoch, "holder": x.holder, "acquired": rel(x.acquired_at)} for x in record.leaders],
        "crashes": [{**c, "at": rel(c["at"])} for c in stack.crashes],
        "leftover_processes": left,
        "unfinished_at_end": [
            {
                "job_id": j.job_id,
                "state": j.state,
                "attempt": j.attempt,
                "pending_reason": j.pending_reason,
                "pending_detail": j.pending_detail,
            }
            for j in sorted(history.jobs.values(), key=lambda j: j.job_id)
            if j.state not in TERMINAL_STATES
        ],
        "durations_s": durations,
        "settings": {k: getattr(s, k) for k in SCALED if k in Settings.model_fields}
        | {"test_faults": list(opts.layout.test_faults), "control_job_workers": s.control_job_workers},
        "fleet": {
            "blocks": opts.layout.blocks,
            "nodes_per_block": opts.layout.nodes_per_block,
            "gpus_per_node": opts.layout.gpus_per_node,
            "agents": {a: n for a, n in stack.agent_nodes.items()},
            "controls": list(opts.layout.controls),
            "postgres": "primary + synchronous standby" if opts.layout.ha else "one server",
        },
        "notes": list(verdict.notes),
        "state_dir": str(stack.root) if opts.keep else None,
    }


def summary(rep: dict[str, Any]) -> None:
    """A short human summary (rich) of a report."""
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=False)
    head = "[green]all invariants hold[/]" if all(rep["invariants"].values()) else "[red]invariants failed[/]"
    console.print(f"chaos seed {rep['seed']}, {rep['minutes']} min: {head}")
    t = Table("invariant", "holds", "counterexample (first of n)")
    for name, ok in rep["invariants"].items():
        examples = rep["counterexamples"].get(name) or []
        n = rep["measurements"].get("violations", {}).get(name, 0)
        first = f"{examples[0]} ({n})" if examples else ""
        t.add_row(name, "[green]yes[/]" if ok else "[red]NO[/]", first[:160])
    console.print(t)
    m = rep["measurements"]
    console.print(
        "faults: " + ", ".join(f"{k} {v}" for k, v in rep["faults"].items())
        + "\njobs: " + ", ".join(f"{k} {v}" for k, v in rep["jobs"].items())
        + f"\ntakeover s: {m.get('takeover_s')}; failure->restart s: {m.get('failure_to_restart_s')}"
        + f"\nlargest attempt overlap: {m.get('attempt_overlap_max_s')}s (bound {m.get('attempt_overlap_bound_s')}s)"
        + f"; unexplained kills: {len(m.get('unexplained_kills') or [])}"
        + (f"\npostgres failovers: {m['postgres_failovers']}" if m.get("postgres_failovers") else "")
        + "".join(
            f"\nunfinished: {u['job_id']} {u['state']} (attempt {u['attempt']}): {u['pending_reason'] or '-'}"
            f" {u['pending_detail'] or ''}".rstrip()
            for u in rep["unfinished_at_end"]
        )
        + f"\nleftover processes: {len(rep['leftover_processes'])}; crashes: {len(rep['crashes'])}"
        + f"; {rep['durations_s']}"
    )  # fmt: skip
