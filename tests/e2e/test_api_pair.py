"""Two API processes on one port (SO_REUSEPORT) and two control processes (one leader),
under a steady stream of submissions through the CLI's client (``cli.user_cmd.ApiClient``,
one Idempotency-Key per submission, reused on each retry).

* an API process is SIGKILLed mid-stream, started again, then the other is killed (so the
  restarted one must serve), and started again;
* the leading control process is SIGKILLed mid-stream; the other takes over.

Either way every submission succeeds (no error after retries), with at most a few retries,
and Postgres holds exactly one job per submission (none lost, none twice)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import pytest

from cli.api_cmd import start_apis, wait_listening
from cli.user_cmd import ApiClient, CliError
from common.embedded import any_free_port
from common.temporal import connect
from tests.e2e.conftest import PY, e2e_settings, kill_ranks, seed_cluster
from tests.e2e.test_failover import leader_row, spawn_control
from tests.support import eventually

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
TOKEN = "tok-alpha"
# the most retries one submission may take, and all of them together over a run: each kill
# resets what the dead process had accepted (at most one request per submitting thread)
MAX_RETRIES_PER_SUBMISSION = 3
MAX_RETRIES_PER_KILL = 4


@dataclass
class Submission:
    name: str
    job_id: str | None = None
    error: str | None = None
    retries: list[str] = field(default_factory=list)
    took_s: float = 0.0


class SubmitStream:
    """``threads`` submitters, each sending one submission (a fresh ApiClient: one CLI
    invocation, one key) every ``pause_s`` until stopped."""

    def __init__(self, url: str, *, threads: int = 2, pause_s: float = 0.4) -> None:
        self.url = url
        self.pause_s = pause_s
        self.done: list[Submission] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(t,), daemon=True) for t in range(threads)]

    def start(self) -> SubmitStream:
        for t in self._threads:
            t.start()
        return self

    def answered(self) -> int:
        with self._lock:
            return len(self.done)

    def failed(self) -> list[Submission]:
        with self._lock:
            return [s for s in self.done if s.error is not None]

    async def more(self, n: int, what: str, timeout: float = 30.0) -> None:
        """Wait for ``n`` more answered submissions (failing at once on an error)."""
        target = self.answered() + n

        def probe() -> bool:
            assert not self.failed(), [(s.name, s.error, s.retries) for s in self.failed()]
            return self.answered() >= target

        await eventually(probe, timeout=timeout, interval=0.1, what=f"{n} more submissions {what}")

    def stop(self) -> list[Submission]:
        self._stop.set()
        for t in self._threads:
            t.join(60)  # a submission in its retries ends within client_retry_s
            assert not t.is_alive(), "a submitter did not finish"
        return list(self.done)

    def _loop(self, thread: int) -> None:
        i = 0
        while not self._stop.is_set():
            s = Submission(f"pair-{thread}-{i}")
            api = ApiClient(self.url, TOKEN, timeout=30, retry_s=30)
            started = time.monotonic()
            try:
                s.job_id = api.request("POST", "/v1/jobs", json_body=job_body(s.name), write=True)["job_id"]
            except CliError as e:
                s.error = f"{e.code}: {e.message}"
            s.took_s = time.monotonic() - started
            s.retries = list(api.retries)
            with self._lock:
                self.done.append(s)
            i += 1
            self._stop.wait(self.pause_s)  # the stream's pace (not a wait for a condition)


def job_body(name: str) -> dict:
    return {
        "name": name,
        "team": "alpha",
        "priority_class": "research",
        "image": "registry/test:1",
        "command": [PY, "-c", "pass"],
        "gpu_type": "h100",
        "replicas": 1,
        "gpus_per_replica": 1,
        "max_runtime": "1h",
    }


async def assert_one_job_per_submission(pool, done: list[Submission], kills: int) -> dict:
    """Every submission answered with a job, exactly one job per submission in Postgres, and
    few retries. Returns what was measured (for the report)."""
    errors = [(s.name, s.error, s.retries) for s in done if s.error is not None]
    assert not errors, errors
    names = [s.name for s in done]
    assert len(set(names)) == len(names)
    rows = await pool.fetch("SELECT job_id, name FROM jobs")
    by_name: dict[str, list[str]] = {}
    for r in rows:
        by_name.setdefault(r["name"], []).append(r["job_id"])
    twice = {n: ids for n, ids in by_name.items() if len(ids) > 1}
    assert not twice, f"submitted twice: {twice}"
    assert len(rows) == len(done), f"{len(rows)} jobs for {len(done)} submissions"
    assert {r["name"]: r["job_id"] for r in rows} == {s.name: s.job_id for s in done}
    keys = await pool.fetchval("SELECT count(*) FROM idempotency_keys WHERE path = '/v1/jobs'")
    assert keys == len(done)
    retries = [r for s in done for r in s.retries]
    worst = max(len(s.retries) for s in done)
    assert worst <= MAX_RETRIES_PER_SUBMISSION, [(s.name, s.retries) for s in done if s.retries]
    assert len(retries) <= MAX_RETRIES_PER_KILL * kills, [(s.name, s.retries) for s in done if s.retries]
    return {
        "submissions": len(done),
        "retried_submissions": sum(1 for s in done if s.retries),
        "retries": sorted(retries),
        "slowest_s": round(max(s.took_s for s in done), 2),
    }


def served_by(log: Path) -> int:
    """How many submissions an API process's access log shows it answered."""
    return log.read_text(errors="replace").count('"POST /v1/jobs HTTP/1.1" 202')


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def start_api(settings, name: str, tmp_path: Path) -> dict[str, subprocess.Popen]:
    """API process ``name`` of the pair; its database sessions carry its name (application_name),
    so the test can see which process a waiting transaction belongs to."""
    sep = "&" if "?" in settings.database_url else "?"
    own = settings.model_copy(update={"database_url": f"{settings.database_url}{sep}application_name={name}"})
    return start_apis(own, 2, tmp_path, names=[name], cwd=REPO)


