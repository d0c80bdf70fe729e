"""The built-in engine keeps a conversation's KV between turns (``GenerateRequest.session_id``).

Every turn that reuses kept KV is checked against the same request computed from scratch (same
seed): the same tokens, log-probs within 1e-4, and against a full forward of the reference model.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.rollouter.engines.builtin.engine import TorchEngine
from asyncrl.rollouter.engines.builtin.kv_cache import BLOCK_TOKENS
from asyncrl.types import GenerateRequest, SamplingParams
from tests.unit import test_torch_engine


model_path, ref = test_torch_engine.model_path, test_torch_engine.ref  # its fixtures: the tiny model, its HF forward


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 40, (n,), generator=g).tolist()


def turn(rid, prompt, max_tokens, seed, session=None):
    return GenerateRequest(rid, np.asarray(prompt), max_tokens=max_tokens,
                           sampling=SamplingParams(temperature=1.0, seed=seed), session_id=session)


def next_prompt(prompt, result, obs_seed, obs_len=5):
    """The conversation so far: the turn's prompt, what it generated, an observation."""
    return list(prompt) + result.response_ids.tolist() + tokens(obs_len, obs_seed)


@torch.no_grad()
def full_forward_logprobs(model, prompt, response):
    ids = torch.as_tensor(np.concatenate([prompt, response]))[None]
    logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return logp[len(prompt) - 1 : -1].gather(1, ids[0, len(prompt) :, None])[:, 0].numpy()


def assert_same(result, scratch, model=None, prompt=None):
    """``result`` (a turn on kept KV) equals ``scratch`` (the same request prefilled in full)."""
    np.testing.assert_array_equal(result.response_ids, scratch.response_ids)
    assert np.abs(result.logprobs - scratch.logprobs).max() <= 1e-4
    if model is not None:
        assert np.abs(full_forward_logprobs(model, prompt, result.response_ids) - result.logprobs).max() <= 1e-4


def used_blocks(engine):
    return engine._runner.cache.used_blocks


def request_blocks(engine):
    """Blocks the requests of the last step hold (a finished request's go back at the next step)."""
    return len({b for seq in engine._runner.held for b in seq.blocks})


# Kept tokens = prompt + max_tokens - 1 (the last sampled token has no KV yet): less than a block,
# exactly one, a block and a bit (the kept last block is partly filled), several.
@pytest.mark.parametrize("prompt_len,max_tokens,decoder", [(6, 5, "auto"), (10, 7, "auto"), (10, 9, "auto"),
                                                           (10, 9, "hf"), (20, 25, "auto")])
