"""The sample stream's group-batch codec: any number of `Group`s as ``[header, pool]``.

`prepare_group` checks a `Group` once, when the producer accepts it (its per-response fields
packed into one msgpack record, its arrays typed); `pack_groups` encodes prepared groups as
one header plus one pool frame, each token column gathered across all of them in one copy;
`unpack_groups` slices them back into `Group` records whose arrays are views on the pool.
`_slice_responses` is also what the generic codec (`asyncrl.queue.codec`) uses to rebuild
a group's trajectories from its columns.

The optional C accelerator (``asyncrl/queue/_fastgroups.c``, built with
``python setup.py build_ext --inplace``) runs the per-response loops of `prepare_group` and
`_slice_responses`; where it is not built, or ``ASYNCRL_PURE_PYTHON`` is set, the Python
code here does the same. It takes only the path where all is as expected and returns None
otherwise, so every error message and every odd-but-valid case stays in Python.

Turns and loss masks (multi-turn agent trajectories) cost nothing where no response has them:
a group's record then has its eleven fields and the message its four columns, as before they
existed. A group with a mask or ``turns != 1`` adds two per-response fields to its record,
``turns`` and ``masked`` (which responses have a mask); a message holding any mask adds a fifth
column, ``uint8`` masks as long as the response columns (a response without a mask has ones
there), sliced back into views like the others. A record of eleven fields decodes with
``loss_mask=None, turns=1``.

Malformed input raises `CodecError` naming what was wrong, as in the generic codec.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import msgpack
import numpy as np

from asyncrl.queue.codec_base import (
    _ALIGN,
    _COLUMN_DTYPES,
    _F4,
    _I8,
    _MASK_DTYPE,
    _NP_KINDS,
    CODEC_VERSION,
    DEFAULT_MAX_FRAME_BYTES,
    CodecError,
    _buffer,
)
from asyncrl.types import FINISH_REASONS, Group, Trajectory

# The optional C accelerator (asyncrl/queue/_fastgroups.c) runs the per-response loops of
# prepare_group and unpack_groups; where it is not built, or ASYNCRL_PURE_PYTHON is set, the
# Python code below does the same. It takes only the path where all is as expected and
# returns None otherwise, so every error message and every odd-but-valid case stays here.
_fast: Any = None
if not os.environ.get("ASYNCRL_PURE_PYTHON"):
    try:
        from asyncrl.queue import _fastgroups as _fast
    except ImportError:
        _fast = None
    else:
        _fast.setup(Trajectory, FINISH_REASONS, _I8, _F4, _MASK_DTYPE)




def _slice_responses(
    sid: str, per_response: list[list[Any]], columns: tuple[Any, ...], po: int, ro: int
) -> tuple[list[Trajectory], int, int]:
    """One group's trajectories, sliced from the token ``columns`` starting at prompt token
    ``po`` and response token ``ro``; returns them with the positions after them.

    ``per_response`` is ``[index, finish, reward, age, plens, rlens]``, lists of one length
    (the caller checked), plus ``[turns, masked]`` for a record that carries them. The columns
    are typed (int64, int64, float32, int64) and the response columns equally long, so each
    record is built without re-checking its arrays (Trajectory._from_typed checks what is
    left: finish_reason); a fifth, the uint8 mask column as long as them, or None, goes with
    ``[turns, masked]``.
    """
    extended = len(per_response) == 8
    if _fast is not None:
        done = _fast.trajectories(sid, *per_response[:6], *columns[:4], po, ro,
                                  *(per_response[6:] + [columns[4]] if extended else ()))
        if done is not None:
            return done
    index, finish, reward, age, plens, rlens = per_response[:6]
    turns, masked = per_response[6:] if extended else (None, None)
    p, r, lp, v = columns[:4]
    m = columns[4] if extended else None
    if extended and not (type(turns) is list and type(masked) is list and len(turns) == len(masked) == len(index)):
        raise CodecError(f"group {sid!r}: turns and masked must be lists with one entry per response")
    np_, nr = len(p), len(r)
    make, trajectories = Trajectory._from_typed, []
    try:
        for i in range(len(index)):
            pe, re = po + plens[i], ro + rlens[i]
            if not (po <= pe <= np_ and ro <= re <= nr):
                raise CodecError(f"group {sid!r}: response {i}'s lengths run outside the token columns")
            turn, mask = (_turns_and_mask(sid, i, turns[i], masked[i], m, ro, re) if extended else (1, None))
            trajectories.append(make(sid, index[i], p[po:pe], r[ro:re], lp[ro:re], v[ro:re], finish[i], reward[i],
                                     age[i], mask, turn))
            po, ro = pe, re
    except CodecError:
        raise
    except (TypeError, ValueError) as e:
        raise CodecError(f"invalid Trajectory in group {sid!r}: {e}") from e
    return trajectories, po, ro


def _turns_and_mask(sid: str, i: int, turns: Any, masked: Any, m: np.ndarray | None, ro: int, re: int):
    """Response ``i``'s turns and loss mask (a view on the mask column, or None), checked."""
    if type(turns) is not int or turns < 0:
        raise CodecError(f"group {sid!r}: response {i}'s turns must be an int >= 0, got {turns!r}")
    if type(masked) is not bool:
        raise CodecError(f"group {sid!r}: response {i}'s masked flag must be a bool, got {masked!r}")
    if not masked:
        return turns, None
    if m is None:
        raise CodecError(f"group {sid!r}: response {i} has a loss mask but the message has no mask column")
    return turns, m[ro:re]



