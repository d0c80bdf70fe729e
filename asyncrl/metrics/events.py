"""Metric events and their wire format (msgpack, no pickle).

One message carries the events one publisher emitted together (a train step's metrics, one
poll of the engines)::

    {"v": 1, "source": "trainer", "seq": 17, "events": [[name, value, step, version, time], ...]}

``seq`` counts a source's messages from 0, so a subscriber that sees 15 then 17 knows it
missed one. ``step`` and ``version`` are -1 where the emitter does not know them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import msgpack

WIRE_VERSION = 1


class MetricsWireError(ValueError):
    """A metrics message that is not in the format above (names what is wrong)."""


@dataclass(slots=True, frozen=True)
class MetricEvent:
    """One measurement: ``name`` had ``value`` at ``time`` (unix s) in ``source``."""

    name: str
    value: float
    step: int = -1
    """Trainer step the value belongs to (-1: none)."""
    version: int = -1
    """Policy version (weight syncs so far) when measured (-1: unknown)."""
    time: float = 0.0
    source: str = ""
    """Emitting process: ``trainer``, ``rollouter``, ``launcher``, ..."""

    def to_json(self) -> dict:
        return {"name": self.name, "value": self.value, "step": self.step, "version": self.version,
                "time": self.time, "source": self.source}

    @classmethod
    def from_json(cls, row: dict) -> MetricEvent:
        try:
            return cls(name=str(row["name"]), value=float(row["value"]), step=int(row.get("step", -1)),
                       version=int(row.get("version", -1)), time=float(row.get("time", 0.0)),
                       source=str(row.get("source", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise MetricsWireError(f"not a metric event ({type(e).__name__}: {e}): {row!r}") from None


def encode(source: str, seq: int, events: Iterable[MetricEvent]) -> bytes:
    rows = [[e.name, e.value, e.step, e.version, e.time] for e in events]
    return msgpack.packb({"v": WIRE_VERSION, "source": source, "seq": seq, "events": rows}, use_bin_type=True)


def decode(message: bytes) -> tuple[str, int, list[MetricEvent]]:
    """message -> (source, seq, events); `MetricsWireError` names what is malformed."""
    try:
        obj = msgpack.unpackb(message, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for bad bytes
        raise MetricsWireError(f"metrics message is not msgpack ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict) or obj.get("v") != WIRE_VERSION:
        raise MetricsWireError(f"metrics message: expected a map with v={WIRE_VERSION}, got {str(obj)[:80]!r}")
    source, seq, rows = obj.get("source"), obj.get("seq"), obj.get("events")
    if not isinstance(source, str) or not isinstance(seq, int) or not isinstance(rows, list):
        raise MetricsWireError("metrics message: 'source' (str), 'seq' (int) and 'events' (list) are required")
    events = []
    for row in rows:
        if not (isinstance(row, list) and len(row) == 5 and isinstance(row[0], str)):
            raise MetricsWireError(f"metrics message from {source!r}: bad event {row!r}")
        name, value, step, version, t = row
        events.append(MetricEvent(name, float(value), int(step), int(version), float(t), source))
    return source, seq, events


def finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
