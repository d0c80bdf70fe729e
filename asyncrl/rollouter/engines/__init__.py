"""Inference engines: one interface (`base.RolloutEngine`, its errors and pause modes), a registry of
kinds (`backends.make_engine`), and one backend each: the built-in engine (`builtin/`, kind
``torch``), vLLM (`vllm/`) and the simulated engine (`sim`).

Engines know nothing of the rollout control (`asyncrl.rollouter`'s Rollouter, EngineActor,
aggregator, partial buffer): they serve requests, pause, and take weights. Names are imported
lazily, so ``import asyncrl.rollouter.engines`` costs no torch until an engine is used.
"""

from __future__ import annotations

from asyncrl._lazy import lazy_exports

_EXPORTS = {
    "RolloutEngine": "asyncrl.rollouter.engines.base",
    "PauseMode": "asyncrl.rollouter.engines.base",
    "EngineError": "asyncrl.rollouter.engines.base",
    "EnginePausedError": "asyncrl.rollouter.engines.base",
    "EngineClosedError": "asyncrl.rollouter.engines.base",
    "ENGINE_KINDS": "asyncrl.rollouter.engines.backends",
    "engine_class": "asyncrl.rollouter.engines.backends",
    "make_engine": "asyncrl.rollouter.engines.backends",
    "TorchEngine": "asyncrl.rollouter.engines.builtin",
    "TorchEngineConfig": "asyncrl.rollouter.engines.builtin",
    "VLLMEngine": "asyncrl.rollouter.engines.vllm",
    "SimEngine": "asyncrl.rollouter.engines.sim",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
