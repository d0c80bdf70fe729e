"""Codec round trips (every dtype, 0-d, empty, non-contiguous, large), zero-copy, and malformed input."""

from __future__ import annotations

import datetime
import random

import msgpack
import numpy as np
import pytest
import torch

from asyncrl.queue import CodecError, pack, unpack
from asyncrl.queue.codec import CODEC_VERSION
from asyncrl.types import Group, Trajectory

pytestmark = pytest.mark.usefixtures("codec_path")  # each test runs on both codec paths

NP_DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
             np.float16, np.float32, np.float64, np.complex64, np.complex128]
TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64]
SHAPES = [(), (0,), (3, 0, 2), (7,), (3, 5)]
OWN = [1, 1 << 30]  # every array in its own frame / every array in the pool


def _np_array(dtype, shape, rng):
    return (rng.standard_normal(shape) * 100).astype(dtype) if shape else np.asarray(rng.integers(0, 100)).astype(dtype)


def _as_bytearrays(frames):
    # What a receiver holds: plain writable buffers, independent of the sender's arrays.
    return [bytearray(memoryview(f).cast("B")) for f in frames]


@pytest.mark.parametrize("own", OWN)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", NP_DTYPES)
def test_numpy_round_trip(dtype, shape, own):
    arr = _np_array(dtype, shape, np.random.default_rng(0))
    out = unpack(_as_bytearrays(pack({"a": arr}, own_frame_bytes=own)))["a"]
    assert out.dtype == arr.dtype and out.shape == arr.shape
    assert np.array_equal(out, arr)


@pytest.mark.parametrize("own", OWN)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_round_trip(dtype, shape, own):
    t = (torch.randn(shape) * 100).to(dtype)
    out = unpack(_as_bytearrays(pack([t], own_frame_bytes=own)))[0]
    assert isinstance(out, torch.Tensor)
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out, t)


@pytest.mark.parametrize("own", OWN)
def test_non_contiguous_is_made_contiguous(own):
    base = np.arange(60, dtype=np.int32).reshape(6, 10)
    views = {"t": base.T, "step": base[::2, 1::3], "neg": base[::-1], "bf": torch.arange(60.0).reshape(6, 10).to(torch.bfloat16).t()[::2]}
    out = unpack(pack(views, own_frame_bytes=own))
    for k, v in views.items():
        assert out[k].shape == v.shape
        assert (torch.equal(out[k], v) if isinstance(v, torch.Tensor) else np.array_equal(out[k], v))


@pytest.mark.parametrize("own", OWN)
def test_decoding_is_zero_copy(own):
    arr = np.arange(1000, dtype=np.int64)
    t = torch.arange(100, dtype=torch.bfloat16)
    frames = _as_bytearrays(pack({"arr": arr, "t": t}, own_frame_bytes=own))
    out = unpack(frames)
    # Writing the received frames is seen through the decoded arrays: they are views, not copies.
    for f in frames[1:]:
        f[:] = bytes(len(f))
    assert not out["arr"].any()
    assert not out["t"].any()


def test_big_arrays_travel_as_their_own_frames_and_small_ones_share_the_pool():
    big, small = np.ones(100_000, np.float32), np.ones(10, np.float32)
    frames = pack([big, small, big.copy()])
    assert len(frames) == 4  # header, pool, two own frames
    assert memoryview(frames[1]).nbytes == 48  # 40 bytes, 16-aligned
    assert memoryview(frames[2]).nbytes == big.nbytes
    assert np.shares_memory(frames[2], big)  # sent without a copy


def test_large_array_64mb():
    arr = np.random.default_rng(1).random(16 * 1024 * 1024, dtype=np.float32)  # 64 MiB
    frames = pack({"x": arr})
    assert sum(memoryview(getattr(f, "buffer", f)).nbytes for f in frames) >= 64 * 1024 * 1024
    out = unpack(frames)["x"]
    assert out.dtype == np.float32 and np.array_equal(out, arr)
    bf = torch.from_numpy(arr).to(torch.bfloat16)  # 32 MiB of bfloat16
    assert torch.equal(unpack(pack(bf)), bf)


def _traj(sid: str, k: int, n_prompt: int, n_resp: int, reward: float = 0.5) -> Trajectory:
    rng = np.random.default_rng(k)
    return Trajectory(
        sample_id=sid, index=k, prompt_ids=rng.integers(0, 50_000, n_prompt), response_ids=rng.integers(0, 50_000, n_resp),
        logprobs=-rng.random(n_resp, dtype=np.float32), versions=np.full(n_resp, 3), finish_reason="length" if k else "stop",
        reward=reward, age=k % 2,
    )


