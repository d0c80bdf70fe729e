"""Calls to Ray actors over ZeroMQ (`asyncrl.rpc`): real actor processes, real sockets on loopback."""

from __future__ import annotations

import asyncio
import gc

import numpy as np
import pytest
import ray

from asyncrl import calls, rpc
from asyncrl.queue.memory import MemorySink
from asyncrl.heap import GC_YOUNG_THRESHOLD
from asyncrl.rollouter.actor import remote_engine_actor
from asyncrl.rollouter.pool import actor_died
from asyncrl.rollouter.rollouter import Prompt, RolloutConfig, Rollouter
from asyncrl.types import GenerateRequest, SamplingParams

SIM = dict(kind="sim", max_running=8, tokens_per_s=4000.0, median_tokens=4, long_tail=4, seed=3)


class Recorder(rpc.Serving):
    """An actor with a plain method, an async one and an async generator that fails part way."""

    def __init__(self):
        self.seen: list[int] = []

    def note(self, i: int) -> int:
        self.seen.append(i)
        return i

    async def noted(self, *, last: int = 0) -> list[int]:
        return self.seen[-last:] if last else list(self.seen)

    async def count_to(self, n: int, fail_at: int | None = None):
        for i in range(n):
            if i == fail_at:
                raise ValueError(f"stopped at {i}")
            await asyncio.sleep(0)
            yield i


def _requests(count: int, prefix: str) -> list[GenerateRequest]:
    return [GenerateRequest(request_id=f"{prefix}{i}", prompt_ids=np.arange(3, 8 + i), max_tokens=16,
                            sampling=SamplingParams(seed=100 + i)) for i in range(count)]


async def test_calls_streams_and_errors_come_back_as_through_ray(ray_cluster):
    engine = remote_engine_actor(num_cpus=0).remote(**SIM)
    linked = await rpc.link(engine)
    assert isinstance(linked, rpc.RpcActor) and linked.handle is engine
    assert await rpc.link(linked) is linked
    assert await calls.call(linked, "version") == await engine.version.remote() == 0

    # A group's results: the same tokens over ZeroMQ as through Ray's streaming call.
    over_ray = [x async for batch in calls.stream(engine, "generate_group", _requests(4, "a"), False, 0.0) for x in batch]
    over_zmq = [x async for batch in calls.stream(linked, "generate_group", _requests(4, "b"), False, 0.0) for x in batch]
    assert sorted(j for j, _ in over_zmq) == [0, 1, 2, 3]
    assert ({j: r.response_ids.tolist() for j, r in over_ray} == {j: r.response_ids.tolist() for j, r in over_zmq})
    stats = await calls.call(linked, "stats")
    assert stats["requests"] == 8  # both calls reached the one engine

    # An error keeps its class and message; an unknown method names itself.
    with pytest.raises(RuntimeError, match="call init_weight_sync first"):
        await calls.call(linked, "receive_weights", version=1)
    with pytest.raises(AttributeError, match="no_such_method"):
        await calls.call(linked, "no_such_method")

    # The actor's process keeps full collections off its event loop, as the Rollouter's does.
    frozen, young = await engine.__ray_call__.remote(lambda self: (gc.get_freeze_count(), gc.get_threshold()[0]))
    assert frozen > 1000 and young == GC_YOUNG_THRESHOLD
    ray.kill(engine)


async def test_calls_start_in_the_order_sent_and_a_stream_ends_with_its_error(ray_cluster):
    actor = ray.remote(num_cpus=0)(Recorder).remote()
    linked = await rpc.link(actor)
    sent = [linked.note.remote(i) for i in range(500)]  # sent at once, none awaited yet
    assert await asyncio.gather(*sent) == list(range(500))
    assert await linked.noted.remote() == list(range(500))
    assert await linked.noted.remote(last=2) == [498, 499]  # keyword arguments travel too

    assert [i async for i in linked.count_to.stream(5)] == [0, 1, 2, 3, 4]
    got = []
    with pytest.raises(ValueError, match="stopped at 3") as err:
        async for ref in linked.count_to.options(num_returns="streaming").remote(10, fail_at=3):  # Ray's form
            got.append(await ref)
    assert got == [0, 1, 2]
    assert isinstance(err.value.__cause__, rpc.RemoteTraceback)  # where it was raised, in the actor
    assert "in count_to" in str(err.value.__cause__) and "ValueError: stopped at 3" in str(err.value.__cause__)
    ray.kill(actor)


