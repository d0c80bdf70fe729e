"""Groups waiting to leave a StreamProducer share one "groups" message (protocol v2).

Real ZeroMQ sockets on loopback, one asyncio loop: batching of sends in a row, the
batch_groups / batch_bytes caps, a lone group not held back, close() flushing the outbox,
a replay to a restarted consumer, and de-duplication / validation of a hand-made batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import zmq
import zmq.asyncio

from asyncrl.net import free_port
from asyncrl.queue import StreamConfig, StreamConsumer, StreamProducer, StreamTimeout
from asyncrl.queue.group_codec import pack_groups, prepare_group
from asyncrl.queue.protocol import envelope, parse_envelope
from asyncrl.types import Group, Trajectory


@pytest.fixture
def config() -> StreamConfig:
    return StreamConfig(endpoint=f"tcp://127.0.0.1:{free_port()}", window=64, heartbeat_s=0.05, peer_timeout_s=1.0)


def group(i: int, n: int = 2, length: int = 8) -> Group:
    sid = f"sample_0_{i}"
    trajs = [
        Trajectory(sid, k, np.arange(3 + k), np.full(length + k, i), np.full(length + k, -0.5, np.float32),
                   np.full(length + k, k), "stop", reward=float(k))
        for k in range(n)
    ]
    return Group(sid, trajs, expected=n, meta={"i": i})


def groups(count: int) -> list[Group]:
    return [group(i, n=1 + i % 3, length=i % 5) for i in range(count)]  # length 0: no response tokens


async def _recv_all(consumer: StreamConsumer, count: int) -> list[Group]:
    got = [await consumer.recv(timeout=10) for _ in range(count)]
    consumer.ack([g.sample_id for g in got])
    return got


def _rogue(config: StreamConfig) -> zmq.asyncio.Socket:
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(config.endpoint)
    return sock


async def _hello(rogue: zmq.asyncio.Socket) -> str:
    """Say hello as a producer would; return the consumer's session from its first credit."""
    await rogue.send_multipart([envelope("ping", {"producer": "raw", "incarnation": "x"})])
    kind, fields = parse_envelope((await asyncio.wait_for(rogue.recv_multipart(), timeout=10))[0])
    assert kind == "credit"
    return fields["session"]


async def _send_batch(rogue: zmq.asyncio.Socket, session: str, sample_ids: list[str], batch: list[Group]) -> None:
    frames = pack_groups([prepare_group(g) for g in batch])
    await rogue.send_multipart([envelope("groups", {"session": session, "sample_ids": sample_ids}), *frames])


def conversation(i: int) -> Group:
    """A multi-turn group: a masked response of two turns beside a plain one."""
    g = group(i, n=2, length=6)
    first = g.trajectories[0]
    g.trajectories[0] = dataclasses.replace(first, loss_mask=np.array([1, 1, 0, 0, 1, 1], np.uint8), turns=2,
                                            finish_reason="max_turns")
    return g


# ----------------------------------------------------------------------------- batching


async def test_turns_and_loss_masks_cross_the_stream_among_plain_groups(config):
    sent = [group(0), conversation(1), group(2), conversation(3)]
    async with StreamConsumer(config) as consumer, StreamProducer(config, producer_id="p") as producer:
        for g in sent:
            await producer.send(g, timeout=10)
        got = await _recv_all(consumer, len(sent))
    assert got == sent
    assert [t.turns for t in got[1].trajectories] == [2, 1] and got[1].trajectories[1].loss_mask is None
    assert got[3].trajectories[0].loss_mask.tolist() == [1, 1, 0, 0, 1, 1]
    assert all(t.loss_mask is None for t in got[0].trajectories + got[2].trajectories)



async def test_groups_sent_in_a_row_share_messages_and_arrive_once_in_order(config):
    sent = groups(40)
    async with StreamConsumer(config) as consumer, StreamProducer(config, producer_id="p") as producer:
        for g in sent:  # the first waits for credit; the others have it and do not yield
            await producer.send(g, timeout=10)
        got = await _recv_all(consumer, len(sent))
        assert [g.sample_id for g in got] == [g.sample_id for g in sent]
        assert got == sent
        await producer.wait_acked(timeout=10)
        assert producer.stats.sent == 40 and producer.stats.messages < 40
        assert consumer.stats.messages == producer.stats.messages
        assert consumer.stats.received == 40 and consumer.stats.delivered == 40
        assert consumer.stats.duplicates == 0 and consumer.stats.malformed == 0
        with pytest.raises(StreamTimeout):
            await consumer.recv(timeout=0.1)


