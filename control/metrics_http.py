"""Serve a control process's Prometheus metrics over HTTP (``settings.control_metrics_listen``).

The exposition is the process's own registry (control/leader/metrics.py) plus the
process-wide default one (the health monitor's families, and the Python process's own).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.registry import Collector

from common.embedded import parse_listen

log = logging.getLogger("gpufleet.control.metrics")


class _Both(Collector):
    def __init__(self, own: CollectorRegistry) -> None:
        self.own = own

    def collect(self) -> Iterable[Any]:
        yield from REGISTRY.collect()
        yield from self.own.collect()


class MetricsServer:
    def __init__(self, own: CollectorRegistry, listen: str) -> None:
        self.host, self.port = parse_listen(listen)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Both(own))
        self._server: Any = None
        self.url = ""

    def start(self) -> str:
        self._server, _thread = start_http_server(self.port, addr=self.host, registry=self.registry)
        port = self._server.server_address[1]
        self.url = f"http://{self.host}:{port}/metrics"
        log.info("metrics at %s", self.url)
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
