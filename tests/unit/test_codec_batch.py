"""The sample stream's group-batch codec: prepare_group / pack_groups / unpack_groups.

Round trips (many groups, empty responses, failed groups, numpy scalars, strided arrays),
zero-copy decoding, the pool frame's layout, what prepare_group refuses, and malformed input:
every malformed batch must raise CodecError, never another exception or a wrong group.
"""

from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

from asyncrl.queue.codec import CODEC_VERSION, CodecError, pack
from asyncrl.queue.group_codec import pack_groups, prepare_group, unpack_groups
from asyncrl.types import Group, Trajectory

pytestmark = pytest.mark.usefixtures("codec_path")  # each test runs on both codec paths

DTYPES = (np.int64, np.int64, np.float32, np.int64)  # prompt_ids, response_ids, logprobs, versions
TOKEN_FIELDS = ("prompt_ids", "response_ids", "logprobs", "versions")


def traj(sid: str, k: int, plen: int, rlen: int, *, seed: int = 0, finish: str = "stop") -> Trajectory:
    rng = np.random.default_rng(seed)
    return Trajectory(
        sid, k, rng.integers(0, 50_000, plen), rng.integers(0, 50_000, rlen),
        rng.standard_normal(rlen).astype(np.float32), np.full(rlen, 3 + k), finish, reward=0.5 * k, age=k % 2,
    )


def group(i: int, n: int = 2, plen: int = 5, rlen: int = 7) -> Group:
    sid = f"sample_0_{i}"
    return Group(sid, [traj(sid, k, plen, rlen + k, seed=100 * i + k) for k in range(n)], expected=n, meta={"i": i})


def failed(i: int) -> Group:
    return Group(f"sample_0_{i}", [], expected=4, status="failed", error="engine died", meta={"i": i})


def round_trip(groups: list[Group], *, as_bytes: bool = True) -> tuple[list[Group], list]:
    frames = pack_groups([prepare_group(g) for g in groups])
    if as_bytes:  # what a receiver holds: buffers independent of the sender's arrays
        frames = [bytes(memoryview(f).cast("B")) for f in frames]
    return unpack_groups(frames), frames


def assert_views_on(groups: list[Group], pool) -> None:
    pool_arr = np.frombuffer(pool, np.uint8)
    for g in groups:
        for t in g.trajectories:
            for name, dt in zip(TOKEN_FIELDS, DTYPES):
                a = getattr(t, name)
                assert a.dtype == dt and a.ndim == 1, (name, a.dtype)
                if len(a):
                    assert np.shares_memory(a, pool_arr), f"{g.sample_id}[{t.index}].{name} is a copy"


# ----------------------------------------------------------------------------- round trips


def test_one_group_round_trips_as_views_on_the_pool():
    g = group(0)
    out, frames = round_trip([g])
    assert out == [g]
    assert_views_on(out, frames[1])


def test_many_groups_of_varied_sizes_round_trip():
    groups = [group(i, n=1 + i % 4, plen=1 + 3 * i, rlen=2 * i) for i in range(20)]
    # One response with no response tokens, one with no prompt tokens.
    empty_resp, empty_prompt = traj("sample_0_20", 0, 4, 0), traj("sample_0_20", 1, 0, 6)
    assert len(empty_resp.response_ids) == 0 and len(empty_prompt.prompt_ids) == 0
    groups.append(Group("sample_0_20", [empty_resp, empty_prompt], expected=2))
    out, frames = round_trip(groups)
    assert [g.sample_id for g in out] == [g.sample_id for g in groups]
    assert out == groups
    assert_views_on(out, frames[1])
    assert len(out[-1].trajectories[0].response_ids) == 0 and len(out[-1].trajectories[1].prompt_ids) == 0


def test_a_failed_group_without_trajectories_in_the_middle_of_a_batch():
    groups = [group(0), group(1, n=3), failed(2), group(3)]
    out, frames = round_trip(groups)
    assert out == groups
    assert out[2].status == "failed" and out[2].error == "engine died" and out[2].trajectories == []
    assert out[2].expected == 4
    assert_views_on(out, frames[1])


def test_a_batch_of_failed_groups_only_has_an_empty_pool():
    groups = [failed(0), failed(1)]
    out, frames = round_trip(groups)
    assert out == groups and len(frames[1]) == 0


