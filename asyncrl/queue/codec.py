"""The sample-stream codec: a msgpack header plus raw frames for the arrays.

``pack(obj)`` turns a value into ``[header, pool, *own_frames]``. The header is msgpack;
every numpy array and torch tensor in ``obj`` is replaced there by a record
``(dtype, shape, frame_index, offset)`` and its bytes travel raw: an array of at least
``own_frame_bytes`` (64 KiB) as its own frame, shared with the array and sent with
``copy=False``; smaller ones copied into the one ``pool`` frame at 16-byte aligned offsets
(ZeroMQ copies small frames anyway, and one frame instead of dozens is what keeps the
per-message cost low). A `Group` travels column-wise: each token field of its ``n``
responses is gathered straight into the pool as one array, so a message has a handful of
records whatever ``n`` is; a producer passes `PoolBuffers` so that the pool frame is a
recycled buffer rather than a fresh allocation per message. ``unpack(frames)`` rebuilds the
value; every array is a view on a received frame (``numpy.frombuffer`` /
``torch.frombuffer``), never a copy. Treat decoded
arrays as read-only: one decoded from immutable bytes is read-only, and a tensor shares the
frame's memory.

The sample stream itself uses a leaner path for its one record type: the group-batch codec
in `asyncrl.queue.group_codec`; what both share is in `asyncrl.queue.codec_base`.

Supported values: None, bool, int (64-bit), float, str, bytes, lists/tuples (decoded as
lists), dicts with str/int keys, numpy arrays and scalars of numeric or bool dtype, torch
tensors (including bfloat16; numpy has no bfloat16, so its bytes are rebuilt with torch),
and `Trajectory` / `Group`, which round-trip exactly. Non-contiguous arrays are made
contiguous on encode; 0-d and empty arrays work.

Left out on purpose: pickle (never, on any path: an unsupported type is a `CodecError`
naming it), object/string/structured numpy dtypes, sparse and quantized tensors, and GPU
tensors stay where they are until encode copies them to host memory.

Any malformed input (garbage bytes, a wrong protocol version, a missing or extra frame, a
frame whose length does not match dtype x shape, a frame over ``max_frame_bytes``) raises
`CodecError` with a message saying what was wrong; it never returns a wrong array.
"""


from __future__ import annotations

import sys
from typing import Any

import msgpack
import numpy as np

from asyncrl.queue.codec_base import (
    _ALIGN,
    _COLUMN_DTYPES,
    _EXT_GROUP,
    _EXT_NDARRAY,
    _EXT_NPSCALAR,
    _EXT_TENSOR,
    _EXT_TRAJECTORY,
    _MASK_DTYPE,
    _NP_KINDS,
    _PLAIN_FIELDS,
    _TORCH_DTYPES,
    _TRAJECTORY_FIELDS,
    CODEC_VERSION,
    DEFAULT_MAX_FRAME_BYTES,
    CodecError,
    _is_torch_tensor,
    _torch,
)
from asyncrl.queue.codec_unpack import unpack
from asyncrl.types import Group, Trajectory

__all__ = ["CODEC_VERSION", "DEFAULT_MAX_FRAME_BYTES", "DEFAULT_OWN_FRAME_BYTES", "CodecError", "PoolBuffers",
           "pack", "unpack"]


DEFAULT_OWN_FRAME_BYTES = 64 * 1024
"""Arrays this large or larger travel as their own frame (ZeroMQ copies smaller frames anyway)."""

_GROW = 256 * 1024  # recycled pool buffers grow in steps of this many bytes


# --------------------------------------------------------------------------------------
# encode


