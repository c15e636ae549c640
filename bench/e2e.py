"""`gpufleet bench e2e --json`: submit -> RUNNING latency on the embedded stack.

    run(jobs=1000, rate=50.0) -> dict

Starts its own embedded Postgres and Temporal dev server (SQLite in WAL mode, as
`gpufleet up` does) in a temporary state dir, migrates, seeds a cluster with room
for every job (1-GPU jobs, 8 GPUs per node), runs one `gpufleet control` process
(a real subprocess: workers, leadership, placement) and, in this process, the REST
API (ASGI, in-process) and a simulated fleet. Jobs are submitted through the API
at ``rate`` per second (open loop: a slow response never delays the next submit).

Latency is measured from the moment a submit request is sent to the job's
``running`` event in Postgres (every rank started). The simulated fleet serves the
agents' ``start_task`` / ``stop_task`` activities on the shared node task queue
without rank processes (a rank "runs" for ``job_seconds``, then exits 0) and
stores its TaskStatus reports through the control plane's own ``ReportDelivery``; the
control process delivers them (the gRPC hop from agent to leader is not exercised here;
``gpufleet bench heartbeat`` measures that).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from temporalio import activity

from common.contracts import (
    START_TASK,
    STOP_TASK,
    StartTask,
    StartTaskResult,
    StopTask,
    StopTaskResult,
    TaskState,
    TaskStatus,
)
from common.embedded import any_free_port


async def _open_loop(n: int, rate: float, one: Any) -> None:
    """Call ``one(i)`` for i < n at ``rate`` per second, open loop: a slow call never
    delays the next one; returns when every call has finished."""
    start = time.monotonic()
    tasks = []
    for i in range(n):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = max(0, min(len(values) - 1, round(q / 100.0 * len(values) + 0.5) - 1))
    return values[k]


class SimFleet:
    """Simulated agents: ``start_task`` accepts at once, the rank exits 0 after ``job_seconds``."""

    def __init__(self, reports: Any, job_seconds: float) -> None:
        self.reports = reports  # stored durably; the control process delivers them
        self.job_seconds = job_seconds
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.started: set[str] = set()
        self.starts = 0

    def activities(self) -> list:
        @activity.defn(name=START_TASK)
        async def start_task(req: StartTask) -> StartTaskResult:
            self.starts += 1
            if req.lease_id in self.started:
                return StartTaskResult(req.lease_id, req.epoch, accepted=True, pid=1, already_running=True)
            self.started.add(req.lease_id)
            self._report(req, "STARTED")
            loop = asyncio.get_running_loop()
            self.timers[req.lease_id] = loop.call_later(self.job_seconds, self._exit, req, 0)
            return StartTaskResult(req.lease_id, req.epoch, accepted=True, pid=1)

        @activity.defn(name=STOP_TASK)
        async def stop_task(req: StopTask) -> StopTaskResult:
            t = self.timers.pop(req.lease_id, None)
            if t is None:
                return StopTaskResult(req.lease_id, req.epoch, accepted=True, reason="unknown lease: nothing to stop")
            t.cancel()
            return StopTaskResult(req.lease_id, req.epoch, accepted=True, exit_code=143)

        return [start_task, stop_task]

    def _exit(self, req: Any, code: int) -> None:
        self.timers.pop(req.lease_id, None)
        self._report(req, "EXITED", code)

    def _report(self, req: Any, state: str, exit_code: int | None = None) -> None:
        self.reports.submit(
            TaskStatus(
                node_id=req.node_id, lease_id=req.lease_id, job_id=req.job_id, attempt=req.attempt, epoch=req.epoch,
                rank=req.rank, state=TaskState(state), at=datetime.now(UTC), exit_code=exit_code,
            )
        )  # fmt: skip


def _process_tree(control: Any, temporal: Any) -> dict[str, list[Any]]:
    import psutil

    me = psutil.Process()
    groups: dict[str, list[Any]] = {"bench_api_fleet": [me], "control": [], "temporal": [], "postgres": []}
    if control is not None:
        cp = psutil.Process(control.pid)
        groups["control"].append(cp)
        groups["control"].extend(cp.children(recursive=True))  # its job workers
    if temporal.proc is not None:
        groups["temporal"].append(psutil.Process(temporal.proc.pid))
    for p in psutil.process_iter(["name", "username"]):
        if (p.info.get("name") or "").startswith("postgres"):
            groups["postgres"].append(p)
    return groups


def _cpu(groups: dict[str, list[Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, procs in groups.items():
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
                if k == "postgres":
                    continue
            except Exception:
                continue
        out[k] = total
    return out


async def _persistence_ops(temporal: Any) -> dict[str, float]:
    """The dev server's persistence requests so far, by operation (its /metrics)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    url = f"http://{temporal.host}:{temporal.metrics_port}/metrics"
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(url)).text
    ops: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "persistence_requests":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") or sample.name == family.name:
                op = sample.labels.get("operation", "?")
                ops[op] = ops.get(op, 0.0) + sample.value
    return ops