async def kill_mid_request(db_dsn: str, proc: subprocess.Popen, name: str, tries: int = 10) -> None:
    """SIGKILL API process ``name`` while a submission is inside its transaction: its
    Idempotency-Key claimed, not committed (the test holds the jobs table a moment, so the
    submission waits on its INSERT, or on the submission before it). Its client sees the
    connection drop; the dead process's transaction rolls back; the retry, on the other
    process, claims the key again and submits once.

    Every submitter may be waiting on the other process instead: then the table is let go
    for the stream to move on, and held again (``tries`` times)."""
    blocker = await asyncpg.connect(db_dsn)

    async def waiting_in() -> bool:
        # an API's session waits on a lock only inside a write, after claiming its key; its
        # state may still read 'idle' (a lock taken while the statement is parsed)
        return bool(
            await blocker.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'",
                name,
            )
        )

    try:
        for _ in range(tries):
            async with blocker.transaction():
                await blocker.execute("LOCK TABLE jobs IN EXCLUSIVE MODE")
                try:
                    await eventually(waiting_in, timeout=3, interval=0.02, what=f"a submission inside {name}")
                except AssertionError:
                    continue  # the table is let go (the transaction ends); the stream moves on
                await asyncio.to_thread(kill, proc)
                return
        raise AssertionError(f"no submission went to {name} while the table was held, in {tries} tries")
    finally:
        await blocker.close()


