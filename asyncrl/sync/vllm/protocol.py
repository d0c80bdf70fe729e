"""What vLLM 0.32/0.33's NCCL weight-transfer engine expects on the wire, and the packing that writes it.

The trainer and the engines never exchange a layout: both cut the same buckets from the same
metadata (`plan_vllm_buckets`), so these functions are the agreement. `engine_init_infos` and
`update_info` are the records vLLM's ``init_weight_transfer_engine`` / ``update_weights`` take;
`broadcast_packed` writes the packed buckets in that geometry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from asyncrl.sync.base import full_tensor
from asyncrl.sync.wire import VLLM_DEFAULT_BUCKET_BYTES, dtype_name


@dataclass(frozen=True)
class TensorMeta:
    """Name, wire dtype and full shape of one tensor the trainer sends."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= int(d)
        return n


def plan_vllm_buckets(sizes: Sequence[int], bucket_bytes: int) -> list[range]:
    """Cut tensors of ``sizes`` bytes (in send order) into buckets the way vLLM 0.33 does.

    A bucket takes tensors until its total *exceeds* ``bucket_bytes``; the tensor that
    crosses the line stays in it. Returns the index range of each bucket.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total > bucket_bytes:
            buckets.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        buckets.append(range(start, len(sizes)))
    return buckets


def check_vllm_alignment(metas: Sequence[TensorMeta], bucket_bytes: int) -> None:
    """Raise ValueError if vLLM 0.33's packed receiver could not view a tensor in its bucket.

    vLLM unpacks with ``bucket.split(sizes)[i].view(dtype)``, which needs each tensor's byte
    offset inside the bucket to be a multiple of its element size (e.g. 7 bf16 values
    followed by an int64 are not). Failing here, before anything is sent, beats the
    engines failing half way through an update.
    """
    for idx in plan_vllm_buckets([m.nbytes for m in metas], bucket_bytes):
        offset = 0
        for i in idx:
            m = metas[i]
            if offset % m.dtype.itemsize:
                raise ValueError(
                    f"{m.name!r} ({m.dtype}) would start at byte {offset} of its packed bucket, which vLLM's "
                    f"receiver cannot view as {m.dtype}; set VLLMSyncConfig.packed=False or change bucket_mb"
                )
            offset += m.nbytes


def update_info(metas: Sequence[TensorMeta]) -> dict[str, list]:
    """vLLM's ``NCCLWeightTransferUpdateInfo`` as plain lists (what ``update_weights`` takes)."""
    return {
        "names": [m.name for m in metas],
        "dtype_names": [dtype_name(m.dtype) for m in metas],
        "shapes": [list(m.shape) for m in metas],
    }


def engine_init_infos(
    *,
    master_address: str,
    master_port: int,
    workers_per_engine: Sequence[int],
    packed: bool = True,
    bucket_bytes: int = VLLM_DEFAULT_BUCKET_BYTES,
    num_buffers: int = 2,
) -> list[dict]:
    """One ``init_weight_transfer_engine`` payload per engine (vLLM's ``NCCLWeightTransferInitInfo``).

    ``workers_per_engine[i]`` is engine i's worker count (``dp * tp * pp`` of that AsyncLLM).
    Engines are laid out after trainer rank 0, one contiguous rank range each.
    """
    if not workers_per_engine or any(w < 1 for w in workers_per_engine):
        raise ValueError(f"workers_per_engine needs one count >= 1 per engine, got {list(workers_per_engine)}")
    world_size = 1 + sum(workers_per_engine)
    infos, offset = [], 1
    for workers in workers_per_engine:
        infos.append(
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": offset,
                "world_size": world_size,
                "packed": packed,
                "packed_buffer_size_bytes": bucket_bytes,
                "packed_num_buffers": num_buffers,
            }
        )
        offset += workers
    return infos


