"""Calls and replies on the wire: msgpack records, no pickle.

A message is two frames, ``[mac, payload]`` (a ROUTER adds the peer's id in front): the MAC
(`asyncrl.rpc.auth`) is checked before the payload is decoded. The payload is one msgpack array:

- a call: ``[call_id, key, method, args, kwargs, streaming]``;
- a reply: ``[call_id, kind, value]``, ``kind`` one of ``ITEM`` (a streaming call's next item),
  ``RETURN`` (the result, or a stream's end) and ``ERROR`` (the exception the call raised).

Values are msgpack's own (None, bool, int, float, str, bytes, list, dict) and these records,
each a msgpack array opened by an extension marker: tuple, set, frozenset, numpy arrays and
scalars (bool, numeric, bytes and str dtypes), dataclasses (by module and name, their
fields in order, rebuilt as pickle rebuilds them: `GenerateRequest`, `GenerateResult`, `ReceiverInit` and the rest of the run's
records) and exceptions (class, args, attributes and the remote traceback's text). Every
value the run's callers send is one of these (`tests/integration/test_rpc.py` checks the
engines' calls); anything else is refused where it is sent, with a `WireError` naming its type.

An exception comes back as its own class where the caller's process has it (imported, or a
module of asyncrl), with its args and attributes, and the remote traceback as its
``__cause__`` (a `RemoteTraceback`, as `concurrent.futures` does); a class the caller cannot
name comes back as a `RemoteError` that names it.
"""

from __future__ import annotations

import dataclasses
import importlib
import operator
import sys
import traceback
from typing import Any

import msgpack
import numpy as np

ITEM, RETURN, ERROR = 0, 1, 2
_TUPLE, _SET, _FROZENSET, _RECORD, _EXC, _NDARRAY, _NPSCALAR = range(1, 8)
_KINDS = frozenset("biufcSU")  # numpy dtype kinds that travel: bool, numbers, bytes and str


class WireError(TypeError):
    """A value the call layer does not carry, or a message it cannot read."""


class RemoteError(RuntimeError):
    """An exception of a class the caller's process cannot name; ``remote_type`` names it."""

    def __init__(self, remote_type: str, message: str):
        super().__init__(f"{remote_type}: {message}")
        self.remote_type = remote_type


class RemoteTraceback(Exception):
    """The traceback of an exception where it was raised, as text (its ``__cause__`` here)."""

    def __str__(self) -> str:
        return f"\n\nthe call's remote traceback:\n{self.args[0]}"


class _Tag:
    """An extension marker opening a record's array (decoded first: the array's hook builds the record)."""

    __slots__ = ("code",)

    def __init__(self, code: int):
        self.code = code


_MARK = {code: msgpack.ExtType(code, b"") for code in range(1, 8)}
_TAGS = {code: _Tag(code) for code in _MARK}

# ---------------------------------------------------------------------------------------- encode


def _fields(cls: type) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


_FIELDS: dict[type, tuple[str, ...]] = {}

_RECORDS: dict[type, tuple[str, Any]] = {}
"""A dataclass sent before -> (its wire name, a getter of its fields' values in order): a call
carries a few records per response, so what `_default` works out per class is kept."""


def _record_of(cls: type) -> tuple[str, Any]:
    names = _fields(cls)
    if len(names) > 1:
        getter = operator.attrgetter(*names)  # (a tuple of the values, in field order)
    elif names:
        get_one = operator.attrgetter(names[0])  # (one name: the value itself, not a tuple)
        getter = lambda obj: (get_one(obj),)
    else:
        getter = lambda obj: ()
    entry = _RECORDS[cls] = (_name(cls), getter)
    return entry


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


_DTYPE_NAMES: dict[np.dtype, str] = {}
"""numpy dtype -> its name on the wire (``dtype.str``); `_DTYPES` the other way."""
_DTYPES: dict[str, np.dtype] = {}


