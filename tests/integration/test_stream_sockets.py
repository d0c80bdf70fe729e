"""The sample stream in one process: real ZeroMQ sockets on loopback, one asyncio loop.

Credit and backpressure, acks, de-duplication, replay to a restarted consumer, two producers,
foreign messages, the blocking facade. Multi-process behaviour is in tests/integration.
"""

from __future__ import annotations

import asyncio
import threading

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio

from asyncrl.net import free_port
from asyncrl.queue import (
    BlockingStreamConsumer,
    BlockingStreamProducer,
    CodecError,
    StreamConfig,
    StreamConsumer,
    StreamProducer,
    StreamTimeout,
)
from asyncrl.queue.protocol import ProtocolError, envelope, parse_envelope
from asyncrl.types import Group, Trajectory


@pytest.fixture
def config() -> StreamConfig:
    return StreamConfig(endpoint=f"tcp://127.0.0.1:{free_port()}", window=4, heartbeat_s=0.05, peer_timeout_s=1.0)


def group(i: int, n: int = 2, length: int = 8) -> Group:
    sid = f"sample_0_{i}"
    trajs = [
        Trajectory(sid, k, np.arange(3), np.full(length, i), np.full(length, -0.5, np.float32), np.full(length, k), "stop")
        for k in range(n)
    ]
    return Group(sid, trajs, expected=n, meta={"i": i})


async def _recv_ids(consumer: StreamConsumer, count: int, ack: bool = True) -> list[str]:
    ids = []
    for _ in range(count):
        g = await consumer.recv(timeout=10)
        ids.append(g.sample_id)
        if ack:
            consumer.ack([g.sample_id])
    return ids


async def test_groups_arrive_in_order_with_their_arrays(config):
    async with StreamConsumer(config) as consumer, StreamProducer(config, producer_id="p") as producer:
        sender = asyncio.create_task(_send_all(producer, range(20)))
        got = []
        for i in range(20):
            g = await consumer.recv(timeout=10)
            assert g == group(i) and g.meta == {"i": i}
            got.append(g.sample_id)
            consumer.ack([g.sample_id])
        await sender
        await producer.wait_acked(timeout=10)
        assert got == [f"sample_0_{i}" for i in range(20)]
        assert producer.unacked == [] and producer.stats.acked == 20
        assert consumer.committed == set(got) and consumer.stats.delivered == 20


async def _send_all(producer: StreamProducer, ids) -> None:
    for i in ids:
        await producer.send(group(i))


async def test_producer_blocks_at_the_window_until_acks_return_credit(config):
    async with StreamConsumer(config) as consumer, StreamProducer(config, producer_id="p") as producer:
        for i in range(config.window):
            await producer.send(group(i), timeout=10)
        with pytest.raises(StreamTimeout, match="send_timeout_s"):
            await producer.send(group(99), timeout=0.5)
        assert [g.sample_id for g in producer.unacked] == [f"sample_0_{i}" for i in range(config.window)]
        # Received but unacked groups still hold the credit: backpressure reaches the caller.
        ids = await _recv_ids(consumer, config.window, ack=False)
        with pytest.raises(StreamTimeout):
            await producer.send(group(99), timeout=0.3)
        consumer.ack(ids[:2])
        await producer.send(group(4), timeout=10)
        await producer.send(group(5), timeout=10)
        assert len(producer.unacked) == config.window
        assert await _recv_ids(consumer, 2, ack=False) == ["sample_0_4", "sample_0_5"]
        with pytest.raises(StreamTimeout, match="StreamConfig.window=4"):
            await consumer.recv(timeout=0.2)


async def test_producer_without_consumer_waits_then_delivers(config):
    async with StreamProducer(config, producer_id="p") as producer:
        with pytest.raises(StreamTimeout):
            await producer.send(group(0), timeout=0.3)
        assert not producer.connected and producer.unacked == []
        sender = asyncio.create_task(producer.send(group(0)))
        async with StreamConsumer(config) as consumer:
            assert await _recv_ids(consumer, 1) == ["sample_0_0"]
            await sender
            await producer.wait_acked(timeout=10)
            assert producer.connected


async def test_restarted_consumer_gets_unacked_groups_again_and_skips_committed(config):
    async with StreamProducer(config, producer_id="p") as producer:
        async with StreamConsumer(config) as first:
            for i in range(4):
                await producer.send(group(i), timeout=10)
            ids = await _recv_ids(first, 4, ack=False)
            first.ack(ids[:2])  # sample_0_0/1 committed; 2 and 3 trained on by nobody yet
            committed = first.committed  # closing at once: the acks may or may not reach the producer
        async with StreamConsumer(config, committed=committed) as second:
            assert second.session != first.session
            assert await _recv_ids(second, 2) == ["sample_0_2", "sample_0_3"]
            await producer.wait_acked(timeout=10)
        assert producer.stats.sessions == 2


async def test_committed_groups_are_acked_not_delivered(config):
    async with StreamConsumer(config, committed={"sample_0_0", "sample_0_1"}) as consumer:
        async with StreamProducer(config, producer_id="p") as producer:
            for i in range(4):
                await producer.send(group(i), timeout=10)
            assert await _recv_ids(consumer, 2) == ["sample_0_2", "sample_0_3"]
            await producer.wait_acked(timeout=10)
            assert consumer.stats.duplicates == 2 and consumer.stats.delivered == 2


