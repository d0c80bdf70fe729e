"""TensorBoard sink: event files under ``<run_dir>/tensorboard`` (one tag per metric name).

Events without a trainer step (engine and stream polls) are logged at the latest step seen,
so every chart shares the training x-axis; the wall time of each point is the event's time.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from asyncrl.metrics.config import MetricsConfig
from asyncrl.metrics.events import MetricEvent


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, cfg: MetricsConfig, run_dir: Path, **_):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = Path(cfg.tensorboard_dir) if cfg.tensorboard_dir else run_dir / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(self.logdir), flush_secs=5)
        self._step = 0

    def write(self, events: Sequence[MetricEvent]) -> None:
        for e in events:
            if e.step >= 0:
                self._step = max(self._step, e.step)
            self._writer.add_scalar(e.name, e.value, global_step=e.step if e.step >= 0 else self._step,
                                    walltime=e.time)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