_BATCH = "groups"  # the second field of a group batch's header
_ZEROS = bytes(_ALIGN)  # column padding


class PreparedGroup:
    """A `Group` checked and laid out for `pack_groups`: done once, when the producer accepts it.

    ``record`` is the group's msgpack record (ids, per-response values, lengths), ``sources``
    its four token columns as lists of 1-d arrays (not copied yet), ``masks`` its part of the
    mask column (None when no response has a mask), ``nbytes`` their size.
    """

    __slots__ = ("group", "record", "sources", "masks", "counts", "nbytes")

    def __init__(self, group: Group, record: bytes, sources: tuple[list[Any], ...], counts: tuple[int, int],
                 masks: list[Any] | None = None) -> None:
        self.group = group
        self.record = record
        self.sources = sources
        self.masks = masks
        self.counts = counts  # prompt tokens, response tokens
        # int64 prompt ids; int64 response ids + float32 logprobs + int64 versions; the record
        self.nbytes = counts[0] * 8 + counts[1] * 20 + len(record)

    @property
    def sample_id(self) -> str:
        return self.group.sample_id


def _plain(obj: Any) -> Any:
    # numpy scalars (a reward computed with numpy, say) become the Python value they hold.
    if isinstance(obj, np.generic) and obj.dtype.kind in _NP_KINDS:
        return obj.item()
    raise TypeError(f"cannot encode a value of type {type(obj).__module__}.{type(obj).__qualname__} (no pickle)")


_local = threading.local()  # one msgpack Packer per thread: a Packer is reusable but not shared


def _record_packer() -> msgpack.Packer:
    try:
        return _local.packer
    except AttributeError:
        _local.packer = msgpack.Packer(default=_plain, use_bin_type=True)  # a failed pack() leaves it empty
        return _local.packer


def prepare_group(group: Group) -> PreparedGroup:
    """Check ``group`` for `pack_groups` and lay it out; `CodecError` says what is wrong with it.

    Every token array must be a 1-d numpy array of its field's dtype (int64 ids and versions,
    float32 logprobs, uint8 loss mask or None), as `Trajectory` makes them; ``meta`` and the
    per-response values must be plain (numpy scalars become Python numbers).
    """
    if not isinstance(group, Group):
        raise CodecError(f"the stream carries Group records, got {type(group).__module__}.{type(group).__qualname__}")
    sid, ts = group.sample_id, group.trajectories
    laid_out = _fast.columns(ts) if _fast is not None else None
    if laid_out is not None:
        p, r, lp, v, index, finish, reward, age, plens, rlens, np_, nr, turns, masks, extended = laid_out
        fields = [sid, group.expected, group.status, group.error, group.meta, index, finish, reward, age, plens, rlens]
    else:
        try:
            p = [t.prompt_ids for t in ts]
            r = [t.response_ids for t in ts]
            lp = [t.logprobs for t in ts]
            v = [t.versions for t in ts]
            masks, turns = [t.loss_mask for t in ts], [t.turns for t in ts]
            plens = list(map(len, p))
            rlens = list(map(len, r))
            # dtype objects of numpy's built-in types are singletons: `is` is the cheap test here.
            typed = all([a.dtype is _I8 and b.dtype is _I8 and c.dtype is _F4 and d.dtype is _I8
                         and a.ndim == 1 and b.ndim == 1 and c.ndim == 1 and d.ndim == 1 and len(c) == n == len(d)
                         and (m is None or (m.dtype is _MASK_DTYPE and m.ndim == 1 and len(m) == n))
                         and type(k) is int and k >= 0
                         for a, b, c, d, n, m, k in zip(p, r, lp, v, rlens, masks, turns)])
            fields = [sid, group.expected, group.status, group.error, group.meta, [t.index for t in ts],
                      [t.finish_reason for t in ts], [t.reward for t in ts], [t.age for t in ts], plens, rlens]
        except (AttributeError, TypeError) as e:
            _explain_untyped(group)
            raise CodecError(f"group {sid!r}: {type(e).__name__}: {e}") from e  # e.g. a field deleted
        if not typed:
            _explain_untyped(group)
        np_, nr = sum(plens), sum(rlens)
        extended = any(m is not None for m in masks) or any(k != 1 for k in turns)
    column = None
    if extended:  # an agent's group: turns and which responses have a mask join the record
        flags = [m is not None for m in masks]
        fields += [turns, flags]
        if any(flags):  # ones where a response has no mask: the column runs along the responses
            column = [m if m is not None else b"\x01" * n for m, n in zip(masks, rlens)]
    return PreparedGroup(group, _record(sid, fields), (p, r, lp, v), (np_, nr), column)


