"""Trace replay: a generic CSV loader and adapters for public trace formats.

Formats (header row required; extra columns are ignored):

* ``generic``: ``submit_time, duration, num_gpu[, team, priority_class, max_runtime]``
  (seconds; ``priority_class`` one of prod-serving, prod-batch, research, preemptible).
* ``philly``: Microsoft ITP/Philly-style ``submission_time, duration, num_gpu`` (seconds,
  or ``YYYY-MM-DD HH:MM:SS`` timestamps for ``submission_time``); a ``vc`` (virtual
  cluster) or ``user`` column, if present, names the team.
* ``alibaba``: Alibaba GPU cluster trace 2023 pods (``openb_pod_list_*.csv``:
  ``creation_time, deletion_time, num_gpu, gpu_milli, qos`` and ``scheduled_time``,
  ``name``). Pods without GPUs are skipped; a pod sharing a GPU (``gpu_milli`` < 1000)
  gets one whole GPU (the engine allocates whole GPUs); the run time is
  ``deletion_time - scheduled_time`` (``- creation_time`` if never scheduled; such
  pending pods are skipped unless ``alibaba_pending``); ``qos`` maps to a class
  (``LS`` prod-serving, ``Guaranteed`` prod-batch, ``Burstable`` research, ``BE``
  preemptible by default). A pod list without times (``openb_pod_list_multigpu50.csv``:
  the default list's pods, then multi-GPU pods appended, with only ``name`` and resource
  columns) replays with ``times_from`` another pod list: a pod found there by ``name``
  takes its times and ``qos``; any other pod takes those of a GPU pod of that list drawn
  by a ``random.Random`` seeded with the run's seed and the pod's name (the report counts
  both: ``times_joined``, ``times_drawn``).

Options (``TraceOptions``): scale the arrival rate (``arrival_scale`` 2 = twice as many
submissions per hour) and job sizes (``size_scale``), pick a window (``start``,
``days``), assign teams (``teams`` N teams with equal guarantees summing to the
cluster; ``team_assign``: ``column`` uses the trace's team column when it has one,
else a stable hash of the job; ``hash``; ``round-robin``). Jobs whose trace has no
max_runtime get a user-style over-estimate; jobs longer than ``checkpoint_s`` checkpoint
every ``checkpoint_s``. Every draw comes from ``random.Random`` seeded explicitly.
"""

from __future__ import annotations

import csv
import math
import random
import zlib
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, overload

from sim.seed import user_max_runtime
from sim.workload import CLASSES, BlockSpec, ClusterSpec, SimJob, TeamSpec, Workload

FORMATS = ("generic", "philly", "alibaba")
DEFAULT_QOS_MAP = {
    "LS": "prod-serving",
    "Guaranteed": "prod-batch",
    "Burstable": "research",
    "BE": "preemptible",
}
_CLASS_ALIASES = {c: c for c in CLASSES} | {
    "serving": "prod-serving",
    "prod_serving": "prod-serving",
    "batch": "prod-batch",
    "prod_batch": "prod-batch",
    "prod": "prod-batch",
    "be": "preemptible",
    "best-effort": "preemptible",
    "spot": "preemptible",
}


class TraceError(ValueError):
    """A trace file that cannot be read (missing column, bad value): says which row."""