async def test_turn_two_prefills_only_its_new_tokens_and_equals_scratch(model_path, ref, prompt_len, max_tokens,
                                                                        decoder):
    p1 = tokens(prompt_len, seed=prompt_len)
    engine = TorchEngine(model_path, eos_token_ids=(), decoder=decoder)
    try:
        r1 = await engine.generate(turn("t1", p1, max_tokens, seed=1, session="s"))
        kept = prompt_len + max_tokens - 1
        assert r1.prefill_tokens == prompt_len
        assert used_blocks(engine) == -(-kept // BLOCK_TOKENS)  # the turn's blocks stay, no more
        p2 = next_prompt(p1, r1, obs_seed=2)
        r2 = await engine.generate(turn("t2", p2, 12, seed=3, session="s"))
        assert r2.prefill_tokens == len(p2) - kept  # the last sampled token + the observation
        stats = engine.stats()
        assert (stats["session_hits"], stats["session_tokens_reused"]) == (1, kept)
        assert stats["prefill_tokens"] == prompt_len + len(p2) - kept
        scratch = await engine.generate(turn("scratch", p2, 12, seed=3))  # no session: a full prefill
        assert scratch.prefill_tokens == len(p2)
        assert_same(r2, scratch, ref, p2)
        # Turn 3 on turn 2's kept blocks (the table adopted, written on and kept again).
        p3 = next_prompt(p2, r2, obs_seed=4, obs_len=3)
        r3 = await engine.generate(turn("t3", p3, 6, seed=5, session="s"))
        assert r3.prefill_tokens == len(p3) - (len(p2) + 12 - 1)
        assert used_blocks(engine) == engine.stats()["session_blocks"] == -(-(len(p3) + 5) // BLOCK_TOKENS)
        await engine.end_session("s")
        assert used_blocks(engine) == 0 and engine.stats()["session_blocks"] == 0
        assert_same(r3, await engine.generate(turn("scratch3", p3, 6, seed=5)), ref, p3)
    finally:
        await engine.close()


async def test_a_group_of_sessions_on_one_forked_prompt(model_path, ref):
    # n conversations start from one prompt (a group): turn 1 shares its prefill (forked blocks,
    # the last one partly filled); each kept turn holds the shared blocks, and each turn 2 writes
    # into its own copy. Member 0 generated one token: its kept blocks are exactly the prompt's.
    p1 = tokens(21, seed=7)
    lengths = [1, 3, 11, 12]
    engine = TorchEngine(model_path, eos_token_ids=(), max_running=8)
    try:
        first = await asyncio.gather(*(engine.generate(turn(f"a{k}", p1, n, seed=10 + k, session=f"s{k}"))
                                       for k, n in enumerate(lengths)))
        assert sum(r.prefill_tokens for r in first) == len(p1)  # one prefill for the group
        assert engine.stats()["session_kept"] == 4
        p2 = [next_prompt(p1, r, obs_seed=20 + k) for k, r in enumerate(first)]
        second = await asyncio.gather(*(engine.generate(turn(f"b{k}", p, 9, seed=30 + k, session=f"s{k}"))
                                        for k, p in enumerate(p2)))
        for k, (p, r, n) in enumerate(zip(p2, second, lengths)):
            assert r.prefill_tokens == len(p) - (len(p1) + n - 1)
            assert_same(r, await engine.generate(turn(f"c{k}", p, 9, seed=30 + k)), ref, p)
        assert engine.stats()["session_hits"] == 4
        assert used_blocks(engine) > request_blocks(engine)
        for k in range(4):
            await engine.end_session(f"s{k}")
        assert used_blocks(engine) == request_blocks(engine) and engine.stats()["session_blocks"] == 0
    finally:
        await engine.close()


async def perturb_weights(engine, model_path, version):
    """A weight update as the sync does it: pause, load, finish, resume; returns the new weights' model.
    Paused first: loading the model from disk holds the event loop, and a turn in flight would run on
    to its end meanwhile in the engine's thread (on a loaded machine, before any new weight lands)."""
    await engine.pause("keep")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval().requires_grad_(False)
    g = torch.Generator().manual_seed(version + 100)
    for p in model.parameters():  # tied ones once
        p.add_(0.05 * torch.randn(p.shape, generator=g))
    await engine.load_weights(model.named_parameters())
    await engine.finish_weight_update(version)
    await engine.resume()
    return model


@pytest.mark.parametrize("new_version", [1, 0])  # 0: weights loaded, the version number kept
async def test_a_weight_update_between_turns_prefills_in_full(model_path, ref, new_version):
    p1 = tokens(10, seed=8)
    engine = TorchEngine(model_path, eos_token_ids=())
    try:
        r1 = await engine.generate(turn("t1", p1, 9, seed=1, session="s"))
        new = await perturb_weights(engine, model_path, new_version)
        assert used_blocks(engine) == 0 and engine.stats()["session_dropped"] == 1
        p2 = next_prompt(p1, r1, obs_seed=2)
        r2 = await engine.generate(turn("t2", p2, 12, seed=3, session="s"))
        assert r2.prefill_tokens == len(p2) and engine.stats()["session_hits"] == 0
        assert_same(r2, await engine.generate(turn("scratch", p2, 12, seed=3)), new, p2)
        assert np.abs(full_forward_logprobs(ref, p2, r2.response_ids) - r2.logprobs).max() > 1e-3  # it mattered
    finally:
        await engine.close()


async def test_a_turn_kept_through_a_sync_is_not_kept_for_the_next(model_path, ref):
    # Paused with keep across a weight update, a turn goes on over KV of the old weights: its
    # blocks mix two versions, so the next turn must not reuse them.
    p1 = tokens(10, seed=9)
    engine = TorchEngine(model_path, eos_token_ids=())
    try:
        task = asyncio.create_task(engine.generate(turn("t1", p1, 30, seed=1, session="s")))
        await asyncio.sleep(0)
        await engine.wait_for_tokens("t1", 5, timeout_s=60)
        new = await perturb_weights(engine, model_path, 1)
        r1 = await task
        assert 5 <= (r1.versions == 0).sum() < 30
        assert engine.stats()["session_kept"] == 0 and used_blocks(engine) == request_blocks(engine) > 0
        p2 = next_prompt(p1, r1, obs_seed=2)
        r2 = await engine.generate(turn("t2", p2, 12, seed=3, session="s"))
        assert r2.prefill_tokens == len(p2)
        assert_same(r2, await engine.generate(turn("scratch", p2, 12, seed=3)), new, p2)
    finally:
        await engine.close()


async def test_end_session_and_clear_cache_free_the_kept_blocks(model_path):
    engine = TorchEngine(model_path, eos_token_ids=())
    try:
        p1 = tokens(10, seed=10)
        r1 = await engine.generate(turn("t1", p1, 9, seed=1, session="s"))
        assert used_blocks(engine) == 2 and engine.stats()["session_live"] == 1
        await engine.end_session("s")
        await engine.end_session("unknown")  # ignored
        assert used_blocks(engine) == 0 and engine.stats()["session_live"] == 0
        p2 = next_prompt(p1, r1, obs_seed=2)
        assert (await engine.generate(turn("t2", p2, 4, seed=3, session="s"))).prefill_tokens == len(p2)
        assert used_blocks(engine) > 0  # t2 is kept in turn ...
        await engine.pause("keep", clear_cache=True)  # ... and dropped with the cache
        await engine.resume()
        assert used_blocks(engine) == 0 and engine.stats()["session_live"] == 0
        p3 = next_prompt(p2, r1, obs_seed=4)
        assert (await engine.generate(turn("t3", p3, 4, seed=3, session="s"))).prefill_tokens == len(p3)
    finally:
        await engine.close()


async def test_least_recently_kept_sessions_go_first_under_the_block_budget(model_path, ref):
    # A budget of 3 blocks: two kept conversations of 2 blocks each do not fit, the older goes.
    engine = TorchEngine(model_path, eos_token_ids=(), session_max_blocks=3)
    try:
        pa, pb = tokens(10, seed=11), tokens(12, seed=12)
        ra = await engine.generate(turn("a1", pa, 9, seed=1, session="a"))
        rb = await engine.generate(turn("b1", pb, 9, seed=2, session="b"))
        assert used_blocks(engine) == 2 and engine.stats()["session_evicted"] == 1
        pa2, pb2 = next_prompt(pa, ra, obs_seed=3), next_prompt(pb, rb, obs_seed=4)
        rb2 = await engine.generate(turn("b2", pb2, 8, seed=5, session="b"))
        ra2 = await engine.generate(turn("a2", pa2, 8, seed=6, session="a"))
        assert rb2.prefill_tokens == len(pb2) - (len(pb) + 8) and ra2.prefill_tokens == len(pa2)
        assert_same(rb2, await engine.generate(turn("scratch", pb2, 8, seed=5)), ref, pb2)
    finally:
        await engine.close()


async def test_an_idle_session_is_freed_after_the_timeout(model_path):
    engine = TorchEngine(model_path, eos_token_ids=(), session_idle_s=30.0)
    now = [1000.0]
    engine._runner.sessions.clock = lambda: now[0]  # no real waiting
    try:
        pa, pb = tokens(10, seed=13), tokens(8, seed=14)
        ra = await engine.generate(turn("a1", pa, 9, seed=1, session="a"))
        now[0] += 20.0
        rb = await engine.generate(turn("b1", pb, 4, seed=2, session="b"))  # a: 20 s idle, kept
        assert engine.stats()["session_live"] == 2
        now[0] += 15.0  # a: 35 s, b: 15 s
        pa2, pb2 = next_prompt(pa, ra, obs_seed=3), next_prompt(pb, rb, obs_seed=4)
        assert (await engine.generate(turn("a2", pa2, 4, seed=3, session="a"))).prefill_tokens == len(pa2)
        assert engine.stats()["session_evicted"] == 1
        assert (await engine.generate(turn("b2", pb2, 4, seed=4, session="b"))).prefill_tokens == len(pb2) - 11
    finally:
        await engine.close()


@pytest.mark.parametrize("change", ["edited", "shorter"])
async def test_a_prompt_that_does_not_extend_the_kept_tokens_prefills_in_full(model_path, ref, change):
    p1 = tokens(10, seed=15)
    engine = TorchEngine(model_path, eos_token_ids=())
    try:
        r1 = await engine.generate(turn("t1", p1, 9, seed=1, session="s"))
        p2 = next_prompt(p1, r1, obs_seed=2)
        if change == "edited":  # one token of the kept ones differs (a re-tokenized conversation)
            p2[12] = 3 if p2[12] != 3 else 4
        else:  # the conversation rewound: a prefix of the kept tokens
            p2 = p2[:14]
        r2 = await engine.generate(turn("t2", p2, 12, seed=3, session="s"))
        assert r2.prefill_tokens == len(p2)
        stats = engine.stats()
        assert (stats["session_hits"], stats["session_misses"], stats["session_kept"]) == (0, 1, 2)
        assert_same(r2, await engine.generate(turn("scratch", p2, 12, seed=3)), ref, p2)
    finally:
        await engine.close()


async def test_requests_without_a_session_keep_nothing(model_path):
    engine = TorchEngine(model_path, eos_token_ids=())
    try:
        await asyncio.gather(*(engine.generate(turn(f"r{k}", tokens(9, k), 7, seed=k)) for k in range(3)))
        stats = engine.stats()
        assert stats["session_kept"] == stats["session_live"] == 0
        assert used_blocks(engine) == request_blocks(engine) > 0  # released at the next step, as before
    finally:
        await engine.close()


@pytest.mark.parametrize("pad_budget", [256, 0])  # 0: the resumed turn runs in a forward of its own
async def test_a_resumed_turn_beside_decodes_and_new_prompts(model_path, ref, monkeypatch, pad_budget):
    # One step runs a decoding request, a group's new prompt (leader + follower) and a resumed turn
    # (its rows start at the kept length): each as if alone.
    from asyncrl.rollouter.engines.builtin import model_runner

    monkeypatch.setattr(model_runner, "PAD_BUDGET", pad_budget)
    p1, pl, pg = tokens(11, seed=16), tokens(7, seed=17), tokens(19, seed=18)
    engine = TorchEngine(model_path, eos_token_ids=(), max_running=8)
    try:
        r1 = await engine.generate(turn("t1", p1, 8, seed=1, session="s"))
        p2 = next_prompt(p1, r1, obs_seed=2, obs_len=9)
        long = asyncio.create_task(engine.generate(turn("long", pl, 40, seed=2)))
        await asyncio.sleep(0)
        await engine.wait_for_tokens("long", 3, timeout_s=60)
        plans, plan = [], engine._runner.plan
        engine._runner.plan = lambda *a: plans.append(plan(*a)) or plans[-1]
        r2, *group = await asyncio.gather(engine.generate(turn("t2", p2, 10, seed=3, session="s")),
                                          *(engine.generate(turn(f"g{k}", pg, 10, seed=4 + k)) for k in range(2)))
        # Their first step: the decoding request, the group's leader, the resumed turn; one follower.
        first = next(p for p in plans if len(p.order) > 1)
        assert (len(first.rows), first.n_decode, len(first.followers), first.starts[1:]) == (3, 1, 1, [0, 18])
        assert first.starts[0] >= len(pl) + 2  # the decoding request, at its last token
        assert r2.prefill_tokens == len(p2) - (len(p1) + 7)
        assert [g.prefill_tokens for g in group] == [len(pg), 0]
        rl = await long
        assert_same(r2, await engine.generate(turn("scratch", p2, 10, seed=3)), ref, p2)
        for g in group:
            assert np.abs(full_forward_logprobs(ref, pg, g.response_ids) - g.logprobs).max() <= 1e-4
        assert np.abs(full_forward_logprobs(ref, pl, rl.response_ids) - rl.logprobs).max() <= 1e-4
    finally:
        await engine.close()


async def test_a_prompt_equal_to_the_kept_tokens_feeds_its_last_one(model_path, ref):
    # The conversation so far is exactly the kept tokens: the last one is fed again, for its logits.
    p1 = tokens(10, seed=19)
    engine = TorchEngine(model_path, eos_token_ids=())
    try:
        r1 = await engine.generate(turn("t1", p1, 9, seed=1, session="s"))
        p2 = p1 + r1.response_ids.tolist()[:-1]
        r2 = await engine.generate(turn("t2", p2, 6, seed=3, session="s"))
        assert r2.prefill_tokens == 1 and engine.stats()["session_tokens_reused"] == len(p2) - 1
        assert_same(r2, await engine.generate(turn("scratch", p2, 6, seed=3)), ref, p2)
    finally:
        await engine.close()


@pytest.mark.gpu
async def test_cuda_group_sessions_turn_two_equals_scratch(model_path):
    p1 = tokens(21, seed=20)
    engine = TorchEngine(model_path, device="cuda", eos_token_ids=(), max_running=8)
    try:
        first = await asyncio.gather(*(engine.generate(turn(f"a{k}", p1, n, seed=10 + k, session=f"s{k}"))
                                       for k, n in enumerate([1, 12])))
        p2 = [next_prompt(p1, r, obs_seed=20 + k) for k, r in enumerate(first)]
        second = await asyncio.gather(*(engine.generate(turn(f"b{k}", p, 9, seed=30 + k, session=f"s{k}"))
                                        for k, p in enumerate(p2)))
        for k, (p, r, n) in enumerate(zip(p2, second, [1, 12])):
            assert r.prefill_tokens == len(p) - (len(p1) + n - 1)
            scratch = await engine.generate(turn(f"c{k}", p, 9, seed=30 + k))
            np.testing.assert_array_equal(r.response_ids, scratch.response_ids)
            assert np.abs(r.logprobs - scratch.logprobs).max() <= 1e-3  # TF32 matmuls on GPU
    finally:
        await engine.close()
