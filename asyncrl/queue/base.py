"""The two ends of a group stream as interfaces: where groups go (`GroupSink`) and come from (`GroupSource`).

The Rollouter sends into a `GroupSink`; the Trainer receives from a `GroupSource` and acks
what it is done with. The ZeroMQ stream implements both across processes
(`asyncrl.queue.producer.StreamProducer` is a sink, `asyncrl.queue.consumer.StreamConsumer`
a source); `asyncrl.queue.memory` implements them in one process (the on-policy loop, tests).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from asyncrl.types import Group


@runtime_checkable
class GroupSink(Protocol):
    """Where finished groups go: the sample stream's producer side."""

    async def send(self, group: Group) -> None:
        """Hand ``group`` over; may wait (backpressure) until the other side has room."""
        ...


@runtime_checkable
class GroupSource(Protocol):
    """Where groups come from: the sample stream's consumer side."""

    async def recv(self, timeout: float | None = None) -> Group:
        """The next group; raises TimeoutError when none arrives within ``timeout`` seconds."""
        ...

    def ack(self, sample_ids: Iterable[str], reason: str | None = None) -> None:
        """Tell the producer these groups are done with (trained and durable, or dropped for ``reason``)."""
        ...
