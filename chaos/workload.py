"""The chaos run's workload, submitted through the API over HTTP like any client.

Every priority class; gangs of 2-4 whole nodes and smaller jobs; training jobs that
checkpoint and resume (``train_counter.py``), short jobs that exit 0, jobs that fail, a
prod-serving replica or two, jobs that run out of ``max_runtime``; three teams whose
guarantees add up to the fleet, so borrowed capacity is reclaimed (preemption). Clients
retry as clients do: on no answer, a 5xx or a 409 "in flight" the same request goes again
with the same Idempotency-Key; some submissions are sent twice on purpose (at once, or
after the answer), and a few jobs are cancelled. Each logical submission names its job
uniquely (``chaos-<n>-<kind>``) so the checker can count the jobs it created.

Every choice about a submission is drawn from the run's seeded ``random.Random`` when it is
planned (``plan_submission``), so a seed gives the same sequence of submissions (when each
goes out depends on the stack: a full fleet holds the next one back).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from chaos.timeline import Submission

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT")
CLASSES = ("prod-serving", "prod-batch", "research", "preemptible")
# kind -> weight (after the first submissions, which cover every class)
KINDS = {"train_gang": 0.2, "train_small": 0.25, "short": 0.25, "fail": 0.1, "serving": 0.1, "timeout": 0.05}
TEAM_WEIGHTS = {"alpha": 0.4, "beta": 0.35, "gamma": 0.25}
IMAGE = "registry/chaos:1"


def train_counter_path() -> str:
    import worker_agent

    return str(Path(worker_agent.__file__).resolve().parent / "examples" / "train_counter.py")


@dataclass(frozen=True)
class PlannedSubmission:
    n: int
    kind: str
    team: str
    body: Mapping[str, Any]
    duplicate: str  # "", "concurrent" (two requests at once) or "after" (again once answered)
    duplicate_after_s: float
    cancel_after_s: float | None


def _body(rng: random.Random, kind: str, team: str, name: str, python: str, train: str) -> dict[str, Any]:
    cls = rng.choice(("research", "preemptible", "prod-batch"))
    replicas, gpus = 1, 1
    max_runtime: str | int = "1h"
    checkpoint = {"preemptible": rng.random() < 0.5, "grace_seconds": 2}
    if kind in ("train_gang", "train_small"):
        if kind == "train_gang":
            replicas, gpus = rng.choice((2, 2, 3, 4)), 8
        else:
            replicas, gpus = rng.choice((1, 1, 2)), rng.choice((1, 2, 4))
        steps = rng.randint(60, 160) if kind == "train_gang" else rng.randint(40, 150)
        command = [python, train, "--steps", str(steps), "--step-time", "0.1", "--checkpoint-every", "10"]
        checkpoint = {"preemptible": True, "grace_seconds": 3}
    elif kind == "short":
        replicas, gpus = rng.choice((1, 1, 2)), rng.choice((1, 2, 4, 8))
        command = [python, "-c", f"import time; time.sleep({rng.uniform(1, 6):.1f})"]
    elif kind == "fail":
        gpus = rng.choice((1, 8))
        command = [python, "-c", "import sys, time; time.sleep(1); sys.exit(3)"]
    elif kind == "serving":
        cls = "prod-serving"
        replicas, gpus = rng.choice((1, 2)), rng.choice((1, 2))
        command = [python, "-c", f"import time; time.sleep({rng.uniform(8, 20):.1f})"]
    elif kind == "timeout":
        command = [python, "-c", "import time; time.sleep(60)"]
        max_runtime = 6
    else:
        raise ValueError(f"unknown workload kind {kind!r}")
    return {
        "team": team,
        "name": name,
        "priority_class": cls,
        "image": IMAGE,
        "command": command,
        "gpu_type": "h100",
        "replicas": replicas,
        "gpus_per_replica": gpus,
        "max_runtime": max_runtime,
        "checkpoint": checkpoint,
    }


def plan_submission(rng: random.Random, n: int, python: str, train: str) -> PlannedSubmission:
    """The ``n``-th submission of a run: kind, team, request body, duplicates, cancel."""
    if n < len(CLASSES):  # the first ones cover every priority class
        cls = CLASSES[n]
        kind = "serving" if cls == "prod-serving" else rng.choice(("train_gang", "train_small", "short"))
    else:
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        cls = ""
    team = rng.choices(list(TEAM_WEIGHTS), weights=list(TEAM_WEIGHTS.values()))[0]
    body = _body(rng, kind, team, f"chaos-{n:04d}-{kind}", python, train)
    if cls:
        body["priority_class"] = cls
    dup_roll = rng.random()
    duplicate = "concurrent" if dup_roll < 0.1 else "after" if dup_roll < 0.2 else ""
    duplicate_after_s = rng.uniform(0.0, 1.0)
    cancel_after_s = rng.uniform(2.0, 10.0) if rng.random() < 0.08 else None
    return PlannedSubmission(n, kind, team, body, duplicate, duplicate_after_s, cancel_after_s)


@dataclass
class _Sent:
    """A submission being sent (mutable while its requests are out)."""

    plan: PlannedSubmission
    key: str
    principal: str
    first_sent_at: float
    statuses: list[int] = field(default_factory=list)
    job_ids: list[str] = field(default_factory=list)
    cancel_requested_at: float | None = None
    accepted_at: float | None = None  # when the first 202 came back

    def record(self) -> Submission:
        b = self.plan.body
        return Submission(
            key=self.key, principal=self.principal, team=self.plan.team, name=str(b["name"]), kind=self.plan.kind,
            priority_class=str(b["priority_class"]), replicas=int(b["replicas"]),
            gpus_per_replica=int(b["gpus_per_replica"]), first_sent_at=self.first_sent_at,
            statuses=tuple(self.statuses), job_ids=tuple(self.job_ids), cancel_requested_at=self.cancel_requested_at,
        )  # fmt: skip


class Workload:
    def __init__(
        self,
        api_url: str,
        teams: Mapping[str, tuple[str, str]],  # team -> (principal, token)
        seed: int,
        *,
        python: str,
        mean_interval_s: float = 2.0,
        max_active: int = 10,
        active: Callable[[list[str]], Awaitable[int]] | None = None,
        log: Callable[[str], None] = lambda _msg: None,
    ) -> None:
        self.api_url = api_url
        self.teams = teams
        self.rng = random.Random(f"workload-{seed}")
        self.seed = seed
        self.python = python
        self.train = train_counter_path()
        self.mean_interval_s = mean_interval_s
        self.max_active = max_active
        self.active = active  # how many of these jobs are not finished yet
        self.log = log
        self.sent: list[_Sent] = []
        self._n = 0
        self._tasks: set[asyncio.Task] = set()
        self._http = httpx.AsyncClient(base_url=api_url, timeout=15.0)

    def records(self) -> tuple[Submission, ...]:
        return tuple(s.record() for s in self.sent)

    def accepted_job_ids(self) -> list[str]:
        return sorted({j for s in self.sent for j in s.job_ids})

    # ------------------------------------------------------------------ the loop

    async def run(self, until: float) -> None:
        """Submit until ``until`` (wall clock): one submission every ``mean_interval_s`` on
        average, holding back while ``max_active`` of them are unfinished."""
        while time.time() < until:
            if self.active is not None:
                try:
                    busy = await self.active(self.accepted_job_ids())
                except Exception:  # Postgres down: submit anyway, as a client would
                    busy = 0
                if busy >= self.max_active:
                    await asyncio.sleep(1.0)
                    continue
            self._start_next()
            await asyncio.sleep(min(6.0, max(0.3, self.rng.expovariate(1.0 / self.mean_interval_s))))

    async def burst(self, n: int) -> list[_Sent]:
        """``n`` submissions at once (while a fault hits the control plane); they are returned
        once each was accepted or given up on."""
        start = len(self.sent)
        tasks = [self._start_next() for _ in range(n)]
        await asyncio.gather(*tasks, return_exceptions=True)
        return self.sent[start : start + n]

    def _start_next(self) -> asyncio.Task:
        plan = plan_submission(self.rng, self._n, self.python, self.train)
        self._n += 1
        principal, _ = self.teams[plan.team]
        sent = _Sent(plan, f"chaos-{self.seed}-{plan.n:04d}", principal, time.time())
        self.sent.append(sent)
        t = asyncio.create_task(self._submit(sent))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def drain(self, timeout_s: float = 60.0) -> None:
        """Wait for the requests still out (retries, duplicates, cancels)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout_s)
        left = list(self._tasks)
        for t in left:
            t.cancel()
        # awaited, so none is still sending once the HTTP client is closed
        await asyncio.gather(*left, return_exceptions=True)

    async def close(self) -> None:
        await self.drain(5.0)
        await self._http.aclose()

    # ------------------------------------------------------------------ requests

    async def _post(self, sent: _Sent) -> int:
        _, token = self.teams[sent.plan.team]
        headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": sent.key}
        try:
            r = await self._http.post("/v1/jobs", json=dict(sent.plan.body), headers=headers)
        except httpx.HTTPError:
            sent.statuses.append(0)
            return 0
        sent.statuses.append(r.status_code)
        if r.status_code == 202:
            if sent.accepted_at is None:
                sent.accepted_at = time.time()
            try:
                sent.job_ids.append(str(r.json()["job_id"]))
            except (ValueError, KeyError, TypeError):
                pass
        elif r.status_code not in (409, 429, 503) and r.status_code < 500:
            self.log(f"{sent.plan.body['name']}: {r.status_code} {r.text[:200]}")
        return r.status_code

    async def _submit(self, sent: _Sent) -> None:
        delay = 0.5
        for attempt in range(10):
            if attempt == 0 and sent.plan.duplicate == "concurrent":
                codes = list(await asyncio.gather(self._post(sent), self._post(sent)))
            else:
                codes = [await self._post(sent)]
            if 202 in codes:
                break
            if any(c not in (0, 409, 429) and c < 500 for c in codes):
                return  # refused for good (admission): nothing to retry
            await asyncio.sleep(delay)
            delay = min(4.0, delay * 1.7)
        else:
            return
        if sent.plan.duplicate == "after":
            await asyncio.sleep(sent.plan.duplicate_after_s)
            await self._post(sent)  # a client retrying although it had its answer
        if sent.plan.cancel_after_s is not None and sent.job_ids:
            await asyncio.sleep(sent.plan.cancel_after_s)
            await self._cancel(sent)

    async def _cancel(self, sent: _Sent) -> None:
        _, token = self.teams[sent.plan.team]
        headers = {"Authorization": f"Bearer {token}", "Idempotency-Key": f"{sent.key}-cancel"}
        sent.cancel_requested_at = time.time()
        delay = 0.5
        for _ in range(8):
            try:
                r = await self._http.delete(f"/v1/jobs/{sent.job_ids[0]}", params={"reason": "chaos"}, headers=headers)
                if r.status_code not in (409, 429) and r.status_code < 500:
                    return
                if r.status_code == 409 and "in_flight" not in r.text:
                    return  # already finished
            except httpx.HTTPError:
                pass
            await asyncio.sleep(delay)
            delay = min(4.0, delay * 1.7)