def agent_group(i: int) -> Group:
    """A multi-turn group: masked responses with several turns, a plain one, an empty masked one."""
    g = group(i, n=4, rlen=6)
    ts = g.trajectories
    ts[0].loss_mask, ts[0].turns, ts[0].finish_reason = np.array([1, 1, 0, 0, 1, 1], np.uint8), 2, "max_turns"
    ts[2].loss_mask, ts[2].turns, ts[2].finish_reason = (np.arange(8) % 2).astype(np.uint8), 4, "context"
    ts[3].turns = 0
    ts[3].response_ids, ts[3].logprobs, ts[3].versions = ts[3].response_ids[:0], ts[3].logprobs[:0], ts[3].versions[:0]
    ts[3].loss_mask = np.zeros(0, np.uint8)
    return g


def test_groups_with_turns_and_masks_round_trip_bit_for_bit_among_plain_ones():
    groups = [group(0), agent_group(1), failed(2), group(3, n=3), agent_group(4)]
    out, frames = round_trip(groups)
    assert out == groups
    assert_views_on(out, frames[1])
    pool = np.frombuffer(frames[1], np.uint8)
    for got, sent in zip(out, groups):
        for a, b in zip(got.trajectories, sent.trajectories):
            assert a.turns == b.turns and (a.loss_mask is None) == (b.loss_mask is None)
            if a.loss_mask is not None:
                assert a.loss_mask.dtype == np.uint8 and a.loss_mask.tobytes() == b.loss_mask.tobytes()
                assert np.shares_memory(a.loss_mask, pool) or len(a.loss_mask) == 0  # zero-copy
    assert [t.loss_mask is None for t in out[1].trajectories] == [False, True, False, False]
    assert len(_header(frames)[3]) == 5  # the mask column


def test_a_batch_without_masks_has_the_wire_of_before():
    groups = [group(0), group(1, n=3)]
    _, frames = round_trip(groups)
    header = _header(frames)
    assert len(header[3]) == 4 and all(len(msgpack.unpackb(r, raw=False)) == 11 for r in header[4])
    out = unpack_groups(frames)
    assert all(t.loss_mask is None and t.turns == 1 for g in out for t in g.trajectories)
    masked = [group(0), agent_group(1)]
    _, with_masks = round_trip(masked)
    # the mask column costs one byte per response token of the batch (plus alignment), no more
    response_tokens = sum(len(t.response_ids) for g in masked for t in g.trajectories)
    _, without = round_trip([group(0), group(1, n=4, rlen=6)])
    assert len(with_masks[1]) - len(without[1]) <= response_tokens + 16


def test_numpy_scalars_in_reward_and_meta_come_back_as_python_numbers():
    g = group(0, n=2)
    g.trajectories[0].reward = np.float32(0.25)
    g.trajectories[1].age = np.int64(3)
    g.meta = {"step": np.int64(7), "ok": np.bool_(True),
              "nested": {"a": [1, 2.5, None, True, "x", {"b": np.float32(-1.5)}], "empty": {}}, "text": "héllo"}
    (out,), _ = round_trip([g])
    assert out == g
    t0, t1 = out.trajectories
    assert type(t0.reward) is float and t0.reward == 0.25
    assert type(t1.age) is int and t1.age == 3
    assert type(out.meta["step"]) is int and out.meta["step"] == 7
    assert out.meta["ok"] is True
    b = out.meta["nested"]["a"][5]["b"]
    assert type(b) is float and b == -1.5
    assert out.meta["nested"]["a"][:5] == [1, 2.5, None, True, "x"] and out.meta["text"] == "héllo"


def test_non_contiguous_token_arrays_are_gathered():
    base = np.arange(40, dtype=np.int64)
    lp = np.linspace(-1, 0, 24, dtype=np.float32)
    t = Trajectory("sample_0_1", 0, base[::2], base[1::3][:8], lp[::3], base[::-5][:8], "length")
    # Trajectory keeps arrays of the right dtype as given: these really are strided views.
    assert not (t.prompt_ids.flags.c_contiguous or t.response_ids.flags.c_contiguous or t.logprobs.flags.c_contiguous)
    g = Group("sample_0_1", [t, traj("sample_0_1", 1, 3, 8)], expected=2)
    out, frames = round_trip([group(0), g])
    assert out == [group(0), g]
    got = out[1].trajectories[0]
    assert np.array_equal(got.prompt_ids, base[::2]) and np.array_equal(got.versions, base[::-5][:8])
    assert_views_on(out, frames[1])


