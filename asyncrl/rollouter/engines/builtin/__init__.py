"""The built-in engine (``engine.kind=torch``): continuous batching over a Hugging Face causal LM.

One concern a file: `engine` (the scheduler: admit, step, pause, weights), `model_runner` (one
step's forward and sampling over every running request), `kv_cache` (paged KV blocks shared by a
group's requests), `sessions` (a conversation's blocks kept between its turns), `decoder` (the lean
forward for Llama-layout models), `sampling` (seeded draws and behaviour log-probs), `config`
(`TorchEngineConfig`).
"""

from asyncrl.rollouter.engines.builtin.config import TorchEngineConfig
from asyncrl.rollouter.engines.builtin.engine import TorchEngine

__all__ = ["TorchEngine", "TorchEngineConfig"]