async def test_an_actor_of_another_run_is_refused(ray_cluster):
    # An actor of this Ray whose process has another run's key, as a server of another run has.
    other = ray.remote(num_cpus=0)(Recorder).options(runtime_env={"env_vars": {rpc.auth.RUN_KEY_ENV: "0f" * 32}}).remote()
    served = await other.serve_rpc.remote()
    assert served["run"] == rpc.auth.key_id(bytes.fromhex("0f" * 32)) != rpc.auth.key_id(rpc.run_key())
    with pytest.raises(rpc.OtherRunError, match="takes the calls of another run"):
        await rpc.link(other)
    engines = {"other": other}
    assert await rpc.link_each(engines, ["other"], 30.0) == set() and engines["other"] is other  # stays a handle
    # Called anyway, with this run's key: the actor drops the call unread.
    stray = rpc.RpcActor(other, served["endpoint"])
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(stray.note.remote(1), 2.0)
    assert await other.noted.remote() == []
    assert await other.__ray_call__.remote(lambda self: self._rpc_server.rejected) == 1
    ray.kill(other)


async def test_a_dead_actor_fails_its_calls_in_flight_and_later_ones_with_rays_error(ray_cluster):
    engine = remote_engine_actor(num_cpus=0).remote(**{**SIM, "tokens_per_s": 2.0})  # 16 tokens: ~64 s
    linked = await rpc.link(engine)
    stream = calls.stream(linked, "generate_group", _requests(2, "slow"), False, 0.0)
    in_flight = asyncio.ensure_future(stream.__anext__())
    async with asyncio.timeout(60):
        while (await engine.stats.remote())["running"] < 2:  # the call is running in the actor
            await asyncio.sleep(0.05)
    assert not in_flight.done()
    ray.kill(engine)
    with pytest.raises(ray.exceptions.RayActorError) as died:
        await asyncio.wait_for(in_flight, 30)
    assert actor_died(died.value)
    with pytest.raises(ray.exceptions.RayActorError):
        await asyncio.wait_for(calls.call(linked, "version"), 30)


@ray.remote(num_cpus=0)
def _version_from_another_process(linked: rpc.RpcActor) -> tuple[str, int]:
    async def ask():
        return await calls.call(linked, "version")

    return type(linked).__name__, asyncio.run(ask())


async def test_a_link_travels_to_another_process_of_the_node(ray_cluster):
    engine = remote_engine_actor(num_cpus=0).remote(**SIM)
    linked = await rpc.link(engine)
    assert await _version_from_another_process.remote(linked) == ("RpcActor", 0)
    ray.kill(engine)


class _NeverDies:
    """The Ray handle a link watches, for an actor in this process (another node cannot exist here)."""

    class rpc_watch:  # noqa: N801 - the shape of a Ray actor method
        @staticmethod
        def remote(seconds: float):
            return asyncio.sleep(seconds)


