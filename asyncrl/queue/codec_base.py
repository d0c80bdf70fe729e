"""What the sample stream's codecs share: the error, the format version, frame checks, the header's
extension codes and record fields, and the torch dtypes a tensor may have.

`asyncrl.queue.codec` (generic ``pack``; ``unpack`` in `asyncrl.queue.codec_unpack`) and `asyncrl.queue.group_codec` (the
stream's group batches) both build on these, so a frame is checked the same way on either path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

CODEC_VERSION = 1
"""Bumped on any change to the header layout; a peer with another version is refused."""

DEFAULT_MAX_FRAME_BYTES = 512 * 1024 * 1024
"""Largest frame `unpack` accepts unless told otherwise (512 MiB)."""

_ALIGN = 16  # pool offsets keep every dtype (complex128 included) aligned

# Numeric and bool numpy dtypes, keyed by `dtype.str` (byte order included).
_NP_KINDS = set("biufc")
_I8, _F4, _U1 = np.dtype(np.int64), np.dtype(np.float32), np.dtype(np.uint8)
_COLUMN_DTYPES = (_I8, _I8, _F4, _I8)  # a group's token columns: prompt_ids, response_ids, logprobs, versions
# The optional fifth column, loss masks: one byte per response token, present only when some
# response of the message has a mask (a response without one is filled with ones there).
_MASK_DTYPE = _U1


class CodecError(ValueError):
    """A value cannot be encoded, or frames cannot be decoded; the message says why."""



def _buffer(frame: Any) -> memoryview:
    # zmq.Frame exposes .buffer; bytes/bytearray/memoryview/ndarray support the buffer protocol.
    buf = getattr(frame, "buffer", frame)
    try:
        mv = memoryview(buf)
    except TypeError as e:
        raise CodecError(f"frame of type {type(frame).__name__} is not a buffer") from e
    if not mv.c_contiguous:
        raise CodecError(f"frame of type {type(frame).__name__} is not contiguous memory")
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")



def _build(cls: type, **kwargs: Any) -> Any:
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise CodecError(f"invalid {cls.__name__}: {e}") from e


_MAX_NDIM = 32

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
