"""What a simulation runs: the cluster shape, the teams and their quotas, the jobs.

Everything here is a plain value, produced by a generator (``sim.seed``) or a trace
loader (``sim.traces``) and consumed by the event loop (``sim.core``). Times are
float seconds relative to the start of the measured window (``Workload.start`` = 0);
a warm-up period has negative submit times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

CLASSES = ("prod-serving", "prod-batch", "research", "preemptible")
SIZE_BUCKETS = ("<=8", "9-1023", ">=1024")


def size_bucket(gpus: int) -> str:
    if gpus <= 8:
        return "<=8"
    if gpus < 1024:
        return "9-1023"
    return ">=1024"


@dataclass(frozen=True, slots=True)
class BlockSpec:
    block_id: str
    gpu_type: str
    nodes: int
    gpus_per_node: int = 8


@dataclass(frozen=True)
class ClusterSpec:
    """Blocks of nodes; node ids are ``{block}-n{index}`` (zero-padded), in block order."""

    blocks: tuple[BlockSpec, ...]

    @staticmethod
    def uniform(
        nodes: int = 3000, block_nodes: int = 32, gpus_per_node: int = 8, gpu_type: str = "h100"
    ) -> ClusterSpec:
        if nodes < 1 or block_nodes < 1:
            raise ValueError("nodes and block_nodes must be >= 1")
        n_blocks = math.ceil(nodes / block_nodes)
        width = max(3, len(str(n_blocks - 1)))
        out = []
        left = nodes
        for b in range(n_blocks):
            k = min(block_nodes, left)
            left -= k
            out.append(BlockSpec(f"b{b:0{width}d}", gpu_type, k, gpus_per_node))
        return ClusterSpec(tuple(out))

    def node_ids(self) -> list[tuple[str, str, str, int]]:
        """(node_id, block_id, gpu_type, gpus) for every node, in a fixed order."""
        out = []
        for b in self.blocks:
            width = max(2, len(str(b.nodes - 1)))
            for i in range(b.nodes):
                out.append((f"{b.block_id}-n{i:0{width}d}", b.block_id, b.gpu_type, b.gpus_per_node))
        return out

    @property
    def total_nodes(self) -> int:
        return sum(b.nodes for b in self.blocks)

    def total_gpus(self, gpu_type: str | None = None) -> int:
        return sum(b.nodes * b.gpus_per_node for b in self.blocks if gpu_type is None or b.gpu_type == gpu_type)

    def gpu_types(self) -> tuple[str, ...]:
        return tuple(sorted({b.gpu_type for b in self.blocks}))

    def node_gpus(self, gpu_type: str) -> int:
        for b in self.blocks:
            if b.gpu_type == gpu_type:
                return b.gpus_per_node
        raise KeyError(gpu_type)

    def min_blocks(self, gpu_type: str, nodes: int) -> int:
        """Fewest blocks of a type that hold ``nodes`` whole nodes (largest blocks first)."""
        sizes = sorted((b.nodes for b in self.blocks if b.gpu_type == gpu_type), reverse=True)
        got = 0
        for i, s in enumerate(sizes, 1):
            got += s
            if got >= nodes:
                return i
        return len(sizes) + 1  # cannot fit at all


@dataclass(frozen=True, slots=True)
class TeamSpec:
    """A team's quota per GPU type: ``{gpu_type: (guaranteed, borrow_limit)}``."""

    name: str
    quotas: tuple[tuple[str, int, int], ...]

    def guaranteed(self, gpu_type: str) -> int:
        for t, g, _ in self.quotas:
            if t == gpu_type:
                return g
        return 0


@dataclass(frozen=True, slots=True)
class SimJob:
    """One submission.

    ``work_s`` is how long the job really runs (uninterrupted); ``max_runtime_s`` is what
    the user declared (usually an over-estimate; a job still running at its max_runtime
    is TIMED_OUT). ``checkpoint_s``: interval between checkpoints (None: the job cannot
    checkpoint; a preemption or failure loses all its work and it restarts from scratch).
    """

    job_id: str
    team: str
    priority: str
    submit: float
    work_s: float
    max_runtime_s: float
    replicas: int = 1
    gpus_per_replica: int = 1
    gpu_type: str = "h100"
    pack: str = "any"
    max_blocks: int | None = None
    max_blocks_wait_s: float | None = None  # None: max_blocks is a hard limit
    checkpoint_s: float | None = None
    grace_s: float = 30.0
    kind: str = ""

    @property
    def gpus(self) -> int:
        return self.replicas * self.gpus_per_replica


@dataclass(frozen=True)
class Workload:
    """A full scenario. Metrics cover ``[0, end]``; jobs may be submitted from ``-warmup``."""

    cluster: ClusterSpec
    teams: tuple[TeamSpec, ...]
    jobs: tuple[SimJob, ...]
    end: float
    warmup: float = 0.0
    name: str = "workload"
    meta: dict = field(default_factory=dict)

    def summary(self) -> dict:
        measured = [j for j in self.jobs if 0.0 <= j.submit < self.end]
        per_class = {c: 0 for c in CLASSES}
        per_bucket = {b: 0 for b in SIZE_BUCKETS}
        gpu_h = 0.0
        large_h = 0.0

        def within(j: SimJob) -> float:  # GPU-hours it asks for inside the window
            return j.gpus * max(0.0, min(j.work_s, j.max_runtime_s, self.end - j.submit)) / 3600.0

        for j in measured:
            per_class[j.priority] = per_class.get(j.priority, 0) + 1
            per_bucket[size_bucket(j.gpus)] += 1
            gpu_h += within(j)
            if j.gpus >= 1024:
                large_h += within(j)
        return {
            "name": self.name,
            "nodes": self.cluster.total_nodes,
            "gpus": self.cluster.total_gpus(),
            "blocks": len(self.cluster.blocks),
            "teams": len(self.teams),
            "days": round(self.end / 86400.0, 4),
            "warmup_h": round(self.warmup / 3600.0, 4),
            "jobs_total": len(self.jobs),
            "jobs_measured": len(measured),
            "jobs_per_class": per_class,
            "jobs_per_size": per_bucket,
            "share_le8": round(per_bucket["<=8"] / len(measured), 4) if measured else None,
            "offered_gpu_hours": round(gpu_h, 1),  # jobs submitted in the window, cut at its end
            "offered_load": round(gpu_h / (self.cluster.total_gpus() * self.end / 3600.0), 4) if self.end else None,
            "large_gang_share_of_gpu_hours": round(large_h / gpu_h, 4) if gpu_h else None,
            **self.meta,
        }