class _Encoder:
    """One `pack` call: collects raw frames while msgpack walks the value.

    An array of at least ``own_frame_bytes`` (contiguous, or made so) gets its own frame and is
    sent without a copy. Smaller ones are copied into one shared pool frame at aligned offsets:
    ZeroMQ copies small frames anyway, and one frame instead of dozens keeps the per-message
    cost low. A group's token columns always go to the pool: gathering n responses into one
    column is a copy either way, so it is made straight into the pool.
    """

    def __init__(self, own_frame_bytes: int) -> None:
        self.own_frame_bytes = own_frame_bytes
        self.own: list[Any] = []
        # What goes into the pool: (offset, nbytes, source, dtype); source is an array, or a
        # list of 1-d arrays gathered in order (a group's column).
        self.writers: list[tuple[int, int, Any, np.dtype]] = []
        self.pool_nbytes = 0
        self._packers: list[msgpack.Packer] = []
        self._depth = 0

    def packb(self, value: Any) -> bytes:
        # Packers are reused per nesting depth: building one per record costs a buffer allocation.
        if self._depth == len(self._packers):
            self._packers.append(msgpack.Packer(default=self.default, use_bin_type=True, buf_size=4096))
        packer = self._packers[self._depth]
        self._depth += 1
        try:
            return packer.pack(value)
        except CodecError:
            raise
        except (OverflowError, TypeError, ValueError) as e:
            raise CodecError(f"cannot encode: {e}") from e
        finally:
            self._depth -= 1

    def default(self, obj: Any) -> msgpack.ExtType:
        if isinstance(obj, Group):
            return self._group(obj)
        if isinstance(obj, np.ndarray):
            return self._ndarray(obj)
        if isinstance(obj, np.generic):
            return msgpack.ExtType(_EXT_NPSCALAR, self.packb(np.asarray(obj)))
        if _is_torch_tensor(obj):
            return self._tensor(obj)
        if isinstance(obj, Trajectory):
            fields = [getattr(obj, f) for f in _TRAJECTORY_FIELDS]
            plain = obj.loss_mask is None and obj.turns == 1  # nothing more on the wire than before
            return msgpack.ExtType(_EXT_TRAJECTORY, self.packb(fields[:_PLAIN_FIELDS] if plain else fields))
        raise CodecError(f"cannot encode a value of type {type(obj).__module__}.{type(obj).__qualname__} (no pickle)")

    def _own(self, code: int, dtype: str, shape: list[int], flat_u8: Any) -> msgpack.ExtType:
        self.own.append(flat_u8)
        return msgpack.ExtType(code, msgpack.packb([dtype, shape, 1 + len(self.own), 0]))  # data frame 1: pool

    def _reserve(self, nbytes: int, source: Any, dtype: np.dtype) -> int:
        offset = self.pool_nbytes
        self.writers.append((offset, nbytes, source, dtype))
        self.pool_nbytes = offset + -(-nbytes // _ALIGN) * _ALIGN
        return offset

    def _pooled(self, code: int, dtype: str, shape: list[int], nbytes: int, source: Any, dt: np.dtype) -> msgpack.ExtType:
        return msgpack.ExtType(code, msgpack.packb([dtype, shape, 1, self._reserve(nbytes, source, dt)]))

    def _ndarray(self, arr: np.ndarray) -> msgpack.ExtType:
        if arr.dtype.kind not in _NP_KINDS:
            raise CodecError(f"cannot encode a numpy array of dtype {arr.dtype} (numeric and bool dtypes only)")
        shape = list(arr.shape)
        if arr.nbytes >= self.own_frame_bytes:
            return self._own(_EXT_NDARRAY, arr.dtype.str, shape, np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
        # One copy, straight from the (possibly strided) array into the pool.
        return self._pooled(_EXT_NDARRAY, arr.dtype.str, shape, arr.nbytes, arr, arr.dtype)

    def _group(self, g: Group) -> msgpack.ExtType:
        # A group travels column-wise: each token field of the n responses is gathered straight
        # into the pool as one array, described by a plain [dtype, shape, 1, offset] record, so
        # a message holds four arrays whatever n is; decoding slices them back into views.
        # One pass over the responses collects every per-response value and column source.
        index, finish, reward, age, plens, rlens, turns, masks = [], [], [], [], [], [], [], []
        sources: tuple[list[Any], ...] = ([], [], [], [])
        for t in g.trajectories:
            p, r = t.prompt_ids, t.response_ids
            index.append(t.index), finish.append(t.finish_reason), reward.append(t.reward), age.append(t.age)
            plens.append(len(p)), rlens.append(len(r)), turns.append(t.turns), masks.append(t.loss_mask)
            sources[0].append(p), sources[1].append(r), sources[2].append(t.logprobs), sources[3].append(t.versions)
        np_, nr = sum(plens), sum(rlens)
        columns = [[dt.str, [count], 1, self._reserve(count * dt.itemsize, src, dt)]
                   for src, dt, count in zip(sources, _COLUMN_DTYPES, (np_, nr, nr, nr))]
        body = [g.sample_id, g.expected, g.status, g.error, g.meta, index, finish, reward, age, plens, rlens, *columns]
        flags = [m is not None for m in masks]
        if any(flags) or any(k != 1 for k in turns):
            # An agent's group: turns, which responses have a mask, and the masks as a column along
            # the responses (ones where a response has none); a plain group stays as it was.
            filled = [m if m is not None else np.ones(n, _MASK_DTYPE) for m, n in zip(masks, rlens)]
            mask_column = [_MASK_DTYPE.str, [nr], 1, self._reserve(nr, filled, _MASK_DTYPE)] if any(flags) else None
            body += [turns, flags, mask_column]
        return msgpack.ExtType(_EXT_GROUP, self.packb(body))

    def _tensor(self, t: Any) -> msgpack.ExtType:
        torch = _torch()
        if t.layout != torch.strided or t.is_quantized:
            raise CodecError(f"cannot encode a {t.layout} tensor (dense tensors only)")
        name = str(t.dtype).removeprefix("torch.")
        if name not in _TORCH_DTYPES:
            raise CodecError(f"cannot encode a torch tensor of dtype {t.dtype} (supported: {', '.join(_TORCH_DTYPES)})")
        shape = list(t.shape)
        t = t.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
        flat = t.reshape(-1).view(torch.uint8).numpy()
        if flat.nbytes >= self.own_frame_bytes:
            return self._own(_EXT_TENSOR, name, shape, flat)
        return self._pooled(_EXT_TENSOR, name, shape, flat.nbytes, flat, flat.dtype)

    def pool(self, buffers: PoolBuffers | None) -> np.ndarray:
        pool = np.empty(self.pool_nbytes, np.uint8) if buffers is None else buffers.take(self.pool_nbytes)
        for offset, nbytes, source, dt in self.writers:
            region = pool[offset : offset + nbytes].view(dt)
            if type(source) is list:
                try:
                    np.concatenate(source, out=region) if source else None
                except (TypeError, ValueError) as e:
                    raise CodecError(f"token arrays cannot be gathered as {dt}: {e}") from e
            else:
                np.copyto(region.reshape(source.shape), source)
        return pool


class PoolBuffers:
    """Pool frames recycled across `pack` calls, so a steady stream does not pay a fresh
    allocation for every message (for a 1k-token group of 8 that is ~40 page faults).

    A buffer is handed out again only once nothing but this object refers to it: the frame
    that was a view on it has been dropped by everyone, ZeroMQ included (pyzmq holds a
    zero-copy frame until the message has left), so a frame in flight is never overwritten.
    When every kept buffer is in use a fresh one is made; at most ``keep`` are kept. Use from
    one thread.
    """

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep
        self._buffers: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        """A writable uint8 array of ``nbytes`` that no one else refers to."""
        buffers = self._buffers
        for i in range(len(buffers)):
            if sys.getrefcount(buffers[i]) == 2:  # the list's reference and getrefcount's argument
                if buffers[i].nbytes < nbytes:  # grown with headroom, as message sizes vary
                    buffers[i] = np.empty(-(-nbytes // _GROW) * _GROW, np.uint8)
                return buffers[i][:nbytes]
        buf = np.empty(nbytes, np.uint8)
        if len(buffers) < self.keep:
            buffers.append(buf)
        return buf[:nbytes]


def pack(obj: Any, *, own_frame_bytes: int = DEFAULT_OWN_FRAME_BYTES, buffers: PoolBuffers | None = None) -> list[Any]:
    """Encode ``obj`` as ``[header, pool, *own_frames]``; own frames share the arrays' memory.

    Arrays of at least ``own_frame_bytes`` travel as their own frame, smaller ones in the
    shared pool frame; with ``buffers`` the pool frame is a recycled buffer (see `PoolBuffers`).
    Raises `CodecError` naming the type of any value it cannot encode.
    """
    enc = _Encoder(own_frame_bytes)
    body = enc.packb(obj)
    header = msgpack.packb([CODEC_VERSION, 1 + len(enc.own), enc.pool_nbytes, body], use_bin_type=True)
    return [header, enc.pool(buffers), *enc.own]
