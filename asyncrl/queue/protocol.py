"""The sample stream's wire protocol: settings, message kinds, the envelope, and errors.

Every message is ``[envelope, *payload]``; the ROUTER side also sees the peer's routing id
in front. The envelope is msgpack ``[MAGIC, PROTOCOL_VERSION, kind, fields]``; only
``groups`` messages carry a payload: `asyncrl.queue.group_codec.pack_groups`'s ``[header, pool]``
of one or more groups.

Producer -> consumer
  ``ping``   ``{producer, incarnation}``: hello and heartbeat, every ``heartbeat_s``.
  ``groups`` ``{session, sample_ids}`` + ``[header, pool]``: groups sent under credit of
  ``session``, each counted on its own. Groups that wait to leave together share a message
  (``batch_bytes``, ``batch_groups``): at 1k tokens x 8 responses that halves the cost per
  group of ZeroMQ and of the event loops on both sides; a lone group leaves at once.
  ``bye``    ``{}``: the producer closes.
Consumer -> producer
  ``credit`` ``{session, granted, acks}``: heartbeat, credit and acks in one message.
  ``granted`` is cumulative per (producer incarnation, consumer session): the producer may
  have sent ``granted`` groups in this session in total. It equals the groups of this peer the
  consumer has finished with (acked, or duplicates it discarded) plus ``window``, so a lost or
  repeated credit message changes nothing and each producer has at most ``window`` groups
  unacked. ``session`` is new for every consumer incarnation: a producer that sees a new one
  re-sends all its unacked groups; the consumer de-duplicates them by ``sample_id``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from asyncrl.queue.codec_base import DEFAULT_MAX_FRAME_BYTES
from asyncrl.queue.security import CurveKeys

MAGIC = b"asyncrl-stream"
PROTOCOL_VERSION = 2

PING, GROUPS, BYE, CREDIT = "ping", "groups", "bye", "credit"
_KINDS = (PING, GROUPS, BYE, CREDIT)


class StreamError(RuntimeError):
    """The stream cannot go on (a background I/O loop failed, or it was closed)."""


class StreamTimeout(TimeoutError):
    """A stream wait ran past its deadline; the message names the setting."""


class ProtocolError(ValueError):
    """A message on the socket is not a well-formed message of this protocol (counted, logged)."""


@dataclass(kw_only=True)
class StreamConfig:
    """Settings of the sample stream, shared by its producers and its consumer."""

    endpoint: str = "tcp://127.0.0.1:5555"
    """ZeroMQ endpoint: the consumer binds it, producers connect to it. Loopback by default."""
    window: int = 64
    """Groups each producer may have unacked at the consumer; must exceed the groups one
    training step consumes, since groups are acked only after the step commits."""
    heartbeat_s: float = 1.0
    """Interval of heartbeats (and credit refresh) in both directions."""
    peer_timeout_s: float = 10.0
    """Silence after which a peer counts as gone (logged; a producer keeps waiting, bounded)."""
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    """Largest frame accepted (ZeroMQ MAXMSGSIZE on the consumer, and checked on send)."""
    batch_bytes: int | None = None
    """Groups waiting to leave (sent while the producer's event loop was busy, or released
    together by returning credit) share one message of up to about this many bytes; a lone
    group never waits for company. None: 4 MiB, or ``max_frame_bytes // 2`` if smaller."""
    batch_groups: int = 64
    """Most groups in one message."""
    socket_buffer_bytes: int | None = 4 * 1024 * 1024
    """Kernel send and receive buffer of each stream socket. Messages of a few MiB then cross
    in fewer, larger writes (about 15% more groups/s at 1k tokens x 8 on the CI machine);
    the kernel caps it at net.core.wmem_max / rmem_max. None keeps the OS default (with TCP
    auto-tuning, which can grow beyond it on a long fat link)."""
    keep_freed_memory: bool = True
    """Let the process reuse freed multi-MB blocks (glibc mallopt, once per process; see
    `asyncrl.queue.transport.keep_freed_memory`): without it each large message page-faults
    its memory in again. Off leaves the process's allocator as it was."""
    send_timeout_s: float | None = None
    """Deadline of ``producer.send`` waiting for credit; None waits as long as the consumer
    needs (backpressure by design)."""
    curve: CurveKeys | None = None
    """ZeroMQ CURVE keys (`asyncrl.queue.security`): the consumer authenticates producers and
    every message is encrypted. The launcher makes them per run when the stream leaves
    loopback; None: plain TCP (loopback)."""

    def __post_init__(self) -> None:
        if "://" not in self.endpoint:
            raise ValueError(f"endpoint {self.endpoint!r} is not a ZeroMQ endpoint; use e.g. 'tcp://127.0.0.1:5555'")
        if self.window < 1:
            raise ValueError(f"window must be >= 1 (groups unacked per producer), got {self.window}")
        if self.heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {self.heartbeat_s}")
        if self.peer_timeout_s <= self.heartbeat_s:
            raise ValueError(
                f"peer_timeout_s ({self.peer_timeout_s}) must exceed heartbeat_s ({self.heartbeat_s}); "
                "use a few heartbeats, e.g. 10x"
            )
        if self.max_frame_bytes < 1024:
            raise ValueError(f"max_frame_bytes must be >= 1024, got {self.max_frame_bytes}")
        if self.batch_bytes is None:
            self.batch_bytes = min(4 * 1024 * 1024, self.max_frame_bytes // 2)
        if not 1 <= self.batch_bytes <= self.max_frame_bytes // 2:
            raise ValueError(
                f"batch_bytes must be in [1, max_frame_bytes // 2 = {self.max_frame_bytes // 2}], got {self.batch_bytes}"
            )
        if self.socket_buffer_bytes is not None and self.socket_buffer_bytes < 4096:
            raise ValueError(f"socket_buffer_bytes must be >= 4096 or None (OS default), got {self.socket_buffer_bytes}")
        if self.batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1, got {self.batch_groups}")
        if self.send_timeout_s is not None and self.send_timeout_s <= 0:
            raise ValueError(f"send_timeout_s must be > 0 or None (wait for credit), got {self.send_timeout_s}")


def envelope(kind: str, fields: dict[str, Any]) -> bytes:
    """Frame 0 of a message of ``kind``."""
    return msgpack.packb([MAGIC, PROTOCOL_VERSION, kind, fields], use_bin_type=True)


def parse_envelope(frame: Any) -> tuple[str, dict[str, Any]]:
    """Return ``(kind, fields)`` of frame 0; `ProtocolError` says what is wrong with it."""
    buf = getattr(frame, "buffer", frame)
    if memoryview(buf).nbytes > 64 * 1024:
        raise ProtocolError(f"envelope of {memoryview(buf).nbytes} bytes is too large to be one")
    try:
        value = msgpack.unpackb(buf, raw=False)
    except Exception as e:
        raise ProtocolError(f"envelope is not msgpack ({type(e).__name__})") from e
    if not isinstance(value, list) or len(value) != 4 or value[0] != MAGIC:
        raise ProtocolError("envelope lacks the asyncrl-stream magic (foreign message)")
    _, version, kind, fields = value
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version!r} is not supported (this side speaks {PROTOCOL_VERSION})")
    if kind not in _KINDS or not isinstance(fields, dict):
        raise ProtocolError(f"unknown message kind {kind!r}")
    return kind, fields


