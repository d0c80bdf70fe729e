"""Calls both ways between the Rollouter and its endpoint process (`asyncrl.agent.endpoint.process`).

One stream socket (a socket pair: no address, nothing to bind), frames of a 4-byte length and a
pickle: the two ends are one run's own processes, started from the same code, so pickle carries
the numpy arrays and records as they are. Either side `call`\\ s an operation the other side
serves (``handlers``) and awaits its value or its exception; a call cancelled here is cancelled
there (an HTTP client gone aborts its engine request in the Rollouter). When the socket closes
(the other process exited), every call waiting here fails with `ChannelClosed` and every call
served here is cancelled.
"""

from __future__ import annotations

import asyncio
import itertools
import pickle
from typing import Any, Awaitable, Callable

_HEADER = 4


class ChannelClosed(ConnectionError):
    """The other end went away: the call cannot be answered."""


def _portable(e: BaseException) -> BaseException:
    """``e`` if it survives a pickle round trip, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(e, protocol=5))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


class Channel:
    """One end: `call` the other side; `serve` (a task) reads its frames and runs ``handlers``."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handlers: dict[str, Callable[..., Awaitable[Any]]],
                 *, peer: str):
        self.reader, self.writer, self.handlers, self.peer = reader, writer, handlers, peer
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self._serving: dict[int, asyncio.Task] = {}
        self._out: list[bytes] = []
        self.closed: str | None = None
        """Why the channel closed (None: open)."""

    def _send(self, msg: tuple) -> None:
        """Queue a frame; the frames of one loop turn go out in one write (`_flush`)."""
        if self.closed is not None:
            raise ChannelClosed(f"{self.peer}: {self.closed}")
        data = pickle.dumps(msg, protocol=5)
        if not self._out:
            asyncio.get_running_loop().call_soon(self._flush)
        self._out.append(len(data).to_bytes(_HEADER, "little"))
        self._out.append(data)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self.closed is None:
            self.writer.write(b"".join(out))

    async def call(self, op: str, *args: Any) -> Any:
        """``op(*args)`` on the other side: its value, or its exception raised here."""
        rid = next(self._ids)
        future = self._waiting[rid] = asyncio.get_running_loop().create_future()
        try:
            self._send(("call", rid, op, args))
        except BaseException:
            self._waiting.pop(rid, None)
            raise
        try:
            return await future
        except asyncio.CancelledError:
            if self._waiting.pop(rid, None) is not None and self.closed is None:
                self._send(("cancel", rid))
            raise

    async def serve(self) -> None:
        """Read frames until the other side closes; then fail what waits and cancel what runs."""
        why = "closed"
        try:
            while True:
                size = int.from_bytes(await self.reader.readexactly(_HEADER), "little")
                msg = pickle.loads(await self.reader.readexactly(size))
                kind, rid = msg[0], msg[1]
                if kind == "call":
                    task = asyncio.create_task(self._run(rid, msg[2], msg[3]))
                    self._serving[rid] = task
                elif kind == "cancel":
                    task = self._serving.pop(rid, None)
                    if task is not None:
                        task.cancel()
                else:  # "ok" / "err"
                    future = self._waiting.pop(rid, None)
                    if future is not None and not future.done():
                        if kind == "ok":
                            future.set_result(msg[2])
                        else:
                            future.set_exception(msg[2])
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            why = "the other process went away" if isinstance(e, asyncio.IncompleteReadError) else str(e)
        finally:
            self.close(why)

    def close(self, why: str) -> None:
        if self.closed is not None:
            return
        self.closed = why
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(ChannelClosed(f"{self.peer}: {why}"))
        self._waiting.clear()
        for task in self._serving.values():
            task.cancel()
        self._serving.clear()
        self.writer.close()

    async def _run(self, rid: int, op: str, args: tuple) -> None:
        try:
            value = await self.handlers[op](*args)
        except asyncio.CancelledError:
            # cancelled here, not by the caller (whose cancel popped it): it must not wait forever
            self._reply(rid, ("err", rid, RuntimeError(f"{op} was cancelled in the {self.peer}'s peer")))
        except Exception as e:
            self._reply(rid, ("err", rid, _portable(e)))
        else:
            self._reply(rid, ("ok", rid, value))

    def _reply(self, rid: int, msg: tuple) -> None:
        """Answer call ``rid`` unless its caller cancelled it or the channel closed."""
        if self._serving.pop(rid, None) is not None and self.closed is None:
            self._send(msg)
