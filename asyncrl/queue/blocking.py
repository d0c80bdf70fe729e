"""Blocking facades of the stream for plain threads (a Trainer loop, a test's child process).

Each facade owns one daemon thread running its own asyncio loop, where the async
`StreamConsumer` / `StreamProducer` lives; every call is forwarded there and waited on with a
deadline. ``close()`` closes the stream and stops and joins the thread.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Callable, Iterable, TypeVar

from asyncrl.queue.consumer import ConsumerStats, StreamConsumer
from asyncrl.queue.producer import ProducerStats, StreamProducer
from asyncrl.queue.protocol import StreamConfig
from asyncrl.types import CommittedSet, Group

T = TypeVar("T")

_CALL_SLACK_S = 30.0  # extra time a forwarded call may take beyond its own timeout


class _LoopThread:
    """An asyncio loop on its own thread, and a way to run coroutines on it from outside."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[T], timeout: float | None) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(None if timeout is None else timeout + _CALL_SLACK_S)

    def call(self, fn: Callable[[], T]) -> T:
        async def call() -> T:
            return fn()

        return self.run(call(), 0.0)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=_CALL_SLACK_S)
        if not self.thread.is_alive():
            self.loop.close()


class BlockingStreamConsumer:
    """`StreamConsumer` for a plain thread: same methods, blocking."""

    def __init__(self, config: StreamConfig | None = None, *, committed: Iterable[str] = ()) -> None:
        self._thread = _LoopThread("stream-consumer")
        self._consumer: StreamConsumer = self._thread.call(lambda: StreamConsumer(config, committed=committed))

    def start(self) -> None:
        self._thread.run(self._consumer.start(), 0.0)

    def recv(self, timeout: float | None = None) -> Group:
        return self._thread.run(self._consumer.recv(timeout), timeout)

    def ack(self, sample_ids: Iterable[str], reason: str | None = None) -> None:
        ids = [sample_ids] if isinstance(sample_ids, str) else list(sample_ids)
        self._thread.call(lambda: self._consumer.ack(ids, reason))

    @property
    def committed(self) -> CommittedSet:
        return self._thread.call(lambda: self._consumer.committed)

    @property
    def stats(self) -> ConsumerStats:
        return self._thread.call(lambda: ConsumerStats(**vars(self._consumer.stats)))

    @property
    def session(self) -> str:
        return self._consumer.session

    def close(self) -> None:
        try:
            self._thread.run(self._consumer.close(), 0.0)
        finally:
            self._thread.stop()

    def __enter__(self) -> BlockingStreamConsumer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class BlockingStreamProducer:
    """`StreamProducer` for a plain thread: same methods, blocking."""

    def __init__(
        self, config: StreamConfig | None = None, *, producer_id: str = "producer", unacked: Iterable[Group] = ()
    ) -> None:
        self._thread = _LoopThread(f"stream-producer-{producer_id}")
        groups = list(unacked)
        self._producer: StreamProducer = self._thread.call(
            lambda: StreamProducer(config, producer_id=producer_id, unacked=groups)
        )

    def start(self) -> None:
        self._thread.run(self._producer.start(), 0.0)

    def send(self, group: Group, timeout: float | None = None) -> None:
        limit = timeout if timeout is not None else self._producer.config.send_timeout_s
        if limit is None:
            # Backpressure may block for as long as the consumer needs: wait without a deadline.
            asyncio.run_coroutine_threadsafe(self._producer.send(group), self._thread.loop).result()
        else:
            self._thread.run(self._producer.send(group, timeout), limit)

    def wait_acked(self, timeout: float) -> None:
        self._thread.run(self._producer.wait_acked(timeout), timeout)

    @property
    def unacked(self) -> list[Group]:
        return self._thread.call(lambda: self._producer.unacked)

    @property
    def stats(self) -> ProducerStats:
        return self._thread.call(lambda: ProducerStats(**vars(self._producer.stats)))

    def close(self) -> None:
        try:
            self._thread.run(self._producer.close(), 0.0)
        finally:
            self._thread.stop()

    def __enter__(self) -> BlockingStreamProducer:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

