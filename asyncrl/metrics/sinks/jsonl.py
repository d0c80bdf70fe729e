"""JSONL sink: ``<run_dir>/events.jsonl``, one event per line (the schema in docs/metrics.md).

(``metrics.jsonl`` beside it is the launcher's one row per train step.)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from asyncrl.metrics.config import MetricsConfig
from asyncrl.metrics.events import MetricEvent

FILENAME = "events.jsonl"


class JsonlSink:
    name = "jsonl"

    def __init__(self, cfg: MetricsConfig, run_dir: Path, **_):
        self.path = run_dir / FILENAME
        self._file = open(self.path, "a")

    def write(self, events: Sequence[MetricEvent]) -> None:
        self._file.write("".join(json.dumps(e.to_json()) + "\n" for e in events))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_events(path: str | Path) -> list[MetricEvent]:
    """The events of an events.jsonl; a torn last line (a run killed mid-write) is skipped."""
    out = []
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):
                out.append(MetricEvent.from_json(json.loads(line)))
    return out
