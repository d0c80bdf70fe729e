"""Console sink: one progress line per train step, with the async facts beside the loss."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from asyncrl.metrics.config import MetricsConfig
from asyncrl.metrics.events import MetricEvent


class ConsoleSink:
    name = "console"

    def __init__(self, cfg: MetricsConfig, run_dir: Path, *, total_steps: int | None = None, stream=None, **_):
        self.total = total_steps
        self._out = stream or sys.stdout
        self._latest: dict[str, float] = {}
        self._t0 = time.time()

    def write(self, events: Sequence[MetricEvent]) -> None:
        step_event = None
        for e in events:
            self._latest[e.name] = e.value
            if e.name == "train/reward_mean":
                step_event = e
        if step_event is not None:
            self._out.write(self._line(step_event) + "\n")
            self._out.flush()

    def _line(self, e: MetricEvent) -> str:
        m = self._latest.get
        total = f"/{self.total}" if self.total else ""
        return (f"step {e.step:3d}{total}  version {e.version:3d}  reward {m('train/reward_mean', 0):.3f}  "
                f"loss {m('train/loss', 0):+.4f}  staleness {m('staleness/mean', 0):.2f}  "
                f"len {m('response_length/mean', 0):.1f}  "
                f"gen {m('throughput/generated_tokens_per_s', 0):.0f} tok/s  "
                f"idle T {m('fully_async/trainer/idle_ratio', 0):.2f} R {m('fully_async/rollouter/idle_ratio', 0):.2f}  "
                f"{e.time - self._t0:.0f}s")

    def flush(self) -> None:
        self._out.flush()

    def close(self) -> None:
        self.flush()
