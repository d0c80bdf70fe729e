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

import math
import sys
import warnings
from typing import Any

import msgpack
import numpy as np

from asyncrl.queue.codec_base import (
    _ALIGN,
    _COLUMN_DTYPES,
    _MASK_DTYPE,
    _NP_KINDS,
    CODEC_VERSION,
    DEFAULT_MAX_FRAME_BYTES,
    CodecError,
    _buffer,
    _build,
)
from asyncrl.queue.group_codec import _slice_responses
from asyncrl.types import Group, Trajectory

__all__ = ["CODEC_VERSION", "DEFAULT_MAX_FRAME_BYTES", "DEFAULT_OWN_FRAME_BYTES", "CodecError", "PoolBuffers",
           "pack", "unpack"]


DEFAULT_OWN_FRAME_BYTES = 64 * 1024
"""Arrays this large or larger travel as their own frame (ZeroMQ copies smaller frames anyway)."""

_MAX_NDIM = 32
_GROW = 256 * 1024  # recycled pool buffers grow in steps of this many bytes

# msgpack extension codes used in the header.
_EXT_NDARRAY = 1
_EXT_TENSOR = 2
_EXT_NPSCALAR = 3
_EXT_TRAJECTORY = 4
_EXT_GROUP = 5

_TRAJECTORY_FIELDS = (
    "sample_id", "index", "prompt_ids", "response_ids", "logprobs", "versions",
    "finish_reason", "reward", "age", "loss_mask", "turns",
)
_PLAIN_FIELDS = 9  # a record without loss_mask and turns (as before they existed) still decodes



# --------------------------------------------------------------------------------------
# torch is optional at import time: the codec is used by processes that never touch it.

def _torch():
    import torch

    return torch


def _is_torch_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and type(obj).__name__ in ("Tensor", "Parameter")


_TORCH_DTYPES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128",
)


def _torch_dtype(name: str):
    if name not in _TORCH_DTYPES:
        raise CodecError(f"unsupported torch dtype {name!r} in header (supported: {', '.join(_TORCH_DTYPES)})")
    return getattr(_torch(), name)


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


# --------------------------------------------------------------------------------------
# decode



