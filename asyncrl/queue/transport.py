"""One ZeroMQ socket driven from an asyncio loop, tuned for the sample stream: an
`asyncrl.pump.Pump` (the calls' sockets are one too) with the stream's own socket options.

Sends never block: the socket has no high-water mark, because credit (not the HWM) bounds
what is queued, so a send is a plain non-blocking call with no future to schedule. Receives
wait on the socket's file descriptor and then drain every waiting message (up to a burst)
without awaiting, so a burst of messages costs one wake-up of the loop, not one per message.

Each socket has its own ZeroMQ context (one I/O thread) so that ``close`` can wait for its
last messages (acks, a bye) to leave before the process moves on or exits.

ZeroMQ's descriptor is edge-triggered and any socket operation (a send included) may consume
the edge, so after every send, and before every wait, ``ZMQ_EVENTS`` is read to learn whether
messages are waiting (that read also re-arms the edge).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Callable
from typing import Any

import zmq

from asyncrl.pump import Pump, unbounded
from asyncrl.queue.security import CurveGuard, CurveKeys, apply_curve

log = logging.getLogger("asyncrl.queue")

_BURST = 64  # most messages taken per wake-up, so one busy peer cannot starve the loop

# glibc mallopt parameters and the values `keep_freed_memory` sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 * 1024 * 1024
_TRIM_THRESHOLD = 128 * 1024 * 1024
_kept: bool | None = None


def keep_freed_memory() -> bool:
    """Let this process reuse freed multi-MB blocks instead of handing them back to the kernel.

    ZeroMQ allocates every received message of more than a few KiB on its own, and so does a
    producer's pool for each message in flight. With glibc's defaults a block of a few MiB
    is mmap'ed and unmapped again, or trimmed from the heap's top, so the next message of that
    size page-faults all of its pages in again: ~730 faults per 3 MiB message, which on the
    2-core CI machine doubled the receiving process's system time. This sets glibc's mmap
    threshold to 32 MiB (the most its own dynamic threshold reaches) and the trim threshold
    to 128 MiB, once per process: freed blocks up to 32 MiB stay in the heap for reuse, and at
    most 128 MiB of free heap top is kept. It changes allocation for the whole process, so
    `StreamConfig.keep_freed_memory` turns it off. Returns True where it applied (Linux, glibc).
    """
    global _kept
    if _kept is None:
        _kept = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                mallopt = libc.mallopt
            except (OSError, AttributeError):  # not glibc (musl has no mallopt)
                mallopt = None
            if mallopt is not None:
                _kept = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
                log.debug("keep_freed_memory: mallopt %s", "applied" if _kept else "refused")
    return _kept


class StreamSocket(Pump):
    """A ROUTER or DEALER socket owned by the running event loop; every method runs on that loop."""

    def __init__(
        self, kind: int, *, routing_id: bytes | None = None, max_frame_bytes: int | None = None,
        buffer_bytes: int | None = None, curve: CurveKeys | None = None,
        on_reject: Callable[[], None] | None = None,
    ) -> None:
        # An own context, so close() can wait for the last messages to leave (ctx.term).
        self._ctx = zmq.Context(io_threads=1)
        sock = self._ctx.socket(kind)
        self.guard: CurveGuard | None = None
        if curve is not None:  # the ROUTER is the consumer: the CURVE server
            apply_curve(sock, curve, server=kind == zmq.ROUTER)
            if kind == zmq.ROUTER:
                self.guard = CurveGuard(self._ctx, sock, curve, on_reject)
        unbounded(sock)
        if buffer_bytes is not None:  # kernel socket buffers (SO_SNDBUF / SO_RCVBUF)
            sock.setsockopt(zmq.SNDBUF, buffer_bytes)
            sock.setsockopt(zmq.RCVBUF, buffer_bytes)
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if max_frame_bytes is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self._readable = asyncio.Event()
        super().__init__(sock, self._readable.set)

    def bind(self, endpoint: str) -> str:
        """Bind; returns the endpoint bound (a ``:*`` or ``:0`` port resolved to the one taken)."""
        self.sock.bind(endpoint)
        return self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect(self, endpoint: str) -> None:
        self.sock.connect(endpoint)

    async def recv_burst(self) -> list[list[Any]]:
        """Wait for messages, then return every one waiting, up to a burst (as zmq Frames)."""
        while True:
            messages = self.take(_BURST, copy=False)
            if messages:
                return messages
            self._readable.clear()  # nothing waits and the edge is re-armed: the next message sets it
            await self._readable.wait()

    async def close(self, linger_s: float = 0.0) -> None:  # type: ignore[override] - it also ends the context
        """Close; queued messages get up to ``linger_s`` seconds to leave before they are dropped."""
        if self.guard is not None:
            self.guard.close()
        Pump.close(self, linger_s)
        await self.loop.run_in_executor(None, self._ctx.term)