def field(fields: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    """``fields[name]`` checked to be of ``kind``; `ProtocolError` names the field."""
    value = fields.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise ProtocolError(f"field {name!r} is {type(value).__name__}, expected {kind}")
    return value


# -- the four messages as typed records ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ping:
    """Producer -> consumer: hello and heartbeat."""

    producer: str
    incarnation: str = ""

    def encode(self) -> bytes:
        return envelope(PING, {"producer": self.producer, "incarnation": self.incarnation})


@dataclass(frozen=True, slots=True)
class Groups:
    """Producer -> consumer: the envelope of ``[header, pool]`` of groups sent under ``session``'s credit."""

    session: str
    sample_ids: list[str]

    def encode(self) -> bytes:
        return envelope(GROUPS, {"session": self.session, "sample_ids": self.sample_ids})


@dataclass(frozen=True, slots=True)
class Bye:
    """Producer -> consumer: the producer closes."""

    def encode(self) -> bytes:
        return envelope(BYE, {})


@dataclass(frozen=True, slots=True)
class Credit:
    """Consumer -> producer: heartbeat, cumulative credit of ``session`` and acks, in one message."""

    session: str
    granted: int
    acks: list[str]

    def encode(self) -> bytes:
        return envelope(CREDIT, {"session": self.session, "granted": self.granted, "acks": self.acks})


Message = Ping | Groups | Bye | Credit


def decode(frame: Any) -> Message:
    """The typed message of envelope ``frame``; `ProtocolError` names what is wrong with it."""
    kind, fields = parse_envelope(frame)
    if kind == GROUPS:
        sids = field(fields, "sample_ids", list)
        if not sids or not all(type(s) is str for s in sids):
            raise ProtocolError("field 'sample_ids' must be a non-empty list of str")
        return Groups(field(fields, "session", str), sids)
    if kind == CREDIT:
        return Credit(field(fields, "session", str), field(fields, "granted", int), field(fields, "acks", list))
    if kind == PING:
        incarnation = fields.get("incarnation", "")
        return Ping(field(fields, "producer", str), incarnation if isinstance(incarnation, str) else "")
    return Bye()
