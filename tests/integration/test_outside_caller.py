"""A local process outside the run, connected to each port a run's process listens on, gets
nothing executed and nothing accepted; the run's own peers are served as before and after.

The hostile payload is a pickle that creates a marker file when it is unpickled (checked first
on a marker of its own, so the test can fail). Servers are started directly, as a run starts them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import urllib.error
import urllib.request

import msgpack
import numpy as np
import pytest
import zmq

from asyncrl import rpc
from asyncrl.rpc import auth
from asyncrl.dashboard.server import DashboardServer
from asyncrl.metrics.stream import MetricsEmitter, MetricsForwarder, MetricsSubscriber
from asyncrl.queue import StreamConfig, StreamConsumer, StreamProducer
from asyncrl.queue.protocol import envelope
from asyncrl.queue.security import make_curve_keys
from asyncrl.types import Group, Trajectory

BIG = 4 * 1024 * 1024 + 1


def group(i: int) -> Group:
    sid = f"sample_0_{i}"
    trajs = [Trajectory(sid, k, np.arange(3), np.full(4, i), np.full(4, -0.5, np.float32), np.full(4, 0), "stop")
             for k in range(2)]
    return Group(sid, trajs, expected=2)


class _Touch:
    """Unpickled, it creates ``path`` (what a remote-code payload would do)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture
def marker(tmp_path):
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Touch(str(probe))))  # the payload works: unpickled, it leaves its file
    assert probe.exists()
    return tmp_path / "executed"


def _hostile(marker) -> list[list[bytes]]:
    evil = pickle.dumps((None, "note", (_Touch(str(marker)),), {}, False))
    return [
        [evil],  # a call without a MAC
        [b"\0" * 32, evil],  # a MAC of zeros
        [auth.mac(b"k" * 32, evil, auth.CALL), evil],  # a MAC under a key of the caller's own (another run's)
        [b"x" * 32, b"\xff" * BIG],  # oversized garbage
        [b""],  # one empty frame
    ]


class Target(rpc.Serving):
    def __init__(self):
        self.seen: list[int] = []

    def note(self, i) -> int:
        self.seen.append(i)
        return i


class _NeverDies:
    class rpc_watch:  # (the shape of a Ray actor method)
        @staticmethod
        def remote(seconds: float):
            return asyncio.sleep(seconds)


def _silent(sock: zmq.Socket, seconds: float = 1.0) -> bool:
    return not sock.poll(int(seconds * 1000), zmq.POLLIN)


async def test_rpc_server_runs_nothing_an_outside_caller_sends_and_serves_the_run(marker, monkeypatch):
    monkeypatch.setattr(auth, "node_ip", lambda: "127.0.0.1")
    target = Target()
    served = await target.serve_rpc()
    server = target._rpc_server
    assert served["run"] == auth.key_id(auth.run_key())  # the run's key signs its calls; it never travels
    assert "secret" not in served
    peer = rpc.RpcActor(_NeverDies(), served["endpoint"])
    assert await asyncio.wait_for(peer.note.remote(1), 10) == 1

    ctx = zmq.Context()
    outsider = ctx.socket(zmq.DEALER)
    outsider.linger = 0
    outsider.connect(served["endpoint"])
    for frames in _hostile(marker):
        outsider.send_multipart(frames)
    await asyncio.sleep(0.2)
    for _ in range(100):  # the server's loop reads the messages; wait until all are counted
        if server.rejected >= 5:
            break
        await asyncio.sleep(0.05)
    assert server.rejected == 5
    assert _silent(outsider)  # no answer at all, not even an error
    assert not marker.exists() and target.seen == [1]
    ctx.destroy(linger=0)

    assert await asyncio.wait_for(peer.note.remote(2), 10) == 2  # the run's caller, served after
    assert target.seen == [1, 2]
    # A caller of another run (another run key): its call is dropped unanswered, like an outsider's.
    other_run = rpc.RpcActor(_NeverDies(), served["endpoint"], secret=(b"o" * 32).hex())
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(other_run.note.remote(3), 1.0)
    assert server.rejected == 6 and target.seen == [1, 2]
    target.close_rpc()


