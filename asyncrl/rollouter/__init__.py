"""Rollouter: inference engines (built-in torch engine, vLLM), the EngineActor that wraps them.

Names are imported lazily so ``import asyncrl.rollouter`` stays cheap (no torch/transformers/ray
until an engine is used).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TorchEngine": "asyncrl.rollouter.torch_engine",
    "TorchEngineConfig": "asyncrl.rollouter.torch_engine",
    "EngineActor": "asyncrl.rollouter.actor",
    "RolloutEngine": "asyncrl.rollouter.engine",
    "EngineError": "asyncrl.rollouter.engine",
    "EnginePausedError": "asyncrl.rollouter.engine",
    "EngineClosedError": "asyncrl.rollouter.engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncrl.rollouter' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