@pytest.mark.parametrize("n_resp", [0, 1, 1000, 9000])
def test_group_round_trip(n_resp):
    g = Group("sample_2_17", [_traj("sample_2_17", k, 11 + k, n_resp + k) for k in range(4)], expected=4,
              meta={"prompt": "2+2=?", "answer": 4, "tags": ["math", None, 1.5], "nested": {"ok": True}})
    out = unpack(pack(g))
    assert isinstance(out, Group) and out == g
    for a, b in zip(out.trajectories, g.trajectories):
        assert a.response_ids.dtype == np.int64 and a.logprobs.dtype == np.float32 and a.versions.dtype == np.int64
        assert np.array_equal(a.response_ids, b.response_ids)


def test_failed_and_empty_groups_and_single_trajectory_round_trip():
    failed = Group("sample_0_3", [_traj("sample_0_3", 0, 4, 2)], expected=8, status="failed", error="engine died")
    assert unpack(pack(failed)) == failed
    empty = Group("sample_0_4", [], expected=2, status="failed", error="timeout")
    assert unpack(pack(empty)) == empty
    t = _traj("sample_5_9", 1, 3, 7, reward=np.float32(0.25))
    out = unpack(pack(t))
    assert out == t and isinstance(out, Trajectory)


def _forge_group(g, mutate):
    """``pack(g)`` with its group record's 15 fields passed through ``mutate``."""
    header, *data = pack(g)
    version, n, pool_nbytes, body = msgpack.unpackb(header, raw=False)
    ext = msgpack.unpackb(body, raw=False)
    fields = msgpack.unpackb(ext.data, raw=False)
    mutate(fields)
    body = msgpack.packb(msgpack.ExtType(ext.code, msgpack.packb(fields, use_bin_type=True)), use_bin_type=True)
    return [msgpack.packb([version, n, pool_nbytes, body], use_bin_type=True), *data]


@pytest.mark.parametrize("mutate, message", [
    (lambda f: f[11].__setitem__(0, "<f8"), "int64, int64, float32, int64"),  # prompt_ids sent as float64
    (lambda f: f[13].__setitem__(0, "<i4"), "int64, int64, float32, int64"),  # logprobs sent as int32
    (lambda f: f[6].__setitem__(1, "exploded"), "finish_reason 'exploded'"),
    (lambda f: f[10].__setitem__(0, f[10][0] + 1), "lengths do not add up"),  # one response token too many
    (lambda f: f[12].__setitem__(3, 10**9), "needs bytes"),  # response_ids column beyond the pool
    (lambda f: f[12].__setitem__(3, -8), "offset -8 is invalid"),
    (lambda f: f[14].__setitem__(2, 7), "refers to frame 7"),
])
def test_forged_group_records_raise_codec_error(mutate, message):
    g = Group("sample_1_2", [_traj("sample_1_2", k, 5, 9) for k in range(3)], expected=3)
    assert unpack(_forge_group(g, lambda f: None)) == g  # the forging itself changes nothing
    with pytest.raises(CodecError, match=message):
        unpack(_forge_group(g, mutate))


def _agent_group(sid: str = "sample_3_5") -> Group:
    """Multi-turn responses: masked with several turns, plain, turns without a mask, empty and masked."""
    ts = [_traj(sid, k, 4, n) for k, n in enumerate((7, 3, 2, 0))]
    ts[0].loss_mask, ts[0].turns, ts[0].finish_reason = np.array([1, 1, 0, 0, 0, 1, 1], np.uint8), 2, "max_turns"
    ts[0].versions[2:5] = -1
    ts[2].turns, ts[2].finish_reason = 3, "context"
    ts[3].loss_mask, ts[3].turns = np.zeros(0, np.uint8), 0
    return Group(sid, ts, expected=4)


def test_group_with_turns_and_masks_round_trips_bit_for_bit():
    g = _agent_group()
    frames = _as_bytearrays(pack(g))
    out = unpack(frames)
    assert out == g
    masks = [t.loss_mask for t in out.trajectories]
    assert masks[1] is None and [t.turns for t in out.trajectories] == [2, 1, 3, 0]
    assert masks[0].dtype == np.uint8 and masks[0].tobytes() == g.trajectories[0].loss_mask.tobytes()
    assert np.shares_memory(masks[0], np.frombuffer(frames[1], np.uint8))  # a view on the pool, as the others
    assert unpack(pack(g.trajectories[0])) == g.trajectories[0]  # a lone Trajectory carries them too


