"""Prometheus metrics of one agent process: its nodes' GPUs (docs/design.md, Observability).

Served as ``GET /metrics`` on the agent's HTTP server (``worker_agent.log_http``). A custom
collector reads each hosted node's latest GPU samples (taken by its heartbeats) when
Prometheus scrapes: no gauges to keep in step, and a node no longer hosted simply
disappears. A scrape copies what it reads on the event loop (where the nodes change) and
renders the text in a thread: a process hosting thousands of simulated nodes takes seconds
to render, which its heartbeats must not wait for. Labels are ``node`` and ``gpu`` (the index on the node); the GPU's UUID is only
on ``gpufleet_gpu_info``, so a swapped board can be told without multiplying every series.
Nothing here names a job or carries a secret: the endpoint needs no auth.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from worker_agent.nvml import DEGRADED, FAILED, OK, UNKNOWN, GpuSample

HEALTH_STATES = (OK, DEGRADED, FAILED, UNKNOWN)

# every family as it appears in the exposition text (a dashboard's queries are checked against these)
METRIC_NAMES = (
    "gpufleet_gpu_info",
    "gpufleet_gpu_utilization_percent",
    "gpufleet_gpu_sm_active_percent",
    "gpufleet_gpu_memory_used_bytes",
    "gpufleet_gpu_memory_total_bytes",
    "gpufleet_gpu_temperature_celsius",
    "gpufleet_gpu_power_watts",
    "gpufleet_gpu_ecc_errors_total",
    "gpufleet_gpu_xid_errors_total",
    "gpufleet_gpu_health",
    "gpufleet_gpu_allocated",
    "gpufleet_agent_nodes",
    "gpufleet_agent_running_ranks",
)

GPU = ["node", "gpu"]


@dataclass(frozen=True)
class NodeView:
    """What a scrape reads of one node."""

    node_id: str
    samples: tuple[GpuSample, ...]
    allocated: frozenset[int]
    running: int


def snapshot(nodes: Mapping[str, Any]) -> list[NodeView]:
    """Copy the hosted nodes' (``NodeAgent``) latest samples and leases; call on their event loop."""
    return [
        NodeView(node_id, tuple(node.samples), frozenset(node.allocated_gpus()), len(node.running()))
        for node_id, node in nodes.items()
    ]


class AgentCollector(Collector):
    """The families of ``METRIC_NAMES`` from the node views ``views()`` returns at collect time."""

    def __init__(self, views: Callable[[], Sequence[NodeView]]) -> None:
        self._views = views

    def collect(self) -> Iterable[Metric]:
        info = InfoMetricFamily("gpufleet_gpu", "a GPU of a node and its UUID", labels=GPU)
        util = GaugeMetricFamily(
            "gpufleet_gpu_utilization_percent", "share of time a kernel ran on the GPU (NVML)", labels=GPU
        )
        sm_active = GaugeMetricFamily(
            "gpufleet_gpu_sm_active_percent", "share of SMs busy (GPU performance monitoring)", labels=GPU
        )
        mem_used = GaugeMetricFamily("gpufleet_gpu_memory_used_bytes", "GPU memory in use", labels=GPU)
        mem_total = GaugeMetricFamily("gpufleet_gpu_memory_total_bytes", "GPU memory in all", labels=GPU)
        temp = GaugeMetricFamily("gpufleet_gpu_temperature_celsius", "GPU die temperature", labels=GPU)
        power = GaugeMetricFamily("gpufleet_gpu_power_watts", "GPU board power draw", labels=GPU)
        ecc = CounterMetricFamily(
            "gpufleet_gpu_ecc_errors", "ECC errors since the driver loaded (volatile)", labels=[*GPU, "kind"]
        )
        xid = CounterMetricFamily("gpufleet_gpu_xid_errors", "Xid errors seen since the agent started", labels=GPU)
        health = GaugeMetricFamily(
            "gpufleet_gpu_health", "1 for the GPU's current health state", labels=[*GPU, "state"]
        )
        allocated = GaugeMetricFamily("gpufleet_gpu_allocated", "1 if a live lease's rank uses the GPU", labels=GPU)
        hosted = self._views()
        for node in hosted:
            for s in node.samples:
                lv = [node.node_id, str(s.index)]
                info.add_metric(lv, {"gpu_uuid": s.uuid})
                for family, value in (
                    (util, s.sm_util),
                    (sm_active, s.sm_active),
                    (mem_used, s.mem_used),
                    (mem_total, s.mem_total),
                    (temp, s.temperature_c),
                    (power, s.power_w),
                ):
                    if value is not None:  # not read on this GPU: no series rather than a made-up 0
                        family.add_metric(lv, float(value))
                if s.ecc_sbe is not None:
                    ecc.add_metric([*lv, "corrected"], float(s.ecc_sbe))
                if s.ecc_dbe is not None:
                    ecc.add_metric([*lv, "uncorrected"], float(s.ecc_dbe))
                xid.add_metric(lv, float(s.xid_count))
                for state in HEALTH_STATES:
                    health.add_metric([*lv, state], 1.0 if s.health == state else 0.0)
                allocated.add_metric(lv, 1.0 if s.index in node.allocated else 0.0)
        yield from (info, util, sm_active, mem_used, mem_total, temp, power, ecc, xid, health, allocated)
        yield GaugeMetricFamily("gpufleet_agent_nodes", "nodes hosted by this agent process", value=len(hosted))
        yield GaugeMetricFamily(
            "gpufleet_agent_running_ranks", "live ranks on this process's nodes", value=sum(n.running for n in hosted)
        )


class AgentMetrics:
    """The agent process's registry (its own, not the global one: tests run several agents in
    one process) over the nodes it hosts (node id -> ``NodeAgent``, a live dict)."""

    def __init__(self, nodes: Mapping[str, Any]) -> None:
        self.nodes = nodes
        self._views: list[NodeView] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(AgentCollector(lambda: self._views))

    async def scrape(self) -> bytes:
        """The exposition text of the nodes as they are now."""
        # two scrapes at once may both render the later copy: both are the latest readings
        self._views = snapshot(self.nodes)
        return await asyncio.to_thread(generate_latest, self.registry)
