"""How a vLLM replica is built and how an asyncrl request becomes vLLM's ``SamplingParams``
(`VLLMEngineConfig`, `sampling_kwargs`, the temperature range vLLM honours); the engine itself
is `asyncrl.rollouter.engines.vllm.engine`.

No torch here: the run's config (`asyncrl.config.engine`) takes its ``engine`` section's fields from
`VLLMEngineConfig` and loads without torch."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.types import GenerateRequest

DTYPES = ("auto", "bfloat16", "float16", "float32")
"""The dtypes a replica computes in, by name (``auto``: the checkpoint's own)."""
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


@dataclass(kw_only=True)
class VLLMEngineConfig:
    """How one vLLM replica is built (fields not listed go through ``engine_kwargs``)."""

    model_path: str | Path
    """Local Hugging Face model directory (config.json + safetensors), as for the built-in engine."""
    dtype: str = "auto"
    """Dtype the replica computes in: ``auto`` = the checkpoint's own (config.json's ``dtype``), so an
    fp32 checkpoint is served in fp32 and the behaviour log-probs match an fp32 trainer (vLLM's
    own ``auto`` serves fp32 checkpoints in a 16-bit dtype); or bfloat16 | float16 | float32
    (a torch.dtype is taken by name)."""
    seed: int = 0
    """vLLM's engine seed (requests without a seed draw from it)."""
    gpu_memory_utilization: float = 0.5
    """Fraction of the GPU this replica may take (weights + KV cache)."""
    max_model_len: int | None = None
    """Longest prompt + response in tokens; None: the model config's."""
    max_num_seqs: int | None = None
    """Cap on requests in the running batch; None keeps vLLM's default."""
    tensor_parallel_size: int = 1
    """GPUs per replica (each is one worker in the weight-transfer group)."""
    enforce_eager: bool | None = None
    """Skip torch.compile and CUDA graph capture (faster start, slower decode); None: True on CPU
    (vLLM's CPU build compiles with inductor at start, which costs more than it saves on small
    models), False on GPU."""
    kv_cache_mb: float | None = None
    """KV cache of this replica in MiB (vLLM's ``kv_cache_memory_bytes``). None: on GPU vLLM sizes
    it from ``gpu_memory_utilization``; on CPU 1024 MiB (vLLM's CPU build would otherwise size it
    from the machine's RAM, for each replica)."""
    weight_transfer: str | None = None
    """vLLM's own weight-transfer engine to set up (``nccl``: `asyncrl.sync.vllm`, GPU only), or
    None when weights come over asyncrl's broadcast group into vLLM's workers
    (`asyncrl.sync.vllm_broadcast`, CPU or GPU)."""
    logprobs_mode: str = "processed_logprobs"
    """Which log-probs vLLM returns; processed_logprobs matches the built-in engine (module doc)."""
    eos_token_ids: tuple[int, ...] | None = None
    """Tokens that end every request (besides its own stop ids); None takes config.json's EOS."""
    initial_version: int = 0
    """Version of the weights the engine starts with."""
    prefix_cache_salt: bool = True
    """Salt each prompt's prefix-cache key with the weight version (see the module doc); False
    only with prefix caching off (``engine_kwargs={"enable_prefix_caching": False}``)."""
    close_timeout_s: float = 30.0
    """How long `VLLMEngine.close` waits for aborted requests to leave before shutting down."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Other ``AsyncEngineArgs`` fields, passed as given."""

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, str):  # a torch.dtype: kept by name
            self.dtype = str(self.dtype).removeprefix("torch.")
        if self.dtype not in DTYPES:
            raise ValueError(f"VLLMEngineConfig.dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"VLLMEngineConfig.logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"VLLMEngineConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"VLLMEngineConfig.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.close_timeout_s <= 0:
            raise ValueError(f"VLLMEngineConfig.close_timeout_s must be > 0, got {self.close_timeout_s}")
        if not self.prefix_cache_salt and self.engine_kwargs.get("enable_prefix_caching", True):
            raise ValueError(
                "VLLMEngineConfig.prefix_cache_salt=False with prefix caching on would let requests after a weight "
                "update reuse prompt KV of older weights: keep it True or set "
                "engine_kwargs={'enable_prefix_caching': False}"
            )
        if self.weight_transfer not in (None, "nccl"):
            raise ValueError(f"VLLMEngineConfig.weight_transfer must be None or 'nccl', got {self.weight_transfer!r}")
        if self.kv_cache_mb is not None and self.kv_cache_mb <= 0:
            raise ValueError(f"VLLMEngineConfig.kv_cache_mb must be > 0 (or None), got {self.kv_cache_mb}")
        clash = {"logprobs_mode", "weight_transfer_config", "model", "skip_tokenizer_init", "worker_extension_cls",
                 "kv_cache_memory_bytes"} & set(self.engine_kwargs)
        if clash:
            raise ValueError(f"VLLMEngineConfig.engine_kwargs must not set {sorted(clash)}: use the fields of the same name")

    def engine_args(self, *, cpu: bool = False) -> dict:
        """Keyword arguments of vLLM's ``AsyncEngineArgs`` for this replica (``cpu``: vLLM's CPU build)."""
        # (imported here: that module imports torch, which the engine's process has and the run's config must not load)
        from asyncrl.sync.vllm_broadcast import WORKER_EXTENSION

        kv_mb = self.kv_cache_mb if self.kv_cache_mb is not None or not cpu else CPU_KV_CACHE_MB
        args = {
            "model": str(self.model_path),
            "dtype": checkpoint_dtype(self.model_path) if self.dtype == "auto" else self.dtype,
            "seed": self.seed,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "tensor_parallel_size": self.tensor_parallel_size,
            "enforce_eager": cpu if self.enforce_eager is None else self.enforce_eager,
            "logprobs_mode": self.logprobs_mode,
            # Requests are token ids and results are token ids: no tokenizer is needed.
            "skip_tokenizer_init": True,
            # Sampling defaults come from the request, not the model's generation_config.json.
            "generation_config": "vllm",
            # asyncrl's receiver in every worker (asyncrl.sync.vllm_broadcast); inert until called
            "worker_extension_cls": WORKER_EXTENSION,
            "disable_log_stats": True,
        }
        if self.weight_transfer is not None:
            args["weight_transfer_config"] = {"backend": self.weight_transfer}
        if kv_mb is not None:
            args["kv_cache_memory_bytes"] = int(kv_mb * 2**20)
        if self.max_model_len is not None:
            args["max_model_len"] = self.max_model_len
        if self.max_num_seqs is not None:
            args["max_num_seqs"] = self.max_num_seqs
        if cpu:
            # A prompt split over two steps discards the first step's sampled token and rewinds a
            # seeded request's generator (``gen.set_offset``), which CPU generators do not have: the
            # worker raises "CPU Generator does not use offset" and the engine dies (vLLM 0.32 CPU,
            # seen once a step's prompts passed 2048 tokens). Whole prompts only.
            args["enable_chunked_prefill"] = False
        return {**args, **self.engine_kwargs}


CPU_KV_CACHE_MB = 1024.0
"""KV cache of a replica of vLLM's CPU build when `VLLMEngineConfig.kv_cache_mb` is None."""


def checkpoint_dtype(model_dir: str | Path) -> str:
    """The dtype a model directory's config.json names (``dtype``, or the older ``torch_dtype``);
    float32 when it names none (what transformers loads such a checkpoint in)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return str(name).removeprefix("torch.")


VLLM_MIN_TEMPERATURE = 0.01
"""vLLM 0.33 raises a temperature in (0, 0.01) to 0.01 (``SamplingParams._MAX_TEMP``)."""
VLLM_MAX_TEMPERATURE = 2.0
"""vLLM 0.33 refuses a temperature above 2."""


def check_vllm_temperature(temperature: float, setting: str = "temperature") -> None:
    """Refuse a sampling temperature vLLM would not honour as given; the error names ``setting``.

    Above 2 vLLM rejects the request; below 0.01 it samples at 0.01 while the trainer would
    divide the logits by the configured value, so the behaviour log-probs would not match.
    Greedy decoding is not a temperature (it is sent as 0) and is not checked here.
    """
    if not VLLM_MIN_TEMPERATURE <= temperature <= VLLM_MAX_TEMPERATURE:
        raise ValueError(
            f"{setting}={temperature} is outside [{VLLM_MIN_TEMPERATURE}, {VLLM_MAX_TEMPERATURE}], the range vLLM 0.33 "
            "samples at as given (it refuses > 2 and raises < 0.01 to 0.01); choose a temperature in it, "
            "or greedy decoding"
        )


def sampling_kwargs(request: GenerateRequest, eos_token_ids: Iterable[int] = ()) -> dict:
    """vLLM ``SamplingParams`` keyword arguments for one asyncrl request.

    The request stops on its own ``stop_token_ids`` plus ``eos_token_ids`` and on nothing
    else (``ignore_eos`` turns off vLLM's tokenizer/generation-config EOS), as in the
    built-in engine. ``output_kind`` (DELTA) is set by the engine, not here.
    """
    s = request.sampling
    if not s.greedy:
        check_vllm_temperature(s.temperature, f"request {request.request_id}: sampling.temperature")
    stops = dict.fromkeys([int(t) for t in eos_token_ids] + [int(t) for t in s.stop_token_ids])
    return {
        "n": 1,
        "max_tokens": request.max_tokens,
        "temperature": 0.0 if s.greedy else s.temperature,
        "top_p": 1.0 if s.greedy else s.top_p,
        "top_k": 0 if s.greedy else s.top_k,
        "seed": s.seed,
        "stop_token_ids": list(stops),
        "ignore_eos": True,
        "logprobs": 0,
        "detokenize": False,
    }


def model_eos_token_ids(model_dir: str | Path) -> tuple[int, ...]:
    """``eos_token_id`` of a model directory's config.json (int or list) as a tuple."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)
