"""The optional C accelerator of the group codec (asyncrl/queue/_fastgroups.c).

It must give exactly what the pure-Python path gives where it takes the fast path, and
return None (so that Python handles it and names the error) on anything else: malformed
per-response values, odd arrays, foreign records. A fuzz test feeds it random values and
checks it never crashes and never disagrees with Python.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from asyncrl.queue import group_codec as codec
from asyncrl.queue.codec_base import CodecError
from asyncrl.queue.group_codec import _slice_responses, pack_groups, prepare_group, unpack_groups
from asyncrl.types import FINISH_REASONS, Group, Trajectory

fast = codec._fast
pytestmark = pytest.mark.skipif(fast is None, reason="asyncrl.queue._fastgroups is not built")

FIELDS = ("sample_id", "index", "prompt_ids", "response_ids", "logprobs", "versions", "finish_reason", "reward", "age",
          "loss_mask", "turns")


def traj(sid: str, k: int, plen: int, rlen: int, finish: str = "stop") -> Trajectory:
    rng = np.random.default_rng(k + 10 * plen + rlen)
    return Trajectory(sid, k, rng.integers(0, 1000, plen), rng.integers(0, 1000, rlen),
                      rng.standard_normal(rlen).astype(np.float32), np.full(rlen, k), finish, reward=0.25 * k, age=k)


def group(i: int, lengths=((3, 5), (0, 0), (4, 1))) -> Group:
    sid = f"sample_0_{i}"
    return Group(sid, [traj(sid, k, p, r) for k, (p, r) in enumerate(lengths)], expected=max(1, len(lengths)))


def agent_group(i: int) -> Group:
    """A multi-turn group: a masked response, a plain one, one with turns but no mask, an empty masked one."""
    g = group(i, ((3, 6), (2, 4), (1, 2), (2, 0)))
    ts = g.trajectories
    ts[0].loss_mask, ts[0].turns = np.array([1, 1, 0, 0, 0, 1], np.uint8), 2
    ts[2].turns = 3
    ts[3].loss_mask, ts[3].turns = np.zeros(0, np.uint8), 0
    return g


ARRAYS = ("prompt_ids", "response_ids", "logprobs", "versions")


def same_masks(a: list[Trajectory], b: list[Trajectory]) -> bool:
    return all((x.loss_mask is None and y.loss_mask is None)
               or (x.loss_mask.dtype == y.loss_mask.dtype == np.uint8 and np.array_equal(x.loss_mask, y.loss_mask))
               for x, y in zip(a, b))


def same_trajectories(a: list[Trajectory], b: list[Trajectory]) -> bool:
    """Field by field: the same objects for the values (NaN included), equal typed arrays."""
    return len(a) == len(b) and all(
        type(x) is type(y) is Trajectory
        and all(getattr(x, f) is getattr(y, f) for f in FIELDS if f not in ARRAYS and f != "loss_mask")
        and all(getattr(x, f).dtype == getattr(y, f).dtype and np.array_equal(getattr(x, f), getattr(y, f))
                for f in ARRAYS)
        for x, y in zip(a, b)
    ) and same_masks(a, b)


def python_slice(*args):
    saved, codec._fast = codec._fast, None
    try:
        return _slice_responses(*args)
    finally:
        codec._fast = saved


def columns(n_prompt: int = 20, n_resp: int = 30, writeable: bool = True):
    pool = bytearray(n_prompt * 8 + n_resp * 20) if writeable else bytes(n_prompt * 8 + n_resp * 20)
    p = np.frombuffer(pool, np.int64, n_prompt, 0)
    r = np.frombuffer(pool, np.int64, n_resp, n_prompt * 8)
    lp = np.frombuffer(pool, np.float32, n_resp, n_prompt * 8 + n_resp * 8)
    v = np.frombuffer(pool, np.int64, n_resp, n_prompt * 8 + n_resp * 12)
    if writeable:
        p[:] = np.arange(n_prompt)
        r[:] = np.arange(n_resp) * 3
        lp[:] = -np.arange(n_resp, dtype=np.float32)
        v[:] = 7
    return p, r, lp, v


def per_response(plens, rlens, finish=None):
    n = len(plens)
    return [list(range(n)), finish or ["stop"] * n, [0.5 * k for k in range(n)], [k % 2 for k in range(n)],
            list(plens), list(rlens)]


# ----------------------------------------------------------------------------- columns (producer)


@pytest.mark.parametrize("lengths", [((3, 5), (0, 0), (4, 1)), (), ((0, 7),), ((256, 1024),) * 8])
def test_columns_and_records_match_the_python_path(lengths):
    g = group(1, lengths)
    laid_out = fast.columns(g.trajectories)
    assert laid_out is not None
    p, r, lp, v, index, finish, reward, age, plens, rlens, np_, nr, turns, masks, extended = laid_out
    ts = g.trajectories
    assert turns == [1] * len(ts) and masks == [None] * len(ts) and extended is False
    assert all(a is t.prompt_ids for a, t in zip(p, ts)) and all(a is t.versions for a, t in zip(v, ts))
    assert all(a is t.response_ids for a, t in zip(r, ts)) and all(a is t.logprobs for a, t in zip(lp, ts))
    assert index == [t.index for t in ts] and finish == [t.finish_reason for t in ts]
    assert reward == [t.reward for t in ts] and age == [t.age for t in ts]
    assert plens == [len(t.prompt_ids) for t in ts] and rlens == [len(t.response_ids) for t in ts]
    assert (np_, nr) == (sum(plens), sum(rlens))
    accelerated = prepare_group(g)
    codec._fast = None
    try:
        plain = prepare_group(g)
    finally:
        codec._fast = fast
    assert accelerated.record == plain.record and accelerated.counts == plain.counts
    assert pack_groups([accelerated]) == pack_groups([plain])


def test_columns_of_an_agent_group_carry_turns_and_masks_as_python_does():
    g = agent_group(1)
    laid_out = fast.columns(g.trajectories)
    assert laid_out is not None
    *_, turns, masks, extended = laid_out
    assert turns == [2, 1, 3, 0] and extended is True
    assert masks[0] is g.trajectories[0].loss_mask and masks[1] is None and masks[3] is g.trajectories[3].loss_mask
    accelerated = prepare_group(g)
    codec._fast = None
    try:
        plain = prepare_group(g)
    finally:
        codec._fast = fast
    assert accelerated.record == plain.record and accelerated.counts == plain.counts
    assert pack_groups([accelerated]) == pack_groups([plain])


def test_turns_alone_extend_the_record_but_add_no_mask_column():
    g = group(1)
    g.trajectories[1].turns = 2
    *_, extended = fast.columns(g.trajectories)
    header = codec.msgpack.unpackb(pack_groups([prepare_group(g)])[0], raw=False)
    assert extended is True and len(header[3]) == 4
    assert len(codec.msgpack.unpackb(header[4][0], raw=False)) == 13


class TrajectoryChild(Trajectory):
    __slots__ = ()


class ArrayChild(np.ndarray):
    pass


def _with(attr, value):
    g = group(2)
    setattr(g.trajectories[1], attr, value)
    return g.trajectories


def _deleted(attr):
    g = group(2)
    delattr(g.trajectories[2], attr)
    return g.trajectories


def _subclass():
    t = group(2).trajectories
    t[0] = TrajectoryChild(*(getattr(t[0], f) for f in FIELDS))
    return t


@pytest.mark.parametrize(
    "trajectories",
    [
        pytest.param(lambda: tuple(group(2).trajectories), id="a tuple"),
        pytest.param(lambda: group(2).trajectories + [{"index": 3}], id="a dict among them"),
        pytest.param(_subclass, id="a Trajectory subclass"),
        pytest.param(lambda: _with("prompt_ids", np.arange(3, dtype=np.int32)), id="int32 prompt_ids"),
        pytest.param(lambda: _with("logprobs", np.zeros(5)), id="float64 logprobs"),
        pytest.param(lambda: _with("versions", np.zeros(5, np.int64).view(ArrayChild)), id="an array subclass"),
        pytest.param(lambda: _with("response_ids", [1, 2, 3]), id="a list"),
        pytest.param(lambda: _with("response_ids", np.zeros((1, 0), np.int64)), id="2-d"),
        pytest.param(lambda: _with("logprobs", np.zeros(3, np.float32)), id="logprobs shorter"),
        pytest.param(lambda: _with("versions", np.zeros(4, np.int64)), id="versions longer"),
        pytest.param(lambda: _deleted("reward"), id="a deleted slot"),
        pytest.param(lambda: _deleted("prompt_ids"), id="a deleted array slot"),
        pytest.param(lambda: _with("loss_mask", np.ones(5, bool)), id="a bool mask"),
        pytest.param(lambda: _with("loss_mask", np.ones(4, np.uint8)), id="a mask shorter"),
        pytest.param(lambda: _with("loss_mask", np.ones(5, np.uint8).view(ArrayChild)), id="a mask subclass"),
        pytest.param(lambda: _with("turns", 2.0), id="turns a float"),
        pytest.param(lambda: _with("turns", True), id="turns a bool"),
        pytest.param(lambda: _with("turns", -1), id="turns negative"),
    ],
)
def test_columns_leaves_anything_unusual_to_python(trajectories):
    assert fast.columns(trajectories()) is None


def test_columns_accepts_big_endian_free_native_arrays_only():
    t = group(3).trajectories
    t[0].prompt_ids = t[0].prompt_ids.astype(">i8")  # equal values, not numpy's native int64
    assert fast.columns(t) is None
    with pytest.raises(CodecError, match="prompt_ids"):
        prepare_group(Group("sample_0_3", t, expected=3))


# ----------------------------------------------------------------------------- trajectories (consumer)


def test_trajectories_match_the_python_path_and_are_views_with_its_base():
    cols = columns()
    args = ("sample_0_9", per_response([4, 0, 16], [10, 3, 0]), cols, 0, 2)
    got = fast.trajectories(args[0], *args[1], *cols, 0, 2)
    want = python_slice(*args)
    assert got[1:] == want[1:] == (20, 15)
    assert same_trajectories(got[0], want[0])
    for a, b in zip(got[0], want[0]):
        for name, col in zip(ARRAYS, cols):
            x, y = getattr(a, name), getattr(b, name)
            assert x.base is y.base and x.flags.writeable and x.flags.c_contiguous and x.flags.aligned
            assert np.shares_memory(x, col) or len(x) == 0


def test_views_of_a_read_only_pool_are_read_only():
    cols = columns(writeable=False)
    out, _, _ = fast.trajectories("sample_0_9", *per_response([2], [3]), *cols, 0, 0)
    assert not out[0].response_ids.flags.writeable and not out[0].prompt_ids.flags.writeable


def test_no_responses_and_empty_columns():
    out = fast.trajectories("sample_0_9", *per_response([], []), *columns(0, 0), 0, 0)
    assert out == ([], 0, 0)


def _bad(**change):
    """Arguments of a valid call (3 responses) with one thing changed."""
    per = per_response([4, 0, 6], [10, 3, 5])
    cols = list(columns())
    po, ro = 0, 1
    for key, value in change.items():
        if key.startswith("per"):
            per[int(key[3:])] = value
        elif key.startswith("col"):
            cols[int(key[3:])] = value
        elif key == "po":
            po = value
        elif key == "ro":
            ro = value
    return ("sample_0_5", *per, *cols, po, ro)


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(_bad(per0=(0, 1, 2)), id="index a tuple"),
        pytest.param(_bad(per3=[0, 1]), id="ages shorter"),
        pytest.param(_bad(per4=[4, 0]), id="prompt lengths shorter"),
        pytest.param(_bad(per4=[4, -1, 6]), id="a negative length"),
        pytest.param(_bad(per4=[4, True, 6]), id="a bool length"),
        pytest.param(_bad(per5=[10, 3.0, 5]), id="a float length"),
        pytest.param(_bad(per5=[10, 2**70, 5]), id="a length past 64 bits"),
        pytest.param(_bad(per5=[10, "3", 5]), id="a str length"),
        pytest.param(_bad(per4=[4, 0, 17]), id="prompt lengths past the column"),
        pytest.param(_bad(per5=[10, 3, 17]), id="response lengths past the column"),
        pytest.param(_bad(po=21), id="po past the column"),
        pytest.param(_bad(ro=-1), id="ro negative"),
        pytest.param(_bad(ro=1.0), id="ro a float"),
        pytest.param(_bad(per1=["stop", "eos", "stop"]), id="an unknown finish_reason"),
        pytest.param(_bad(per1=["stop", b"stop", "stop"]), id="finish_reason as bytes"),
        pytest.param(_bad(per1=["stop", ["stop"], "stop"]), id="finish_reason a list"),
        pytest.param(_bad(col0=list(range(20))), id="a list column"),
        pytest.param(_bad(col1=np.zeros((6, 5), np.int64)), id="a 2-d column"),
        pytest.param(_bad(col2=np.zeros(60, np.float32)[::2]), id="a strided column"),
        pytest.param(_bad(col3=np.zeros(29, np.int64)), id="response columns of different lengths"),
        pytest.param(_bad(col1=np.zeros(30, np.int64).view(ArrayChild)), id="an array subclass column"),
    ],
)
def test_trajectories_leaves_anything_malformed_to_python(args):
    assert fast.trajectories(*args) is None


def test_trajectories_wants_thirteen_or_sixteen_arguments():
    assert fast.trajectories() is None
    assert fast.trajectories(*_bad()[:-1]) is None
    assert fast.trajectories(*_bad(), [1, 1, 1], [False, False, False]) is None


def mask_column(n_resp: int = 30) -> np.ndarray:
    return (np.arange(n_resp) % 3 != 1).astype(np.uint8)


def test_trajectories_with_turns_and_masks_match_the_python_path():
    cols, m = columns(), mask_column()
    per = per_response([4, 0, 16], [10, 3, 0]) + [[2, 1, 0], [True, False, True]]
    got = fast.trajectories("sample_0_9", *per[:6], *cols, 0, 2, *per[6:], m)
    want = python_slice("sample_0_9", per, (*cols, m), 0, 2)
    assert got[1:] == want[1:] == (20, 15)
    assert same_trajectories(got[0], want[0])
    first, second, third = got[0]
    assert (first.turns, second.turns, third.turns) == (2, 1, 0) and second.loss_mask is None
    assert np.array_equal(first.loss_mask, m[2:12]) and np.shares_memory(first.loss_mask, m)
    assert third.loss_mask.dtype == np.uint8 and len(third.loss_mask) == 0


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param(([1, 1, 1], [True, False, False], None), id="a mask flagged without a mask column"),
        pytest.param(([1, 1], [False, False, False], None), id="turns shorter"),
        pytest.param(([1, 1, 1], (False, False, False), None), id="flags a tuple"),
        pytest.param(([1, -1, 1], [False, False, False], None), id="negative turns"),
        pytest.param(([1, True, 1], [False, False, False], None), id="turns a bool"),
        pytest.param(([1, 1, 1], [False, 1, False], None), id="a flag an int"),
        pytest.param(([1, 1, 1], [True, False, False], mask_column(29)), id="a mask column too short"),
        pytest.param(([1, 1, 1], [True, False, False], mask_column().astype(bool)), id="a bool mask column"),
    ],
)
def test_trajectories_leaves_malformed_turns_and_masks_to_python(extra):
    assert fast.trajectories(*_bad(), *extra) is None


def test_python_names_what_the_accelerator_refused():
    frames = pack_groups([prepare_group(group(4))])
    header = codec.msgpack.unpackb(frames[0], raw=False)
    record = codec.msgpack.unpackb(header[4][0], raw=False)
    record[6][1] = "eos"
    header[4][0] = codec.msgpack.packb(record, use_bin_type=True)
    with pytest.raises(CodecError, match="finish_reason 'eos'"):
        unpack_groups([codec.msgpack.packb(header, use_bin_type=True), frames[1]])


_VALUES = [0, 1, 2, 3, 5, 8, 30, -1, -7, 2**63, 2**70, True, False, 1.0, 2.5, None, "3", "stop", "length", "abort",
           "truncated", "eos", b"stop", [], [1], {}, "", float("nan")]


def test_fuzz_never_crashes_and_never_disagrees_with_python():
    rng = random.Random(1234)
    cols, masks = columns(), mask_column()
    taken = 0
    for _ in range(3000):
        n = rng.randrange(0, 5)
        per = []
        for k in range(6):
            m = n if rng.random() < 0.9 else rng.randrange(0, 5)
            if k in (4, 5):
                column = [rng.randrange(0, 12) if rng.random() < 0.9 else rng.choice(_VALUES) for _ in range(m)]
            elif k == 1:
                column = [rng.choice(FINISH_REASONS) if rng.random() < 0.9 else rng.choice(_VALUES) for _ in range(m)]
            else:
                column = [rng.choice(_VALUES) for _ in range(m)]
            per.append(column if rng.random() < 0.97 else tuple(column))
        po = rng.randrange(0, 8) if rng.random() < 0.9 else rng.choice(_VALUES)
        ro = rng.randrange(0, 8) if rng.random() < 0.9 else rng.choice(_VALUES)
        extra: list = []
        if rng.random() < 0.4:  # a record with turns and masks
            turns = [rng.randrange(0, 4) if rng.random() < 0.9 else rng.choice(_VALUES) for _ in range(n)]
            flags = [rng.random() < 0.5 if rng.random() < 0.9 else rng.choice(_VALUES) for _ in range(n)]
            extra = [turns, flags, masks if rng.random() < 0.8 else None]
        got = fast.trajectories("sample_0_1", *per, *cols, po, ro, *extra)
        if got is None:
            continue
        taken += 1
        want = python_slice("sample_0_1", per + extra[:2], (*cols, *extra[2:]), po, ro)
        assert got[1:] == want[1:]
        assert same_trajectories(got[0], want[0])
    assert taken > 300  # the fast path was really exercised