async def test_a_caller_of_another_node_gets_a_curve_endpoint_that_admits_only_its_key(monkeypatch):
    # The actor's side of serve_rpc, in this process: its "node" is loopback, the caller's another one.
    monkeypatch.setattr(rpc.auth, "node_ip", lambda: "127.0.0.1")
    actor = Recorder()
    with pytest.raises(ValueError, match="caller_key"):
        await actor.serve_rpc(caller_node="10.255.0.1")
    links = rpc.Links()  # the caller's: its CURVE key pair is the one registered
    public, _ = links.client_keys()
    served = await actor.serve_rpc(caller_node="10.255.0.1", caller_key=public)
    assert served["endpoint"].startswith("tcp://127.0.0.1:") and served["server_key"]
    assert served["endpoint"] != (await actor.serve_rpc())["endpoint"]  # this node's callers: plain loopback
    admitted = rpc.RpcActor(_NeverDies(), served["endpoint"], server_key=served["server_key"], links=links)
    assert await asyncio.wait_for(admitted.note.remote(7), 10) == 7
    assert await rpc.link(admitted, rpc.Links()) is admitted  # a CURVE link keeps the links its key is of

    # Another caller's links, their key never registered through serve_rpc: the handshake fails, no call
    # reaches the actor.
    stranger = rpc.RpcActor(_NeverDies(), served["endpoint"], server_key=served["server_key"], key="x",
                            links=rpc.Links())
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(stranger.note.remote(8), 2)
    assert actor.seen == [7]
    actor.close_rpc()


async def test_an_in_process_object_is_called_as_it_is_and_a_link_stays_on_its_node(ray_cluster, monkeypatch):
    plain = Recorder()
    assert await rpc.link(plain) is plain
    engine = remote_engine_actor(num_cpus=0).remote(**SIM)
    linked = await rpc.link(engine)
    monkeypatch.setattr(rpc.auth, "node_ip", lambda: "10.255.0.1")  # the link handed to a process of another node
    moved = rpc.RpcActor(*linked.__reduce__()[1])
    with pytest.raises(RuntimeError, match="link the Ray handle there"):
        await calls.call(moved, "version")
    ray.kill(engine)


async def test_link_each_links_in_place_and_leaves_a_handle_replaced_meanwhile(ray_cluster):
    cls = remote_engine_actor(num_cpus=0)
    a, b = cls.remote(**SIM), cls.remote(**SIM)
    engines = {"a": a, "b": b, "plain": Recorder()}
    linking = asyncio.ensure_future(rpc.link_each(engines, ["a", "b", "plain"], 30.0))
    await asyncio.sleep(0)  # the links are asked for
    engines["a"] = "restarted"  # replica a started again while its old handle was being linked
    assert await linking == {"b", "plain"}
    assert engines["a"] == "restarted" and isinstance(engines["b"], rpc.RpcActor) and engines["b"].handle is b
    assert isinstance(engines["plain"], Recorder)  # nothing to link: called as it is
    ray.kill(a)
    ray.kill(b)


async def _groups(engine_calls: str) -> dict[str, list]:
    engines = [remote_engine_actor(num_cpus=0).remote(**SIM) for _ in range(2)]
    prompts = [Prompt(text=str(i), prompt_ids=np.arange(2, 6 + i)) for i in range(6)]
    sink = MemorySink()
    cfg = RolloutConfig(n=3, max_tokens=16, groups_per_sync=6, engine_calls=engine_calls)
    r = Rollouter(cfg, engines, sink, prompts, lambda prompt, ids: float(len(ids)))
    await asyncio.wait_for(r.run(num_groups=6), 120)
    assert all(isinstance(r.pool.handle(e), rpc.RpcActor) == (engine_calls == "zmq") for e in range(2))
    for e in engines:
        ray.kill(e)
    return {g.sample_id: [t.response_ids.tolist() for t in sorted(g.trajectories, key=lambda t: t.index)]
            for g in sink.groups if g.complete}


async def test_the_rollouter_gets_the_same_groups_over_zeromq_as_through_ray(ray_cluster):
    over_zmq = await _groups("zmq")
    assert len(over_zmq) == 6 and all(len(v) == 3 for v in over_zmq.values())
    assert over_zmq == await _groups("ray")


def test_engine_calls_is_checked():
    with pytest.raises(ValueError, match="RolloutConfig.engine_calls must be zmq or ray, got 'grpc'"):
        RolloutConfig(engine_calls="grpc")
