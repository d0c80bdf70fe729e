"""The calls' wire (`asyncrl.rpc.wire`, `asyncrl.rpc.auth`): typed msgpack records, no pickle,
the error path, the run's key; and a real ZeroMQ round trip in one process with pickle turned off."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle

import numpy as np
import pytest

from asyncrl import rpc
from asyncrl.rpc import auth, wire
from asyncrl.sync.base import GroupInit, ReceiverInit
from asyncrl.types import GenerateRequest, GenerateResult, SamplingParams


def _request(i: int) -> GenerateRequest:
    return GenerateRequest(f"r{i}", np.arange(3, 9 + i), 16, SamplingParams(seed=i, stop_token_ids=(2, 7)), "s")


def _result(i: int) -> GenerateResult:
    return GenerateResult(f"r{i}", np.arange(i + 1), np.full(i + 1, -0.5, np.float32), np.zeros(i + 1, np.int64),
                          "stop", np.int64(3))


def test_a_call_of_the_engines_round_trips_with_its_types():
    requests = [_request(i) for i in range(3)]
    call_id, key, method, args, kwargs, streaming = wire.decode(
        wire.call(7, 2, "generate_group", (requests, True, 0.02), {"opt": {1: {"a", "b"}}}, True))
    assert (call_id, key, method, streaming, kwargs) == (7, 2, "generate_group", True, {"opt": {1: {"a", "b"}}})
    got, truncatable, batch_s = args
    assert truncatable is True and batch_s == 0.02
    for sent, came in zip(requests, got, strict=True):
        assert type(came) is GenerateRequest and type(came.sampling) is SamplingParams
        assert came.sampling == sent.sampling and came.sampling.stop_token_ids == (2, 7)  # a tuple stays one
        assert came.prompt_ids.dtype == np.int64 and came.prompt_ids.tolist() == sent.prompt_ids.tolist()
        assert came.prompt_ids.flags.writeable  # (as the caller's own arrays are)


def test_a_reply_keeps_tuples_arrays_scalars_and_records():
    value = [(i, _result(i)) for i in range(3)] + [(3, np.zeros((2, 3), np.float32)), (4, np.bool_(True))]
    call_id, kind, got = wire.decode(wire.reply(5, wire.ITEM, value))
    assert (call_id, kind) == (5, wire.ITEM)
    assert [type(x) for x in got] == [tuple] * 5
    for (i, sent), (j, came) in zip(value[:3], got[:3]):
        assert i == j and type(came) is GenerateResult and came.request_id == sent.request_id
        assert came.logprobs.dtype == np.float32 and came.logprobs.tolist() == sent.logprobs.tolist()
        assert type(came.prefill_tokens) is np.int64 and came.prefill_tokens == 3
    assert got[3][1].shape == (2, 3) and got[3][1].dtype == np.float32
    assert type(got[4][1]) is np.bool_ and bool(got[4][1])
    init = ReceiverInit(group=GroupInit(), rank_offset=3, options={"packed": True})
    assert wire.decode(wire.reply(1, wire.RETURN, init))[2] == init


def test_an_error_keeps_its_class_message_attributes_and_remote_traceback():
    def deep():
        raise KeyError("no such key: 'w'")

    try:
        deep()
    except KeyError as exc:
        sent = exc
    sent.note = "kept"
    _, kind, came = wire.decode(wire.reply(1, wire.ERROR, sent))
    assert kind == wire.ERROR and type(came) is KeyError and came.args == ("no such key: 'w'",)
    assert came.note == "kept"
    assert isinstance(came.__cause__, wire.RemoteTraceback)
    text = str(came.__cause__)
    assert "in deep" in text and "KeyError" in text and text.count("Traceback") == 1

    # A class this process cannot name comes back as a RemoteError that names it.
    payload = wire.reply(1, wire.ERROR, ValueError("boom")).replace(b"builtins:ValueError", b"elsewhere:OddThings")
    came = wire.decode(payload)[2]
    assert type(came) is wire.RemoteError and came.remote_type == "elsewhere.OddThings" and "boom" in str(came)

    # Args that do not travel: the message does.
    came = wire.decode(wire.reply(1, wire.ERROR, RuntimeError(object(), "x")))[2]
    assert type(came) is RuntimeError and "object object at" in came.args[0]


def test_what_does_not_travel_is_refused_at_the_sender_by_its_type():
    with pytest.raises(wire.WireError, match="builtins:object does not travel"):
        wire.call(1, None, "note", (object(),), {}, False)
    with pytest.raises(wire.WireError, match="dtype object does not travel"):
        wire.call(1, None, "note", (np.array([None]),), {}, False)
    # A result that does not travel is answered as that error (the caller does not wait for its deadline).
    came = wire.decode(wire.reply(4, wire.RETURN, {"x": lambda: 0}))
    assert came[:2] == [4, wire.ERROR] and type(came[2]) is wire.WireError and "function" in str(came[2])


def test_no_pickle_reaches_the_decoder():
    evil = pickle.dumps((None, "note", (), {}, False))
    with pytest.raises(Exception):  # noqa: B017 - msgpack's own error: the bytes are not a message
        wire.decode(evil)
    with pytest.raises(wire.WireError, match="unknown record"):
        wire.decode(b"\x93\x01\x01\xd4\x63\x00")  # [1, 1, ext 99]


def test_macs_are_per_run_and_per_direction(monkeypatch):
    key, other = b"a" * 32, b"b" * 32
    tag = auth.mac(key, b"payload", auth.CALL)
    assert auth.authentic(key, tag, b"payload", auth.CALL)
    assert not auth.authentic(other, tag, b"payload", auth.CALL)  # another run's key
    assert not auth.authentic(key, tag, b"payload", auth.REPLY)  # a call's MAC is no reply's
    assert auth.key_id(key) != auth.key_id(other) and key.hex() not in auth.key_id(key)

    monkeypatch.setenv(auth.RUN_KEY_ENV, "ab" * 32)
    assert auth.run_key() == bytes.fromhex("ab" * 32) and auth.run_env() == {auth.RUN_KEY_ENV: "ab" * 32}
    monkeypatch.setenv(auth.RUN_KEY_ENV, "zz")
    with pytest.raises(ValueError, match="ASYNCRL_RUN_KEY must be 64 hex digits"):
        auth.run_key()
    monkeypatch.delenv(auth.RUN_KEY_ENV)
    made = auth.run_key()  # a process without one makes it, for what it starts afterwards
    assert len(made) == 32 and auth.run_key() == made
    assert auth.new_run_key() != made


class _NeverDies:
    class rpc_watch:  # (the shape of a Ray actor method)
        @staticmethod
        def remote(seconds: float):
            return asyncio.sleep(seconds)


class Echo(rpc.Serving):
    def generate(self, request: GenerateRequest) -> GenerateResult:
        return GenerateResult(request.request_id, request.prompt_ids[::-1].copy(), np.zeros(len(request.prompt_ids),
                              np.float32), np.ones(len(request.prompt_ids), np.int64), "length")

    async def fail(self, message: str):
        raise LookupError(message)

    def opaque(self):
        return object()


async def test_calls_over_real_sockets_need_no_pickle(monkeypatch):
    monkeypatch.setattr(auth, "node_ip", lambda: "127.0.0.1")

    def no_pickle(*_, **__):
        raise AssertionError("pickle on the calls' wire")

    echo = Echo()
    served = await echo.serve_rpc()
    monkeypatch.setattr(pickle, "dumps", no_pickle)
    monkeypatch.setattr(pickle, "loads", no_pickle)
    peer = rpc.RpcActor(_NeverDies(), served["endpoint"])
    got = await asyncio.wait_for(peer.generate.remote(_request(2)), 10)
    assert dataclasses.astuple(got)[0] == "r2" and got.response_ids.tolist() == list(range(10, 2, -1))
    with pytest.raises(LookupError, match="gone") as err:
        await asyncio.wait_for(peer.fail.remote("gone"), 10)
    assert "in fail" in str(err.value.__cause__)
    with pytest.raises(wire.WireError, match="builtins:object does not travel"):
        await asyncio.wait_for(peer.opaque.remote(), 10)
    with pytest.raises(wire.WireError, match="builtins:object does not travel"):
        await peer.generate.remote(object())  # refused here: nothing sent
    assert echo._rpc_server.rejected == 0 and echo._rpc_server.malformed == 0
    echo.close_rpc()


async def test_links_are_owned_by_their_caller_and_the_modules_keep_none(monkeypatch):
    from asyncrl.rpc import client, server

    monkeypatch.setattr(auth, "node_ip", lambda: "127.0.0.1")
    echo = Echo()
    served = await echo.serve_rpc()
    mine, theirs, handle = rpc.Links(), rpc.Links(), _NeverDies()
    a = rpc.RpcActor(handle, served["endpoint"], links=mine)
    b = await rpc.link(rpc.RpcActor(handle, served["endpoint"]), mine)  # made elsewhere (unpickled): moved onto mine
    c = rpc.RpcActor(handle, served["endpoint"], links=theirs)
    for actor in (a, b, c):
        assert (await asyncio.wait_for(actor.generate.remote(_request(3)), 10)).request_id == "r3"
    assert b.links is mine and mine.to(a) is mine.to(b)  # one socket per caller and actor
    assert theirs.to(c) is not mine.to(a) and mine.client_keys() != theirs.client_keys()
    mine.close()
    theirs.close()
    echo.close_rpc()
    # No registry at module level: what the modules hold at the top is code and constants, not state.
    for module in (client, auth, server):
        state = [name for name, value in vars(module).items()
                 if isinstance(value, (dict, list, set)) and not name.startswith("__")]
        assert state == [], f"{module.__name__} keeps {state} at module level"
    assert not hasattr(client, "_links") and not hasattr(auth, "_client_keys")  # (the two there were)


async def test_the_owners_of_links_close_their_sockets_when_they_close(monkeypatch):
    """The Rollouter's pool (at its stop), the aggregator and the weight-sync coordinator (at the run's
    shutdown) each own a `Links`: their close closes its real ZeroMQ sockets and ends its liveness watches."""
    from asyncrl.rollouter.aggregator import AggregatorActor
    from asyncrl.rollouter.pool import EnginePool
    from asyncrl.sync.coordinator import WeightSyncCoordinator, engine_name

    monkeypatch.setattr(auth, "node_ip", lambda: "127.0.0.1")
    echo = Echo()
    served = await echo.serve_rpc()

    def replica():  # as a process of the node gets it (unpickled): linked onto its caller's links
        return rpc.RpcActor(_NeverDies(), served["endpoint"])

    pool = EnginePool([replica()], timeout_s=10.0)
    aggregator = AggregatorActor([replica()], None)
    coordinator = WeightSyncCoordinator([object()], [replica()])
    await aggregator._link()
    await coordinator._link()
    linked = {pool: await pool.engine(0), aggregator: aggregator.engines[0],
              coordinator: coordinator.engines[engine_name(0)]}
    opened = {}
    for owner, engine in linked.items():
        assert engine.links is owner._links
        assert (await asyncio.wait_for(engine.generate.remote(_request(1)), 10)).request_id == "r1"
        opened[owner] = list(owner._links._links.values())
        assert len(opened[owner]) == 1 and not opened[owner][0]._pump.sock.closed
    pool.close()
    await aggregator.close()
    coordinator.close()
    await asyncio.sleep(0)  # (the watches' cancellation lands)
    for owner, links in opened.items():
        assert [link._pump.sock.closed for link in links] == [True], type(owner).__name__
        assert [link._watcher.cancelled() for link in links] == [True], type(owner).__name__
        assert owner._links._links == {}
    echo.close_rpc()
