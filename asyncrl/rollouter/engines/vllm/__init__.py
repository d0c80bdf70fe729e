"""The vLLM engine (``engine.kind=vllm``): `VLLMEngine` over vLLM's ``AsyncLLM`` (`engine`), and how
a replica is built and a request translated (`config`). ``vllm`` itself is imported only when an
engine is built, so this package imports on machines without it. Names are imported lazily:
``config`` loads without torch (the run's config reads it)."""

from asyncrl._lazy import lazy_exports

_EXPORTS = {
    "VLLMEngine": "asyncrl.rollouter.engines.vllm.engine",
    "VLLMEngineConfig": "asyncrl.rollouter.engines.vllm.config",
    "check_vllm_temperature": "asyncrl.rollouter.engines.vllm.config",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