def _record(sid: str, fields: list[Any]) -> bytes:
    try:
        return _record_packer().pack(fields)
    except (OverflowError, TypeError, ValueError) as e:
        raise CodecError(f"group {sid!r}: {e}") from e


def _explain_untyped(group: Group) -> None:
    """Raise `CodecError` naming what keeps ``group`` off `prepare_group`'s fast path.

    Arrays equal in dtype to the expected one without being numpy's own singleton (a dtype
    with metadata, say) are fine: then this returns and the group is packed as it is.
    """
    sid = group.sample_id
    for t in group.trajectories:
        if not isinstance(t, Trajectory):
            raise CodecError(f"group {sid!r} holds a {type(t).__name__}, not a Trajectory")
        arrays = (t.prompt_ids, t.response_ids, t.logprobs, t.versions)
        for name, a, dt in zip(("prompt_ids", "response_ids", "logprobs", "versions"), arrays, _COLUMN_DTYPES):
            if not isinstance(a, np.ndarray) or a.dtype != dt or a.ndim != 1:
                what = f"{a.ndim}-d {a.dtype}" if isinstance(a, np.ndarray) else type(a).__name__
                raise CodecError(
                    f"group {sid!r} response {t.index}: {name} must be a 1-d numpy array of {dt} "
                    f"(as Trajectory makes it), got {what}"
                )
        if not len(t.response_ids) == len(t.logprobs) == len(t.versions):
            raise CodecError(f"group {sid!r} response {t.index}: response_ids, logprobs, versions differ in length")
        m = t.loss_mask
        if m is not None and (not isinstance(m, np.ndarray) or m.dtype != _MASK_DTYPE or m.shape != t.response_ids.shape):
            what = f"{m.ndim}-d {m.dtype} of {len(m)}" if isinstance(m, np.ndarray) else type(m).__name__
            raise CodecError(f"group {sid!r} response {t.index}: loss_mask must be None or a 1-d uint8 array with one "
                             f"entry per response token (as Trajectory makes it), got {what}")
        if type(t.turns) is not int or t.turns < 0:
            raise CodecError(f"group {sid!r} response {t.index}: turns must be an int >= 0, got {t.turns!r}")


def pack_groups(batch: list[PreparedGroup]) -> list[Any]:
    """Encode prepared groups as one message, ``[header, pool]``.

    The pool holds four token columns (prompt ids, response ids, logprobs, versions), each
    gathered across every response of every group, and a fifth (loss masks, one byte per
    response token) when some response has a mask; the header holds each group's record and
    where the columns lie. `unpack_groups` slices them back into views.

    The pool is one ``bytes`` joined from the arrays themselves: one memcpy per array into a
    fresh frame, about half the cost of numpy gathering the same arrays into a recycled
    buffer (its per-array setup and copy loop), and no buffer to track while ZeroMQ sends it.
    """
    np_ = sum(g.counts[0] for g in batch)
    nr = sum(g.counts[1] for g in batch)
    masked = any(g.masks is not None for g in batch)
    columns, parts, offset = [], [], 0
    for k, (dt, count) in enumerate(zip(_COLUMN_DTYPES + (_MASK_DTYPE,) * masked, (np_, nr, nr, nr, nr))):
        columns.append([dt.str, count, offset])
        for g in batch:
            if k < 4:
                parts += g.sources[k]
            elif g.masks is not None:
                parts += g.masks
            else:  # a group without masks: all its tokens are the model's
                parts.append(b"\x01" * g.counts[1])
        nbytes = count * dt.itemsize
        pad = -nbytes % _ALIGN  # the next column starts aligned
        if pad:
            parts.append(_ZEROS[:pad])
        offset += nbytes + pad
    try:
        pool = b"".join(parts)
    except TypeError:  # a strided view has no contiguous buffer to copy from: numpy lays it out
        pool = b"".join([np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a for a in parts])
    header = msgpack.packb([CODEC_VERSION, _BATCH, offset, columns, [g.record for g in batch]], use_bin_type=True)
    return [header, pool]


