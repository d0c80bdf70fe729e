"""How the trainer reaches vLLM's NCCL weight-transfer engine, and the rendezvous deadline both halves honour."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.sync.wire import VLLM_STORE_TIMEOUT_S, dtype_from_name


@dataclass(kw_only=True)
class VLLMSyncConfig:
    """How the trainer reaches vLLM's NCCL weight-transfer engine."""

    master_address: str = "127.0.0.1"
    """Address of trainer rank 0, where vLLM's TCPStore rendezvous is hosted."""
    master_port: int = 0
    """Port of that TCPStore; 0 picks a free one when the sender is built."""
    bucket_mb: float = 1024.0
    """Packed bucket threshold in MiB (vLLM's ``packed_buffer_size_bytes``; its default is 1 GiB)."""
    num_buffers: int = 2
    """Buckets in flight at once on each side (vLLM's ``packed_num_buffers``)."""
    packed: bool = True
    """Packed buckets (True) or one broadcast per tensor (False), vLLM's ``packed``."""
    join_timeout_s: float = 120.0
    """Deadline of the rendezvous with every engine worker: the trainer's TCPStore waits this long,
    and `VLLMWeightSender.send` waits this long for the join. At most vLLM's own store timeout
    (300 s): the engines' workers give up then whatever is set here."""
    wire_dtype: str | None = None
    """Dtype the weights travel in (the engine's, e.g. ``bfloat16``: half the bytes of fp32);
    None sends the trainer's own dtype. vLLM's ``load_weights`` casts to the engine's dtype."""

    def __post_init__(self) -> None:
        if self.bucket_mb <= 0:
            raise ValueError(f"VLLMSyncConfig.bucket_mb must be > 0, got {self.bucket_mb}")
        if self.num_buffers < 1:
            raise ValueError(f"VLLMSyncConfig.num_buffers must be >= 1, got {self.num_buffers}")
        if not 0 <= self.master_port < 65536:
            raise ValueError(f"VLLMSyncConfig.master_port must be in [0, 65535], got {self.master_port}")
        check_join_timeout(self.join_timeout_s, "VLLMSyncConfig.join_timeout_s")
        if self.wire_dtype is not None:
            dtype_from_name(self.wire_dtype)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 1024 * 1024)


def check_join_timeout(timeout_s: float, setting: str) -> None:
    """Refuse a rendezvous deadline vLLM's workers would not honour (they wait 300 s at most)."""
    if not 0 < timeout_s <= VLLM_STORE_TIMEOUT_S:
        raise ValueError(
            f"{setting}={timeout_s} must be in (0, {VLLM_STORE_TIMEOUT_S:g}]: vLLM 0.33's workers wait "
            f"{VLLM_STORE_TIMEOUT_S:g} s in their TCPStore rendezvous, so a longer deadline cannot hold"
        )
