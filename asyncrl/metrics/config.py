"""`MetricsConfig`: which sinks record the run's metric stream, and the stream's limits."""

from __future__ import annotations

from dataclasses import dataclass, field

SINKS = ("jsonl", "console", "tensorboard", "prometheus", "wandb")
"""Sink names `MetricsConfig.sinks` accepts (one file per backend in `asyncrl.metrics.sinks`)."""


@dataclass(kw_only=True)
class MetricsConfig:
    """Settings of the metrics stream, its sinks and the live dashboard."""

    enabled: bool = True
    """Run the metric stream at all; False leaves the launcher's metrics.jsonl and progress view only."""
    sinks: list[str] = field(default_factory=lambda: ["jsonl", "console"])
    """Sinks of the stream; ``jsonl`` (``<run_dir>/events.jsonl``) is always on, ``console`` is the
    launcher's progress view (always on too)."""
    poll_interval_s: float = 1.0
    """How often the Rollouter process reports its counters, the stream's and the engines' stats."""
    send_hwm: int = 10_000
    """Messages a publisher queues before it drops (a publisher never blocks)."""
    recv_hwm: int = 100_000
    """Messages a subscriber queues before the forwarder drops for it (its drops are counted)."""
    prometheus_port: int = 9464
    """Port of the Prometheus ``/metrics`` endpoint (0 picks a free one)."""
    host: str = "127.0.0.1"
    """Address the Prometheus endpoint and the dashboard bind to (loopback unless told otherwise)."""
    tensorboard_dir: str | None = None
    """TensorBoard event directory (default ``<run_dir>/tensorboard``)."""
    wandb_project: str = "asyncrl"
    """wandb project of the ``wandb`` sink (runs in offline mode unless WANDB_MODE says otherwise)."""
    dashboard: bool = False
    """Serve the live dashboard from the launcher."""
    dashboard_port: int = 8050
    """Port of the live dashboard (0 picks a free one)."""

    def __post_init__(self) -> None:
        self.sinks = list(self.sinks)
        unknown = [s for s in self.sinks if s not in SINKS]
        if unknown:
            raise ValueError(f"MetricsConfig.sinks has unknown sink(s) {unknown}; choose from {list(SINKS)}")
        if "jsonl" not in self.sinks:
            self.sinks.insert(0, "jsonl")
        if self.poll_interval_s <= 0:
            raise ValueError(f"MetricsConfig.poll_interval_s must be > 0, got {self.poll_interval_s}")
        for name in ("send_hwm", "recv_hwm"):
            if getattr(self, name) < 1:
                raise ValueError(f"MetricsConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prometheus_port", "dashboard_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ValueError(f"MetricsConfig.{name} must be a port in 0..65535, got {getattr(self, name)}")