async def test_a_group_sent_by_two_producers_is_delivered_once_and_acked_to_both(config):
    async with StreamConsumer(config) as consumer:
        async with StreamProducer(config, producer_id="a") as a, StreamProducer(config, producer_id="b") as b:
            await a.send(group(7), timeout=10)
            g = await consumer.recv(timeout=10)
            await b.send(group(7), timeout=10)
            await b.send(group(8), timeout=10)
            assert (await consumer.recv(timeout=10)).sample_id == "sample_0_8"
            assert consumer.stats.duplicates == 1
            consumer.ack([g.sample_id, "sample_0_8"])
            await a.wait_acked(timeout=10)
            await b.wait_acked(timeout=10)


async def test_restored_unacked_groups_are_sent_first(config):
    restored = [group(10), group(11)]
    async with StreamConsumer(config) as consumer:
        async with StreamProducer(config, producer_id="p", unacked=restored) as producer:
            assert [g.sample_id for g in producer.unacked] == ["sample_0_10", "sample_0_11"]
            await producer.send(group(12), timeout=10)
            assert await _recv_ids(consumer, 3) == ["sample_0_10", "sample_0_11", "sample_0_12"]
            await producer.wait_acked(timeout=10)


async def test_ack_rules(config):
    async with StreamConsumer(config) as consumer, StreamProducer(config, producer_id="p") as producer:
        await producer.send(group(1), timeout=10)
        await producer.send(group(2), timeout=10)
        with pytest.raises(ValueError, match="already sent"):
            await producer.send(group(1))
        await _recv_ids(consumer, 2, ack=False)
        with pytest.raises(ValueError, match="never delivered"):
            consumer.ack(["sample_0_99"])
        consumer.ack(["sample_0_1"], reason="version gap 5 > max_version_gap 4")
        consumer.ack(["sample_0_2"])
        consumer.ack(["sample_0_2"])  # again: a no-op
        await producer.wait_acked(timeout=10)
        assert consumer.stats.dropped == 1 and consumer.stats.acked == 1
        assert consumer.committed == {"sample_0_1", "sample_0_2"}


async def test_foreign_and_malformed_messages_are_counted_and_the_stream_goes_on(config, until):
    async with StreamConsumer(config) as consumer, StreamProducer(config, producer_id="p") as producer:
        rogue = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(config.endpoint)
        try:
            await rogue.send_multipart([b"\x00garbage"])
            await rogue.send_multipart([b"x" * 100, b"y"])
            await rogue.send_multipart([envelope("ping", {"producer": 5})])  # a field of the wrong type
            await rogue.send_multipart([envelope("group", {"session": consumer.session, "sample_id": "s"}), b"zz"])
            await rogue.send_multipart([envelope("credit", {"session": "x", "granted": 1, "acks": []})])
            await producer.send(group(0), timeout=10)
            assert await _recv_ids(consumer, 1) == ["sample_0_0"]
            # The consumer handles messages in arrival order per peer; the rogue's came first.
            await until(lambda: consumer.stats.malformed >= 5, 10, "5 malformed messages counted")
            assert consumer.stats.malformed == 5
        finally:
            rogue.close(0)


async def test_a_foreign_frame_over_max_frame_bytes_is_cut_off_and_the_stream_goes_on(config):
    config.max_frame_bytes = 64 * 1024
    async with StreamConsumer(config) as consumer, StreamProducer(config, producer_id="p") as producer:
        rogue = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(config.endpoint)
        try:
            await rogue.send_multipart([envelope("ping", {"producer": "rogue", "incarnation": "x"}), bytes(1 << 20)])
            for i in range(3):
                await producer.send(group(i), timeout=10)
            assert await _recv_ids(consumer, 3) == ["sample_0_0", "sample_0_1", "sample_0_2"]
            await producer.wait_acked(timeout=10)
            assert all(peer.producer != "rogue" for peer in consumer._peers.values())  # never got through
        finally:
            rogue.close(0)


async def test_oversized_group_is_refused_at_send(config):
    config.max_frame_bytes = 4096
    async with StreamProducer(config, producer_id="p") as producer:
        with pytest.raises(CodecError, match="max_frame_bytes=4096"):
            await producer.send(group(0, length=10_000))
        assert producer.unacked == []


def test_blocking_facades_work_from_plain_threads(config):
    received: list[str] = []
    with BlockingStreamConsumer(config) as consumer, BlockingStreamProducer(config, producer_id="p") as producer:
        def train() -> None:
            for _ in range(10):
                g = consumer.recv(timeout=10)
                received.append(g.sample_id)
                consumer.ack([g.sample_id])

        trainer = threading.Thread(target=train)
        trainer.start()
        for i in range(10):
            producer.send(group(i))
        trainer.join(timeout=30)
        producer.wait_acked(timeout=10)
        assert received == [f"sample_0_{i}" for i in range(10)]
        assert consumer.committed == set(received) and producer.unacked == []
        assert consumer.stats.acked == 10 and producer.stats.acked == 10


def test_config_and_envelope_errors_name_the_field():
    with pytest.raises(ValueError, match="window"):
        StreamConfig(window=0)
    with pytest.raises(ValueError, match="peer_timeout_s"):
        StreamConfig(heartbeat_s=2.0, peer_timeout_s=1.0)
    with pytest.raises(ValueError, match="endpoint"):
        StreamConfig(endpoint="127.0.0.1:5555")
    with pytest.raises(ProtocolError, match="magic"):
        parse_envelope(b"\x93\x01\x02\x03")
    with pytest.raises(ProtocolError, match="protocol version"):
        parse_envelope(msgpack.packb([b"asyncrl-stream", 99, "ping", {}]))
    assert parse_envelope(envelope("bye", {})) == ("bye", {})
