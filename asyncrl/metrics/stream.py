"""The run's metric stream on ZeroMQ: a forwarder, emitters that publish, subscribers that read.

::

    MetricsEmitter ─┐                                     ┌─► MetricsSubscriber (sinks)
    MetricsEmitter ─┼─► XSUB  MetricsForwarder  XPUB ─────┼─► MetricsSubscriber (dashboard)
    MetricsEmitter ─┘   publish endpoint   subscribe endpoint └─► ...

The launcher owns the forwarder; any process makes an emitter from the publish endpoint. A
publisher never blocks: a send that finds its queue full (``send_hwm``) is dropped and
counted in ``MetricsEmitter.dropped``; the forwarder keeps one queue of ``recv_hwm`` messages
per subscriber and drops for that subscriber alone when it is full. Every message carries a
per-source sequence number, so a subscriber counts what it missed (``MetricsSubscriber.dropped``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import zmq

from asyncrl.metrics.events import MetricEvent, MetricsWireError, decode, encode, finite

log = logging.getLogger("asyncrl.metrics")

MAX_MESSAGE_BYTES = 1 << 20
"""Largest message the forwarder takes from a publisher (an emit_many of a few hundred metrics is ~20 KiB)."""

ENDPOINTS_FILE = "metrics.endpoints.json"
"""Where the launcher writes the run's endpoints in its run directory."""


@dataclass(frozen=True)
class MetricsEndpoints:
    """Where publishers connect (``publish``) and subscribers connect (``subscribe``)."""

    publish: str
    subscribe: str

    def write(self, run_dir: str | Path) -> Path:
        path = Path(run_dir) / ENDPOINTS_FILE
        path.write_text(json.dumps(asdict(self)))
        return path

    @classmethod
    def read(cls, run_dir: str | Path) -> MetricsEndpoints | None:
        path = Path(run_dir) / ENDPOINTS_FILE
        if not path.exists():
            return None
        row = json.loads(path.read_text())
        return cls(publish=row["publish"], subscribe=row["subscribe"])