async def _persistence_ops_settled(temporal: Any, tries: int = 8) -> dict[str, float]:
    """``_persistence_ops`` once the server's metrics have caught up: it exports its
    counters on a reporting interval, so a scrape right after the work can miss the last
    requests (a 20-job run once read 19 creates)."""
    last = await _persistence_ops(temporal)
    for _ in range(tries):
        await asyncio.sleep(1.0)
        now = await _persistence_ops(temporal)
        if now == last:
            return now
        last = now
    return last


def _per_job(before: dict[str, float], after: dict[str, float], jobs: int) -> dict[str, Any] | None:
    """What each job cost the server's store over the window: requests per job, by operation."""
    if not jobs:
        return None
    diff = {op: (after.get(op, 0.0) - before.get(op, 0.0)) / jobs for op in after}
    top = sorted(((op, round(v, 2)) for op, v in diff.items() if v >= 0.05), key=lambda kv: -kv[1])
    return {"total": round(sum(diff.values()), 2), "by_operation": dict(top)}


def _settings_env(settings: Any, **over: Any) -> dict[str, str]:
    env = settings.to_env()
    env.update({f"GPUFLEET_{k.upper()}": str(v) for k, v in over.items()})
    return env


async def _sample_timeline(client: Any, job_ids: list[str]) -> list[list[str]]:
    """For a few jobs: ms since workflow start of each history event up to RUNNING (diagnostics)."""
    out = []
    for jid in job_ids:
        try:
            hist = await client.get_workflow_handle(jid).fetch_history()
        except Exception:
            continue
        events = list(hist.events)
        t0 = events[0].event_time.ToDatetime().timestamp()
        line = []
        for e in events[:22]:
            name = type(e).__name__
            from temporalio.api.enums.v1 import EventType

            name = EventType.Name(e.event_type).replace("EVENT_TYPE_", "").lower()
            line.append(f"{(e.event_time.ToDatetime().timestamp() - t0) * 1000:.0f} {name}")
        out.append(line)
    return out


