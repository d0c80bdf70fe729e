"""The header that opens every sync of the ``broadcast`` backend, written by rank 0 and read by each receiver.

int64 ``[MAGIC, version, meta_nbytes, num_buckets]`` (`asyncrl.sync.wire.HEADER_LEN` values): the
receiver checks the magic and the version before it takes anything else off the group.
"""

from __future__ import annotations

import torch

from asyncrl.sync.wire import HEADER_LEN, MAGIC, WeightSyncError


def encode_header(version: int, meta_nbytes: int, num_buckets: int) -> torch.Tensor:
    """The header of a sync of weights ``version``: ``meta_nbytes`` of metadata follow (0: unchanged), then
    ``num_buckets`` buckets."""
    return torch.tensor([MAGIC, version, meta_nbytes, num_buckets], dtype=torch.int64)


def empty_header(device: torch.device) -> torch.Tensor:
    """A buffer to receive a header into."""
    return torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)


def decode_header(header: torch.Tensor, *, rank: int, version: int) -> tuple[int, int]:
    """``(meta_nbytes, num_buckets)`` of a received header; raises `WeightSyncError` when it is not a sync
    header or carries another version than the coordinator asked ``rank`` to receive."""
    magic, sent_version, meta_nbytes, num_buckets = (int(x) for x in header.cpu())
    if magic != MAGIC:
        raise WeightSyncError(f"rank {rank}: bad sync header magic {magic:#x}; sender and receiver disagree")
    if sent_version != version:
        raise WeightSyncError(f"rank {rank}: trainer sends version {sent_version}, coordinator asked for {version}")
    return meta_nbytes, num_buckets
