"""Prometheus sink: a ``/metrics`` endpoint (prometheus-client) with the latest value of each metric.

``fully_async/trainer/idle_ratio`` from source ``trainer`` becomes the gauge
``asyncrl_fully_async_trainer_idle_ratio{source="trainer"}``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from asyncrl.metrics.config import MetricsConfig
from asyncrl.metrics.events import MetricEvent


def prometheus_name(name: str) -> str:
    return "asyncrl_" + re.sub(r"[^a-zA-Z0-9_]", "_", name)


class PrometheusSink:
    name = "prometheus"

    def __init__(self, cfg: MetricsConfig, run_dir: Path, **_):
        from prometheus_client import CollectorRegistry, start_http_server

        self.registry = CollectorRegistry()
        self._gauges: dict[str, object] = {}
        self._server, self._thread = start_http_server(cfg.prometheus_port, addr=cfg.host, registry=self.registry)
        self.port = self._server.server_port
        self.url = f"http://{cfg.host}:{self.port}/metrics"

    def write(self, events: Sequence[MetricEvent]) -> None:
        from prometheus_client import Gauge

        for e in events:
            gauge = self._gauges.get(e.name)
            if gauge is None:
                gauge = self._gauges[e.name] = Gauge(prometheus_name(e.name), e.name, ["source"],
                                                     registry=self.registry)
            gauge.labels(source=e.source).set(e.value)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