class MetricsForwarder:
    """An XSUB/XPUB proxy in a thread: many publishers in, many subscribers out."""

    def __init__(self, host: str = "127.0.0.1", *, recv_hwm: int = 100_000,
                 max_message_bytes: int = MAX_MESSAGE_BYTES):
        self._ctx = zmq.Context()
        self._xsub = self._ctx.socket(zmq.XSUB)
        self._xpub = self._ctx.socket(zmq.XPUB)
        self._xpub.setsockopt(zmq.SNDHWM, recv_hwm)  # per subscriber: a slow one drops, the rest go on
        self._xsub.setsockopt(zmq.RCVHWM, recv_hwm)
        # Bounded: a larger message (from no emitter of the run) drops its sender's connection.
        self._xsub.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        pub_port = self._xsub.bind_to_random_port(f"tcp://{host}")
        sub_port = self._xpub.bind_to_random_port(f"tcp://{host}")
        self.endpoints = MetricsEndpoints(publish=f"tcp://{host}:{pub_port}", subscribe=f"tcp://{host}:{sub_port}")
        self._control = f"inproc://metrics-control-{id(self)}"
        self._ctl_recv = self._ctx.socket(zmq.PAIR)
        self._ctl_recv.bind(self._control)
        self._ctl_send = self._ctx.socket(zmq.PAIR)
        self._ctl_send.connect(self._control)
        self._thread = threading.Thread(target=self._run, name="metrics-forwarder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            zmq.proxy_steerable(self._xsub, self._xpub, None, self._ctl_recv)
        except zmq.ContextTerminated:
            pass
        finally:
            for s in (self._xsub, self._xpub, self._ctl_recv):
                s.close(linger=0)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._thread.is_alive():
            self._ctl_send.send(b"TERMINATE")
            self._thread.join(timeout_s)
        self._ctl_send.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> MetricsForwarder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class MetricsEmitter:
    """Publish metric events from any process; never blocks the caller.

    The socket is an XPUB (a PUB that also hears subscriptions), so the constructor can wait
    up to ``ready_timeout_s`` for the forwarder to pass a subscription on: without that wait
    the first events after connecting would be dropped (ZeroMQ's slow joiner).
    """

    def __init__(self, publish: str, source: str, *, send_hwm: int = 10_000, ready_timeout_s: float = 2.0):
        self.source = source
        self.sent = 0
        """Messages handed to ZeroMQ."""
        self.dropped = 0
        """Messages dropped because the send queue was full."""
        self.skipped = 0
        """Values that were not finite numbers (NaN, inf, non-numbers) and were left out."""
        self._seq = 0
        self._lock = threading.Lock()
        self._sock = zmq.Context.instance().socket(zmq.XPUB)
        self._sock.setsockopt(zmq.SNDHWM, send_hwm)
        self._sock.setsockopt(zmq.LINGER, 1000)  # close() lets the last messages out for up to 1 s
        self._sock.connect(publish)
        self.ready = bool(self._sock.poll(int(ready_timeout_s * 1000), zmq.POLLIN))
        """True once a subscriber was heard of; False means early events may have been dropped."""

    def emit(self, name: str, value: float, *, step: int = -1, version: int = -1) -> None:
        self.emit_many({name: value}, step=step, version=version)

    def emit_many(self, values: Mapping[str, float], *, step: int = -1, version: int = -1) -> None:
        """Publish ``values`` (name -> number) as one message; non-finite values are skipped."""
        now = time.time()
        events = []
        for name, value in values.items():
            if isinstance(value, bool) or not finite(value):
                self.skipped += 1
                continue
            events.append(MetricEvent(name, float(value), int(step), int(version), now, self.source))
        if not events:
            return
        with self._lock:
            message = encode(self.source, self._seq, events)
            self._seq += 1
            try:
                self._sock.send(message, zmq.NOBLOCK)
                self.sent += 1
            except zmq.Again:
                self.dropped += 1

    @property
    def last_seq(self) -> int:
        """Sequence number of the last message emitted (-1: none yet)."""
        return self._seq - 1

    def close(self) -> None:
        with self._lock:
            self._sock.close()


class MetricsSubscriber:
    """Read the stream: `recv` returns the events of one message; drops are counted per source."""

    def __init__(self, subscribe: str, *, recv_hwm: int = 100_000):
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, recv_hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(subscribe)
        self.received = 0
        """Messages decoded."""
        self.malformed = 0
        """Messages that were not metric messages (logged once, skipped)."""
        self.dropped: dict[str, int] = {}
        """source -> messages missed (gaps in its sequence numbers)."""
        self._next_seq: dict[str, int] = {}

    def recv(self, timeout_s: float | None = None) -> list[MetricEvent]:
        """The events of the next message; [] when none arrived within ``timeout_s``."""
        if not self._sock.poll(None if timeout_s is None else int(timeout_s * 1000), zmq.POLLIN):
            return []
        message = self._sock.recv()
        try:
            source, seq, events = decode(message)
        except MetricsWireError as e:
            if not self.malformed:
                log.warning("metrics subscriber: skipping a malformed message (%s); later ones are only counted", e)
            self.malformed += 1
            return []
        expected = self._next_seq.get(source)
        if expected is not None and seq > expected:
            self.dropped[source] = self.dropped.get(source, 0) + seq - expected
        # seq < expected: the source restarted its numbering (a new process under the same name).
        self._next_seq[source] = seq + 1
        self.received += 1
        return events

    def seen(self, source: str) -> int:
        """The last sequence number received from ``source`` (-1: none yet)."""
        return self._next_seq.get(source, 0) - 1

    @property
    def total_dropped(self) -> int:
        return sum(self.dropped.values())

    def close(self) -> None:
        self._sock.close(linger=0)
