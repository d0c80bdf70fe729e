"""The vLLM engine (``engine.kind=vllm``): `VLLMEngine` over vLLM's ``AsyncLLM`` (`engine`), and how
a replica is built and a request translated (`config`). ``vllm`` itself is imported only when an
engine is built, so this package imports on machines without it."""

from asyncrl.rollouter.engines.vllm.config import VLLMEngineConfig, check_vllm_temperature
from asyncrl.rollouter.engines.vllm.engine import VLLMEngine

__all__ = ["VLLMEngine", "VLLMEngineConfig", "check_vllm_temperature"]
