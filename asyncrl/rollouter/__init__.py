"""Rollouter: the rollout control (the Rollouter, the EngineActor that wraps one engine replica,
the AggregatorActor, partial rollout) over the inference engines of `asyncrl.rollouter.engines`.

Names are imported lazily so ``import asyncrl.rollouter`` stays cheap (no torch/transformers/ray
until an engine is used).
"""

from __future__ import annotations

from asyncrl._lazy import lazy_exports

_EXPORTS = {
    "TorchEngine": "asyncrl.rollouter.engines.builtin",
    "TorchEngineConfig": "asyncrl.rollouter.engines.builtin",
    "EngineActor": "asyncrl.rollouter.actor",
    "AggregatorActor": "asyncrl.rollouter.aggregator",
    "PartialRolloutConfig": "asyncrl.rollouter.partial",
    "Rollouter": "asyncrl.rollouter.rollouter",
    "RolloutConfig": "asyncrl.rollouter.rollouter",
    "RolloutEngine": "asyncrl.rollouter.engines.base",
    "EngineError": "asyncrl.rollouter.engines.base",
    "EnginePausedError": "asyncrl.rollouter.engines.base",
    "EngineClosedError": "asyncrl.rollouter.engines.base",
    "make_engine": "asyncrl.rollouter.engines.backends",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