class _Decoder:
    """One `unpack` call: resolves extension records against the raw frames."""

    def __init__(self, buffers: list[memoryview]) -> None:
        self.buffers = buffers  # buffers[0] is the pool
        self.used = [False] * len(buffers)
        self.used[0] = True

    def unpackb(self, data: bytes) -> Any:
        return msgpack.unpackb(data, ext_hook=self.ext_hook, raw=False, strict_map_key=False)

    def ext_hook(self, code: int, data: bytes) -> Any:
        if code == _EXT_NDARRAY:
            return self._ndarray(*self._locate(self._record(data, "array"), "array"))
        if code == _EXT_TENSOR:
            return self._tensor(*self._locate(self._record(data, "tensor"), "tensor"))
        if code == _EXT_NPSCALAR:
            arr = self.unpackb(data)
            if not isinstance(arr, np.ndarray) or arr.ndim != 0:
                raise CodecError("numpy scalar record does not hold a 0-d array")
            return arr[()]
        if code == _EXT_TRAJECTORY:
            values = self._fields(data, "Trajectory", len(_TRAJECTORY_FIELDS), _PLAIN_FIELDS)
            return _build(Trajectory, **dict(zip(_TRAJECTORY_FIELDS, values)))
        if code == _EXT_GROUP:
            c = self._fields(data, "Group", _GROUP_COLUMNS + 3, _GROUP_COLUMNS)
            if c[5]:  # a group without responses has no columns to rebuild
                c[11:15] = [self._column(rec, dt) for rec, dt in zip(c[11:15], _COLUMN_DTYPES)]
                if len(c) > _GROUP_COLUMNS and c[17] is not None:
                    c[17] = self._column(c[17], _MASK_DTYPE)
            return _group_from_columns(c)
        raise CodecError(f"unknown extension code {code} in header")

    def _column(self, rec: Any, dt: np.dtype) -> np.ndarray:
        # A group's token column as the encoder writes it: [dtype, [count], 1, offset], inside
        # the pool. Anything else takes the general path, whose errors say what is wrong.
        if type(rec) is list and len(rec) == 4 and rec[0] == dt.str and rec[2] == 1:
            shape, offset = rec[1], rec[3]
            if type(shape) is list and len(shape) == 1 and type(shape[0]) is int and type(offset) is int:
                count, pool = shape[0], self.buffers[0]
                if count > 0 and offset >= 0 and offset + count * dt.itemsize <= pool.nbytes:
                    return np.frombuffer(pool, dt, count, offset)
        return self._ndarray(*self._locate(rec, "column"))

    def _fields(self, data: bytes, what: str, n: int, older: int | None = None) -> list[Any]:
        # ``older``: the field count of records made before turns and masks existed (also valid).
        values = self.unpackb(data)
        if not isinstance(values, list) or len(values) not in (n, older):
            raise CodecError(f"{what} record is not a list of {n} fields" + (f" (or {older})" if older else ""))
        return values

    @staticmethod
    def _record(data: bytes, what: str) -> Any:
        try:
            return msgpack.unpackb(data, raw=False)
        except Exception as e:
            raise CodecError(f"{what} record is not msgpack: {e}") from e

    def _locate(self, record: Any, what: str) -> tuple[str, tuple[int, ...], memoryview, int, int]:
        if not isinstance(record, list) or len(record) != 4:
            raise CodecError(f"{what} record is not (dtype, shape, frame_index, offset)")
        dtype, shape, index, offset = record
        if not isinstance(dtype, str):
            raise CodecError(f"{what} dtype must be a string, got {type(dtype).__name__}")
        if not isinstance(shape, list) or len(shape) > _MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
            raise CodecError(f"{what} shape {shape!r} is not a list of non-negative ints")
        if type(index) is not int or not 1 <= index <= len(self.buffers):
            raise CodecError(f"{what} refers to frame {index!r} but the message has {len(self.buffers)} data frames")
        if type(offset) is not int or offset < 0 or (index != 1 and offset != 0):
            raise CodecError(f"{what} offset {offset!r} is invalid for data frame {index}")
        if index != 1:
            if self.used[index - 1]:
                raise CodecError(f"{what} refers to data frame {index} a second time")
            self.used[index - 1] = True
        return dtype, tuple(shape), self.buffers[index - 1], offset, index

    @staticmethod
    def _view(buf: memoryview, offset: int, index: int, shape: tuple[int, ...], itemsize: int, dtype: str) -> memoryview:
        need = math.prod(shape) * itemsize
        if index == 1:  # pooled: must lie inside the pool
            if offset + need > buf.nbytes:
                raise CodecError(
                    f"pooled array of dtype {dtype} x shape {list(shape)} needs bytes {offset}..{offset + need} "
                    f"but the pool frame has {buf.nbytes}"
                )
            return buf[offset : offset + need]
        if buf.nbytes != need:
            raise CodecError(f"data frame {index} has {buf.nbytes} bytes but dtype {dtype} x shape {list(shape)} needs {need}")
        return buf

    def _ndarray(self, dtype: str, shape: tuple[int, ...], buf: memoryview, offset: int, index: int) -> np.ndarray:
        dt = _NP_DTYPES.get(dtype)
        if dt is None:
            try:
                dt = np.dtype(dtype)
            except TypeError as e:
                raise CodecError(f"unknown numpy dtype {dtype!r} in header") from e
            if dt.kind not in _NP_KINDS or dt.str != dtype:
                raise CodecError(f"unsupported numpy dtype {dtype!r} in header (numeric and bool dtypes only)")
        view = self._view(buf, offset, index, shape, dt.itemsize, dtype)
        return np.frombuffer(view, dtype=dt).reshape(shape)

    def _tensor(self, dtype: str, shape: tuple[int, ...], buf: memoryview, offset: int, index: int) -> Any:
        torch = _torch()
        tdt = _torch_dtype(dtype)
        view = self._view(buf, offset, index, shape, tdt.itemsize, dtype)
        if view.nbytes == 0:  # torch.frombuffer refuses empty buffers
            return torch.empty(shape, dtype=tdt)
        with warnings.catch_warnings():
            # Immutable input (bytes) is shared, not copied; torch warns that it is not writable.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(view, dtype=tdt).reshape(shape)