def stop_all(procs: dict[str, subprocess.Popen]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs.values():
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def pair_settings(tmp_path, db_dsn, temporal_env, controls: int):
    ports = [any_free_port() for _ in range(controls)]
    return e2e_settings(
        tmp_path,
        db_dsn,
        temporal_env.client.service_client.config.target_host,
        api_port=any_free_port(),
        api_reuse_port=True,
        control_grpc_port=ports[0],
        control_addresses=[f"127.0.0.1:{p}" for p in ports],
    ), ports


async def test_an_api_process_killed_under_a_stream_of_submissions_costs_a_retry_not_a_job(
    pool, db_dsn, temporal_env, tmp_path
):
    from control.process import ControlProcess
    from worker_agent.agent import AgentProcess

    settings, _ = pair_settings(tmp_path, db_dsn, temporal_env, controls=1)
    nodes = await seed_cluster(pool, settings)
    client = await connect(settings)
    control = ControlProcess(settings, holder="c1", pool=pool, client=client)
    agent = AgentProcess(settings, nodes, backend="simulated")
    apis: dict[str, subprocess.Popen] = {}
    stream: SubmitStream | None = None
    try:
        await control.start()
        await agent.start()
        apis = start_api(settings, "api-1", tmp_path) | start_api(settings, "api-2", tmp_path)
        await asyncio.to_thread(wait_listening, apis, settings.api_port, 90, tmp_path)
        stream = SubmitStream(f"http://127.0.0.1:{settings.api_port}").start()
        await stream.more(10, "before any kill")
        for name in ("api-1", "api-2"):
            # one dies (with whatever it was serving), the other serves alone...
            await kill_mid_request(db_dsn, apis[name], name)
            await stream.more(10, f"with {name} dead")
            # ...until it is back; then the next kill leaves the restarted one serving alone
            apis |= start_api(settings, name, tmp_path)
            await asyncio.to_thread(wait_listening, {name: apis[name]}, settings.api_port, 90, tmp_path)
            await stream.more(10, f"with {name} back")
        done = await asyncio.to_thread(stream.stop)
        stream = None
        report = await assert_one_job_per_submission(pool, done, kills=2)
        # each kill caught a submission mid-request, and its client retried it
        assert report["retried_submissions"] >= 2, report
        # the kernel spread the connections: each process answered some
        served = {name: served_by(tmp_path / f"{name}.log") for name in apis}
        assert all(served.values()), served
        print(f"\napi pair: {report}, served {served}")
    finally:
        if stream is not None:
            stream.stop()
        stop_all(apis)
        await agent.stop()
        await control.stop()
        kill_ranks(settings.state_dir)


async def test_the_leader_control_killed_under_a_stream_of_submissions_the_other_takes_over(
    pool, db_dsn, temporal_env, tmp_path
):
    from worker_agent.agent import AgentProcess

    settings, ports = pair_settings(tmp_path, db_dsn, temporal_env, controls=2)
    nodes = await seed_cluster(pool, settings)
    procs: dict[str, subprocess.Popen] = {}
    agent = AgentProcess(settings, nodes, backend="simulated")
    stream: SubmitStream | None = None
    try:
        procs["c1"] = spawn_control(settings, "c1", ports[0], tmp_path / "c1.log")

        async def leads(holder: str):
            row = await leader_row(pool, settings)
            return row if row is not None and row["holder"] == holder else None

        first = await eventually(lambda: leads("c1"), timeout=60, interval=0.2, what="c1 leading")
        procs["c2"] = spawn_control(settings, "c2", ports[1], tmp_path / "c2.log")
        await agent.start()
        procs |= start_apis(settings, 2, tmp_path, cwd=REPO)
        await asyncio.to_thread(
            wait_listening, {n: procs[n] for n in ("api-1", "api-2")}, settings.api_port, 90, tmp_path
        )
        stream = SubmitStream(f"http://127.0.0.1:{settings.api_port}").start()
        await stream.more(20, "before the kill")
        placed_by_c1 = await pool.fetchval(
            "SELECT count(*) FROM audit WHERE actor = 'placement:c1' AND action = 'allocate'"
        )
        killed_at = time.monotonic()
        await asyncio.to_thread(kill, procs["c1"])
        second = await eventually(lambda: leads("c2"), timeout=45, interval=0.2, what="c2 taking over")
        took = time.monotonic() - killed_at
        assert second["epoch"] > first["epoch"]
        await stream.more(40, "after the takeover", timeout=45)
        done = await asyncio.to_thread(stream.stop)
        stream = None
        report = await assert_one_job_per_submission(pool, done, kills=1)

        # the new leader places what was submitted: every job runs to its end
        async def all_succeeded():
            return await pool.fetchval("SELECT count(*) FILTER (WHERE state <> 'SUCCEEDED') = 0 FROM jobs")

        await eventually(all_succeeded, timeout=90, interval=0.5, what="every submitted job SUCCEEDED")
        placed_by_c2 = await pool.fetchval(
            "SELECT count(*) FROM audit WHERE actor = 'placement:c2' AND action = 'allocate'"
        )
        assert placed_by_c1 and placed_by_c2, (placed_by_c1, placed_by_c2)
        print(f"\nleader kill: takeover {took:.1f}s, {report}, c2 placed {placed_by_c2}")
    finally:
        if stream is not None:
            stream.stop()
        await agent.stop()
        stop_all(procs)
        kill_ranks(settings.state_dir)
