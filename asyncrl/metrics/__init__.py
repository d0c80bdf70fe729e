"""The run's metric stream: events, the forwarder, emitters, subscribers, sinks (see docs/metrics.md)."""

from asyncrl._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(__name__, {
    "MetricsConfig": "asyncrl.metrics.config",
    "SINKS": "asyncrl.metrics.config",
    "MetricEvent": "asyncrl.metrics.events",
    "MetricsForwarder": "asyncrl.metrics.stream",
    "MetricsEmitter": "asyncrl.metrics.stream",
    "MetricsSubscriber": "asyncrl.metrics.stream",
    "MetricsEndpoints": "asyncrl.metrics.stream",
    "MetricsService": "asyncrl.metrics.service",
})
