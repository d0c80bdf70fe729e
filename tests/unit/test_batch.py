"""Batch assembly: fixed keys and token alignment; fail closed on failed/short groups; drop policy;
staleness; even splits over ranks; micro-batch trimming."""

import numpy as np
import pytest
import torch

from asyncrl.trainer.batch import (
    BATCH_KEYS,
    IncompleteGroupError,
    assemble,
    micro_batches,
    screen_groups,
    shard_rows,
)
from asyncrl.types import Group, Trajectory


def traj(sid, k, prompt, response, reward=0.0, version=0, finish="stop"):
    r = np.asarray(response, dtype=np.int64)
    return Trajectory(sample_id=sid, index=k, prompt_ids=np.asarray(prompt, dtype=np.int64), response_ids=r,
                      logprobs=-(np.arange(len(r), dtype=np.float32) + 1) / 10,
                      versions=np.full(len(r), version, np.int64), finish_reason=finish, reward=reward)


def group(sid, n=2, version=0, **kw):
    return Group(sample_id=sid, expected=n,
                 trajectories=[traj(sid, k, [5, 6], [7 + k] * (k + 1), reward=float(k), version=version)
                               for k in range(n)], **kw)


def test_assemble_keys_alignment_and_advantages():
    g0 = Group(sample_id="sample_0_0", expected=2, trajectories=[
        traj("sample_0_0", 1, [5, 6, 7], [9], reward=0.0),
        traj("sample_0_0", 0, [5], [8, 9, 10], reward=1.0),
    ])
    b = assemble([g0, group("sample_0_1")], pad_token_id=0)
    assert tuple(sorted(b.keys())) == tuple(sorted(BATCH_KEYS))
    assert b.batch_size == torch.Size([4])
    # Row 0 is trajectory index 0 (sorted), right-padded to the widest row (4 tokens).
    assert b["input_ids"][0].tolist() == [5, 8, 9, 10]
    assert b["input_ids"][1].tolist() == [5, 6, 7, 9]
    assert b["response_mask"][0].tolist() == [0, 1, 1, 1]
    assert b["response_mask"][1].tolist() == [0, 0, 0, 1]
    assert b["input_ids"][2].tolist() == [5, 6, 7, 0] and b["attention_mask"][2].tolist() == [1, 1, 1, 0]
    assert b["position_ids"][2].tolist() == [0, 1, 2, 2]
    # Behaviour log-probs sit on the response token they belong to.
    assert torch.allclose(b["old_logprobs"][0], torch.tensor([0.0, -0.1, -0.2, -0.3]))
    assert b["versions"][0].tolist() == [-1, 0, 0, 0]
    # Rewards 1 vs 0 in a group of two: advantages +-1/sqrt(2)/... normalised -> +-0.7071.
    assert b["advantages"][0, 1].item() == pytest.approx(0.70710, abs=1e-4)
    assert b["advantages"][1, 3].item() == pytest.approx(-0.70710, abs=1e-4)
    assert b["advantages"][0, 0].item() == 0.0  # prompt tokens carry no advantage
    assert b["group_index"].tolist() == [0, 0, 1, 1]


def test_failed_group_fails_closed_naming_sample_id():
    bad = group("sample_0_7", status="failed", error="engine died")
    with pytest.raises(IncompleteGroupError, match="sample_0_7.*engine died") as err:
        screen_groups([group("sample_0_1"), bad])
    assert err.value.sample_ids == ["sample_0_7"]
    with pytest.raises(IncompleteGroupError, match="sample_0_7"):
        assemble([bad])  # assembly refuses it too: never a partial batch


def test_short_and_aborted_groups_fail_closed_with_what_is_missing():
    short = Group(sample_id="sample_1_3", expected=4, trajectories=group("sample_1_3", n=4).trajectories[:3])
    aborted = group("sample_1_4")
    aborted.trajectories[1].finish_reason = "abort"
    with pytest.raises(IncompleteGroupError) as err:
        screen_groups([short, aborted])
    msg = str(err.value)
    assert "sample_1_3: 3 of 4 trajectories" in msg
    assert "sample_1_4: unfinished responses 1:abort" in msg
    assert "on_incomplete_group='drop'" in msg


def test_drop_policy_returns_reasons_and_keeps_the_rest():
    short = Group(sample_id="sample_0_2", expected=2, trajectories=group("sample_0_2").trajectories[:1])
    kept, dropped = screen_groups([group("sample_0_1"), short, group("sample_0_3")], on_incomplete="drop")
    assert [g.sample_id for g in kept] == ["sample_0_1", "sample_0_3"]
    assert dropped == [("sample_0_2", "incomplete: 1 of 2 trajectories")]


def test_stale_groups_dropped_only_when_gap_set():
    old, fresh = group("sample_0_1", version=1), group("sample_0_2", version=4)
    kept, dropped = screen_groups([old, fresh], max_version_gap=2, current_version=4)
    assert [g.sample_id for g in kept] == ["sample_0_2"]
    assert dropped[0][0] == "sample_0_1" and "oldest token version 1" in dropped[0][1]
    kept, dropped = screen_groups([old, fresh], current_version=4)
    assert len(kept) == 2 and dropped == []


