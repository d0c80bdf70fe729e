"""Bucket layout of a weight sync: which tensor goes where in which packed uint8 bucket.

A model's parameters (name, dtype, global shape) are laid out, in ``named_parameters()``
order, into buckets of at most ``bucket_bytes``; each tensor sits at a 64-byte-aligned
offset so a receiver can view it in place (``buf[off:off + n].view(dtype).view(shape)``).
A tensor larger than ``bucket_bytes`` travels alone in a bucket of exactly its size, so no
tensor is ever split (a receiver never holds half a tensor) and the largest buffer either
side needs is ``max(bucket_bytes, largest tensor)``.

Tied weights (one Parameter under two names, e.g. ``lm_head.weight`` and
``model.embed_tokens.weight``) are sent once, under the first name; the layout records the
other names as ``aliases`` so a receiver whose engine lists them loads the same bytes.

The layout is what travels once as metadata (msgpack, never pickle) and is then re-used
while it does not change. Leaves out: splitting one tensor across buckets, buffers (only
parameters are synced), quantized/packed formats.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgpack
import torch

from asyncrl.sync.wire import dtype_from_name, dtype_name

ALIGN = 64
"""Byte alignment of every tensor inside a bucket."""

LAYOUT_FORMAT = 1
"""Version of the encoded layout; a receiver refuses another one."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True, kw_only=True)
class TensorSlot:
    """Where one tensor lives inside its bucket."""

    name: str
    dtype: str
    """dtype name without ``torch.``, e.g. ``float32``."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset inside the bucket (a multiple of ALIGN)."""
    nbytes: int


@dataclass(frozen=True, kw_only=True)
class Bucket:
    """One packed uint8 buffer's worth of tensors."""

    index: int
    nbytes: int
    """Bytes on the wire (end of the last slot)."""
    slots: tuple[TensorSlot, ...]