async def _lean_baseline(client: Any, pool: Any, jobs: int, rate: float, temporal: Any) -> dict[str, Any]:
    """The lean job workflow at the same rate on the same server (same-run baseline):
    start -> its 3 local activities, the signal and the node activity are done."""
    from bench.lean_workflow import ACT_LEAN_NODE, ACT_LEAN_WRITE, LEAN_WORKFLOW, LeanJobWorkflow
    from common.temporal import make_worker

    @activity.defn(name=ACT_LEAN_WRITE)
    async def lean_write(job_id: str) -> str:
        await pool.execute("UPDATE leader SET holder = holder WHERE false")  # one short round trip
        return job_id

    @activity.defn(name=ACT_LEAN_NODE)
    async def lean_node(job_id: str) -> str:
        return job_id

    queue = f"bench-lean-{uuid.uuid4().hex[:6]}"
    wf_worker = make_worker(client, queue, workflows=[LeanJobWorkflow], activities=[lean_write])
    node_worker = make_worker(client, queue + "-node", activities=[lean_node])
    lat: list[float] = []
    errors = 0
    import psutil

    server = psutil.Process(temporal.proc.pid)
    ops0 = await _persistence_ops_settled(temporal)
    cpu0 = sum(server.cpu_times()[:2])
    async with wf_worker, node_worker:

        async def one(i: int) -> None:
            nonlocal errors
            t0 = time.monotonic()
            try:
                h = await client.start_workflow(LEAN_WORKFLOW, f"lean-{i}", id=f"lean-{i}-{uuid.uuid4().hex[:6]}",
                                                task_queue=queue)  # fmt: skip
                await h.signal("go", "")
                await h.result()
            except Exception:
                errors += 1
                return
            lat.append((time.monotonic() - t0) * 1000.0)

        await _open_loop(jobs, rate, one)
    cpu1, ops1 = sum(server.cpu_times()[:2]), await _persistence_ops_settled(temporal)
    return {
        "what": "lean job workflow (3 local activities, 1 signal, 1 node activity), same server, same rate",
        "workflows": len(lat),
        "errors": errors,
        "p50_ms": round(_pct(lat, 50), 1) if lat else None,
        "p95_ms": round(_pct(lat, 95), 1) if lat else None,
        "p99_ms": round(_pct(lat, 99), 1) if lat else None,
        "temporal_cpu_ms_per_job": round((cpu1 - cpu0) * 1000 / len(lat), 1) if lat else None,
        "temporal_persistence_per_job": _per_job(ops0, ops1, len(lat)),
    }