def test_decoding_the_sender_frames_shares_the_pool_array():
    groups = [group(0), group(1)]
    frames = pack_groups([prepare_group(g) for g in groups])
    out = unpack_groups(frames)
    assert out == groups
    arr = out[1].trajectories[1].response_ids
    assert np.shares_memory(arr, np.frombuffer(frames[1], np.uint8))


# ----------------------------------------------------------------------------- the pool frame


def test_each_batch_gets_its_own_immutable_pool():
    first = [group(0), group(1)]
    second = [group(2), group(3)]  # same sizes
    f1 = pack_groups([prepare_group(g) for g in first])
    f2 = pack_groups([prepare_group(g) for g in second])
    assert type(f1[1]) is bytes and f1[1] is not f2[1]
    out1 = unpack_groups(f1)
    assert unpack_groups(f2) == second and out1 == first  # packing the second left the first as it was
    assert not out1[0].trajectories[0].response_ids.flags.writeable  # views on immutable bytes


def test_the_pool_holds_each_column_aligned_and_padded_with_zeros():
    g = group(0, n=1, plen=3, rlen=5)  # 24 prompt bytes, 40 response bytes, 20 logprob bytes
    header, pool = pack_groups([prepare_group(g)])
    columns = msgpack.unpackb(header, raw=False)[3]
    assert [c[2] for c in columns] == [0, 32, 80, 112] and len(pool) == 160
    t = g.trajectories[0]
    assert pool[24:32] == bytes(8) and pool[100:112] == bytes(12)
    assert pool[32:72] == t.response_ids.tobytes() and pool[80:100] == t.logprobs.tobytes()


# ----------------------------------------------------------------------------- prepare_group errors


def _broken(attr: str, value) -> Group:
    g = group(0)
    setattr(g.trajectories[1], attr, value)  # replaced after construction: Trajectory no longer checks it
    return g


@pytest.mark.parametrize(
    ("attr", "value", "words"),
    [
        ("response_ids", [1, 2, 3], ("response_ids", "list")),
        ("response_ids", np.zeros((2, 8), np.int64), ("response_ids", "2-d")),
        ("response_ids", np.zeros(8, np.float32), ("response_ids", "float32")),
        ("prompt_ids", np.zeros(5, np.int32), ("prompt_ids", "int32")),
        ("versions", np.zeros(8, np.uint64), ("versions", "uint64")),
        ("logprobs", np.zeros(8, np.float64), ("logprobs", "float64")),
        ("logprobs", np.zeros(3, np.float32), ("logprobs",)),  # length no longer matches response_ids
        ("loss_mask", np.ones(8, bool), ("loss_mask", "bool")),
        ("loss_mask", np.ones(3, np.uint8), ("loss_mask", "one entry per response token")),
        ("loss_mask", [1, 1], ("loss_mask", "list")),
        ("turns", "2", ("turns", "'2'")),
    ],
)
def test_prepare_group_names_the_bad_field(attr, value, words):
    with pytest.raises(CodecError) as err:
        prepare_group(_broken(attr, value))
    for word in words:
        assert word in str(err.value)
    assert "sample_0_0" in str(err.value)


def test_prepare_group_refuses_meta_it_cannot_encode():
    g = group(0)
    g.meta = {"fine": 1, "bad": object()}
    with pytest.raises(CodecError, match="object"):
        prepare_group(g)
    # The record packer is reused: a failed record leaves nothing behind in it.
    assert unpack_groups(pack_groups([prepare_group(group(1))])) == [group(1)]


def test_prepare_group_refuses_a_non_group():
    with pytest.raises(CodecError, match="Trajectory"):
        prepare_group(traj("sample_0_0", 0, 2, 2))
    with pytest.raises(CodecError, match="dict"):
        prepare_group({"sample_id": "sample_0_0"})


def test_prepare_group_refuses_a_foreign_record_in_trajectories():
    g = group(0)
    g.trajectories.append({"index": 2})
    with pytest.raises(CodecError, match="dict"):
        prepare_group(g)


# ----------------------------------------------------------------------------- malformed input


def _valid(groups=None) -> list:
    groups = groups or [group(0), failed(1), group(2, n=3)]
    return [bytes(memoryview(f).cast("B")) for f in pack_groups([prepare_group(g) for g in groups])]


def _header(frames) -> list:
    return msgpack.unpackb(frames[0], raw=False)


def _with_header(frames, edit) -> list:
    header = _header(frames)
    edit(header)
    return [msgpack.packb(header, use_bin_type=True), frames[1]]


