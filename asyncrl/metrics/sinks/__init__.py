"""Sinks record the metric stream: one interface (`base.Sink`), one file per backend."""

from asyncrl.metrics.sinks.base import Sink, SinkSet, SinkUnavailable, open_sinks

__all__ = ["Sink", "SinkSet", "SinkUnavailable", "open_sinks"]