def test_plain_records_keep_their_old_size_and_old_records_still_decode():
    g = Group("sample_1_2", [_traj("sample_1_2", k, 5, 9) for k in range(3)], expected=3)
    fields = []
    _forge_group(g, fields.extend)
    assert len(fields) == 15  # no turns, no masks: the record of before they existed
    t = _traj("sample_1_2", 0, 5, 9)
    ext = msgpack.unpackb(msgpack.unpackb(pack(t)[0], raw=False)[3], raw=False)
    assert len(msgpack.unpackb(ext.data, raw=False)) == 9
    out = unpack(pack(t))
    assert out.loss_mask is None and out.turns == 1


@pytest.mark.parametrize("mutate, message", [
    (lambda f: f[15].__setitem__(1, -2), "turns must be an int >= 0"),
    (lambda f: f[16].__setitem__(0, 1), "masked flag must be a bool"),
    (lambda f: f.__setitem__(17, None), "has a loss mask but the message has no mask column"),
    (lambda f: f[17].__setitem__(0, "|i1"), "mask column must be 1-d uint8"),
    (lambda f: f.__setitem__(16, [True]), "turns and masked must be lists"),
])
def test_forged_turns_and_masks_raise_codec_error(mutate, message):
    g = _agent_group()
    assert unpack(_forge_group(g, lambda f: None)) == g
    with pytest.raises(CodecError, match=message):
        unpack(_forge_group(g, mutate))


def test_decoded_group_records_are_typed_trajectories_viewing_the_pool():
    g = Group("sample_1_3", [_traj("sample_1_3", k, 5, 9) for k in range(2)], expected=2)
    frames = _as_bytearrays(pack(g))
    out = unpack(frames)
    assert out == g
    frames[1][:] = bytes(len(frames[1]))  # zero-copy: the records see the pool frame change
    assert all(not t.response_ids.any() and not t.prompt_ids.any() for t in out.trajectories)
    out = unpack(pack(g))
    for t in out.trajectories:
        assert type(t) is Trajectory and t.valid and t.sample_id == "sample_1_3"
        assert [a.dtype for a in (t.prompt_ids, t.response_ids, t.logprobs, t.versions)] == [np.int64, np.int64, np.float32, np.int64]
        assert [a.ndim for a in (t.prompt_ids, t.response_ids, t.logprobs, t.versions)] == [1, 1, 1, 1]


def test_plain_values_round_trip():
    value = {"a": [1, -2, 2**63 - 1, -(2**63)], "b": {"c": None, "d": [True, False, 1.25, "é"]}, 7: b"\x00\xff",
             "np": [np.int32(5), np.float16(0.5), np.bool_(True)]}
    out = unpack(pack(value))
    assert out == {**value, "np": [5, 0.5, True]}
    assert [type(x) for x in out["np"]] == [np.int32, np.float16, np.bool_]
    assert unpack(pack((1, (2, 3)))) == [1, [2, 3]]  # tuples come back as lists


@pytest.mark.parametrize(
    "value, name",
    [(object(), "object"), ({1, 2}, "set"), (datetime.datetime(2026, 1, 1), "datetime"), (2**64, "int"),
     (np.array(["a", "b"]), "<U1"), (np.array([object()]), "object"), (torch.zeros(3).to_sparse(), "sparse")],
)
def test_unsupported_value_raises_naming_the_type(value, name):
    with pytest.raises(CodecError, match=name):
        pack({"ok": 1, "bad": [value]})


# ------------------------------------------------------------------------- malformed input


def _frames():
    return _as_bytearrays(pack({"big": np.arange(50_000), "small": np.arange(5, dtype=np.int16), "t": torch.ones(3)}))


def _reheader(frames, mutate):
    header = msgpack.unpackb(bytes(frames[0]))
    mutate(header)
    return [msgpack.packb(header), *frames[1:]]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda f: [b"\xc1garbage", *f[1:]], "not valid msgpack"),
        (lambda f: [msgpack.packb({"a": 1}), *f[1:]], "header is not \\[version"),
        (lambda f: [msgpack.packb(["v9", 1]), *f[1:]], "codec version 'v9'"),
        (lambda f: f[:-1], "announces 2 data frames but 1 arrived"),
        (lambda f: [*f, b"extra"], "announces 2 data frames but 3 arrived"),
        (lambda f: [f[0], f[1], f[2][:-8]], "needs 400000"),
        (lambda f: [f[0], f[1][:-16], f[2]], "pool frame has"),
        (lambda f: _reheader(f, lambda h: h.__setitem__(0, CODEC_VERSION + 1)), "codec version 2"),
        (lambda f: _reheader(f, lambda h: h.__setitem__(3, b"\x81\xa1a\xc7\x01\x09x")), "unknown extension code 9"),
        (lambda f: [], "expected \\[header, pool"),
        (lambda f: "not frames", "expected \\[header, pool"),
    ],
)
def test_malformed_frames_raise_codec_error(make, message):
    with pytest.raises(CodecError, match=message):
        unpack(make(_frames()))