_GROUP_COLUMNS = 15

_NP_DTYPES = {np.dtype(c).str: np.dtype(c) for c in "?bBhHiIlLqQefdFD"}


def _group_from_columns(c: list[Any]) -> Group:
    sample_id, expected, status, error, meta, index, finish, reward, age, plens, rlens, p, r, lp, v = c[:_GROUP_COLUMNS]
    turns, masked, m = c[_GROUP_COLUMNS:] or (None, None, None)
    n = len(index) if isinstance(index, list) else -1
    if n < 0 or not all(isinstance(col, list) and len(col) == n for col in (finish, reward, age, plens, rlens)):
        raise CodecError(f"group {sample_id!r}: per-response columns disagree in length")
    trajectories = []
    if n:
        arrays = (p, r, lp, v)
        if not all(isinstance(a, np.ndarray) and a.ndim == 1 and a.dtype == dt for a, dt in zip(arrays, _COLUMN_DTYPES)):
            raise CodecError(f"group {sample_id!r}: token columns must be 1-d arrays of int64, int64, float32, int64")
        if not all(type(x) is int and x >= 0 for x in plens + rlens):
            raise CodecError(f"group {sample_id!r}: lengths must be non-negative ints")
        if sum(plens) != len(p) or not sum(rlens) == len(r) == len(lp) == len(v):
            raise CodecError(f"group {sample_id!r}: lengths do not add up to the token columns")
        if m is not None and not (isinstance(m, np.ndarray) and m.ndim == 1 and m.dtype == _MASK_DTYPE and len(m) == len(r)):
            raise CodecError(f"group {sample_id!r}: the mask column must be 1-d uint8 as long as the response column")
        extra = [turns, masked] if turns is not None or masked is not None else []
        trajectories, _, _ = _slice_responses(sample_id, c[5:11] + extra, (p, r, lp, v, m), 0, 0)
    return _build(Group, sample_id=sample_id, trajectories=trajectories, expected=expected, status=status,
                  error=error, meta=meta)


def unpack(frames: list[Any], *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Any:
    """Decode ``[header, pool, *own_frames]`` as `pack` made it; arrays are views on the frames.

    Raises `CodecError` for any malformed input (see the module docstring).
    """
    if not isinstance(frames, (list, tuple)) or len(frames) < 2:
        raise CodecError(f"expected [header, pool, *data_frames], got {len(frames) if isinstance(frames, (list, tuple)) else type(frames).__name__}")
    buffers = [_buffer(f) for f in frames]
    for i, buf in enumerate(buffers):
        if buf.nbytes > max_frame_bytes:
            raise CodecError(f"frame {i} has {buf.nbytes} bytes, over max_frame_bytes={max_frame_bytes}")
    try:
        header = msgpack.unpackb(buffers[0], raw=False)
    except Exception as e:
        raise CodecError(f"header is not valid msgpack: {type(e).__name__}: {e}") from e
    if isinstance(header, list) and header and header[0] != CODEC_VERSION:
        raise CodecError(f"codec version {header[0]!r} is not supported (this side speaks {CODEC_VERSION})")
    if not isinstance(header, list) or len(header) != 4:
        raise CodecError("header is not [version, n_data_frames, pool_nbytes, body]")
    _, n_frames, pool_nbytes, body = header
    if type(n_frames) is not int or type(pool_nbytes) is not int or not isinstance(body, bytes):
        raise CodecError("header is not [version, n_data_frames, pool_nbytes, body]")
    if n_frames != len(buffers) - 1:
        raise CodecError(f"header announces {n_frames} data frames but {len(buffers) - 1} arrived")
    if buffers[1].nbytes != pool_nbytes:
        raise CodecError(f"pool frame has {buffers[1].nbytes} bytes but the header announces {pool_nbytes}")
    dec = _Decoder(buffers[1:])
    try:
        value = dec.unpackb(body)
    except CodecError:
        raise
    except Exception as e:
        raise CodecError(f"body is not valid: {type(e).__name__}: {e}") from e
    if not all(dec.used):
        unused = [i + 1 for i, u in enumerate(dec.used) if not u]
        raise CodecError(f"data frames {unused} are not referenced by the header")
    return value