async def test_batch_groups_caps_the_groups_of_one_message(config):
    config = dataclasses.replace(config, batch_groups=4)
    sent = groups(40)
    async with StreamConsumer(config) as consumer, StreamProducer(config, producer_id="p") as producer:
        for g in sent:
            await producer.send(g, timeout=10)
        assert await _recv_all(consumer, 40) == sent
        assert producer.stats.sent == 40 and producer.stats.messages >= 10
        assert consumer.stats.messages == producer.stats.messages and consumer.stats.received == 40


async def test_batch_bytes_caps_the_bytes_of_one_message(config):
    sent = [group(i) for i in range(40)]
    sizes = [prepare_group(g).nbytes for g in sent]
    # Room for two groups but never three.
    config = dataclasses.replace(config, batch_bytes=2 * max(sizes) + min(sizes) // 2)
    assert 3 * min(sizes) > config.batch_bytes
    async with StreamConsumer(config) as consumer, StreamProducer(config, producer_id="p") as producer:
        for g in sent:
            await producer.send(g, timeout=10)
        assert await _recv_all(consumer, 40) == sent
        assert consumer.stats.messages >= 20 and consumer.stats.messages == producer.stats.messages
        assert producer.stats.messages < 40  # two did share


async def test_a_lone_group_is_not_held_back(config):
    async with StreamConsumer(config) as consumer, StreamProducer(config, producer_id="p") as producer:
        await producer.send(group(0), timeout=10)
        assert await consumer.recv(timeout=5) == group(0)
        assert producer.stats.messages == 1 and consumer.stats.messages == 1


async def test_close_right_after_send_flushes_the_outbox(config):
    async with StreamConsumer(config) as consumer:
        producer = StreamProducer(config, producer_id="p")
        await producer.start()
        try:
            await producer.send(group(0), timeout=10)  # waits for the first credit
            await producer.send(group(1), timeout=10)  # credit in hand: no yield
            assert producer.stats.messages == 0  # both still wait in the outbox
        finally:
            await producer.close()
        assert producer.stats.messages == 1 and producer.stats.sent == 2
        assert await _recv_all(consumer, 2) == [group(0), group(1)]
        assert consumer.stats.messages == 1



async def test_acks_reach_the_producer_without_waiting_for_a_heartbeat(config, until):
    # Heartbeats 100 s apart: every credit message below is an ack flush, by batch or by timer.
    config = dataclasses.replace(config, heartbeat_s=100.0, peer_timeout_s=1000.0, window=64)  # a batch: 16 acks
    async with StreamConsumer(config) as consumer, StreamProducer(config, producer_id="p") as producer:
        sent = [group(i) for i in range(40)]
        for g in sent[:17]:
            await producer.send(g, timeout=10)
        got = [await consumer.recv(timeout=5) for _ in range(17)]
        consumer.ack([got[0].sample_id])  # a lone ack: goes out within the coalescing delay
        await until(lambda: len(producer.unacked) == 16, 5)
        consumer.ack([g.sample_id for g in got[1:]])  # a full batch: goes out at once
        await until(lambda: not producer.unacked, 5)
        for g in sent[17:]:  # and acks keep flowing, one by one, batch after batch
            await producer.send(g, timeout=10)
            consumer.ack([(await consumer.recv(timeout=5)).sample_id])
        await until(lambda: not producer.unacked, 5)
        assert producer.stats.acked == 40 and consumer.stats.acked == 40

# ----------------------------------------------------------------------------- replay


async def test_replay_to_a_restarted_consumer_is_batched_and_commits_each_group_once(config):
    sent = [group(i) for i in range(40)]
    ids = [g.sample_id for g in sent]
    async with StreamProducer(config, producer_id="p") as producer:
        async with StreamConsumer(config) as first:
            for g in sent:
                await producer.send(g, timeout=10)
            got = [await first.recv(timeout=10) for _ in range(40)]
            assert got == sent
            first.ack(ids[:10])
            # The step that used 10..19 committed too, but the trainer stopped before acking:
            # its checkpoint says committed, the producer still holds them.
            committed = first.committed | set(ids[10:20])
        assert len(producer.unacked) >= 30
        async with StreamConsumer(config, committed=committed) as second:
            got = await _recv_all(second, 20)
            assert got == sent[20:]
            await producer.wait_acked(timeout=10)
            assert second.stats.delivered == 20 and second.stats.acked == 20
            assert second.stats.duplicates >= 10  # 10..19, and 0..9 if the first consumer's acks were lost
            assert second.stats.received == 20 + second.stats.duplicates
            assert second.stats.messages < second.stats.received  # the replay shared messages
            assert second.committed == set(ids)
            with pytest.raises(StreamTimeout):
                await second.recv(timeout=0.1)
        assert first.stats.acked == 10
        assert producer.stats.sessions == 2 and producer.stats.resent == second.stats.received
        assert producer.unacked == []


# ----------------------------------------------------------------------------- hand-made batches


async def test_a_batch_repeating_an_id_and_holding_a_committed_one_delivers_the_fresh_group_once(config):
    async with StreamConsumer(config, committed={"sample_0_1"}) as consumer:
        rogue = _rogue(config)
        try:
            session = await _hello(rogue)
            batch = [group(0), group(1), group(0)]
            await _send_batch(rogue, session, [g.sample_id for g in batch], batch)
            assert await consumer.recv(timeout=10) == group(0)
            assert consumer.stats.messages == 1 and consumer.stats.received == 3
            assert consumer.stats.duplicates == 2 and consumer.stats.malformed == 0
            with pytest.raises(StreamTimeout):
                await consumer.recv(timeout=0.1)
            assert consumer.stats.delivered == 1
        finally:
            rogue.close(0)


@pytest.mark.parametrize(
    ("sample_ids", "payload"),
    [(["sample_0_6"], [5]), (["sample_0_5", "sample_0_6"], [5]), (["sample_0_6", "sample_0_5"], [5, 6])],
    ids=["other-id", "extra-id", "swapped"],
)
async def test_sample_ids_that_do_not_match_the_payload_are_malformed_and_the_stream_goes_on(config, sample_ids, payload, until):
    async with StreamConsumer(config) as consumer:
        rogue = _rogue(config)
        try:
            session = await _hello(rogue)
            await _send_batch(rogue, session, sample_ids, [group(i) for i in payload])
            await until(lambda: consumer.stats.malformed >= 1, 10)
            assert consumer.stats.malformed == 1 and consumer.stats.delivered == 0
            async with StreamProducer(config, producer_id="p") as producer:
                await producer.send(group(7), timeout=10)
                assert await consumer.recv(timeout=10) == group(7)  # nothing of the bad batch came first
                consumer.ack(["sample_0_7"])
                await producer.wait_acked(timeout=10)
            assert consumer.stats.malformed == 1 and consumer.stats.delivered == 1
        finally:
            rogue.close(0)


# ----------------------------------------------------------------------------- config


def test_batch_settings_are_checked_and_errors_name_the_field():
    with pytest.raises(ValueError, match="batch_bytes"):
        StreamConfig(batch_bytes=0)
    with pytest.raises(ValueError, match="batch_bytes"):
        StreamConfig(max_frame_bytes=4096, batch_bytes=2049)
    assert StreamConfig(max_frame_bytes=4096, batch_bytes=2048).batch_bytes == 2048
    with pytest.raises(ValueError, match="batch_groups"):
        StreamConfig(batch_groups=0)
    assert StreamConfig().batch_bytes == 4 * 1024 * 1024 and StreamConfig().batch_groups == 64


def test_default_batch_bytes_follows_a_small_max_frame_bytes():
    # A consumer configured for small frames needs no batch setting of its own.
    assert StreamConfig(max_frame_bytes=1024 * 1024).batch_bytes == 512 * 1024
    assert StreamConfig(max_frame_bytes=64 * 1024 * 1024).batch_bytes == 4 * 1024 * 1024


_KEEP_PROBE = """
import asyncio, sys
from asyncrl.queue import StreamConfig, StreamConsumer, transport

async def main():
    config = StreamConfig(endpoint="tcp://127.0.0.1:*", keep_freed_memory=sys.argv[1] == "on")
    async with StreamConsumer(config):
        pass
    print(transport._kept)

asyncio.run(main())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
@pytest.mark.parametrize("setting, expected", [("on", "True"), ("off", "None")])
def test_keep_freed_memory_is_applied_by_a_started_stream_unless_turned_off(setting, expected):
    # Process-wide allocator state: probed in a fresh interpreter each time.
    out = subprocess.run([sys.executable, "-c", _KEEP_PROBE, setting], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected


def test_socket_buffer_bytes_is_checked_and_none_keeps_the_os_default():
    with pytest.raises(ValueError, match="socket_buffer_bytes"):
        StreamConfig(socket_buffer_bytes=100)
    assert StreamConfig(socket_buffer_bytes=None).socket_buffer_bytes is None
