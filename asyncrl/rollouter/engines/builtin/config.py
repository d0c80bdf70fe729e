"""Settings of the built-in engine (`asyncrl.rollouter.engines.builtin.engine.TorchEngine`).

No torch here: the run's config (`asyncrl.config.engine`) takes its ``engine`` section's fields from
this class and loads without torch (``dtype`` is kept by name, as ``from_pretrained`` takes it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DTYPES = ("auto", "bfloat16", "float16", "float32")
"""The dtypes the engine computes in, by name (``auto``: the checkpoint's own)."""


@dataclass(kw_only=True)
class TorchEngineConfig:
    """Settings of the built-in engine."""

    model_path: str | Path
    """Local directory of a Hugging Face causal LM (config.json + weights)."""
    device: str = "cpu"
    """Torch device the model runs on (``cpu``, ``cuda``, ``cuda:1``...)."""
    dtype: str = "float32"
    """Model dtype by name (bfloat16 | float16 | float32; a torch.dtype is taken by name), or ``auto`` for
    the checkpoint's own (config.json's). float32 gives log-probs exact to ~1e-6 against a full forward."""
    max_running: int = 128
    """Most requests decoded together in one batched forward (KV blocks are taken as they fill,
    so an idle slot holds no memory)."""
    max_model_len: int | None = None
    """Prompt + response token limit; None takes the model's ``max_position_embeddings``."""
    eos_token_ids: tuple[int, ...] | None = None
    """Tokens that end every request (besides its own stop ids); None takes the model's EOS."""
    seed: int = 0
    """Seed of the sampler used by requests that carry no seed of their own."""
    pause_timeout_s: float = 600.0
    """How long ``pause("wait")`` may wait for in-flight requests to drain."""
    attn_implementation: str | None = None
    """Passed to ``from_pretrained`` (None: transformers' default, ``sdpa`` on most setups)."""
    decoder: str = "auto"
    """``auto``: the lean Llama-layout forward (`asyncrl.rollouter.engines.builtin.decoder`) where the model has
    that layout, else the model's own; ``hf``: always the model's own ``forward``."""
    batch_wait_ms: float = 5.0
    """When requests arrive while the engine runs fewer than a quarter of ``max_running``, its
    scheduler waits this long (once per such arrival) for more before its next step, so that they
    start in one step instead of one step each: a step's cost is mostly fixed at small batches, and
    calls that come one by one (an agent's over HTTP, the next turns of conversations) otherwise make
    many small steps. 0: step at once."""
    session_idle_s: float = 60.0
    """A conversation's kept KV (`asyncrl.rollouter.engines.builtin.sessions`) is freed when its next
    turn has not come this many seconds after the last one ended (a tool call that slow is rare)."""
    session_max_blocks: int = 2048
    """Most KV blocks (16 tokens each) the kept turns of conversations may hold together; beyond it
    the least recently kept is freed. 0 keeps nothing: every turn prefills its whole prompt."""

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str):  # a torch.dtype: kept by name
            self.dtype = str(self.dtype).removeprefix("torch.")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be a torch dtype, its name (bfloat16, float16, float32) or 'auto', "
                             f"got {self.dtype!r}")
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (or None for the model's), got {self.max_model_len}")
        if self.decoder not in ("auto", "hf"):
            raise ValueError(f"decoder must be 'auto' or 'hf', got {self.decoder!r}")
        if not 0 <= self.batch_wait_ms <= 1000:
            raise ValueError(f"batch_wait_ms must be in [0, 1000], got {self.batch_wait_ms}")
        if self.session_idle_s <= 0:
            raise ValueError(f"session_idle_s must be > 0, got {self.session_idle_s}")
        if self.session_max_blocks < 0:
            raise ValueError(f"session_max_blocks must be >= 0 (0 keeps no session's KV), got {self.session_max_blocks}")
        if self.pause_timeout_s <= 0:
            raise ValueError(f"pause_timeout_s must be > 0, got {self.pause_timeout_s}")
