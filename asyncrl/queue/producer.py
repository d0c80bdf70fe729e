"""The Rollouter's end of the sample stream: a DEALER that sends groups under credit.

``StreamProducer`` connects a DEALER to the consumer's endpoint and says hello (``ping``)
every ``heartbeat_s``. It sends a group only while it has credit from the consumer's current
session; ``await send(group)`` waits otherwise, so backpressure reaches the caller and
nothing is ever dropped to make room. Every sent group stays in ``unacked`` until the
consumer acks it. When a new consumer session appears (the consumer restarted), all unacked
groups are re-sent first, in their original order; the consumer de-duplicates them.

Groups accepted by ``send`` leave at the next turn of the event loop; those accepted in the
meantime (a caller sending several in a row, credit returning to a blocked producer, a
replay) share one message, up to ``batch_bytes`` / ``batch_groups``. A lone group never
waits for company, and each group still counts against credit and is acked on its own.

If the consumer goes silent for ``peer_timeout_s`` the producer logs it and keeps waiting:
its memory stays bounded by the window (``unacked`` never exceeds the credit granted).
The Rollouter checkpoints ``unacked`` and passes it back as ``StreamProducer(unacked=...)``
on resume, so nothing generated is lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Iterable

import zmq

from asyncrl.queue import protocol as P
from asyncrl.queue.codec_base import CodecError
from asyncrl.queue.group_codec import PreparedGroup, pack_groups, prepare_group
from asyncrl.queue.lifecycle import StreamEndpoint
from asyncrl.queue.protocol import StreamConfig
from asyncrl.queue.transport import StreamSocket, keep_freed_memory
from asyncrl.types import Group

log = logging.getLogger("asyncrl.queue")

_FRAME_SLACK = 256  # column alignment padding of a pool frame, on top of its groups' bytes


@dataclass
class ProducerStats:
    """Counters of a producer since `start`."""

    sent: int = 0
    """Groups sent (re-sends included)."""
    messages: int = 0
    """Messages that carried them: groups waiting together leave in one message."""
    resent: int = 0
    """Groups sent again to a new consumer session."""
    acked: int = 0
    """Groups the consumer acked (and the producer forgot)."""
    sessions: int = 0
    """Consumer sessions seen (1 + consumer restarts)."""
    malformed: int = 0
    """Messages from the socket rejected as malformed."""


class StreamProducer(StreamEndpoint):
    """Sends groups to one consumer; see the module docstring.

    Use from one asyncio event loop (`BlockingStreamProducer` wraps it for a plain thread).
    """

    role = "stream producer"

    def __init__(
        self, config: StreamConfig | None = None, *, producer_id: str = "producer", unacked: Iterable[Group] = ()
    ) -> None:
        super().__init__()
        self.config = config or StreamConfig()
        self.producer_id = producer_id
        self.incarnation = uuid.uuid4().hex[:12]
        self.stats = ProducerStats()
        # Groups are kept checked and laid out (not encoded): a resend (rare) encodes again.
        self._unacked: OrderedDict[str, PreparedGroup] = OrderedDict()
        for g in unacked:
            if not isinstance(g, Group):
                raise TypeError(f"unacked must hold Group records, got {type(g).__name__}")
            self._unacked[g.sample_id] = self._prepare(g)
        self._resend: deque[str] = deque()
        # Groups sent under credit but not yet handed to ZeroMQ: they leave together in one
        # message at the next turn of the event loop (or once they fill batch_bytes).
        self._outbox: list[PreparedGroup] = []
        self._outbox_bytes = 0
        self._flush_handle: asyncio.Handle | None = None
        self._session: str | None = None
        self._granted = 0
        self._sent = 0  # groups sent in this session
        self._last_heard = 0.0
        self._connected = False
        self._changed = asyncio.Event()  # replaced by a fresh one each time it is set (see _signal)

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Connect and say hello; returns at once (credit arrives when the consumer is up)."""
        self._check_not_started()
        if self.config.keep_freed_memory:
            keep_freed_memory()
        sock = StreamSocket(
            zmq.DEALER, routing_id=f"{self.producer_id}/{self.incarnation}".encode(),
            buffer_bytes=self.config.socket_buffer_bytes, curve=self.config.curve,
        )
        sock.connect(self.config.endpoint)
        self._sock = sock
        self._last_heard = time.monotonic()
        self._ping()
        self._start_loops(self._read_loop(), self._heartbeat_loop())
        log.info("stream producer %s connecting to %s", self.producer_id, self.config.endpoint)

    async def close(self) -> None:
        """Say bye and close; ``unacked`` keeps what the consumer has not acked."""
        if self._closed:
            return
        self._closed = True
        if self._sock is not None and self._failure is None:
            try:
                self._flush_outbox()  # what send() accepted goes out before the bye
                self._sock.send([P.Bye().encode()])
            except zmq.ZMQError:
                pass
        await self._stop_loops()
        if self._sock is not None:
            await self._sock.close(linger_s=0.2)  # time for the bye; unacked groups are kept in any case
        self._signal()

    def _wake(self) -> None:
        self._signal()

    def _signal(self) -> None:
        # Wake every waiter; each re-checks its own condition.
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _wait_until(self, predicate: Any, timeout: float | None) -> bool:
        """Wait until ``predicate()``; False if ``timeout`` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not predicate():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            try:
                async with asyncio.timeout(left):
                    await self._changed.wait()
            except TimeoutError:
                pass
        return True

    # ---------------------------------------------------------------- the Rollouter's API

    @property
    def unacked(self) -> list[Group]:
        """Groups sent (or restored) and not yet acked, oldest first: what a checkpoint keeps."""
        return [p.group for p in self._unacked.values()]

    @property
    def connected(self) -> bool:
        """True while the consumer has been heard from within ``peer_timeout_s``."""
        return self._connected

    @property
    def credit(self) -> int:
        """Groups this producer may send now."""
        return max(0, self._granted - self._sent) if self._session else 0

    async def send(self, group: Group, timeout: float | None = None) -> None:
        """Send ``group`` once credit allows; waits while out of credit (backpressure).

        The group is in ``unacked`` when this returns and leaves at the next turn of the
        event loop, with any others sent meanwhile.

        ``timeout`` (default ``StreamConfig.send_timeout_s``; None: no deadline) bounds the
        wait and raises `StreamTimeout`. Raises `CodecError` for a group that cannot be
        encoded or has a frame over ``max_frame_bytes``, ValueError for a ``sample_id``
        already unacked, `StreamError` once closed or failed.
        """
        if not isinstance(group, Group):
            raise TypeError(f"the stream carries Group records, got {type(group).__name__}")
        if group.sample_id in self._unacked:
            raise ValueError(f"group {group.sample_id} was already sent and is not acked yet")
        prepared = self._prepare(group)
        timeout = self.config.send_timeout_s if timeout is None else timeout
        if not self._may_send() and not await self._wait_until(self._may_send, timeout):
            raise P.StreamTimeout(
                f"no credit for {group.sample_id} within {timeout}s (StreamConfig.send_timeout_s); "
                f"consumer {'connected' if self._connected else 'not heard from'}, "
                f"{len(self._unacked)} groups unacked"
            )
        self._raise_if_down()
        if group.sample_id in self._unacked:
            raise ValueError(f"group {group.sample_id} was already sent and is not acked yet")
        self._unacked[group.sample_id] = prepared
        self._enqueue(prepared)

    async def wait_acked(self, timeout: float) -> None:
        """Wait until every sent group is acked; `StreamTimeout` after ``timeout`` seconds."""
        if not await self._wait_until(lambda: not self._unacked or self._down(), timeout):
            raise P.StreamTimeout(f"{len(self._unacked)} groups still unacked after wait_acked(timeout={timeout})")
        if self._unacked:
            self._raise_if_down()

    # ---------------------------------------------------------------- internals

    def _prepare(self, group: Group) -> PreparedGroup:
        prepared = prepare_group(group)
        if prepared.nbytes + _FRAME_SLACK > self.config.max_frame_bytes:
            raise CodecError(
                f"group {group.sample_id} needs {prepared.nbytes} bytes in one frame, over "
                f"StreamConfig.max_frame_bytes={self.config.max_frame_bytes}"
            )
        return prepared

    def _may_send(self) -> bool:
        return self._down() or (self.credit > 0 and not self._resend)

    def _enqueue(self, prepared: PreparedGroup) -> None:
        """Count ``prepared`` against credit and queue it for the next message."""
        if self._outbox and self._outbox_bytes + prepared.nbytes > self.config.batch_bytes:
            self._flush_outbox()
        self._sent += 1
        self._outbox.append(prepared)
        self._outbox_bytes += prepared.nbytes
        if self._outbox_bytes >= self.config.batch_bytes or len(self._outbox) >= self.config.batch_groups:
            self._flush_outbox()
        elif self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_soon(self._flush_outbox)

    def _flush_outbox(self) -> None:
        """Send every queued group in one message (sends never block)."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        if not self._outbox or self._sock is None or self._failure is not None:
            return
        batch, self._outbox, self._outbox_bytes = self._outbox, [], 0
        try:
            frames = pack_groups(batch)
            head = P.Groups(self._session, [g.sample_id for g in batch]).encode()
            self._sock.send([head, *frames], copy=False)
        except Exception as e:  # groups were checked by send(): this is out of memory or a dead socket
            if self._failure is None:
                self._failure = e
                log.error("stream producer %s cannot send %d groups", self.producer_id, len(batch), exc_info=e)
            self._signal()  # senders and wait_acked raise StreamError; the groups stay in unacked
            return
        self.stats.sent += len(batch)
        self.stats.messages += 1

    def _ping(self) -> None:
        assert self._sock is not None
        self._sock.send([P.Ping(self.producer_id, self.incarnation).encode()])

    async def _read_loop(self) -> None:
        assert self._sock is not None
        while True:
            for frames in await self._sock.recv_burst():
                try:
                    msg = P.decode(frames[0])
                    if not isinstance(msg, P.Credit):
                        raise P.ProtocolError(f"a producer does not accept {type(msg).__name__.lower()!r} messages")
                except P.ProtocolError as e:
                    self.stats.malformed += 1
                    log.warning("stream producer %s rejected a message: %s", self.producer_id, e)
                    continue
                self._on_credit(msg.session, msg.granted, msg.acks)
            self._signal()

    def _on_credit(self, session: str, granted: int, acks: list[Any]) -> None:
        self._last_heard = time.monotonic()
        if not self._connected:
            self._connected = True
            log.info("stream producer %s: consumer is up (session %s)", self.producer_id, session)
        for sid in acks:
            if self._unacked.pop(sid, None) is not None:
                self.stats.acked += 1
        if session != self._session:
            # A new consumer incarnation: credit restarts, and everything unacked goes again.
            self._session, self._granted, self._sent = session, granted, 0
            self._outbox, self._outbox_bytes = [], 0  # counted against the old session; all go again
            self._resend = deque(self._unacked)
            self.stats.sessions += 1
            if self.stats.sessions > 1:
                log.warning(
                    "stream producer %s: new consumer session %s, re-sending %d unacked groups",
                    self.producer_id, session, len(self._resend),
                )
        else:
            self._granted = max(self._granted, granted)
        while self._resend and self.credit > 0:
            sid = self._resend.popleft()
            if sid in self._unacked:
                self.stats.resent += 1
                self._enqueue(self._unacked[sid])

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            self._ping()
            silent = time.monotonic() - self._last_heard
            if self._connected and silent > self.config.peer_timeout_s:
                self._connected = False
                log.warning(
                    "stream producer %s: consumer silent for %.1fs (StreamConfig.peer_timeout_s=%s); "
                    "holding %d unacked groups and waiting",
                    self.producer_id, silent, self.config.peer_timeout_s, len(self._unacked),
                )
