"""`MetricsService`: the launcher's side of the metric stream (forwarder, sinks).

The live dashboard subscribes to the same stream; the launcher starts it beside this service
(`asyncrl.processes`), so metrics/ never imports dashboard/.

::

    service = MetricsService(MetricsConfig(), run_dir)
    emitter = service.emitter("trainer")   # other processes: MetricsEmitter(service.endpoints.publish, ...)
    ...
    service.close()                        # drains the stream into the sinks, then stops

The sinks run in one thread of the launcher that subscribes to the stream like any other
subscriber, so a slow sink costs the run nothing but that subscriber's drops (reported at
close).
"""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

from asyncrl.metrics.config import MetricsConfig
from asyncrl.metrics.sinks import open_sinks
from asyncrl.metrics.stream import MetricsEmitter, MetricsForwarder, MetricsSubscriber

log = logging.getLogger("asyncrl.metrics")

_QUIET_S = 0.2  # at close: the stream counts as drained after this long without a message


class MetricsService:
    def __init__(self, cfg: MetricsConfig, run_dir: str | Path):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.forwarder = MetricsForwarder(cfg.host, recv_hwm=cfg.recv_hwm)
        self.endpoints = self.forwarder.endpoints
        self.endpoints.write(self.run_dir)
        self.sinks = open_sinks(cfg, self.run_dir)
        self._subscriber = MetricsSubscriber(self.endpoints.subscribe, recv_hwm=cfg.recv_hwm)
        self._stop = threading.Event()
        self._seen = threading.Condition()
        self._thread = threading.Thread(target=self._record, name="metrics-sinks", daemon=True)
        self._thread.start()
        self.reporter = None
        """The launcher's `TrainerReporter`, once it has made one."""

    def emitter(self, source: str) -> MetricsEmitter:
        return MetricsEmitter(self.endpoints.publish, source, send_hwm=self.cfg.send_hwm)

    def _record(self) -> None:
        while True:
            events = self._subscriber.recv(timeout_s=_QUIET_S)
            if events:
                self.sinks.write(events)
                if self._subscriber.received % 16 == 0:
                    self.sinks.flush()
                with self._seen:
                    self._seen.notify_all()
            else:
                self.sinks.flush()
                if self._stop.is_set():
                    return

    def wait_recorded(self, emitter: MetricsEmitter, timeout_s: float = 5.0) -> bool:
        """Wait until the sinks have what ``emitter`` published so far; False at the deadline."""
        last = emitter.last_seq
        with self._seen:
            return self._seen.wait_for(lambda: self._subscriber.seen(emitter.source) >= last, timeout_s)

    def close(self) -> None:
        """Drain what was published into the sinks, close them, stop the forwarder."""
        if self.reporter is not None:
            self.reporter.emitter.close()  # lingers until its last messages are out
        self._stop.set()
        self._thread.join(30)
        self.sinks.close()
        dropped = self._subscriber.dropped
        if any(dropped.values()):
            print(f"asyncrl: the metrics sinks missed messages (per source: {dropped}); "
                  f"raise MetricsConfig.recv_hwm", file=sys.stderr, flush=True)
        self._subscriber.close()
        self.forwarder.close()
