"""One ZeroMQ socket pumped from the running event loop's own selector: the calls' sockets
(`asyncrl.rpc`) and the sample stream's (`asyncrl.queue.transport`) are both this.

Sends never block and never drop: the socket has no high-water mark (what bounds the queue is
the caller's: the stream's credit, a call's caller). Receives take every waiting message at one
wake of the loop (up to ``limit``), with no future per message.

ZeroMQ's descriptor is edge-triggered and any socket operation (a send included) may consume
the edge, so after every send ``ZMQ_EVENTS`` is read to learn whether messages wait (that read
also re-arms the edge), and ``after_send`` is told when they do.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("asyncrl.pump")

EVENTS, POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: pyzmq's enum flags cost a Python call per `&`


def unbounded(sock: zmq.Socket) -> zmq.Socket:
    """``sock`` with no high-water marks and no linger (what every pumped socket needs)."""
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


class Pump:
    """A ZeroMQ socket read from the running loop's selector: ``on_readable()`` runs when the
    descriptor signals, ``after_send()`` (default: ``on_readable``) when a send finds messages
    waiting. Every method runs on that loop."""

    def __init__(self, sock: zmq.Socket, on_readable: Callable[[], None],
                 after_send: Callable[[], None] | None = None) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self._after_send = after_send or on_readable
        self._fd = sock.getsockopt(zmq.FD)
        self.loop.add_reader(self._fd, on_readable)

    def send(self, frames: Any, copy: bool = True) -> None:
        """Queue a message now; big frames given with ``copy=False`` are sent without a copy."""
        sock = self.sock
        sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
        if sock.get(EVENTS) & POLLIN:
            self._after_send()  # the send may have taken the edge that announced them

    def take(self, limit: int, copy: bool = True) -> list[list[Any]]:
        """Every message waiting now, up to ``limit`` (empty: none waits, and the edge is re-armed)."""
        sock, out = self.sock, []
        # ZMQ_EVENTS says whether a whole message waits (and re-arms the descriptor's edge):
        # asking it is cheaper than the zmq.Again a blind non-blocking receive raises.
        while len(out) < limit and not sock.closed and sock.get(EVENTS) & POLLIN:
            try:
                out.append(sock.recv_multipart(flags=zmq.NOBLOCK, copy=copy))
            except zmq.Again:
                break
        return out

    def close(self, linger_s: float = 0.0) -> None:
        """Stop reading and close; queued messages get up to ``linger_s`` seconds to leave."""
        if self.sock.closed:
            return
        if not self.loop.is_closed():
            self.loop.remove_reader(self._fd)
        self.sock.close(linger=int(linger_s * 1000))


class Dispatch(Pump):
    """A `Pump` that hands each message to ``on_frames(frames)`` as it is read (the calls' sockets).
    Messages a send finds waiting are read on the loop's next turn, not inside the send."""

    def __init__(self, sock: zmq.Socket, on_frames: Callable[[list], None]) -> None:
        self._on_frames = on_frames
        self._scheduled = False
        super().__init__(sock, self._drain, self._drain_soon)

    def _drain(self) -> None:
        self._scheduled = False
        while batch := self.take(64):
            for frames in batch:
                try:
                    self._on_frames(frames)
                except Exception:  # one bad message must not stop the socket
                    log.exception("a message could not be handled")

    def _drain_soon(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._drain)
