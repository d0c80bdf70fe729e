"""`RunConfig`: the whole run's typed config, composed of the parts' own dataclasses.

::

    steps, seed, run_dir, mode   (asyncrl.modes) async | sync
    model            ModelConfig             which weights (a local HF directory, or the tiny demo model)
    data             DataConfig              train / validation files, reward function
    rollout          RolloutSection          (asyncrl.rollouter) RolloutConfig less groups_per_sync (the Trainer's)
    engine           EngineConfig            EngineRunConfig + (asyncrl.rollouter.engines) the engines' own fields
    trainer          TrainerSection          (asyncrl.trainer) TrainerConfig's loop + WorkerConfig's optim/algorithm
    weight_sync      WeightSyncSection       (asyncrl.sync) WeightSyncConfig less workers_per_engine (computed)
    stream           StreamConfig            (asyncrl.queue)
    partial_rollout  PartialRolloutConfig    (asyncrl.rollouter.partial) long-tail truncation
    skip             RunSkipConfig           (asyncrl.skip) the async_rollout role: cache/replay per sample
    metrics          MetricsConfig           (asyncrl.metrics) metric stream, sinks, dashboard
    placement        PlacementConfig         GPUs, replicas, ranks, nodes, Ray address

OmegaConf does the merging (`asyncrl.config.loader`): the dataclasses are the schema, a YAML file
and dotted overrides (``trainer.optim.lr=1e-6 skip.async_rollout.steps=[3,4]``) merge into it with
type coercion, and an unknown key or a value of the wrong type is an error naming its dotted path.
Defaults that follow from others are interpolations (``stream.window`` follows from the batch,
the checkpoint interval and the staleness); a user may set one, and `check` then fails if it
contradicts the values it follows from, naming both. Values that only follow from others are not
keys at all: the loss's temperature is ``rollout.temperature``, the weight sync's workers per
engine come from ``engine``, and the Rollouter's ``groups_per_sync`` is the Trainer's
(``trainer.groups_per_batch x require_batches x trigger_parameter_sync_step``; `derived.COMPUTED`).

Modules: one per section it owns (``data``, ``engine``, ``placement``, ``skip``, ``stream``,
``rollout``, ``sync``, ``trainer``), each with the checks of its own fields (``section``: a section made from
its owners' dataclasses, less what the run decides); ``root`` (`RunConfig` and the checks across
sections), ``derived`` (interpolated defaults), ``presets`` (defaults by kind of run), ``flags``
(the launcher's aliases, imported by `asyncrl.launch`), ``loader`` (`load_config`). The names
below are imported lazily, so ``import asyncrl.config.flags`` loads no section.

Every error here is a `ConfigError` whose message is one line naming the dotted path (and the
launcher flag, when the value came from one).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "ConfigError": "errors",
    "ALIASES": "flags", "FLAGS": "flags", "Flag": "flags", "named": "flags",
    "ModelConfig": "data", "DataConfig": "data",
    "EngineConfig": "engine", "EngineRunConfig": "engine", "VLLM_ONLY_ENGINE_SETTINGS": "engine",
    "BUILTIN_ONLY_ENGINE_SETTINGS": "engine",
    "PlacementConfig": "placement", "RunSkipConfig": "skip",
    "TrainerSection": "trainer", "AlgorithmSection": "trainer", "_FROM_PLACEMENT_OR_RUN": "trainer",
    "WeightSyncSection": "sync", "RolloutSection": "rollout",
    "RunConfig": "root", "check": "root",
    "DERIVED": "derived", "COMPUTED": "derived",
    "RUN_DEFAULTS": "presets", "SYNC_MODE_DEFAULTS": "presets", "SYNC_PARTIAL_DEFAULTS": "presets",
    "DEMO_DEFAULTS": "presets", "BUILTIN_TASK_DEFAULTS": "presets", "CALCULATOR_TASK_DEFAULTS": "presets",
    "CALCULATOR_DEMO_DEFAULTS": "presets", "REAL_DEFAULTS": "presets",
    "load_config": "loader", "to_yaml": "loader",
}
# The parts' own configs, importable from here as they were when this was one module.
_PARTS: dict[str, str] = {
    "MetricsConfig": "asyncrl.metrics.config", "StreamConfig": "asyncrl.queue.protocol",
    "PartialRolloutConfig": "asyncrl.rollouter.partial", "RolloutConfig": "asyncrl.rollouter.rollouter",
    "SkipConfig": "asyncrl.skip.config", "SkipRoleConfig": "asyncrl.skip.config",
    "WeightSyncConfig": "asyncrl.sync.config", "AlgorithmConfig": "asyncrl.trainer.config",
    "OptimConfig": "asyncrl.trainer.config", "TrainerConfig": "asyncrl.trainer.config",
    "WorkerConfig": "asyncrl.trainer.config",
}
__all__ = [*_EXPORTS, *_PARTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
    elif name in _PARTS:
        module = importlib.import_module(_PARTS[name])
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value
