"""In-process `GroupSource` and `GroupSink`: a group stream without sockets.

`MemorySink` keeps what a Rollouter sends, in order, and lets a caller wait for a count;
`MemorySource` hands a list of groups to a Trainer and records every ack. Used by tests
and by in-process loops.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterable

from asyncrl.types import Group


class MemorySink:
    """A `GroupSink` that keeps every group it is sent (no backpressure)."""

    def __init__(self) -> None:
        self.groups: list[Group] = []
        self._changed: asyncio.Condition | None = None

    async def send(self, group: Group) -> None:
        self.groups.append(group)
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()

    async def wait_for(self, count: int, timeout: float) -> list[Group]:
        """Wait until at least ``count`` groups arrived; TimeoutError after ``timeout`` seconds."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: len(self.groups) >= count), timeout)
        return self.groups


class MemorySource:
    """A `GroupSource` over groups put in this process; records every ack."""

    def __init__(self, groups: Iterable[Group] = ()):
        self._queue: collections.deque[Group] = collections.deque(groups)
        self.acks: list[tuple[str, str | None]] = []
        """``(sample_id, reason)`` of every ack, in order."""

    def put(self, group: Group) -> None:
        self._queue.append(group)

    async def recv(self, timeout: float | None = None) -> Group:
        """The next group put; raises TimeoutError at once when none is left (nothing else could put one)."""
        if not self._queue:
            raise TimeoutError("MemorySource is empty")
        return self._queue.popleft()

    def ack(self, sample_ids: Iterable[str], reason: str | None = None) -> None:
        self.acks.extend((sid, reason) for sid in sample_ids)
