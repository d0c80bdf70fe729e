"""The Trainer's end of the sample stream: a ROUTER that grants credit, delivers and acks.

``StreamConsumer`` binds a ROUTER on ``StreamConfig.endpoint``. Each producer (a DEALER) says
hello with a ``ping``; the consumer answers with ``credit`` messages that carry its session
id, the producer's cumulative credit and any acks (see `asyncrl.queue.protocol`).

Delivery: every received group is de-duplicated by ``sample_id`` against the committed set
(those are acked at once, never delivered) and against the groups held now (received and not
yet acked: the duplicate's producer is remembered so the eventual ack reaches it too).
``recv()`` hands out groups; ``ack(sample_ids)`` after the training step that used them
committed (or with a ``reason`` when a policy dropped them) returns credit to their producers
and adds them to ``committed``. A consumer restarted with its persisted ``committed`` set
sees each group once.

Malformed or foreign messages are counted in ``stats`` and logged; the stream goes on.
``committed`` is a `CommittedSet`: a watermark plus the ids done out of feed order, so it stays
small however long the stream runs. Left out: several consumers sharing producers (one
consumer per stream).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

import zmq

from asyncrl.queue import protocol as P
from asyncrl.queue.codec_base import CodecError
from asyncrl.queue.group_codec import unpack_groups
from asyncrl.queue.lifecycle import StreamEndpoint
from asyncrl.queue.protocol import StreamConfig, StreamError
from asyncrl.queue.transport import StreamSocket, keep_freed_memory
from asyncrl.types import CommittedSet, Group

log = logging.getLogger("asyncrl.queue")

_CLOSE_FLUSH_S = 1.0  # how long close() spends getting the last acks out
_ACK_COALESCE_S = 0.002  # longest an ack waits for others to share its credit message


@dataclass
class ConsumerStats:
    """Counters of a consumer since `start`."""

    received: int = 0
    """Groups received (duplicates and stale ones included)."""
    messages: int = 0
    """Group messages received (several groups may share one)."""
    delivered: int = 0
    """Groups handed out by ``recv``."""
    acked: int = 0
    """Groups acked after a committed step."""
    dropped: int = 0
    """Groups acked with a reason (dropped by policy)."""
    duplicates: int = 0
    """Groups discarded because their ``sample_id`` was committed or already held."""
    stale: int = 0
    """Groups sent under an earlier consumer session (the producer re-sends them)."""
    malformed: int = 0
    """Messages rejected: foreign, garbage, wrong version, undecodable group."""
    rejected_peers: int = 0
    """Connection attempts whose CURVE handshake failed (a peer without the run's keys)."""


@dataclass
class _Peer:
    """What the consumer knows of one producer incarnation (one routing id)."""

    producer: str
    finished: int = 0
    """Groups of this peer acked or discarded in this session: credit granted = finished + window."""
    last_seen: float = field(default_factory=time.monotonic)
    gone: bool = False
    acks: list[str] = field(default_factory=list)
    """Acks not yet sent to it."""


class StreamConsumer(StreamEndpoint):
    """Receives groups from any number of producers; see the module docstring.

    Use from one asyncio event loop (`BlockingStreamConsumer` wraps it for a plain thread).
    """

    role = "stream consumer"

    def __init__(self, config: StreamConfig | None = None, *, committed: Iterable[str] = ()) -> None:
        super().__init__()
        self.config = config or StreamConfig()
        self.session = uuid.uuid4().hex
        self.stats = ConsumerStats()
        self.endpoint = self.config.endpoint
        """The endpoint bound (a ``:*`` port resolved once started): what producers connect to."""
        self._committed = CommittedSet(committed)
        self._holders: dict[str, list[bytes]] = {}  # sample_id held now -> peers that sent it
        self._delivered: set[str] = set()
        self._ready: deque[Group] = deque()
        self._peers: dict[bytes, _Peer] = {}
        self._dirty: set[bytes] = set()
        self._ack_batch = max(1, self.config.window // 4)  # acks that go out at once, not after _ACK_COALESCE_S
        self._flush_now = False  # a dirty peer has _ack_batch acks waiting
        self._wake_reader = asyncio.Event()
        # The coalescing timer is not cancelled when a batch of acks goes out early: it fires
        # once, within _ACK_COALESCE_S, and sends what is dirty by then (often nothing).
        self._flush_timer: asyncio.TimerHandle | None = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Bind the ROUTER and start the I/O loop; producers get credit as they say hello."""
        self._check_not_started()
        if self.config.keep_freed_memory:
            keep_freed_memory()
        sock = StreamSocket(
            zmq.ROUTER, max_frame_bytes=self.config.max_frame_bytes, buffer_bytes=self.config.socket_buffer_bytes,
            curve=self.config.curve, on_reject=self._on_rejected_peer,
        )
        try:
            self.endpoint = sock.bind(self.config.endpoint)
        except zmq.ZMQError as e:
            await sock.close()
            raise StreamError(f"cannot bind StreamConfig.endpoint={self.config.endpoint!r}: {e}") from e
        self._sock = sock
        self._start_loops(self._read_loop(), self._heartbeat_loop())
        log.info("stream consumer bound %s (session %s, window %d)", self.config.endpoint, self.session, self.config.window)

    def _on_rejected_peer(self) -> None:
        # Called from the CURVE monitor's thread; a counter bump is safe under the GIL.
        self.stats.rejected_peers += 1
        if self.stats.rejected_peers <= 10 or self.stats.rejected_peers % 1000 == 0:
            log.warning("stream consumer refused a peer without the run's CURVE keys (%d so far)",
                        self.stats.rejected_peers)

    async def close(self) -> None:
        """Send the last acks, stop the I/O loop and close the socket.

        Groups not acked stay with their producers, which re-send them to the next consumer.
        """
        if self._closed:
            return
        self._closed = True
        await self._stop_loops()
        if self._flush_timer is not None:
            self._flush_timer.cancel()
        if self._sock is not None:
            if self._failure is None:
                try:  # acks of committed steps should reach the producers, or they come back as duplicates
                    self._flush()
                except zmq.ZMQError:
                    log.warning("stream consumer closed before its last acks were sent")
            await self._sock.close(linger_s=_CLOSE_FLUSH_S)
        self._wake_reader.set()

    def _wake(self) -> None:
        self._wake_reader.set()

    # ---------------------------------------------------------------- the Trainer's API

    @property
    def committed(self) -> CommittedSet:
        """A copy of the ``sample_id``s acked so far (including those given at construction)."""
        return self._committed.copy()

    @property
    def unacked(self) -> list[str]:
        """``sample_id``s handed out by ``recv`` and not yet acked."""
        return sorted(self._delivered)

    @property
    def depth(self) -> int:
        """Groups received and waiting for `recv` (the stream's depth on the Trainer's side)."""
        return len(self._ready)

    async def recv(self, timeout: float | None = None) -> Group:
        """The next group, waiting up to ``timeout`` seconds (None: no deadline).

        Raises `StreamTimeout` (naming the window when unacked groups may be what blocks),
        `StreamError` if the consumer was closed or its I/O loop failed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready:
            self._raise_if_down()
            self._wake_reader.clear()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise P.StreamTimeout(
                    f"no group arrived within recv(timeout={timeout}); {len(self._delivered)} delivered groups "
                    f"are unacked. Each producer may have StreamConfig.window={self.config.window} groups "
                    "unacked: ack the groups a committed step used, or raise window above what one step needs"
                )
            try:
                async with asyncio.timeout(left):
                    await self._wake_reader.wait()
            except TimeoutError:
                pass
        group = self._ready.popleft()
        self._delivered.add(group.sample_id)
        self.stats.delivered += 1
        return group

    def ack(self, sample_ids: Iterable[str], reason: str | None = None) -> None:
        """Mark groups done: the step that used them committed, or a policy dropped them (``reason``).

        Credit returns to their producers, which then forget them. Acking a committed id again
        is a no-op; an id never handed out by ``recv`` raises ValueError.
        """
        sample_ids = [sample_ids] if isinstance(sample_ids, str) else list(sample_ids)
        delivered, committed = self._delivered, self._committed
        unknown = [s for s in sample_ids if s not in delivered and s not in committed]
        if unknown:
            raise ValueError(f"ack of sample_ids never delivered by recv(): {unknown[:5]}")
        for sid in sample_ids:
            # A delivered id is never committed (recv hands out only ids that are not), so the
            # committed set, which parses each id it is asked about, is asked only about the rest.
            if sid in delivered:
                delivered.remove(sid)
            elif sid in committed:
                continue
            committed.add(sid)
            if reason is None:
                self.stats.acked += 1
            else:
                self.stats.dropped += 1
                log.info("group %s dropped: %s", sid, reason)
            for peer_id in self._holders.pop(sid, ()):
                self._finish(peer_id, sid)
        self._credit_soon()

    # ---------------------------------------------------------------- I/O

    def _finish(self, peer_id: bytes, sid: str) -> None:
        peer = self._peers.get(peer_id)
        if peer is not None:
            peer.finished += 1
            peer.acks.append(sid)
            self._dirty.add(peer_id)
            if len(peer.acks) >= self._ack_batch:
                self._flush_now = True

    async def _read_loop(self) -> None:
        assert self._sock is not None
        while True:
            for frames in await self._sock.recv_burst():
                try:
                    self._handle(frames)
                except (P.ProtocolError, CodecError) as e:
                    self._reject(e)
                except Exception as e:  # a message must never stop the stream; say loudly that it was odd
                    log.exception("unexpected error handling a message")
                    self._reject(e)

    def _reject(self, e: Exception) -> None:
        self.stats.malformed += 1
        if self.stats.malformed <= 10 or self.stats.malformed % 1000 == 0:
            log.warning("stream consumer rejected a message (%d so far): %s", self.stats.malformed, e)

    def _handle(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            raise P.ProtocolError(f"message of {len(frames)} frames has no envelope")
        peer_id, msg = frames[0].bytes, P.decode(frames[1])
        if isinstance(msg, P.Ping):
            self._hello(peer_id, msg.producer)
        elif isinstance(msg, P.Groups):
            self._groups(peer_id, msg, frames[2:])
        elif isinstance(msg, P.Bye):
            peer = self._peers.get(peer_id)
            if peer is not None:
                peer.gone = True
                log.info("producer %s said bye", peer.producer)
        else:
            raise P.ProtocolError(f"a consumer does not accept {type(msg).__name__.lower()!r} messages")

    def _hello(self, peer_id: bytes, producer: str) -> None:
        peer = self._peers.get(peer_id)
        if peer is None:
            peer = self._peers[peer_id] = _Peer(producer=producer)
            self._dirty.add(peer_id)
            self._flush()  # its first credit: no reason to make it wait
            log.info("producer %s connected", producer)
        elif peer.gone:
            peer.gone = False
            self._dirty.add(peer_id)
            self._flush()
            log.info("producer %s is back", producer)
        peer.last_seen = time.monotonic()

    def _groups(self, peer_id: bytes, msg: P.Groups, payload: list[Any]) -> None:
        session, sids = msg.session, msg.sample_ids
        if peer_id not in self._peers:
            raise P.ProtocolError(f"groups {sids[:3]} from a producer that never said hello")
        self._hello(peer_id, self._peers[peer_id].producer)
        self.stats.messages += 1
        self.stats.received += len(sids)
        if session != self.session:
            self.stats.stale += len(sids)  # sent under an earlier consumer's credit; re-sent under ours
            return
        fresh: dict[str, int] = {}  # sample_id -> position in the message, for groups to deliver
        for i, sid in enumerate(sids):
            if sid in self._committed:
                self.stats.duplicates += 1
                self._finish(peer_id, sid)
            elif sid in self._holders:
                self.stats.duplicates += 1
                if peer_id not in self._holders[sid]:
                    self._holders[sid].append(peer_id)
                else:
                    self._finish(peer_id, sid)  # the same peer twice: it needs the credit back
            elif sid in fresh:
                self.stats.duplicates += 1
                self._finish(peer_id, sid)
            else:
                fresh[sid] = i
        if fresh:
            try:
                groups = unpack_groups(payload, max_frame_bytes=self.config.max_frame_bytes)
                if [g.sample_id for g in groups] != sids:
                    raise CodecError(f"payload of groups message {sids[:3]}... does not hold those groups in order")
            except CodecError:
                for sid in fresh:
                    self._finish(peer_id, sid)  # never deliverable: give the credit back, keep no state
                self._credit_soon()
                raise
            for sid, i in fresh.items():
                self._holders[sid] = [peer_id]
                self._ready.append(groups[i])
            self._wake_reader.set()
        if len(fresh) < len(sids):
            self._credit_soon()

    def _credit_soon(self) -> None:
        """Send credit now if a peer has a batch of acks waiting, else within _ACK_COALESCE_S.

        A burst of acks then shares one credit message; the window leaves producers plenty of
        credit meanwhile.
        """
        if self._flush_now:
            self._flush()
        elif self._flush_timer is None and self._dirty and not self._closed:
            self._flush_timer = asyncio.get_running_loop().call_later(_ACK_COALESCE_S, self._on_flush_timer)

    def _on_flush_timer(self) -> None:
        self._flush_timer = None
        self._flush()

    def _flush(self) -> None:
        """Send every dirty peer its credit, session and pending acks (sends never block)."""
        self._flush_now = False
        if self._sock is None or not self._dirty:
            return
        dirty, self._dirty = self._dirty, set()
        for peer_id in dirty:
            peer = self._peers.get(peer_id)
            if peer is None:
                continue
            acks, peer.acks = peer.acks, []
            msg = P.Credit(self.session, peer.finished + self.config.window, acks).encode()
            self._sock.send([peer_id, msg])

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            now = time.monotonic()
            for peer_id, peer in self._peers.items():
                if not peer.gone and now - peer.last_seen > self.config.peer_timeout_s:
                    peer.gone = True
                    log.warning(
                        "producer %s silent for %.1fs (StreamConfig.peer_timeout_s=%s): counted as gone",
                        peer.producer, now - peer.last_seen, self.config.peer_timeout_s,
                    )
                if not peer.gone:
                    self._dirty.add(peer_id)
            self._flush()


