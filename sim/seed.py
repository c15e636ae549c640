"""The seed workload: the cluster gpufleet is built for (docs/design.md), and a day of its submissions.

Deterministic from a seed (every draw comes from ``random.Random`` instances derived
from it, one per stream, so changing one stream leaves the others as they were).

* Cluster: 3,000 nodes x 8 GPUs (24,000), blocks of 32 nodes, one GPU type.
* Teams in all four classes with guarantees that sum to the cluster: two serving teams,
  two pre-training teams, an eval team and six research teams. Everyone may borrow
  idle capacity up to the cluster size; serving teams beyond their guarantee get
  capacity only by reclaiming borrowed allocations (the engine's rule).
* ~40,000 submissions/day with a daily shape (x1.5 at 14:00, x0.5 at 02:00):
  - ~30% arrive in hyper-parameter sweeps submitted at 50/s (100-600 jobs each,
    preemptible or research, 1-8 GPUs);
  - other small jobs (<= 8 GPUs) so that ~90% of all submissions use <= 8 GPUs;
  - medium jobs (16-512 GPUs, whole nodes, half of them asking for one block, which they
    wait for at most ``one_block_wait_s``, like Slurm's ``--switches=1`` with its default
    ``max_switch_wait`` of 300 s);
  - a few dozen large gangs/day (1,024-8,192 GPUs, pack=block with a max_blocks a
    little above the minimum), holding most GPU-hours;
  - prod-serving: long-lived services running from the start, plus daytime scale-ups
    (new deployments, a few hours each).
* max_runtime over-estimated the way users do: a third leave the class default, most
  round a 1.5-4x guess up to the hour, a few are tight, ~3% under-estimate and time out.
* Checkpoints: large gangs every 15-30 min, medium 20-60 min (80%), small 15-60 min
  (half of them; the rest cannot checkpoint and restart from scratch).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from sim.workload import ClusterSpec, SimJob, TeamSpec, Workload

DAY = 86_400.0
HOUR = 3600.0
CLASS_CAP_S = {
    "prod-serving": 30 * DAY,
    "prod-batch": 72 * HOUR,
    "research": 48 * HOUR,
    "preemptible": 24 * HOUR,
}


@dataclass(frozen=True)
class SeedConfig:
    days: float = 1.0
    seed: int = 1
    warmup_h: float = 6.0
    nodes: int = 3000
    block_nodes: int = 32
    gpus_per_node: int = 8
    gpu_type: str = "h100"
    submissions_per_day: float = 40_000.0
    sweep_share: float = 0.30
    sweep_rate_per_s: float = 50.0
    large_per_day: float = 30.0
    medium_share: float = 0.095
    serving_scaleups_per_day: float = 150.0
    serving_base_gpus: int = 2000
    load_scale: float = 1.0  # multiplies every duration (a quick way to try a busier or quieter day)
    # how long a medium job asking for one block waits for it before it takes the fewest
    # blocks it can: Slurm's default max_switch_wait; None makes one block a hard limit
    one_block_wait_s: float | None = 300.0


# name, guarantee (24,000-GPU cluster), role. Serving guarantees cover the services and
# their daytime peak (beyond it they could only reclaim borrowed allocations).
TEAMS = (
    ("serving-chat", 3072, "serving"),
    ("serving-search", 1536, "serving"),
    ("pretrain-a", 8192, "pretrain"),
    ("pretrain-b", 4096, "pretrain"),
    ("eval", 1024, "eval"),
    ("rl", 1536, "research"),
    ("nlp", 1408, "research"),
    ("vision", 1024, "research"),
    ("speech", 640, "research"),
    ("robotics", 640, "research"),
    ("safety", 832, "research"),
)


def _teams(cfg: SeedConfig, total: int) -> tuple[TeamSpec, ...]:
    base = sum(g for _, g, _ in TEAMS)
    out = []
    acc = 0
    for i, (name, g, role) in enumerate(TEAMS):
        gg = total - acc if i == len(TEAMS) - 1 else round(g * total / base)
        acc += gg
        borrow = min(total, max(gg // 2, 64)) if role == "serving" else total - gg
        out.append(TeamSpec(name, ((cfg.gpu_type, gg, borrow),)))
    return tuple(out)


def daily_shape(t: float, amplitude: float = 0.5, peak_h: float = 14.0) -> float:
    """Arrival-rate multiplier at time ``t`` (mean 1 over a day)."""
    h = (t / HOUR) % 24.0
    return 1.0 + amplitude * math.cos(2 * math.pi * (h - peak_h) / 24.0)


def _arrivals(rng: random.Random, per_day: float, start: float, end: float, amplitude: float) -> list[float]:
    """Non-homogeneous Poisson arrivals by thinning."""
    if per_day <= 0:
        return []
    lam_max = per_day / DAY * (1 + amplitude)
    out: list[float] = []
    t = start
    while True:
        t += rng.expovariate(lam_max)
        if t >= end:
            return out
        if rng.random() * (1 + amplitude) <= daily_shape(t, amplitude):
            out.append(t)


def _lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, median * math.exp(rng.gauss(0.0, sigma))))


def _choice(rng: random.Random, items: list, weights: Sequence[float]):
    x = rng.random() * sum(weights)
    for it, w in zip(items, weights, strict=True):
        x -= w
        if x < 0:
            return it
    return items[-1]


def user_max_runtime(rng: random.Random, work: float, cls: str) -> float:
    """What a user declares: the class default, a rounded-up guess, a tight guess, or too little."""
    cap = CLASS_CAP_S[cls]
    x = rng.random()
    if x < 0.30:
        m = cap
    elif x < 0.85:
        m = math.ceil(work * rng.uniform(1.5, 4.0) / HOUR) * HOUR
    elif x < 0.97:
        m = math.ceil(work * rng.uniform(1.05, 1.5) / 300.0) * 300.0
    else:
        m = work * rng.uniform(0.5, 0.95)
    return max(600.0, min(cap, m))


def seed_workload(cfg: SeedConfig | None = None) -> Workload:
    cfg = cfg or SeedConfig()
    cluster = ClusterSpec.uniform(cfg.nodes, cfg.block_nodes, cfg.gpus_per_node, cfg.gpu_type)
    total = cluster.total_gpus()
    scale = total / 24_000.0  # the mix is sized for 24,000 GPUs; smaller clusters get fewer jobs
    teams = _teams(cfg, total)
    roles = {name: role for name, _, role in TEAMS}
    guar = {t.name: t.guaranteed(cfg.gpu_type) for t in teams}
    start, end = -cfg.warmup_h * HOUR, cfg.days * DAY
    G = cfg.gpus_per_node
    ls = cfg.load_scale

    def rng(stream: str) -> random.Random:
        return random.Random(f"gpufleet-seed:{cfg.seed}:{stream}")

    raw: list[tuple] = []  # (submit, tiebreak, fields...)

    def add(submit: float, **kw) -> None:
        raw.append((submit, len(raw), kw))

    research = [n for n, _, r in TEAMS if r == "research"]
    research_w = [guar[n] for n in research]

    # ---- sweeps: bursts at 50/s
    r = rng("sweeps")
    n_sweep_jobs_day = cfg.submissions_per_day * cfg.sweep_share * scale
    mean_sweep = 350.0
    for t0 in _arrivals(r, n_sweep_jobs_day / mean_sweep, start, end, 0.5):
        n = r.randint(100, 600)
        team = _choice(r, research, research_w)
        cls = "preemptible" if r.random() < 0.7 else "research"
        gpus = _choice(r, [1, 2, 4, 8], [0.55, 0.2, 0.15, 0.1])
        median = r.uniform(10, 40) * 60
        ckpt = r.random() < 0.5
        for i in range(n):
            work = _lognormal(r, median, 0.5, 60, 12 * HOUR) * ls
            add(
                t0 + i / cfg.sweep_rate_per_s,
                team=team,
                priority=cls,
                work_s=work,
                max_runtime_s=user_max_runtime(r, work, cls),
                replicas=1,
                gpus_per_replica=gpus,
                checkpoint_s=r.uniform(15, 60) * 60 if ckpt else None,
                grace_s=30.0,
                kind="sweep",
            )

    # ---- small jobs (<= 8 GPUs)
    r = rng("small")
    small_day = cfg.submissions_per_day * (1 - cfg.sweep_share - cfg.medium_share) * scale
    small_day -= (cfg.large_per_day + cfg.serving_scaleups_per_day) * scale
    small_teams = research + ["eval", "pretrain-a", "pretrain-b"]
    small_w = research_w + [guar["eval"], guar["pretrain-a"] * 0.3, guar["pretrain-b"] * 0.3]
    for t in _arrivals(r, small_day, start, end, 0.5):
        team = _choice(r, small_teams, small_w)
        if roles[team] == "research":
            cls = _choice(r, ["research", "preemptible", "prod-batch"], [0.72, 0.22, 0.06])
        else:
            cls = _choice(r, ["prod-batch", "research"], [0.75, 0.25])
        gpus = _choice(r, [1, 2, 4, 8], [0.45, 0.15, 0.15, 0.25])
        work = _lognormal(r, 15 * 60, 1.2, 30, 24 * HOUR) * ls
        add(
            t,
            team=team,
            priority=cls,
            work_s=work,
            max_runtime_s=user_max_runtime(r, work, cls),
            replicas=1,
            gpus_per_replica=gpus,
            checkpoint_s=r.uniform(15, 60) * 60 if r.random() < 0.5 else None,
            grace_s=30.0,
            kind="small",
        )

    # ---- medium jobs (16-512 GPUs, whole nodes)
    r = rng("medium")
    med_teams = research + ["eval", "pretrain-a", "pretrain-b"]
    med_w = research_w + [guar["eval"], guar["pretrain-a"] * 0.4, guar["pretrain-b"] * 0.4]
    for t in _arrivals(r, cfg.submissions_per_day * cfg.medium_share * scale, start, end, 0.5):
        team = _choice(r, med_teams, med_w)
        if roles[team] == "research":
            cls = _choice(r, ["research", "preemptible", "prod-batch"], [0.8, 0.12, 0.08])
        else:
            cls = _choice(r, ["prod-batch", "research"], [0.7, 0.3])
        gpus = _choice(r, [16, 32, 64, 128, 256, 512], [0.40, 0.28, 0.17, 0.09, 0.045, 0.015])
        nodes = gpus // G if gpus >= G else 1
        work = _lognormal(r, 20 * 60, 1.0, 120, 48 * HOUR) * ls
        if nodes <= cfg.block_nodes and r.random() < 0.5:
            pack, mb = "block", 1
        else:
            pack, mb = "block", None
        add(
            t,
            team=team,
            priority=cls,
            work_s=work,
            max_runtime_s=user_max_runtime(r, work, cls),
            replicas=nodes,
            gpus_per_replica=G,
            pack=pack,
            max_blocks=mb,
            max_blocks_wait_s=cfg.one_block_wait_s if mb else None,
            checkpoint_s=r.uniform(20, 60) * 60 if r.random() < 0.8 else None,
            grace_s=60.0,
            kind="medium",
        )

    # ---- large gangs (1,024-8,192 GPUs)
    r = rng("large")
    for t in _arrivals(r, cfg.large_per_day * scale, start, end, 0.2):
        who = _choice(r, ["pretrain-a", "pretrain-b", "research"], [0.4, 0.33, 0.27])
        if who == "pretrain-a":
            team, cls = who, "prod-batch"
            gpus = _choice(r, [8192, 4096, 2048], [0.25, 0.35, 0.40])
        elif who == "pretrain-b":
            team, cls = who, "prod-batch"
            gpus = _choice(r, [4096, 2048, 1024], [0.2, 0.4, 0.4])
        else:
            team, cls = _choice(r, ["rl", "nlp"], [1, 1]), "research"
            gpus = _choice(r, [2048, 1024], [0.3, 0.7])
        gpus = max(G, int(gpus * scale) // G * G) if scale < 1 else gpus
        nodes = gpus // G
        mn = math.ceil(nodes / cfg.block_nodes)
        work = _lognormal(r, 3 * HOUR, 0.7, 1800, 36 * HOUR) * ls
        add(
            t,
            team=team,
            priority=cls,
            work_s=work,
            max_runtime_s=user_max_runtime(r, work, cls),
            replicas=nodes,
            gpus_per_replica=G,
            pack="block",
            max_blocks=mn + max(1, mn // 4),
            checkpoint_s=r.uniform(15, 30) * 60,
            grace_s=120.0,
            kind="large",
        )

    # ---- prod-serving: services running from the start, then daytime scale-ups
    r = rng("serving")
    serving = [n for n, _, ro in TEAMS if ro == "serving"]
    serving_w = [guar[n] for n in serving]
    base = int(cfg.serving_base_gpus * scale)
    placed = 0
    k = 0
    while placed < base:
        team = serving[k % len(serving)] if k < len(serving) else _choice(r, serving, serving_w)
        gpr = _choice(r, [8, 4], [0.7, 0.3])
        reps = r.randint(2, 12)
        reps = max(1, min(reps, (base - placed) // gpr)) if base - placed >= gpr else 1
        add(
            start + k * 0.5,
            team=team,
            priority="prod-serving",
            work_s=CLASS_CAP_S["prod-serving"],
            max_runtime_s=CLASS_CAP_S["prod-serving"],
            replicas=reps,
            gpus_per_replica=gpr,
            checkpoint_s=None,
            grace_s=30.0,
            kind="service",
        )
        placed += reps * gpr
        k += 1
    for t in _arrivals(r, cfg.serving_scaleups_per_day * scale, start, end, 0.9):
        team = _choice(r, serving, serving_w)
        gpr = _choice(r, [8, 4], [0.7, 0.3])
        reps = r.randint(1, 4)
        work = r.uniform(2, 8) * HOUR
        add(
            t,
            team=team,
            priority="prod-serving",
            work_s=work,
            max_runtime_s=math.ceil(work / HOUR) * HOUR,
            replicas=reps,
            gpus_per_replica=gpr,
            checkpoint_s=None,
            grace_s=30.0,
            kind="scaleup",
        )

    raw.sort(key=lambda x: (x[0], x[1]))
    width = max(7, len(str(len(raw))))
    jobs = tuple(
        SimJob(job_id=f"j{i:0{width}d}", submit=s, gpu_type=cfg.gpu_type, **kw) for i, (s, _, kw) in enumerate(raw)
    )
    return Workload(
        cluster=cluster,
        teams=teams,
        jobs=jobs,
        end=end,
        warmup=cfg.warmup_h * HOUR,
        name="seed",
        meta={"seed": cfg.seed, "generator": "sim.seed", "load_scale": cfg.load_scale},
    )
