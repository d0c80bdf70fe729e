"""``trainer``: TrainerConfig's loop and WorkerConfig's computing knobs, as one section.

The Trainer's section is TrainerConfig without what the run decides (the ranks come from
placement, the checkpoint directory and samples.jsonl from run_dir) plus WorkerConfig's computing
knobs, so the optimizer is ``trainer.optim`` as verl users type it. Fields, types and defaults are
the owners' own: a knob added to TrainerConfig or WorkerConfig appears here by itself.
"""

from __future__ import annotations

import dataclasses
import importlib.util

from asyncrl.config.errors import ConfigError
from asyncrl.config.section import section_of
from asyncrl.trainer.config import AlgorithmConfig, TrainerConfig, WorkerConfig

_FROM_PLACEMENT_OR_RUN = {"worker", "world_size", "gpus_per_rank", "checkpoint_dir", "samples_path", "transcripts_path",
                          "model_path", "pad_token_id", "stop_token_id", "seed"}
_SECTION_DEFAULTS = {"micro_batch_size": 16, "groups_per_batch": 8}

AlgorithmSection = section_of(
    "AlgorithmSection", (AlgorithmConfig,), module=__name__, leave_out={"temperature"}, validate=True,
    doc="GRPO advantages and the PPO-style policy loss (its temperature is the rollout's: rollout.temperature).")
TrainerSection = section_of(
    "TrainerSection", (WorkerConfig, TrainerConfig), module=__name__, leave_out=_FROM_PLACEMENT_OR_RUN,
    defaults=_SECTION_DEFAULTS, types={"algorithm": AlgorithmSection},
    doc="The Trainer: its loop (TrainerConfig) and per-rank computing (WorkerConfig).")
_WORKER_KEYS = [f.name for f in dataclasses.fields(WorkerConfig) if f.name not in _FROM_PLACEMENT_OR_RUN]


def check_trainer(t) -> None:
    """What the trainer section needs installed."""
    if t.lora.enabled and importlib.util.find_spec("peft") is None:
        raise ConfigError(f"trainer.lora.rank={t.lora.rank} needs peft installed: pip install 'asyncrl[lora]'")
