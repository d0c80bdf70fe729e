"""The lifecycle both ends of the sample stream share: their I/O loops, failure, and closing.

`StreamEndpoint` owns the background tasks of a `StreamProducer` or `StreamConsumer` (its
read loop and heartbeat): they are started together, a loop that fails is recorded once and
re-raised as `StreamError` at the next call that needs the stream (``send``, ``recv``, ...),
and `close` cancels and awaits every one of them. Each end adds its socket and what must
happen before and after the loops stop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from asyncrl.queue.protocol import StreamError

log = logging.getLogger("asyncrl.queue")


class StreamEndpoint:
    """Background loops with one owner (see module doc); subclasses name themselves in ``role``."""

    role = "stream endpoint"

    def __init__(self) -> None:
        self._tasks: list[asyncio.Task] = []
        self._failure: BaseException | None = None
        self._sock: Any = None
        self._closed = False

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def start(self) -> None:  # pragma: no cover - each end implements it
        raise NotImplementedError

    async def close(self) -> None:  # pragma: no cover - each end implements it
        raise NotImplementedError

    def _check_not_started(self) -> None:
        if self._sock is not None:
            raise StreamError(f"{self.role} already started")

    def _start_loops(self, *loops: Coroutine) -> None:
        for coro in loops:
            task = asyncio.create_task(coro)
            task.add_done_callback(self._on_task_done)
            self._tasks.append(task)

    async def _stop_loops(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def _on_task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()
            log.error("%s I/O loop failed", self.role, exc_info=self._failure)
            self._wake()

    def _wake(self) -> None:
        """Wake whoever waits on this end (to re-check its condition, or see the failure)."""

    def _down(self) -> bool:
        return self._closed or self._failure is not None

    def _raise_if_down(self) -> None:
        if self._failure is not None:
            raise StreamError(f"{self.role} I/O loop failed") from self._failure
        if self._closed or self._sock is None:
            raise StreamError(f"{self.role} is closed (or was never started)")
