"""The interface every inference engine implements (built-in torch engine, vLLM).

Semantics follow vLLM's ``pause_generation`` / ``resume_generation``:

- ``abort``: every in-flight request ends now with ``finish_reason="abort"`` and its partial
  output; new requests are refused (`EnginePausedError`) until ``resume()``.
- ``wait``: stop admitting (new requests are refused), let in-flight requests finish.
- ``keep``: freeze in-flight requests in place with their KV cache; new requests queue; after
  ``resume()`` they continue from the same token with whatever weights are then loaded.
  ``clear_cache=True`` drops the KV cache and re-prefills on resume.

Weights are replaced only while paused: ``load_weights`` any number of times (a full set or a
bucket at a time), then ``finish_weight_update(version)`` makes them live; tokens generated
after ``resume()`` carry the new version.

Optional hook (not part of the protocol; the vLLM engine does not have it):
``weight_views() -> dict[str, torch.Tensor]`` returns the live parameter tensors by name,
valid only while paused (until ``resume()``). A weight receiver may write received bytes
straight into them instead of calling ``load_weights``; ``finish_weight_update(version)`` is
still what makes them live. Engines without it are loaded through ``load_weights``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Protocol, runtime_checkable

import torch

from asyncrl.types import GenerateRequest, GenerateResult

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")


def engine_config(config_cls: type, model_path, config, kwargs: dict):
    """The config of an engine built as ``Engine(model_path, **settings)`` or ``Engine(config=...)``."""
    name = config_cls.__name__
    if config is None:
        if model_path is None:
            raise ValueError(f"{name.removesuffix('Config')} needs model_path (or config={name}(...))")
        return config_cls(model_path=model_path, **kwargs)
    if model_path is not None or kwargs:
        raise ValueError("pass either config= or model_path and keyword settings, not both")
    return config


_M64 = 0xFFFFFFFFFFFFFFFF


def mix64(x: int) -> int:
    """SplitMix64's finaliser: a well-mixed 64-bit value from any integer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class EngineError(RuntimeError):
    """Base class of the errors an engine raises to its callers."""


class EnginePausedError(EngineError):
    """A request arrived while the engine refuses new work (paused with ``abort`` or ``wait``)."""


class EngineClosedError(EngineError):
    """The engine was closed; no request is served any more."""


@runtime_checkable
class RolloutEngine(Protocol):
    """One inference engine replica."""

    @property
    def version(self) -> int:
        """Weight version now live (number of weight syncs applied)."""
        ...

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Generate one response; many calls may be in flight at once."""
        ...

    async def pause(self, mode: PauseMode = "keep", clear_cache: bool = False) -> None:
        """Pause generation (see the module docstring); returns once the mode holds."""
        ...

    async def resume(self) -> None:
        """Resume generation: frozen requests continue, queued ones are admitted."""
        ...

    async def abort(self, request_ids: Iterable[str]) -> None:
        """End the named requests now with their partial output (``finish_reason="abort"``)."""
        ...

    async def end_session(self, session_id: str) -> None:
        """The conversation ``session_id`` ended: drop whatever the engine kept for its next turn
        (a no-op for an engine that keeps nothing, or whose prefix cache does the work)."""
        ...

    def progress(self, request_ids: Iterable[str]) -> dict[str, int]:
        """Tokens generated so far by each named request in flight (0 while it waits for a
        slot); ids not in flight are left out."""
        ...

    def param_meta(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """Name, dtype and shape of every parameter the engine loads, in a stable order."""
        ...

    async def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the given tensors into the model (only while paused)."""
        ...

    async def finish_weight_update(self, version: int) -> None:
        """Make the loaded weights live as ``version``."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters: running, queued, tokens_generated, kv_tokens, reprefill_tokens."""
        ...

    async def close(self) -> None:
        """Stop the engine; in-flight requests end with ``EngineClosedError``."""
        ...