def test_shard_rows_even_split_and_pad_rows_for_an_uneven_one():
    b = assemble([group("sample_0_1"), group("sample_0_2")])
    halves = [shard_rows(b, 2, r) for r in range(2)]
    assert torch.equal(torch.cat([h["input_ids"] for h in halves]), b["input_ids"])
    thirds = [shard_rows(b, 3, r) for r in range(3)]  # 4 rows (a group of varying size) over 3 ranks
    assert [t.batch_size[0] for t in thirds] == [2, 2, 2]
    padded = torch.cat(thirds)
    assert torch.equal(padded[:4]["input_ids"], b["input_ids"])
    pads = padded[4:]
    assert pads["response_mask"].sum() == 0 and pads["attention_mask"].sum(-1).tolist() == [1, 1]
    assert pads["group_index"].tolist() == [-1, -1] and (pads["versions"] == -1).all()
    assert (pads["advantages"] == 0).all() and (pads["old_logprobs"] == 0).all()


def test_advantages_are_taken_per_episode_when_responses_have_branches():
    from asyncrl.trainer.algorithm import grpo_advantages
    from asyncrl.trainer.batch import episode_advantages
    from asyncrl.types import EPISODES_KEY

    sid = "sample_0_1"
    ts = [traj(sid, k, [5], [7], reward=r) for k, r in enumerate([1.0, 1.0, 1.0, 0.0, 0.5])]
    g = Group(sample_id=sid, expected=5, trajectories=ts, meta={EPISODES_KEY: [0, 0, 0, 1, 2]})
    per_episode = grpo_advantages(torch.tensor([[1.0, 0.0, 0.5]]))[0]
    assert torch.allclose(episode_advantages(g), per_episode[[0, 0, 0, 1, 2]])
    as_rows = grpo_advantages(torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.5]]))[0]
    assert not torch.allclose(episode_advantages(g), as_rows)  # episode 0's three branches count once
    plain = Group(sample_id=sid, expected=5, trajectories=ts)
    assert torch.allclose(episode_advantages(plain), as_rows)  # without branches: GRPO per trajectory
    bad = Group(sample_id=sid, expected=5, trajectories=ts, meta={EPISODES_KEY: [0, 1]})
    with pytest.raises(ValueError, match="one int episode per trajectory"):
        assemble([bad])


def test_micro_batches_trim_padding_columns():
    g = Group(sample_id="sample_0_1", expected=2, trajectories=[
        traj("sample_0_1", 0, [5], [8]), traj("sample_0_1", 1, [5, 6, 7, 8], [9, 9, 9]),
    ])
    b = assemble([g])
    mbs = micro_batches(b, 1)
    assert [mb["input_ids"].shape[1] for mb in mbs] == [2, 7]
    assert mbs[0]["input_ids"].tolist() == [[5, 8]]
    assert mbs[0]["rewards"].shape == (1,)


def test_tokens_after_the_first_stop_token_stay_in_the_batch_but_leave_the_loss():
    # Engines that run past EOS (the long-tail workload): EOS is 2; what follows it no reward reads.
    g = Group(sample_id="sample_0_0", expected=2, trajectories=[
        traj("sample_0_0", 0, [1, 5], [9, 2, 7, 2, 8], reward=1.0),
        traj("sample_0_0", 1, [1, 5], [8, 8, 8, 8, 8], reward=0.0),  # no EOS: every token counts
    ])
    plain = assemble([g])
    b = assemble([g], stop_token_id=2)
    assert b["input_ids"].tolist() == plain["input_ids"].tolist()  # the forward sees the same tokens
    assert b["attention_mask"].tolist() == plain["attention_mask"].tolist()
    assert b["versions"].tolist() == plain["versions"].tolist()  # they were generated all the same
    assert plain["response_mask"][0].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert b["response_mask"][0].tolist() == [0, 0, 1, 1, 0, 0, 0]  # the answer and its EOS
    assert b["response_mask"][1].tolist() == [0, 0, 1, 1, 1, 1, 1]
    assert b["advantages"][0].tolist() == pytest.approx([0, 0, 0.7071, 0.7071, 0, 0, 0], abs=1e-4)


def test_the_stop_token_mask_keeps_observation_tokens_out_as_well():
    t = traj("sample_0_0", 0, [1, 5], [9, 3, 3, 2, 8], reward=1.0)
    t.loss_mask = np.array([1, 0, 0, 1, 1], dtype=np.uint8)  # two observation tokens, then EOS and one past it
    g = Group(sample_id="sample_0_0", expected=2, trajectories=[t, traj("sample_0_0", 1, [1, 5], [8, 8], reward=0.0)])
    b = assemble([g], stop_token_id=2)
    assert b["response_mask"][0].tolist() == [0, 0, 1, 0, 0, 1, 0]
    assert b["versions"][0].tolist() == [-1, -1, 0, -1, -1, 0, 0]  # observations carry none; past EOS was generated