async def _bench(
    root: Path,
    jobs: int,
    rate: float,
    job_seconds: float,
    settle_s: float,
    log_dir: Path,
    with_baseline: bool = True,
) -> dict[str, Any]:
    import httpx

    from api.main import create_app
    from common.db import create_pool, migrate
    from common.embedded import EmbeddedPostgres, EmbeddedTemporal
    from common.settings import Principal, Settings
    from common.temporal import connect, make_worker
    from control.report_delivery import ReportDelivery
    from store.seed import ensure_cluster
    from store.teams import TeamQuota, set_quota

    t_setup = time.monotonic()
    pg = EmbeddedPostgres(root / "pgdata")
    dsn = pg.start()
    temporal = EmbeddedTemporal(
        root / "temporal" / "temporal.db", port=any_free_port(), ui=False, log_file=log_dir / "temporal.log",
        metrics_port=any_free_port(),
    )  # fmt: skip
    control: subprocess.Popen | None = None
    worker = None
    worker_run: asyncio.Task | None = None
    pool = None
    reports = None
    try:
        address = temporal.start()
        nodes_needed = max(1, -(-jobs // 8))
        blocks = max(1, -(-nodes_needed // 32))
        token = "bench-" + uuid.uuid4().hex
        settings = Settings(
            env="dev",
            state_dir=root / "state",
            database_url=dsn,
            temporal_address=address,
            control_grpc_port=any_free_port(),
            control_metrics_listen="127.0.0.1:0",
            agent_task_queue_mode="shared",
            api_tokens={token: Principal(name="bench", team="bench")},
            max_queued_per_team=max(5000, jobs),
            db_pool_max=20,
            # the simulated fleet sends no heartbeats: keep the health monitor from
            # declaring its nodes silent (suspect/down) during the run
            suspect_after_s=1e6,
            down_after_s=2e6,
            takeover_quiet_s=1e6,
        )
        pool = await create_pool(dsn, min_size=2, max_size=20)
        async with pool.acquire() as conn:
            await migrate(conn)
            await ensure_cluster(
                conn, gpu_type="h100", blocks=blocks, nodes_per_block=32,
                task_queue_prefix=settings.agent_task_queue_prefix,
            )  # fmt: skip
            total = blocks * 32 * 8
            await set_quota(conn, TeamQuota("bench", "h100", total, 0), actor="bench", reason="bench e2e")
        log = open(log_dir / "control.log", "ab")
        control = subprocess.Popen(
            # BENCH_CONTROL_WRAPPER: a script run instead of `-m cli.main` (profiling experiments)
            [
                sys.executable,
                *(
                    [os.environ["BENCH_CONTROL_WRAPPER"]]
                    if os.environ.get("BENCH_CONTROL_WRAPPER")
                    else ["-m", "cli.main"]
                ),
                "control",
                "--holder",
                "bench",
                "--log-level",
                "WARNING",
            ],
            env=_settings_env(settings),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        client = await connect(settings)
        reports = ReportDelivery(pool, client, settings)
        fleet = SimFleet(reports, job_seconds)
        from temporalio.worker import PollerBehaviorAutoscaling

        worker = make_worker(client, settings.agent_shared_task_queue, activities=fleet.activities(),
                             max_concurrent_activities=500,
                             activity_task_poller_behavior=PollerBehaviorAutoscaling(initial=10))  # fmt: skip
        worker_run = asyncio.create_task(worker.run())  # shut down (and awaited) at the end
        deadline = time.monotonic() + 60
        while await pool.fetchval("SELECT count(*) FROM leader WHERE expires_at > now()") == 0:
            if control.poll() is not None:
                raise RuntimeError(f"control exited with code {control.returncode} (see {log_dir / 'control.log'})")
            if time.monotonic() > deadline:
                raise RuntimeError("control did not take leadership within 60 s")
            await asyncio.sleep(0.2)
        app = create_app(settings, pool=pool, temporal_client=client)
        http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://api", timeout=60,
            limits=httpx.Limits(max_connections=1000),
        )  # fmt: skip
        setup_s = time.monotonic() - t_setup

        sent: dict[str, float] = {}
        errors: list[str] = []
        body = {
            "team": "bench", "priority_class": "research", "image": "registry/bench:1", "command": ["true"],
            "gpu_type": "h100", "replicas": 1, "gpus_per_replica": 1, "max_runtime": "1h",
        }  # fmt: skip

        async def submit(i: int) -> None:
            t0 = time.time()
            try:
                r = await http.post(
                    "/v1/jobs", json={**body, "name": f"bench-{i}"},
                    headers={"Authorization": f"Bearer {token}", "Idempotency-Key": f"bench-{i}-{uuid.uuid4().hex}"},
                )  # fmt: skip
            except Exception as e:
                errors.append(f"submit {i}: {type(e).__name__}: {e}")
                return
            if r.status_code != 202:
                errors.append(f"submit {i}: HTTP {r.status_code} {r.text[:200]}")
                return
            sent[r.json()["job_id"]] = t0

        procs = _process_tree(control, temporal)
        ops0 = await _persistence_ops_settled(temporal)
        cpu0 = _cpu(procs)
        start = time.monotonic()
        await _open_loop(jobs, rate, submit)
        submit_s = time.monotonic() - start

        running: dict[str, float] = {}
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            rows = await pool.fetch(
                "SELECT job_id, min(at) AS at FROM job_events WHERE event = 'running' GROUP BY job_id"
            )
            running = {r["job_id"]: r["at"].timestamp() for r in rows}
            if all(j in running for j in sent):
                break
            await asyncio.sleep(0.5)
        latencies = [(running[j] - t0) * 1000.0 for j, t0 in sent.items() if j in running]
        cpu1 = _cpu(procs)
        wall = time.monotonic() - start
        ops1 = await _persistence_ops_settled(temporal)  # after wall: the settling is not the run's
        cpu_s = {k: round(cpu1.get(k, 0.0) - cpu0.get(k, 0.0), 1) for k in cpu1}
        # where the time goes: submit -> row committed -> gang allocated -> every rank started
        marks = await pool.fetch(
            "SELECT j.job_id, extract(epoch FROM j.submitted_at) AS sub,"
            " (SELECT extract(epoch FROM min(at)) FROM job_events e WHERE e.job_id = j.job_id AND e.event = 'allocated') AS alloc"
            " FROM jobs j"
        )
        seg: dict[str, list[float]] = {"api_ms": [], "queue_to_allocated_ms": [], "allocated_to_running_ms": []}
        for r in marks:
            j = r["job_id"]
            if j in sent and j in running and r["alloc"] is not None:
                seg["api_ms"].append((float(r["sub"]) - sent[j]) * 1000)
                seg["queue_to_allocated_ms"].append((float(r["alloc"]) - float(r["sub"])) * 1000)
                seg["allocated_to_running_ms"].append((running[j] - float(r["alloc"])) * 1000)
        breakdown = {k: {"p50": round(_pct(v, 50), 1), "p95": round(_pct(v, 95), 1)} for k, v in seg.items() if v}
        never = [j for j in sent if j not in running]
        if never:
            errors.append(f"{len(never)} job(s) not RUNNING within {settle_s:.0f}s of the last submit")
        states = {r["state"]: r["n"] for r in await pool.fetch("SELECT state, count(*) AS n FROM jobs GROUP BY state")}
        events = {
            r["event"]: r["n"] for r in await pool.fetch("SELECT event, count(*) AS n FROM job_events GROUP BY event")
        }
        pending = {f"{r['pending_reason']}: {r['pending_detail']}": r["n"] for r in await pool.fetch(
            "SELECT pending_reason, pending_detail, count(*) AS n FROM jobs WHERE state = 'QUEUED'"
            " GROUP BY 1, 2 ORDER BY 3 DESC LIMIT 5")}  # fmt: skip
        node_states = {
            r["state"]: r["n"] for r in await pool.fetch("SELECT state, count(*) AS n FROM nodes GROUP BY 1")
        }
        failures = [r["reason"] for r in await pool.fetch(
            "SELECT DISTINCT reason FROM job_events WHERE event = 'attempt_failed' LIMIT 5")]  # fmt: skip
        cycles = await pool.fetchval("SELECT count(DISTINCT (detail->>'epoch')) FROM audit WHERE action = 'allocate'")
        await http.aclose()
        timeline = await _sample_timeline(client, list(sent)[len(sent) // 2 :: max(1, len(sent) // 5)][:5])
        baseline = await _lean_baseline(client, pool, jobs, rate, temporal) if with_baseline else None
        p = {q: _pct(latencies, q) for q in (50, 95, 99)}
        return {
            "submitted": len(sent),
            "requested": jobs,
            "rate_per_s": rate,
            "achieved_rate_per_s": round(len(sent) / submit_s, 2) if submit_s > 0 else None,
            "errors": len(errors),
            "error_samples": errors[:5],
            "running": len(latencies),
            "p50_ms": round(p[50], 1) if p[50] is not None else None,
            "p95_ms": round(p[95], 1) if p[95] is not None else None,
            "p99_ms": round(p[99], 1) if p[99] is not None else None,
            "mean_ms": round(statistics.fmean(latencies), 1) if latencies else None,
            "max_ms": round(max(latencies), 1) if latencies else None,
            "must_p95_ms": 5000,
            "target_p95_ms": 2000,
            "must_met": bool(p[95] is not None and p[95] <= 5000 and not errors),
            "target_met": bool(p[95] is not None and p[95] <= 2000 and not errors),
            "baseline": baseline,
            "sample_timelines_ms": timeline,
            "p95_vs_baseline": (
                round(p[95] / baseline["p95_ms"], 2) if baseline and baseline.get("p95_ms") and p[95] else None
            ),
            "breakdown": breakdown,
            "cpu_seconds": {**cpu_s, "wall_s": round(wall, 1)},
            "temporal_cpu_ms_per_job": round(cpu_s.get("temporal", 0.0) * 1000 / len(sent), 1) if sent else None,
            "temporal_persistence_per_job": _per_job(ops0, ops1, len(sent)),
            "job_states": states,
            "job_events": events,
            "pending": pending,
            "node_states": node_states,
            "attempt_failures": failures,
            "leader_epochs": cycles,
            "cluster_gpus": blocks * 32 * 8,
            "job_seconds": job_seconds,
            "setup_s": round(setup_s, 1),
            "fleet": "simulated in-process agents (start_task/stop_task activities, no rank processes,"
            " no heartbeats: health silence timers disabled)",
            "measured": "submit request sent -> the job's 'running' event (every rank started)",
            "stack": "embedded Postgres + Temporal dev server (SQLite WAL), API in-process (ASGI), control subprocess",
        }
    finally:
        if reports is not None:
            await reports.close()
        if worker is not None:
            try:
                await asyncio.wait_for(worker.shutdown(), 10)
            except Exception:
                pass
        if worker_run is not None:
            await asyncio.gather(worker_run, return_exceptions=True)
        if control is not None and control.poll() is None:
            control.send_signal(signal.SIGTERM)
            try:
                control.wait(20)
            except subprocess.TimeoutExpired:
                control.kill()
        if pool is not None:
            await pool.close()
        temporal.stop()
        pg.stop()


def run(
    jobs: int = 1000,
    rate: float = 50.0,
    job_seconds: float = 300.0,
    settle_s: float = 120.0,
    keep: bool = False,
    baseline: bool = True,
    repeat: int = 1,
) -> dict:
    """Run the benchmark ``repeat`` times, each on a fresh stack; returns the JSON-ready
    result of the run with the median p95, with every run's figures under ``runs`` (this
    machine is shared and noisy: one run says little). The lean baseline runs once, in
    the last repetition."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    results: list[dict] = []
    for i in range(max(1, repeat)):
        root = Path(tempfile.mkdtemp(prefix="gpufleet-bench-e2e-"))
        log_dir = root / "logs"
        log_dir.mkdir(parents=True)
        try:
            last = i == max(1, repeat) - 1
            result = asyncio.run(_bench(root, jobs, rate, job_seconds, settle_s, log_dir, baseline and last))
            result["logs"] = str(log_dir) if keep else None
            results.append(result)
        finally:
            if not keep:
                shutil.rmtree(root, ignore_errors=True)
    if len(results) == 1:
        return results[0]
    ranked = sorted(results, key=lambda r: float("inf") if r.get("p95_ms") is None else r["p95_ms"])
    median = dict(ranked[len(ranked) // 2])  # the upper median when even: never the best run
    base = results[-1].get("baseline")
    errors = sum(r["errors"] for r in results)
    p95 = median.get("p95_ms")
    median.update(
        runs=[{k: r.get(k) for k in ("p50_ms", "p95_ms", "p99_ms", "errors", "cpu_seconds")} for r in results],
        repeat=len(results),
        errors=errors,
        baseline=base,
        p95_vs_baseline=round(p95 / base["p95_ms"], 2) if base and base.get("p95_ms") and p95 else None,
        must_met=bool(p95 is not None and p95 <= 5000 and not errors),
        target_met=bool(p95 is not None and p95 <= 2000 and not errors),
        reported="the run with the median p95 of all runs; errors summed over all runs",
    )
    return median


if __name__ == "__main__":  # python -m bench.e2e [jobs] [rate]
    from common.temporal import hard_exit

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    r = float(sys.argv[2]) if len(sys.argv) > 2 else 50.0
    print(json.dumps(run(jobs=n, rate=r), indent=2))
    hard_exit(0)
