"""The built-in engine (``engine.kind=torch``): continuous batching over a Hugging Face causal LM.

One concern a file: `engine` (the scheduler: admit, step, pause, weights), `model_runner` (one
step's forward and sampling over every running request), `kv_cache` (paged KV blocks shared by a
group's requests), `sessions` (a conversation's blocks kept between its turns), `decoder` (the lean
forward for Llama-layout models), `sampling` (seeded draws and behaviour log-probs), `config`
(`TorchEngineConfig`).

Names are imported lazily: ``config`` loads without torch (the run's config reads it).
"""

from asyncrl._lazy import lazy_exports

_EXPORTS = {
    "TorchEngine": "asyncrl.rollouter.engines.builtin.engine",
    "TorchEngineConfig": "asyncrl.rollouter.engines.builtin.config",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
