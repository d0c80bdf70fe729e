"""What both ends of a weight sync must agree on: wire constants, dtype names, errors.

Senders and receivers of every backend import these from here, so the two halves of a
protocol cannot drift apart.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # this module loads without torch (configs import it)
    import torch

# -- the built-in broadcast (asyncrl.sync.broadcast) ------------------------------------------

MAGIC = 0x57535943  # "WSYC"
"""First value of every sync header; a receiver refuses another one."""
HEADER_LEN = 4
"""int64 header ``[MAGIC, version, meta_nbytes, num_buckets]``."""

# -- vLLM's NCCL weight-transfer engine (asyncrl.sync.vllm), facts of vLLM 0.33 -------------

VLLM_DEFAULT_BUCKET_BYTES = 1024 * 1024 * 1024
"""vLLM 0.33's ``DEFAULT_PACKED_BUFFER_SIZE_BYTES`` (1 GiB)."""
VLLM_STORE_TIMEOUT_S = 300.0
"""vLLM 0.33's workers join the transfer group through ``StatelessProcessGroup.create``, whose
TCPStore waits ``store_timeout=300`` s; nothing asyncrl passes changes that on the engine side."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the name both backends put on the wire (vLLM's worker
    resolves it with ``getattr(torch, name)``)."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of `dtype_name`; ValueError names an unknown dtype."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in weight-sync metadata")
    return dtype


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message names the member, the step and the setting involved."""


class VLLMWeightSyncError(WeightSyncError):
    """A weight sync through vLLM's transfer engine failed (a `WeightSyncError`)."""
