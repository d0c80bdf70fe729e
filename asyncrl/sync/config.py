"""`WeightSyncConfig`: settings of the weight sync (its own module so configs load without torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from asyncrl.sync.wire import VLLM_STORE_TIMEOUT_S

SyncMethod = Literal["broadcast", "vllm"]
SYNC_METHODS: tuple[str, ...] = ("broadcast", "vllm")
"""The weight-sync backends (`asyncrl.sync.base`): asyncrl's own group, or vLLM's transfer engine."""


@dataclass(kw_only=True)
class WeightSyncConfig:
    """Settings of the weight sync."""

    method: SyncMethod = "broadcast"
    """Backend: ``broadcast`` (asyncrl's own group, gloo or nccl: into the built-in engine, and
    into vLLM's workers through asyncrl's worker extension, `asyncrl.sync.vllm_broadcast`) or
    ``vllm`` (vLLM's NCCL weight-transfer engine: vLLM engines on GPU only)."""
    wire_dtype: str = "engine"
    """``vllm`` only: dtype the weights travel in. ``engine`` asks the engines (bf16 engines get
    half the bytes of fp32); a dtype name (e.g. ``float32``) forces it; ``trainer`` keeps the
    trainer's own dtype."""
    bucket_mb: float = 4.0
    """Size of one packed bucket in MiB (a larger tensor travels alone, from its own memory,
    and lands straight in an engine parameter that has the ``weight_views`` hook); the choice
    of 4 is measured in docs/benchmarks.md (bench_sync)."""
    backend: str = "auto"
    """``gloo``, ``nccl`` or ``auto`` (nccl when CUDA is available)."""
    master_addr: str = "127.0.0.1"
    """Address trainer rank 0 hosts the sync group's store on; it must reach every engine.
    ``auto`` = rank 0's Ray node address (multi-node); the loopback default suits one machine."""
    master_port: int = 0
    """Port of that store; 0 = a free port picked by trainer rank 0."""
    workers_per_engine: int = 1
    """Group ranks each engine occupies (its tensor/pipeline-parallel workers)."""
    connect_timeout_s: float = 120.0
    """Deadline of forming the sync group (all engines joining)."""
    pause_timeout_s: float = 60.0
    """Deadline of ``pause(keep)`` on every engine, and of the liveness ping after a failure."""
    transfer_timeout_s: float = 300.0
    """Deadline of one broadcast + load of the whole model (also every collective's timeout)."""
    resume_timeout_s: float = 60.0
    """Deadline of ``resume()`` on every engine."""
    retries: int = 1
    """Re-sends to the live engines over a re-formed group after a failed transfer."""

    def __post_init__(self) -> None:
        if self.method not in SYNC_METHODS:
            raise ValueError(f"WeightSyncConfig.method must be one of {SYNC_METHODS}, got {self.method!r}")
        if self.method == "vllm" and self.connect_timeout_s > VLLM_STORE_TIMEOUT_S:
            raise ValueError(
                f"WeightSyncConfig.connect_timeout_s={self.connect_timeout_s} must be <= {VLLM_STORE_TIMEOUT_S:g} "
                f"with method='vllm': vLLM 0.33's workers give up their rendezvous after {VLLM_STORE_TIMEOUT_S:g} s"
            )
        if self.bucket_mb <= 0:
            raise ValueError(f"WeightSyncConfig.bucket_mb must be > 0, got {self.bucket_mb}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"WeightSyncConfig.backend must be 'auto', 'gloo' or 'nccl', got {self.backend!r}")
        if self.workers_per_engine < 1:
            raise ValueError(f"WeightSyncConfig.workers_per_engine must be >= 1, got {self.workers_per_engine}")
        for name in ("connect_timeout_s", "pause_timeout_s", "transfer_timeout_s", "resume_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"WeightSyncConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.retries < 0:
            raise ValueError(f"WeightSyncConfig.retries must be >= 0, got {self.retries}")

