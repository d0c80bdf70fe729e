"""What both codecs of the sample stream share: the error, the format version, frame checks.

`asyncrl.queue.codec` (generic ``pack``/``unpack``) and `asyncrl.queue.group_codec` (the
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