@dataclass(frozen=True)
class TraceOptions:
    format: str = "generic"
    arrival_scale: float = 1.0
    size_scale: float = 1.0
    duration_scale: float = 1.0
    start: float | None = None  # trace time of the window start (None: the first submission)
    days: float | None = None  # window length (None: up to the last submission)
    warmup_h: float = 0.0  # jobs submitted this long before the window start are replayed too
    teams: int = 8
    team_assign: str = "column"  # column | hash | round-robin
    default_class: str = "research"
    qos_map: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_QOS_MAP))
    alibaba_pending: bool = False
    checkpoint_s: float | None = 1800.0
    gpu_type: str = "h100"
    seed: int = 1
    block_pack_min_gpus: int = 64  # jobs at least this large ask for pack=block
    times_from: str | None = None  # alibaba: a pod list whose times (and qos) the pods take


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One job as read from a trace, before scaling and windowing."""

    key: str
    submit: float
    duration: float
    gpus: int
    team: str | None = None
    priority: str | None = None
    max_runtime: float | None = None
    fractional: bool = False


@overload
def _num(row: dict, col: str, line: int, required: Literal[True] = True) -> float: ...
@overload
def _num(row: dict, col: str, line: int, required: bool) -> float | None: ...
def _num(row: dict, col: str, line: int, required: bool = True) -> float | None:
    v = (row.get(col) or "").strip()
    if v == "":
        if required:
            raise TraceError(f"line {line}: column {col!r} is empty")
        return None
    try:
        return float(v)
    except ValueError:
        raise TraceError(f"line {line}: column {col!r} is not a number: {v!r}") from None


def _time(v: str, line: int, col: str) -> float:
    v = v.strip()
    try:
        return float(v)
    except ValueError:
        pass
    for fmt in ("%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S.%f"):
        try:
            return datetime.strptime(v, fmt).replace(tzinfo=UTC).timestamp()
        except ValueError:
            continue
    raise TraceError(f"line {line}: column {col!r}: not seconds or a timestamp: {v!r}")


def _require(header: list[str], cols: tuple[str, ...], fmt: str) -> None:
    missing = [c for c in cols if c not in header]
    if missing:
        raise TraceError(f"{fmt} trace: missing column(s) {missing} (header: {header})")


def _class(v: str | None, line: int) -> str | None:
    if v is None or not v.strip():
        return None
    c = _CLASS_ALIASES.get(v.strip().lower())
    if c is None:
        raise TraceError(f"line {line}: unknown priority_class {v!r} (one of {', '.join(CLASSES)})")
    return c


def read_rows(path: str | Path, opts: TraceOptions) -> tuple[list[TraceRow], dict]:
    """Parse a trace file into rows; returns (rows, counts of skipped/adjusted rows)."""
    fmt = opts.format
    if fmt not in FORMATS:
        raise TraceError(f"unknown trace format {fmt!r} (one of {', '.join(FORMATS)})")
    stats = {"rows": 0, "skipped_no_gpu": 0, "skipped_pending": 0, "skipped_bad_duration": 0, "fractional_gpu": 0}
    rows: list[TraceRow] = []
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        header = [h.strip() for h in (reader.fieldnames or [])]
        reader.fieldnames = header
        if fmt == "generic":
            _require(header, ("submit_time", "duration", "num_gpu"), fmt)
        elif fmt == "philly":
            _require(header, ("submission_time", "duration", "num_gpu"), fmt)
        elif opts.times_from is not None:
            _require(header, ("name", "num_gpu", "gpu_milli"), fmt)
        else:
            if "name" in header and "num_gpu" in header and "creation_time" not in header:
                raise TraceError(
                    f"{fmt} trace: no times (header: {header}); replay it with --times-from"
                    " a pod list that has them (openb_pod_list_default.csv)"
                )
            _require(header, ("creation_time", "deletion_time", "num_gpu", "gpu_milli", "qos"), fmt)
        times = _pod_times(opts.times_from) if fmt == "alibaba" and opts.times_from is not None else None
        if times is not None:
            stats["times_joined"] = stats["times_drawn"] = 0
        r: TraceRow | None
        for i, row in enumerate(reader, start=2):
            stats["rows"] += 1
            if fmt == "generic":
                r = _generic(row, i)
            elif fmt == "philly":
                r = _philly(row, i)
            else:
                if times is not None:
                    row = _with_times(row, i, times, opts.seed, stats)
                r = _alibaba(row, i, opts, stats)
            if r is None:
                continue
            if r.gpus <= 0:
                stats["skipped_no_gpu"] += 1
                continue
            if not r.duration > 0:
                stats["skipped_bad_duration"] += 1
                continue
            rows.append(r)
    return rows, stats


_TIME_COLUMNS = ("creation_time", "deletion_time", "scheduled_time", "qos")


def _pod_times(path: str) -> tuple[dict[str, dict], list[dict]]:
    """An Alibaba pod list's times by pod name, and the scheduled GPU pods' times in file
    order (the ones a pod without times of its own draws from)."""
    by_name: dict[str, dict] = {}
    gpu_pods: list[dict] = []
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        header = [h.strip() for h in (reader.fieldnames or [])]
        reader.fieldnames = header
        _require(header, ("name", "num_gpu", "creation_time", "deletion_time", "qos"), f"--times-from {path}")
        for i, row in enumerate(reader, start=2):
            t = {c: row.get(c, "") for c in _TIME_COLUMNS}
            by_name[(row.get("name") or "").strip()] = t
            if (row.get("scheduled_time") or "").strip() and _num(row, "num_gpu", i) > 0:
                gpu_pods.append(t)
    if not gpu_pods:
        raise TraceError(f"--times-from {path}: no scheduled GPU pods to take times from")
    return by_name, gpu_pods


def _with_times(row: dict, line: int, times: tuple[dict[str, dict], list[dict]], seed: int, stats: dict) -> dict:
    """The pod with the times of its namesake in ``times``, else of a GPU pod drawn from it."""
    by_name, gpu_pods = times
    name = (row.get("name") or "").strip()
    if not name:
        raise TraceError(f"line {line}: column 'name' is empty (needed to join times)")
    t = by_name.get(name)
    if t is not None:
        stats["times_joined"] += 1
    else:
        t = random.Random(f"{seed}:{name}").choice(gpu_pods)
        stats["times_drawn"] += 1
    return {**row, **t}


def _generic(row: dict, line: int) -> TraceRow:
    return TraceRow(
        key=(row.get("job_id") or row.get("name") or f"row{line}").strip(),
        submit=_num(row, "submit_time", line),
        duration=_num(row, "duration", line),
        gpus=int(_num(row, "num_gpu", line)),
        team=(row.get("team") or "").strip() or None,
        priority=_class(row.get("priority_class"), line),
        max_runtime=_num(row, "max_runtime", line, required=False) if "max_runtime" in row else None,
    )


def _philly(row: dict, line: int) -> TraceRow:
    team = (row.get("vc") or row.get("team") or row.get("user") or "").strip() or None
    return TraceRow(
        key=(row.get("job_id") or row.get("jobid") or f"row{line}").strip(),
        submit=_time(row["submission_time"], line, "submission_time"),
        duration=_num(row, "duration", line),
        gpus=int(_num(row, "num_gpu", line)),
        team=team,
        priority=None,
    )


def _alibaba(row: dict, line: int, opts: TraceOptions, stats: dict) -> TraceRow | None:
    n = int(_num(row, "num_gpu", line))
    if n <= 0:
        stats["skipped_no_gpu"] += 1
        return None
    created = _num(row, "creation_time", line)
    deleted = _num(row, "deletion_time", line)
    sched = _num(row, "scheduled_time", line, required=False) if "scheduled_time" in row else created
    if sched is None:
        if not opts.alibaba_pending:
            stats["skipped_pending"] += 1
            return None
        sched = created
    milli = _num(row, "gpu_milli", line, required=False)
    frac = milli is not None and milli < 1000
    if frac:
        stats["fractional_gpu"] += 1
    qos = (row.get("qos") or "").strip()
    cls = opts.qos_map.get(qos)
    if cls is None and qos:
        cls = opts.default_class
    return TraceRow(
        key=(row.get("name") or f"row{line}").strip(),
        submit=created,
        duration=deleted - sched,
        gpus=n,
        priority=cls,
        fractional=frac,
    )


def _shape(gpus: int, node_gpus: int) -> tuple[int, int]:
    """(replicas, gpus_per_replica): one replica up to a node; beyond, the largest divisor <= node size."""
    if gpus <= node_gpus:
        return 1, gpus
    for g in range(node_gpus, 0, -1):
        if gpus % g == 0:
            return gpus // g, g
    return gpus, 1  # pragma: no cover - g=1 always divides


def _scaled_gpus(gpus: int, scale: float, node_gpus: int) -> int:
    if scale == 1.0:
        return gpus
    g = max(1, round(gpus * scale))
    if g > node_gpus:
        g = math.ceil(g / node_gpus) * node_gpus
    return g


def load_trace(path: str | Path, cluster: ClusterSpec, opts: TraceOptions | None = None) -> Workload:
    opts = opts or TraceOptions()
    rows, stats = read_rows(path, opts)
    if not rows:
        raise TraceError(f"{path}: no jobs with GPUs")
    if opts.default_class not in CLASSES:
        raise TraceError(f"default class {opts.default_class!r} is not one of {', '.join(CLASSES)}")
    if opts.arrival_scale <= 0 or opts.size_scale <= 0 or opts.duration_scale <= 0:
        raise TraceError("scales must be > 0")
    rows.sort(key=lambda r: (r.submit, r.key))
    t0 = rows[0].submit if opts.start is None else opts.start
    # arrival scaling compresses trace time around the window start
    warm = opts.warmup_h * 3600.0
    node_gpus = cluster.node_gpus(opts.gpu_type)
    total = cluster.total_gpus(opts.gpu_type)
    last = (rows[-1].submit - t0) / opts.arrival_scale
    end = opts.days * 86_400.0 if opts.days is not None else max(last + 1.0, 1.0)
    rng = random.Random(f"gpufleet-trace:{opts.seed}")
    team_names = [f"team{i:02d}" for i in range(max(1, opts.teams))]
    col_teams = sorted({r.team for r in rows if r.team}) if opts.team_assign == "column" else []
    use_col = opts.team_assign == "column" and bool(col_teams)
    if use_col and len(col_teams) > opts.teams:
        # fold the trace's teams into N by a stable hash
        fold = {t: team_names[zlib.crc32(t.encode()) % len(team_names)] for t in col_teams}
    elif use_col:
        fold = {t: t for t in col_teams}
        team_names = col_teams
    else:
        fold = {}
    jobs: list[SimJob] = []
    too_big = 0
    for idx, r in enumerate(rows):
        submit = (r.submit - t0) / opts.arrival_scale
        if submit < -warm or submit >= end:
            continue
        gpus = _scaled_gpus(r.gpus, opts.size_scale, node_gpus)
        if gpus > total:
            too_big += 1
            continue
        reps, gpr = _shape(gpus, node_gpus)
        if use_col:
            team = fold.get(r.team) if r.team else team_names[zlib.crc32(r.key.encode()) % len(team_names)]
        elif opts.team_assign == "round-robin":
            team = team_names[idx % len(team_names)]
        elif opts.team_assign in ("hash", "column"):
            team = team_names[zlib.crc32(r.key.encode()) % len(team_names)]
        else:
            raise TraceError(f"unknown team assignment {opts.team_assign!r} (column, hash, round-robin)")
        cls = r.priority or opts.default_class
        work = r.duration * opts.duration_scale
        if r.max_runtime is not None and r.max_runtime > 0:
            mrt = r.max_runtime * opts.duration_scale
        else:
            mrt = user_max_runtime(rng, work, cls)
        ck = opts.checkpoint_s if opts.checkpoint_s and work > opts.checkpoint_s and cls != "prod-serving" else None
        jobs.append(
            SimJob(
                job_id="",
                team=team or team_names[0],
                priority=cls,
                submit=submit,
                work_s=work,
                max_runtime_s=mrt,
                replicas=reps,
                gpus_per_replica=gpr,
                gpu_type=opts.gpu_type,
                pack="block" if gpus >= opts.block_pack_min_gpus else "any",
                checkpoint_s=ck,
                grace_s=120.0 if gpus >= 1024 else (60.0 if gpus > node_gpus else 30.0),
                kind=r.key,
            )
        )
    width = max(6, len(str(len(jobs))))
    jobs = [replace(j, job_id=f"t{i:0{width}d}") for i, j in enumerate(jobs)]
    teams = _even_teams(team_names, opts.gpu_type, total)
    stats.update({"jobs": len(jobs), "too_big_for_cluster": too_big, "format": opts.format, "file": Path(path).name})
    return Workload(
        cluster=cluster,
        teams=teams,
        jobs=tuple(jobs),
        end=end,
        warmup=warm,
        name=f"trace:{Path(path).name}",
        meta={
            "trace": stats,
            "arrival_scale": opts.arrival_scale,
            "size_scale": opts.size_scale,
            "duration_scale": opts.duration_scale,
            "team_assign": "column" if use_col else (opts.team_assign if opts.team_assign != "column" else "hash"),
        },
    )


def _even_teams(names: list[str], gpu_type: str, total: int) -> tuple[TeamSpec, ...]:
    """Equal guarantees summing to the cluster; each team may borrow the rest."""
    n = len(names)
    base, extra = divmod(total, n)
    out = []
    for i, name in enumerate(names):
        g = base + (1 if i < extra else 0)
        out.append(TeamSpec(name, ((gpu_type, g, total - g),)))
    return tuple(out)


def load_topology_csv(path: str | Path, gpus_per_node: int = 8, gpu_type: str = "h100") -> ClusterSpec:
    """A cluster from a host-to-switch map (Alibaba Lingjun ``topo.csv``: ``ip, DSW, PSW, ASW``):
    one block per top-of-rack switch (``PSW``, ``ASW`` pair), blocks of uneven size."""
    counts: dict[str, int] = {}
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        header = [h.strip() for h in (reader.fieldnames or [])]
        reader.fieldnames = header
        _require(header, ("PSW", "ASW"), "topology")
        for row in reader:
            key = f"{row['PSW'].strip()}-{row['ASW'].strip()}"
            counts[key] = counts.get(key, 0) + 1
    blocks = tuple(BlockSpec(k, gpu_type, n, gpus_per_node) for k, n in sorted(counts.items()))
    return ClusterSpec(blocks)
