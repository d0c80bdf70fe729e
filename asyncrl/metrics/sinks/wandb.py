"""wandb sink, when the ``wandb`` package is installed (offline mode unless WANDB_MODE says otherwise).

wandb is optional (the `metrics` extra installs it); without it this sink reports itself off and the run goes on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from asyncrl.metrics.config import MetricsConfig
from asyncrl.metrics.events import MetricEvent
from asyncrl.metrics.sinks.base import SinkUnavailable


class WandbSink:
    name = "wandb"

    def __init__(self, cfg: MetricsConfig, run_dir: Path, **_):
        try:
            import wandb
        except ImportError:
            raise SinkUnavailable("the wandb package is not installed (pip install wandb)") from None
        os.environ.setdefault("WANDB_MODE", "offline")
        self._run = wandb.init(project=cfg.wandb_project, name=run_dir.name, dir=str(run_dir))

    def write(self, events: Sequence[MetricEvent]) -> None:
        row = {e.name: e.value for e in events}
        steps = [e.step for e in events if e.step >= 0]
        if steps:
            row["trainer/step"] = max(steps)
        self._run.log(row)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self._run.finish()