def _with_record(frames, edit, k: int = 0) -> list:
    """Frames whose k-th group record was changed by ``edit`` (a list of its 11 fields)."""
    def change(header):
        rec = msgpack.unpackb(header[4][k], raw=False)
        edit(rec)
        header[4][k] = msgpack.packb(rec, use_bin_type=True)
    return _with_header(frames, change)


def _set(i, value):
    def edit(lst):
        lst[i] = value
    return edit


# Record fields: sid, expected, status, error, meta, index, finish, reward, age, plens, rlens.
MALFORMED = {
    "header garbage": (lambda f: [b"\xc1\x00garbage", f[1]], "msgpack"),
    "header not a list": (lambda f: [msgpack.packb({"a": 1}), f[1]], "group batch"),
    "codec version": (lambda f: _with_header(f, _set(0, CODEC_VERSION + 98)), "codec version"),
    "kind not groups": (lambda f: _with_header(f, _set(1, "group")), "group batch"),
    "header too short": (lambda f: _with_header(f, lambda h: h.pop()), "group batch"),
    "pool too short": (lambda f: [f[0], f[1][:-1]], "pool"),
    "pool too long": (lambda f: [f[0], f[1] + b"\x00" * 16], "pool"),
    "pool_nbytes not int": (lambda f: _with_header(f, _set(2, float(len(f[1])))), "pool"),
    "three columns": (lambda f: _with_header(f, lambda h: h[3].pop()), "columns"),
    "records not a list": (lambda f: _with_header(f, _set(4, {"a": b""})), "records"),
    "column dtype": (lambda f: _with_header(f, lambda h: _set(0, "<i4")(h[3][0])), "column"),
    "column dtype big-endian": (lambda f: _with_header(f, lambda h: _set(0, ">f4")(h[3][2])), "column"),
    "column negative count": (lambda f: _with_header(f, lambda h: _set(1, -1)(h[3][1])), "column"),
    "column float count": (lambda f: _with_header(f, lambda h: _set(1, 2.0)(h[3][1])), "column"),
    "column overruns pool": (lambda f: _with_header(f, lambda h: _set(2, len(f[1]) - 8)(h[3][3])), "overruns"),
    "column count overruns pool": (lambda f: _with_header(f, lambda h: _set(1, len(f[1]))(h[3][1])), "overruns"),
    "record not bytes": (lambda f: _with_header(f, lambda h: _set(0, 5)(h[4])), "msgpack"),
    "record a str": (lambda f: _with_header(f, lambda h: _set(0, "abc")(h[4])), "msgpack"),
    "record garbage": (lambda f: _with_header(f, lambda h: _set(0, b"\xc1\xc1")(h[4])), "msgpack"),
    "record truncated": (lambda f: _with_header(f, lambda h: _set(0, h[4][0][:-3])(h[4])), "msgpack"),
    "record of 10 fields": (lambda f: _with_record(f, lambda r: r.pop()), "11 fields"),
    "record a dict": (lambda f: _with_header(f, lambda h: _set(0, msgpack.packb({"a": 1}))(h[4])), "11 fields"),
    "sample_id not str": (lambda f: _with_record(f, _set(0, 17)), "wrong type"),
    "meta not dict": (lambda f: _with_record(f, _set(4, [1])), "wrong type"),
    "error not str": (lambda f: _with_record(f, _set(3, 5)), "wrong type"),
    "per-response columns disagree": (lambda f: _with_record(f, lambda r: r[7].pop()), "disagree"),
    "index not a list": (lambda f: _with_record(f, _set(5, 3)), "disagree"),
    "prompt lengths run past the column": (lambda f: _with_record(f, lambda r: _set(0, 10_000)(r[9]), k=2), "outside"),
    "response lengths run past the column": (lambda f: _with_record(f, lambda r: _set(1, 10_000)(r[10]), k=2), "outside"),
    "negative length": (lambda f: _with_record(f, lambda r: _set(0, -1)(r[10])), "outside"),
    "length a str": (lambda f: _with_record(f, lambda r: _set(0, "5")(r[9])), "sample_0_0"),
    "length a float": (lambda f: _with_record(f, lambda r: _set(0, 5.0)(r[9])), "sample_0_0"),
    "lengths do not cover the columns": (lambda f: _with_record(f, lambda r: _set(1, r[10][1] - 1)(r[10]), k=2), "cover"),
    "lengths of a group dropped": (lambda f: _with_record(f, lambda r: [r[i].pop() for i in range(5, 11)], k=2), "cover"),
    "finish_reason not allowed": (lambda f: _with_record(f, lambda r: _set(1, "eos")(r[6])), "finish_reason"),
    "expected 0": (lambda f: _with_record(f, _set(1, 0)), "expected"),
    "expected a float": (lambda f: _with_record(f, _set(1, 2.0)), "expected"),
    "status weird": (lambda f: _with_record(f, _set(2, "weird")), "status"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_batch_raises_codec_error_saying_what(case):
    make, words = MALFORMED[case]
    frames = make(_valid())
    with pytest.raises(CodecError, match=words):
        unpack_groups(frames)


def test_the_edits_above_start_from_a_valid_batch():
    frames = _valid()
    assert unpack_groups(frames) == [group(0), failed(1), group(2, n=3)]
    assert unpack_groups(_with_header(frames, lambda h: None)) == unpack_groups(frames)


@pytest.mark.parametrize(
    "frames",
    [[], [b"x"], None, b"header", [b"\x90", b"", b""]],
    ids=["none", "one", "not-a-list", "bytes", "three"],
)
def test_wrong_number_of_frames(frames):
    with pytest.raises(CodecError, match="header, pool"):
        unpack_groups(frames)


def test_a_frame_that_is_not_a_buffer():
    with pytest.raises(CodecError, match="not a buffer"):
        unpack_groups([_valid()[0], 12345])


def test_the_generic_pack_format_is_not_a_group_batch():
    frames = pack(group(0))
    assert len(frames) == 2
    with pytest.raises(CodecError, match="group batch"):
        unpack_groups(frames)


def test_frames_over_max_frame_bytes_are_refused():
    frames = _valid()
    limit = len(frames[1]) - 1
    assert len(frames[0]) <= limit
    with pytest.raises(CodecError, match=f"max_frame_bytes={limit}"):
        unpack_groups(frames, max_frame_bytes=limit)
    with pytest.raises(CodecError, match="frame 0 .*max_frame_bytes=8"):
        unpack_groups(frames, max_frame_bytes=8)
    assert len(unpack_groups(frames, max_frame_bytes=len(frames[1]))) == 3


@pytest.mark.parametrize("column", [2, 3], ids=["logprobs", "versions"])
def test_column_counts_that_disagree_raise_codec_error(column):
    def shorten(header):
        header[3][column][1] -= 1
    frames = _with_header(_valid(), shorten)
    with pytest.raises(CodecError, match="response columns disagree"):
        unpack_groups(frames)


def test_prepare_group_refuses_a_trajectory_missing_a_field():
    g = group(0)
    del g.trajectories[0].finish_reason
    with pytest.raises(CodecError, match="finish_reason"):
        prepare_group(g)


@pytest.mark.parametrize("strided", ["pool", "header-2d"])
def test_non_contiguous_frames_raise_codec_error(strided):
    header, pool = _valid()
    if strided == "pool":
        frames = [header, np.frombuffer(pool, np.uint8).repeat(2)[::2]]
    else:
        frames = [np.zeros((8, 16), np.uint8)[:, ::2], pool]
    with pytest.raises(CodecError):
        unpack_groups(frames)


def test_fuzzed_headers_raise_codec_error_or_decode_to_groups():
    groups = [group(0), failed(1), group(2, n=3, rlen=0), group(3, n=1)]
    header, pool = _valid(groups)
    pool_arr = np.frombuffer(pool, np.uint8)
    rng = random.Random(1234)
    outcomes = {"error": 0, "same": 0, "other": 0}
    for trial in range(500):
        data = bytearray(header)
        if trial % 5 == 4:
            data = data[: rng.randrange(len(data))]  # truncated
        else:
            data[rng.randrange(len(data))] = rng.randrange(256)  # one byte changed
        try:
            out = unpack_groups([bytes(data), pool])
        except CodecError:
            outcomes["error"] += 1
            continue
        # No other exception type may escape (pytest would fail on it). What decodes is a
        # list of groups whose token arrays are typed views inside the pool.
        assert type(out) is list and all(type(g) is Group for g in out)
        assert_views_on(out, pool)
        for g in out:
            for t in g.trajectories:
                assert type(t) is Trajectory
                assert len(t.response_ids) == len(t.logprobs) == len(t.versions)
                for name in TOKEN_FIELDS:
                    a = getattr(t, name)
                    assert len(a) == 0 or 0 <= a.ctypes.data - pool_arr.ctypes.data <= len(pool) - a.nbytes
        outcomes["same" if out == groups else "other"] += 1
    assert outcomes["error"] > 250, outcomes  # most corruptions are caught, not just survived
