"""The registry of engine kinds: the one place that imports the backends.

``torch`` -> the built-in engine (`asyncrl.rollouter.engines.builtin`), ``vllm`` -> vLLM
(`asyncrl.rollouter.engines.vllm`, imported only when asked for: it needs the ``vllm`` extra),
``sim`` -> the simulated engine for scale tests and benchmarks (`asyncrl.rollouter.engines.sim`).
Each backend implements `asyncrl.rollouter.engines.base.RolloutEngine`.
"""

from __future__ import annotations

from typing import Any

ENGINE_KINDS = ("torch", "vllm", "sim")


def engine_class(kind: str) -> type:
    """The class of engine ``kind``; an unknown kind is a ValueError naming the kinds."""
    if kind == "torch":
        from asyncrl.rollouter.engines.builtin import TorchEngine

        return TorchEngine
    if kind == "vllm":
        from asyncrl.rollouter.engines.vllm import VLLMEngine

        return VLLMEngine
    if kind == "sim":
        from asyncrl.rollouter.engines.sim import SimEngine

        return SimEngine
    raise ValueError(f"engine kind must be one of {ENGINE_KINDS}, got {kind!r}")


def config_class(kind: str) -> type:
    """The settings dataclass of engine ``kind`` (``torch`` | ``vllm``). Their modules load no torch,
    so the run's config (`asyncrl.config.engine`) makes its ``engine`` section of their fields."""
    if kind == "torch":
        from asyncrl.rollouter.engines.builtin.config import TorchEngineConfig

        return TorchEngineConfig
    if kind == "vllm":
        from asyncrl.rollouter.engines.vllm.config import VLLMEngineConfig

        return VLLMEngineConfig
    raise ValueError(f"engine kind with a config must be torch or vllm, got {kind!r}")


def make_engine(kind: str = "torch", **engine_kwargs: Any):
    """Build an engine of ``kind`` (``torch`` | ``vllm`` | ``sim``) from its keyword settings."""
    return engine_class(kind)(**engine_kwargs)


def check_temperature(kind: str, temperature: float, setting: str = "temperature") -> None:
    """Refuse a sampling temperature engine ``kind`` would not honour as given (vLLM clamps some);
    the error names ``setting``. Imports the backend only for kinds that have such limits."""
    if kind == "vllm":  # torch is imported only for vLLM runs, which need it anyway
        from asyncrl.rollouter.engines.vllm.config import check_vllm_temperature

        check_vllm_temperature(temperature, setting)
