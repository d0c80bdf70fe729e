"""Rollouter: inference engines (built-in torch engine, vLLM), the EngineActor that wraps them,
the AggregatorActor and partial rollout.

Names are imported lazily so ``import asyncrl.rollouter`` stays cheap (no torch/transformers/ray
until an engine is used).
"""

from __future__ import annotations

from asyncrl._lazy import lazy_exports

_EXPORTS = {
    "TorchEngine": "asyncrl.rollouter.torch_engine",
    "TorchEngineConfig": "asyncrl.rollouter.torch_engine",
    "EngineActor": "asyncrl.rollouter.actor",
    "AggregatorActor": "asyncrl.rollouter.aggregator",
    "PartialRolloutConfig": "asyncrl.rollouter.partial",
    "Rollouter": "asyncrl.rollouter.rollouter",
    "RolloutConfig": "asyncrl.rollouter.rollouter",
    "RolloutEngine": "asyncrl.rollouter.engine",
    "EngineError": "asyncrl.rollouter.engine",
    "EnginePausedError": "asyncrl.rollouter.engine",
    "EngineClosedError": "asyncrl.rollouter.engine",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