def _dtype_name(dtype: np.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        if dtype.kind not in _KINDS:
            raise WireError(f"numpy dtype {dtype} does not travel on asyncrl.rpc's wire (only bool, numbers, bytes "
                            "and str)")
        name = _DTYPE_NAMES[dtype] = dtype.str
    return name


def _default(obj: Any) -> Any:
    """msgpack's hook for what it does not pack itself (with ``strict_types``: tuples and subclasses too)."""
    cls = type(obj)
    if cls is tuple:
        return [_MARK[_TUPLE], *obj]
    if cls is np.ndarray:
        return [_MARK[_NDARRAY], _dtype_name(obj.dtype), obj.tobytes(), *obj.shape]
    entry = _RECORDS.get(cls)
    if entry is None and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        entry = _record_of(cls)
    if entry is not None:
        return [_MARK[_RECORD], entry[0], *entry[1](obj)]
    if isinstance(obj, BaseException):
        return _exception(obj)
    if isinstance(obj, np.generic):
        return [_MARK[_NPSCALAR], _dtype_name(obj.dtype), obj.tobytes()]
    if cls is set or cls is frozenset:
        return [_MARK[_SET if cls is set else _FROZENSET], *obj]
    for base in (bool, int, float, str, bytes, list, dict):  # (an IntEnum, an OrderedDict: their plain value)
        if isinstance(obj, base):
            return base(obj)
    raise WireError(f"a {_name(cls)} does not travel on asyncrl.rpc's wire: send msgpack's types, tuples, sets, "
                    "numpy arrays, dataclasses or exceptions (no pickle on the calls' wire)")


def _exception(exc: BaseException) -> list:
    args, state = list(exc.args), dict(vars(exc))
    try:
        _packb(args)
    except Exception:  # noqa: BLE001 - args that do not travel: the message does
        args = [str(exc)]
    try:
        _packb(state)
    except Exception:  # noqa: BLE001
        state = {}
    text = "".join(traceback.format_exception(exc)) if exc.__traceback__ is not None else ""
    return [_MARK[_EXC], _name(type(exc)), args, state, text]


def _packb(value: Any) -> bytes:
    return msgpack.packb(value, default=_default, strict_types=True)


def call(call_id: int, key: Any, method: str, args: tuple, kwargs: dict, streaming: bool) -> bytes:
    """A call's payload (`WireError` for an argument that does not travel)."""
    return _packb([call_id, key, method, list(args), kwargs, streaming])


def reply(call_id: int, kind: int, value: Any) -> bytes:
    """A reply's payload; a value that does not travel is answered as that `WireError`."""
    try:
        return _packb([call_id, kind, value])
    except Exception as exc:  # noqa: BLE001 - the caller learns why, instead of waiting for its deadline
        return _packb([call_id, ERROR, exc])


# ---------------------------------------------------------------------------------------- decode


_CLASSES: dict[str, type] = {}


def _class(name: str) -> type | None:
    """The class ``module:qualname`` of this process: from a module already imported, or one of asyncrl's."""
    cls = _CLASSES.get(name)
    if cls is None:
        module, _, qualname = name.partition(":")
        mod = sys.modules.get(module)
        if mod is None and (module == "asyncrl" or module.startswith("asyncrl.")):
            mod = importlib.import_module(module)
        cls = mod
        for part in qualname.split("."):
            cls = getattr(cls, part, None)
        if not isinstance(cls, type):
            return None
        _CLASSES[name] = cls
    return cls


def _record(name: str, values: list) -> Any:
    cls = _class(name)
    if cls is None or not dataclasses.is_dataclass(cls):
        raise WireError(f"a record of {name} came on asyncrl.rpc's wire: this process has no such dataclass")
    # Rebuilt field by field, as pickle rebuilds it: checked where it was made, not again here.
    obj = object.__new__(cls)
    own = getattr(obj, "__dict__", None)
    if own is not None:
        own.update(zip(_fields(cls), values))
    else:  # (slots)
        for field, value in zip(_fields(cls), values):
            object.__setattr__(obj, field, value)
    return obj


def _error(name: str, args: list, state: dict, text: str) -> BaseException:
    cls = _class(name)
    if cls is None or not issubclass(cls, BaseException):
        exc: BaseException = RemoteError(name.replace(":", "."), str(args[0]) if len(args) == 1 else str(tuple(args)))
    else:
        try:
            exc = cls(*args)
        except Exception:  # noqa: BLE001 - an __init__ of another signature: as pickle rebuilds it
            exc = cls.__new__(cls, *args)
        exc.args = tuple(args)
        vars(exc).update(state)
    if text:
        exc.__cause__ = RemoteTraceback(text)
    return exc


def _dtype(name: str) -> np.dtype:
    dtype = _DTYPES.get(name)
    if dtype is None:
        dtype = np.dtype(name)
        if dtype.kind not in _KINDS:
            raise WireError(f"numpy dtype {name} came on asyncrl.rpc's wire: it does not travel")
        _DTYPES[name] = dtype
    return dtype


def _list(items: list) -> Any:
    if not items or type(items[0]) is not _Tag:
        return items
    code = items[0].code
    if code == _TUPLE:
        return tuple(items[1:])
    if code == _NDARRAY:
        # A copy: writable, as the caller's own arrays are (a view on the message would be read-only).
        array = np.frombuffer(bytearray(items[2]), _dtype(items[1]))
        return array if len(items) == 4 else array.reshape(items[3:])  # (1-D: already its shape)
    if code == _RECORD:
        return _record(items[1], items[2:])
    if code == _NPSCALAR:
        return np.frombuffer(items[2], _dtype(items[1]), count=1)[0]
    if code == _EXC:
        return _error(*items[1:])
    return set(items[1:]) if code == _SET else frozenset(items[1:])


def _ext(code: int, data: bytes) -> _Tag:
    tag = _TAGS.get(code)
    if tag is None or data:
        raise WireError(f"an unknown record (extension {code}) came on asyncrl.rpc's wire")
    return tag


def decode(payload: bytes) -> list:
    """A call's or a reply's fields (`WireError`, or msgpack's own error, when it cannot be read)."""
    out = msgpack.unpackb(payload, ext_hook=_ext, list_hook=_list, strict_map_key=False)
    if type(out) is not list or len(out) not in (3, 6):
        raise WireError("a message on asyncrl.rpc's wire that is neither a call nor a reply")
    return out


def call_id(payload: bytes) -> int | None:
    """The call id of a payload `decode` could not read (to answer or fail that call), else None."""
    try:
        out = msgpack.unpackb(payload, strict_map_key=False)
    except Exception:  # noqa: BLE001
        return None
    return out[0] if type(out) is list and out and type(out[0]) is int else None