@dataclass(frozen=True, kw_only=True)
class BucketLayout:
    """The whole sync: buckets in send order, plus tied-weight aliases."""

    buckets: tuple[Bucket, ...]
    aliases: tuple[tuple[str, str], ...] = ()
    """``(alias, source)``: the alias holds the same tensor as ``source``, which is sent."""
    bucket_bytes: int

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def max_bucket_bytes(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)

    @property
    def names(self) -> list[str]:
        """Names of the tensors sent, in order (aliases not included)."""
        return [s.name for b in self.buckets for s in b.slots]

    def encode(self) -> bytes:
        """msgpack bytes of the layout (the sync's metadata message)."""
        return msgpack.packb(
            {
                "format": LAYOUT_FORMAT,
                "bucket_bytes": self.bucket_bytes,
                "aliases": [list(a) for a in self.aliases],
                "buckets": [
                    [b.nbytes, [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes] for s in b.slots]]
                    for b in self.buckets
                ],
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> BucketLayout:
        """Inverse of `encode`; ValueError names what is wrong with the message."""
        try:
            msg = msgpack.unpackb(data)
            fmt = msg["format"]
        except Exception as exc:  # noqa: BLE001 - any decode failure is a bad message
            raise ValueError(f"weight-sync metadata is not a valid layout message: {exc}") from exc
        if fmt != LAYOUT_FORMAT:
            raise ValueError(f"weight-sync metadata has format {fmt}, this receiver reads {LAYOUT_FORMAT}")
        buckets = tuple(
            Bucket(
                index=i,
                nbytes=nbytes,
                slots=tuple(
                    TensorSlot(name=n, dtype=d, shape=tuple(shape), offset=off, nbytes=nb)
                    for n, d, shape, off, nb in slots
                ),
            )
            for i, (nbytes, slots) in enumerate(msg["buckets"])
        )
        aliases = tuple((a, s) for a, s in msg["aliases"])
        return cls(buckets=buckets, aliases=aliases, bucket_bytes=msg["bucket_bytes"])

    def fingerprint(self) -> str:
        """Short hash of the layout: equal fingerprints mean the cached metadata still holds."""
        return hashlib.sha1(self.encode()).hexdigest()[:16]


def plan_buckets(
    metas: Iterable[tuple[str, torch.dtype | str, Sequence[int]]],
    bucket_bytes: int,
    aliases: Iterable[tuple[str, str]] = (),
) -> BucketLayout:
    """Lay ``(name, dtype, shape)`` out into buckets of at most ``bucket_bytes`` (see module doc)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[Bucket] = []
    slots: list[TensorSlot] = []
    end = 0

    def close() -> None:
        nonlocal slots, end
        if slots:
            buckets.append(Bucket(index=len(buckets), nbytes=end, slots=tuple(slots)))
        slots, end = [], 0

    seen: set[str] = set()
    for name, dtype, shape in metas:
        if name in seen:
            raise ValueError(f"parameter {name!r} appears twice in the weight-sync metadata")
        seen.add(name)
        dtype = dtype if isinstance(dtype, str) else dtype_name(dtype)
        shape = tuple(int(d) for d in shape)
        nbytes = dtype_from_name(dtype).itemsize * _numel(shape)
        offset = _align(end)
        if slots and offset + nbytes > bucket_bytes:
            close()
            offset = 0
        slots.append(TensorSlot(name=name, dtype=dtype, shape=shape, offset=offset, nbytes=nbytes))
        end = offset + nbytes
        if end >= bucket_bytes:
            close()
    close()
    return BucketLayout(buckets=tuple(buckets), aliases=tuple(aliases), bucket_bytes=bucket_bytes)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def model_param_metas(model: torch.nn.Module) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], list[tuple[str, str]]]:
    """``(metas, aliases)`` of a model's parameters; tied ones are listed once (global shapes).

    Works on a plain module and on one sharded with FSDP2 (a DTensor's ``.shape`` is global).
    """
    metas, aliases, first_name = [], [], {}
    for name, p in model.named_parameters(remove_duplicate=False):
        key = id(p)
        if key in first_name:
            aliases.append((name, first_name[key]))
            continue
        first_name[key] = name
        metas.append((name, p.dtype, tuple(p.shape)))
    return metas, aliases


def pack(bucket: Bucket, tensors: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy ``tensors`` (one per slot, in slot order) into ``out[:bucket.nbytes]`` and return that view."""
    if len(tensors) != len(bucket.slots):
        raise ValueError(f"bucket {bucket.index} has {len(bucket.slots)} slots, got {len(tensors)} tensors")
    view = out[: bucket.nbytes]
    for slot, t in zip(bucket.slots, tensors):
        if tuple(t.shape) != slot.shape or dtype_name(t.dtype) != slot.dtype:
            raise ValueError(
                f"{slot.name}: expected {slot.dtype}{list(slot.shape)}, got {dtype_name(t.dtype)}{list(t.shape)}"
            )
        dst = view[slot.offset : slot.offset + slot.nbytes].view(t.dtype).view(t.shape)
        dst.copy_(t, non_blocking=True)
    return view


def unpack(bucket: Bucket, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Views of every tensor of ``bucket`` inside ``buf`` (no copy: they alias ``buf``)."""
    if buf.dtype != torch.uint8 or buf.numel() < bucket.nbytes:
        raise ValueError(f"bucket {bucket.index} needs a uint8 buffer of >= {bucket.nbytes} bytes")
    return [
        (s.name, buf[s.offset : s.offset + s.nbytes].view(dtype_from_name(s.dtype)).view(s.shape))
        for s in bucket.slots
    ]


NUM_BUFFERS = 2
"""Bucket buffers in flight on each side: one on the wire while the next is packed / loaded
(3 and 4 measured no better on the 2-core CPU bench, which is bound by memory copies)."""


class BucketBuffers:
    """The alternating bucket buffers of one side of a sync, kept between syncs.

    Fresh host memory costs a page fault per page on first touch (on the wire that halves
    loopback throughput), so the buffers live as long as their owner unless `release`d.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._bufs: list[torch.Tensor] = []

    def get(self, slot: int, nbytes: int) -> torch.Tensor:
        """Buffer ``slot`` (0 .. NUM_BUFFERS-1), at least ``nbytes`` long (grown when needed)."""
        while len(self._bufs) <= slot:
            self._bufs.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._bufs[slot].numel() < nbytes:
            self._bufs[slot] = torch.empty(0, dtype=torch.uint8, device=self.device)  # free before growing
            self._bufs[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._bufs[slot]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs)

    def release(self) -> None:
        self._bufs = []