def model_tensor_metas(model: torch.nn.Module, wire_dtype: torch.dtype | None = None) -> list[TensorMeta]:
    """Metadata of ``model.named_parameters()`` (tied weights once, global shapes under FSDP2), with
    floating-point tensors in ``wire_dtype`` when given."""
    return [TensorMeta(name, _wire(p.dtype, wire_dtype), tuple(p.shape)) for name, p in model.named_parameters()]


def iter_full_tensors(model: torch.nn.Module, wire_dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` in ``wire_dtype`` (floating point only); an FSDP2 shard (DTensor)
    is all-gathered, so every rank must iterate."""
    for name, p in model.named_parameters():
        full = full_tensor(p).detach()
        yield name, full.to(_wire(full.dtype, wire_dtype))


def _wire(dtype: torch.dtype, wire_dtype: torch.dtype | None) -> torch.dtype:
    return wire_dtype if wire_dtype is not None and dtype.is_floating_point else dtype


def broadcast_packed(
    pairs: Iterable[tuple[str, torch.Tensor]],
    metas: Sequence[TensorMeta],
    *,
    bucket_bytes: int,
    broadcast: Callable[[torch.Tensor, object], None],
    device: torch.device,
    streams: Sequence[object | None],
) -> tuple[int, int]:
    """Pack ``pairs`` into vLLM-geometry buckets and hand each to ``broadcast(buffer, stream)``.

    Bucket ``b`` uses slot ``b % len(streams)``: before re-using a slot its previous bucket
    must have left (the slot's stream is synchronized), so at most ``len(streams)`` buckets
    are held and packing one overlaps sending another. Each incoming tensor is copied into
    the bucket and dropped, so a gathered full tensor lives only until it is packed.
    Checks every pair against ``metas`` (the receiver cuts its buckets from them). Returns
    ``(bytes sent, peak bytes of bucket buffers held at once)``.
    """
    plan = plan_vllm_buckets([m.nbytes for m in metas], bucket_bytes)
    it = iter(pairs)
    held: list[torch.Tensor | None] = [None] * len(streams)
    sent = peak = 0
    for b, idx in enumerate(plan):
        slot = b % len(streams)
        stream = streams[slot]
        if stream is not None:
            stream.synchronize()
        held[slot] = None
        if stream is not None:
            # Parameters were last written on the caller's stream (optimizer step).
            stream.wait_stream(torch.cuda.current_stream(device))
        ctx = torch.cuda.stream(stream) if stream is not None else nullcontext()
        with ctx:
            nbytes = sum(metas[i].nbytes for i in idx)
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            offset = 0
            for i in idx:
                name, tensor = next_checked(it, metas, i)
                raw = tensor.contiguous().view(-1).view(torch.uint8)
                buf[offset : offset + raw.numel()].copy_(raw, non_blocking=True)
                offset += raw.numel()
                del tensor, raw
            broadcast(buf, stream)
            held[slot] = buf
            sent += nbytes
            peak = max(peak, sum(h.numel() for h in held if h is not None))
    extra = next(it, None)
    if extra is not None:
        raise ValueError(f"weight source yielded {extra[0]!r} beyond the {len(metas)} tensors in the metadata")
    for stream in streams:
        if stream is not None:
            stream.synchronize()
    return sent, peak


def next_checked(it: Iterator, metas: Sequence[TensorMeta], i: int) -> tuple[str, torch.Tensor]:
    """The next ``(name, tensor)`` of ``it``, checked against ``metas[i]`` (what the engines expect there)."""
    expected = metas[i]
    try:
        name, tensor = next(it)
    except StopIteration:
        raise ValueError(
            f"weight source ended after {i} tensors; the metadata declares {len(metas)} "
            f"(next expected {expected.name!r}) and the engines are waiting for them"
        ) from None
    if name != expected.name or tensor.dtype != expected.dtype or tuple(tensor.shape) != expected.shape:
        raise ValueError(
            f"weight source disagrees with the metadata at index {i}: declared {expected.name!r} "
            f"{expected.dtype} {expected.shape}, got {name!r} {tensor.dtype} {tuple(tensor.shape)}"
        )
    return name, tensor