async def test_a_caller_ignores_replies_from_a_process_on_its_servers_port(marker):
    ctx = zmq.Context()
    impostor = ctx.socket(zmq.ROUTER)
    impostor.linger = 0
    port = impostor.bind_to_random_port("tcp://127.0.0.1")
    peer = rpc.RpcActor(_NeverDies(), f"tcp://127.0.0.1:{port}")
    call = peer.note.remote(1)
    assert impostor.poll(10_000)
    who, mac, payload = impostor.recv_multipart()
    assert auth.authentic(auth.run_key(), mac, payload, auth.CALL)  # (what a server of this run checks)
    body = pickle.dumps(_Touch(str(marker)))
    impostor.send_multipart([who, b"\0" * 32, body])
    impostor.send_multipart([who, body])
    impostor.send_multipart([who, auth.mac(b"o" * 32, body, auth.REPLY), body])  # a server of another run
    impostor.send_multipart([who, mac, payload])  # the call echoed: a call's MAC does not pass for a reply's
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(call, 1.0)
    assert not marker.exists()
    assert peer.links.to(peer).rejected == 4  # (the link its call went out on)
    ctx.destroy(linger=0)


async def test_sample_stream_on_loopback_admits_only_the_runs_producers(marker):
    keys = make_curve_keys()  # as the launcher makes them for every run (processes.addresses)
    cfg = StreamConfig(endpoint="tcp://127.0.0.1:*", window=4, heartbeat_s=0.05, peer_timeout_s=1.0, curve=keys)
    async with StreamConsumer(cfg) as consumer:
        ctx = zmq.Context()
        outsider = ctx.socket(zmq.DEALER)
        outsider.linger = 0
        outsider.connect(consumer.endpoint)
        # NOBLOCK: once its handshake has failed, a send could wait forever (and stop this loop).
        for frames in ([envelope("ping", {"producer": "outsider", "incarnation": "x"})],
                       [envelope("group", {"session": "", "sample_ids": ["sample_0_9"]}),
                        pickle.dumps(_Touch(str(marker)))],
                       [b"\xff" * BIG]):
            try:
                outsider.send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # (not even queued: nothing of it can reach the consumer)
        for _ in range(200):
            if consumer.stats.rejected_peers:
                break
            await asyncio.sleep(0.05)
        assert consumer.stats.rejected_peers >= 1  # its handshake failed: nothing it sent was read
        assert consumer.stats.malformed == 0 and consumer.stats.received == 0
        assert _silent(outsider, 0.5)  # no credit granted
        ctx.destroy(linger=0)

        producer_cfg = dataclasses.replace(cfg, endpoint=consumer.endpoint, curve=keys.for_producer())
        async with StreamProducer(producer_cfg, producer_id="p") as producer:
            await producer.send(group(3))
            got = await consumer.recv(timeout=10)
        assert got.sample_id == "sample_0_3" and consumer.stats.received == 1
    assert not marker.exists()


def test_metrics_stream_parses_only_typed_bounded_messages(marker):
    with MetricsForwarder() as fwd:
        sub = MetricsSubscriber(fwd.endpoints.subscribe)
        ctx = zmq.Context()
        emitter = MetricsEmitter(fwd.endpoints.publish, "trainer")
        assert emitter.ready  # the subscriber's subscription reached the publishers
        outsider = ctx.socket(zmq.XPUB)  # (an XPUB hears the subscription: its messages are not dropped unsent)
        outsider.linger = 0
        outsider.connect(fwd.endpoints.publish)
        assert outsider.poll(10_000, zmq.POLLIN)
        outsider.send(pickle.dumps(_Touch(str(marker))))  # not msgpack: skipped, counted
        outsider.send(msgpack.packb({"v": 1, "source": "x", "seq": 0, "events": [["a", 1.0, 0, 0, 0.0]]})
                      + b"\0" * BIG)  # oversized: never forwarded
        got = []
        for _ in range(50):
            got += sub.recv(timeout_s=0.1)
            if sub.malformed:
                break
        emitter.emit("loss", 0.5, step=7)
        for _ in range(100):
            got += sub.recv(timeout_s=0.1)
            if any(e.name == "loss" for e in got):
                break
        got += sub.recv(timeout_s=0.5)  # (anything else still on its way)
        assert sub.malformed == 1 and [(e.name, e.value, e.step, e.source) for e in got] == [("loss", 0.5, 7, "trainer")]
        assert not marker.exists()
        emitter.close()
        sub.close()
        ctx.destroy(linger=0)


class _NoFeed:
    description = "none"

    def run(self, hub, stop) -> None:
        stop.wait()


def test_dashboard_answers_only_get_on_loopback(marker):
    server = DashboardServer(_NoFeed())
    try:
        assert server.url.startswith("http://127.0.0.1:")
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            req = urllib.request.Request(server.url + "events", data=pickle.dumps(_Touch(str(marker))), method=method)
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=10)
            assert err.value.code == 501  # no handler: the body is never read
        with urllib.request.urlopen(server.url + "info", timeout=10) as resp:
            assert resp.status == 200 and b'"feed": "none"' in resp.read()
        assert server.hub.connect()[0] == []  # nothing reached the hub
        assert not marker.exists()
    finally:
        server.close()
