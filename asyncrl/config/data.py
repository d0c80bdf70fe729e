"""``model`` and ``data``: which weights, which prompts, how responses are scored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from asyncrl.config.errors import ConfigError
from asyncrl.config.flags import named


@dataclass(kw_only=True)
class ModelConfig:
    """The policy's weights."""

    path: str | None = None
    """Local Hugging Face model directory (config.json + weights + tokenizer); None: the tiny
    warm-started demo model shipped in the package (`asyncrl.models.default_model_path`)."""


@dataclass(kw_only=True)
class DataConfig:
    """Prompts and how responses are scored (verl's dataset layout, see `asyncrl.data`)."""

    train: str | None = None
    """JSONL or parquet file of prompts; None: the built-in task ``task``."""
    task: Literal["arithmetic", "calculator"] = "arithmetic"
    """The built-in task when ``train`` is None: ``arithmetic`` (addition, one short answer) or
    ``calculator`` (two-digit multiplication with a calculator tool, an agent loop:
    `asyncrl.tasks.calculator`), each with its own warm-started default model."""
    val: str | None = None
    """Validation file (same layout), scored greedily every ``val_every`` steps under ``val/``."""
    val_every: int = 10
    """Train steps between two validations (and one after the last step)."""
    reward: str | None = None
    """``module:function``: verl's ``compute_score(data_source, solution_str, ground_truth,
    extra_info)`` or ``(prompt, response)``, sync or async; required with ``train``."""
    long_tail: int = 1
    """Built-in task only: 1, or a power of 2: per-prompt response budgets up to this many times
    ``rollout.max_tokens`` (`asyncrl.tasks.arithmetic.long_tail_budget`); the engines then do not
    stop at EOS, so every response is generated to its budget (a benchmark workload)."""

    def __post_init__(self) -> None:
        if self.val_every < 1:
            raise ValueError(f"val_every must be >= 1, got {self.val_every}")
        if self.long_tail < 1 or self.long_tail & (self.long_tail - 1):
            raise ValueError(f"long_tail must be 1 or a power of 2, got {self.long_tail}")




def check_data(d: DataConfig) -> None:
    """The data section's own combinations: a built-in task's settings need no dataset, a dataset needs a reward."""
    if d.task != "arithmetic" and d.train is not None:
        raise ConfigError(f"{named('data.task')}={d.task} is a built-in task; it does not apply with "
                          f"{named('data.train')}={d.train} (remove one)")
    if d.long_tail > 1 and d.train is not None:
        raise ConfigError(f"{named('data.long_tail')}={d.long_tail} is a workload of the built-in task; "
                          f"remove it or {named('data.train')}")
    if d.train is not None and d.reward is None:
        raise ConfigError(f"{named('data.train')}={d.train} needs a reward: set {named('data.reward')} "
                          "to module:function (the built-in task's reward only scores the built-in task)")
    if d.val is not None and d.train is None and d.reward is None:
        raise ConfigError(f"{named('data.val')} needs {named('data.reward')} (or the training data's reward)")