def test_frame_over_max_raises():
    frames = _frames()
    with pytest.raises(CodecError, match="over max_frame_bytes=1024"):
        unpack(frames, max_frame_bytes=1024)
    assert unpack(frames, max_frame_bytes=400_000)["big"][-1] == 49_999


def _record(dtype, shape, index, offset):
    return msgpack.ExtType(1, msgpack.packb([dtype, shape, index, offset]))


@pytest.mark.parametrize(
    "record, frames, message",
    [
        (_record("|O", [1], 2, 0), [b"", b"\x00" * 8], "unsupported numpy dtype"),
        (_record("<i8", [2], 2, 0), [b"", b"\x00" * 8], "needs 16"),
        (_record("<i8", [2], 1, 8), [b"\x00" * 16, ], "pool frame has 16"),
        (_record("<i8", [-1], 1, 0), [b"\x00" * 16], "non-negative"),
        (_record("<i8", [1], 5, 0), [b"\x00" * 16], "refers to frame 5"),
        (msgpack.ExtType(2, msgpack.packb(["float128", [1], 1, 0])), [b"\x00" * 16], "unsupported torch dtype"),
        ([_record("<i8", [1], 2, 0), _record("<i8", [1], 2, 0)], [b"", b"\x00" * 8], "second time"),
        (msgpack.ExtType(5, msgpack.packb(["sample_0_1", 1, "ok", None, {}, [0], ["stop"], [0.0], [0], [1], [2],
                                           ["<i8", [1], 1, 0], ["<i8", [1], 1, 0], ["<f4", [1], 1, 0], ["<i8", [1], 1, 0]])),
         [b"\x00" * 16], "lengths do not add up"),
        (msgpack.ExtType(5, msgpack.packb(["sample_0_1", 1, "ok", None, {}, [0], ["stop"], [0.0], [0], [1], [1],
                                           ["<i8", [1], 1, 0], ["<i8", [1], 1, 0], ["<f4", [1], 1, 0], "nope"])),
         [b"\x00" * 16], "column record is not"),
    ],
)
def test_forged_headers_raise_codec_error(record, frames, message):
    body = msgpack.packb(record)
    header = msgpack.packb([CODEC_VERSION, len(frames), len(frames[0]), body])
    with pytest.raises(CodecError, match=message):
        unpack([header, *frames])


def test_random_corruption_never_escapes_as_another_error():
    # Flipping bytes of a header either still decodes (to arrays whose lengths were checked)
    # or raises CodecError; nothing else, no crash, no hang.
    g = Group("sample_0_1", [_traj("sample_0_1", k, 5, 20) for k in range(3)], expected=3, meta={"x": [1, 2]})
    frames = _as_bytearrays(pack(g))
    rng = random.Random(0)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(500):
        header = bytearray(frames[0])
        for _ in range(rng.randint(1, 4)):
            header[rng.randrange(len(header))] = rng.randrange(256)
        try:
            unpack([bytes(header), *frames[1:]])
            outcomes["ok"] += 1
        except CodecError:
            outcomes["error"] += 1
    assert outcomes["error"] > 0 and sum(outcomes.values()) == 500


def test_pool_buffers_hand_out_a_buffer_again_only_once_it_is_let_go():
    from asyncrl.queue.codec import PoolBuffers

    buffers = PoolBuffers(keep=2)
    a, b = buffers.take(100), buffers.take(100)
    assert not np.shares_memory(a, b)
    c = buffers.take(100)  # both kept ones in use: a fresh one, not kept
    assert not np.shares_memory(c, a) and not np.shares_memory(c, b)
    del a
    d = buffers.take(64)  # a's buffer is free again
    assert np.shares_memory(d, buffers._buffers[0]) and d.nbytes == 64 and d.flags.writeable
    del b
    e = buffers.take(1000)  # b's buffer is free but too small: replaced by a bigger one
    assert e.nbytes == 1000 and np.shares_memory(e, buffers._buffers[1]) and len(buffers._buffers) == 2
