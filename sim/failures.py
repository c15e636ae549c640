"""GPU and node faults: a schedule drawn once per run, shared by every policy.

Faults arrive as a Poisson process at ``rate_per_gpu_hour`` x the cluster's GPUs
(default 2e-5 per GPU-hour: the Llama 3 report counts 419 unexpected interruptions
in 54 days on 16,384 GPUs, i.e. ~2e-5). Each fault hits one node (weighted by its
GPU count). A GPU fault (fatal Xid, double-bit ECC, link fault) cordons the node at
once; a node fault takes it down. Either way every gang on the node fails as a whole
(one bad GPU fails its whole gang) and is re-queued ahead of its class, resuming from
its last checkpoint; prod-serving loses only the replicas on that node. The node is
repaired, passes burn-in, and comes back ``ready``.

A fault that hits a node that is not ready at that moment (already down, in repair
or burn-in) is dropped by the simulator, so the same schedule gives the same faults
under every policy.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from sim.workload import ClusterSpec


@dataclass(frozen=True, slots=True)
class FailureModel:
    rate_per_gpu_hour: float = 2e-5
    gpu_fault_share: float = 0.7  # the rest are whole-node faults
    gpu_repair_median_s: float = 2 * 3600.0  # swap / reset, then burn-in
    node_repair_median_s: float = 8 * 3600.0
    repair_sigma: float = 0.6  # lognormal spread of repair times
    burn_in_s: float = 2 * 3600.0


@dataclass(frozen=True, slots=True)
class Fault:
    time: float
    node_index: int  # index into ClusterSpec.node_ids()
    kind: str  # "gpu" (node cordoned) or "node" (node down)
    repair_s: float
    burn_in_s: float


def fault_schedule(
    cluster: ClusterSpec, model: FailureModel, start: float, end: float, rng: random.Random
) -> tuple[Fault, ...]:
    """Faults in ``[start, end)``, drawn from ``rng``."""
    if model.rate_per_gpu_hour <= 0 or end <= start:
        return ()
    nodes = cluster.node_ids()
    weights = [g for _, _, _, g in nodes]
    cum = []
    acc = 0
    for w in weights:
        acc += w
        cum.append(acc)
    total_gpus = acc
    rate_per_s = model.rate_per_gpu_hour * total_gpus / 3600.0
    out: list[Fault] = []
    t = start
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= end:
            break
        x = rng.random() * total_gpus
        lo, hi = 0, len(cum) - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if cum[mid] > x:
                hi = mid
            else:
                lo = mid + 1
        kind = "gpu" if rng.random() < model.gpu_fault_share else "node"
        median = model.gpu_repair_median_s if kind == "gpu" else model.node_repair_median_s
        repair = median * math.exp(rng.gauss(0.0, model.repair_sigma))
        out.append(Fault(t, lo, kind, repair, model.burn_in_s))
    return tuple(out)
