"""Decoding the sample-stream codec's messages: `unpack` (see `asyncrl.queue.codec` for the format).

Every array comes back as a view on a received frame; any malformed input raises `CodecError`
saying what was wrong.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import msgpack
import numpy as np

from asyncrl.queue.codec_base import (
    _COLUMN_DTYPES,
    _EXT_GROUP,
    _EXT_NDARRAY,
    _EXT_NPSCALAR,
    _EXT_TENSOR,
    _EXT_TRAJECTORY,
    _MASK_DTYPE,
    _MAX_NDIM,
    _NP_KINDS,
    _PLAIN_FIELDS,
    _TRAJECTORY_FIELDS,
    CODEC_VERSION,
    DEFAULT_MAX_FRAME_BYTES,
    CodecError,
    _buffer,
    _build,
    _torch,
    _torch_dtype,
)
from asyncrl.queue.group_codec import _slice_responses
from asyncrl.types import Group, Trajectory


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