def unpack_groups(frames: list[Any], *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> list[Group]:
    """Decode ``[header, pool]`` as `pack_groups` made it; token arrays are views on the pool.

    Raises `CodecError` for any malformed input, naming what was wrong.
    """
    if not isinstance(frames, (list, tuple)) or len(frames) != 2:
        raise CodecError(f"a group batch is [header, pool], got {len(frames) if isinstance(frames, (list, tuple)) else type(frames).__name__} frames")
    head, pool = _buffer(frames[0]), _buffer(frames[1])
    for i, buf in enumerate((head, pool)):
        if buf.nbytes > max_frame_bytes:
            raise CodecError(f"frame {i} has {buf.nbytes} bytes, over max_frame_bytes={max_frame_bytes}")
    try:
        header = msgpack.unpackb(head, raw=False)
    except Exception as e:
        raise CodecError(f"group batch header is not valid msgpack: {type(e).__name__}: {e}") from e
    if isinstance(header, list) and header and header[0] != CODEC_VERSION:
        raise CodecError(f"codec version {header[0]!r} is not supported (this side speaks {CODEC_VERSION})")
    if not isinstance(header, list) or len(header) != 5 or header[1] != _BATCH:
        raise CodecError("header is not a group batch [version, 'groups', pool_nbytes, columns, records]")
    _, _, pool_nbytes, columns, records = header
    if type(pool_nbytes) is not int or pool_nbytes != pool.nbytes:
        raise CodecError(f"pool frame has {pool.nbytes} bytes but the header announces {pool_nbytes!r}")
    if not isinstance(records, list) or not isinstance(columns, list) or len(columns) not in (4, 5):
        raise CodecError("group batch header lacks its four (or five, with masks) columns or its records")
    arrays = []
    for col, dt in zip(columns, _COLUMN_DTYPES + (_MASK_DTYPE,)):
        if not (isinstance(col, list) and len(col) == 3 and col[0] == dt.str and type(col[1]) is int
                and type(col[2]) is int and col[1] >= 0 and col[2] >= 0):
            raise CodecError(f"group batch column {col!r} is not [{dt.str!r}, count, offset]")
        count, start = col[1], col[2]
        if start + count * dt.itemsize > pool.nbytes:
            raise CodecError(f"column of {count} x {dt} at offset {start} overruns the {pool.nbytes}-byte pool")
        arrays.append(np.frombuffer(pool, dt, count, start))
    if not len(arrays[1]) == len(arrays[2]) == len(arrays[3]) == len((arrays + [arrays[1]])[4]):
        raise CodecError(
            f"response columns disagree: {len(arrays[1])} ids, {len(arrays[2])} logprobs, {len(arrays[3])} versions"
            + (f", {len(arrays[4])} mask entries" if len(arrays) == 5 else "")
        )
    return _groups_from_records(records, *arrays)


def _groups_from_records(records: list[Any], p: np.ndarray, r: np.ndarray, lp: np.ndarray, v: np.ndarray,
                         m: np.ndarray | None = None) -> list[Group]:
    """Slice the batch's columns back into groups, checking each record on the way."""
    groups, columns = [], (p, r, lp, v, m)
    po = ro = 0  # next prompt token, next response token
    for rec in records:
        try:
            c = msgpack.unpackb(rec, raw=False, strict_map_key=False)
        except Exception as e:
            raise CodecError(f"group record is not valid msgpack: {type(e).__name__}: {e}") from e
        if type(c) is not list or len(c) not in (11, 13):
            raise CodecError("group record is not a list of 11 fields (13 with turns and masks)")
        sid, expected, status, error, meta, index, finish, reward, age, plens, rlens = c[:11]
        if type(sid) is not str or type(expected) is not int or type(meta) is not dict or not (error is None or type(error) is str):
            raise CodecError(f"group record {sid!r}: sample_id, expected, error or meta has the wrong type")
        n = len(index) if type(index) is list else -1
        if not (n >= 0 and type(finish) is list and type(reward) is list and type(age) is list and type(plens) is list
                and type(rlens) is list and len(finish) == n == len(reward) == len(age) == len(plens) == len(rlens)):
            raise CodecError(f"group {sid!r}: per-response columns disagree in length")
        trajectories, po, ro = _slice_responses(sid, c[5:], columns, po, ro)
        try:
            groups.append(Group._from_typed(sid, trajectories, expected, status, error, meta))
        except ValueError as e:
            raise CodecError(f"invalid group {sid!r}: {e}") from e
    if po != len(p) or ro != len(r):
        raise CodecError(f"group records cover {po} prompt and {ro} response tokens, the columns hold {len(p)} and {len(r)}")
    return groups
