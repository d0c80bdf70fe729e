"""The sink interface and `SinkSet`, which keeps the run going when a sink fails.

A sink that cannot open (port taken, package missing) or fails while writing (disk full) is
reported once, on the ``asyncrl.metrics`` logger and stderr, and switched off; the others and
the run go on.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from asyncrl.importpath import load_path
from asyncrl.metrics.config import MetricsConfig
from asyncrl.metrics.events import MetricEvent

log = logging.getLogger("asyncrl.metrics")

BACKENDS = {
    "jsonl": "asyncrl.metrics.sinks.jsonl:JsonlSink",
    "tensorboard": "asyncrl.metrics.sinks.tensorboard:TensorBoardSink",
    "prometheus": "asyncrl.metrics.sinks.prometheus:PrometheusSink",
    "wandb": "asyncrl.metrics.sinks.wandb:WandbSink",
}


class SinkUnavailable(RuntimeError):
    """A sink cannot run here (its package is missing, its port is taken); says why."""


class Sink(Protocol):
    """Where events go. Backends are built as ``Backend(cfg, run_dir, **options)``."""

    name: str

    def write(self, events: Sequence[MetricEvent]) -> None:
        """Record one message's events (called from one thread only)."""

    def flush(self) -> None:
        """Make what was written durable/visible."""

    def close(self) -> None:
        """Flush and release files, sockets, threads."""


class SinkSet:
    """The open sinks; a failing one is reported once and dropped."""

    def __init__(self, sinks: Sequence[Sink]):
        self.sinks = list(sinks)
        self.failed: dict[str, str] = {}
        """sink name -> why it was switched off."""

    def write(self, events: Sequence[MetricEvent]) -> None:
        for sink in list(self.sinks):
            self._guard(sink, "write", sink.write, events)

    def flush(self) -> None:
        for sink in list(self.sinks):
            self._guard(sink, "flush", sink.flush)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # closing is best effort: the run is over
                log.warning("metrics sink %r failed to close: %s", sink.name, e)
        self.sinks = []

    def _guard(self, sink: Sink, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:
            self.report(sink.name, f"{what} failed: {type(e).__name__}: {e}")
            self.sinks.remove(sink)
            try:
                sink.close()
            except Exception:
                pass

    def report(self, name: str, why: str) -> None:
        self.failed[name] = why
        # printed, not logged: the launcher configures no logging handler, and this must be seen once
        print(f"asyncrl: metrics sink {name!r} is off: {why}; the run goes on without it", file=sys.stderr, flush=True)


def open_sinks(cfg: MetricsConfig, run_dir: str | Path, **options) -> SinkSet:
    """Open the sinks ``cfg.sinks`` names; ``options`` go to the backends that take them.

    ``console`` is the launcher's progress view (`asyncrl.progress`), not a stream sink.
    """
    out = SinkSet([])
    for name in (s for s in cfg.sinks if s in BACKENDS):
        try:
            cls = load_path(BACKENDS[name], f"metrics.sinks[{name}]", ImportError)
            out.sinks.append(cls(cfg, Path(run_dir), **options))
        except Exception as e:  # SinkUnavailable, OSError (port taken, disk), ImportError
            out.report(name, f"cannot open: {type(e).__name__}: {e}")
    return out
