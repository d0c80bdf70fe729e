"""The stream with ZeroMQ CURVE: the run's producers deliver; a raw socket without the keys can
neither deliver to the consumer nor read from a producer, and its attempts are counted."""

from __future__ import annotations

import asyncio
import dataclasses

import msgpack
import numpy as np
import pytest
import zmq

from asyncrl.queue import StreamConfig, StreamConsumer, StreamProducer
from asyncrl.queue.protocol import envelope
from asyncrl.queue.security import make_curve_keys
from asyncrl.types import Group, Trajectory


def group(i: int, n: int = 2) -> Group:
    sid = f"sample_0_{i}"
    trajs = [Trajectory(sid, k, np.arange(3), np.full(4, i), np.full(4, -0.5, np.float32), np.full(4, 0), "stop")
             for k in range(n)]
    return Group(sid, trajs, expected=n)


@pytest.fixture
def keys():
    return make_curve_keys()


def config(keys, endpoint="tcp://127.0.0.1:*") -> StreamConfig:
    return StreamConfig(endpoint=endpoint, window=4, heartbeat_s=0.05, peer_timeout_s=1.0, curve=keys)


async def wait_for(predicate, timeout: float = 10.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(poll(), timeout)


def raw_dealer(endpoint: str, **curve) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    for name, value in curve.items():
        setattr(sock, name, value)
    sock.connect(endpoint)
    return ctx, sock


async def test_the_runs_producer_delivers_over_curve(keys):
    async with StreamConsumer(config(keys)) as consumer:
        assert consumer.endpoint.startswith("tcp://127.0.0.1:") and not consumer.endpoint.endswith(":*")
        producer_cfg = dataclasses.replace(config(keys.for_producer()), endpoint=consumer.endpoint)
        async with StreamProducer(producer_cfg, producer_id="p") as producer:
            await producer.send(group(1))
            got = await consumer.recv(timeout=10)
            assert got.sample_id == "sample_0_1" and list(got.trajectories[0].response_ids) == [1, 1, 1, 1]
        assert consumer.stats.rejected_peers == 0


@pytest.mark.parametrize("who", ["plaintext", "own client key", "wrong server key"])
async def test_a_peer_without_the_keys_cannot_deliver_and_is_counted(keys, who):
    async with StreamConsumer(config(keys)) as consumer:
        public, secret = zmq.curve_keypair()
        curve = {
            "plaintext": {},
            "own client key": dict(curve_serverkey=keys.server_public.encode(), curve_publickey=public,
                                   curve_secretkey=secret),
            "wrong server key": dict(curve_serverkey=zmq.curve_keypair()[0], curve_publickey=public,
                                     curve_secretkey=secret),
        }[who]
        ctx, sock = raw_dealer(consumer.endpoint, **curve)
        try:
            # A well-formed hello and group message, as the run's producer would send them.
            sock.send_multipart([envelope("ping", {"producer": "intruder", "incarnation": "x"})], flags=zmq.NOBLOCK)
            sock.send_multipart([envelope("group", {"session": "", "sample_ids": ["sample_0_9"]}),
                                 msgpack.packb({"x": 1})], flags=zmq.NOBLOCK)
            await wait_for(lambda: consumer.stats.rejected_peers >= 1)
            with pytest.raises(TimeoutError):
                await consumer.recv(timeout=0.5)
            assert consumer.stats.received == 0 and consumer.stats.malformed == 0
        finally:
            sock.close()
            ctx.term()


async def test_a_fake_consumer_without_the_server_secret_reads_nothing(keys):
    # The producer holds the run's keys; a raw ROUTER on its endpoint, a CURVE server with other
    # keys (or plain TCP), never completes the handshake, so no message reaches it.
    for curve_server in (True, False):
        ctx = zmq.Context()
        rogue = ctx.socket(zmq.ROUTER)
        rogue.linger = 0
        if curve_server:
            public, secret = zmq.curve_keypair()
            rogue.curve_server, rogue.curve_publickey, rogue.curve_secretkey = True, public, secret
        port = rogue.bind_to_random_port("tcp://127.0.0.1")
        producer = StreamProducer(config(keys.for_producer(), f"tcp://127.0.0.1:{port}"), producer_id="p")
        try:
            await producer.start()
            sending = asyncio.create_task(producer.send(group(2)))
            # The producer says hello every heartbeat (50 ms): 40 heartbeats go unheard.
            assert rogue.poll(2000) == 0
            sending.cancel()
        finally:
            await producer.close()
            rogue.close()
            ctx.term()
